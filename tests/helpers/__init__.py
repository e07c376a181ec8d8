"""Builders and launched scripts the tests share; not collected (no test_ prefix)."""
