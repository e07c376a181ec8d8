"""Numerical core of flatness-seeking training steps. Nothing here knows about the Trainer."""
