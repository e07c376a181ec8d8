"""The docs' generated blocks: what lies between ``<!-- NAME: begin -->`` and ``<!-- NAME: end -->`` in a page."""

from __future__ import annotations

from pathlib import Path


def replace_generated(text: str, name: str, body: str, page: Path) -> str:
    """``text`` (``page``'s) with the block ``name`` replaced by ``body``; a page without its markers is an error."""
    begin, end = f"<!-- {name}: begin -->", f"<!-- {name}: end -->"
    if begin not in text or end not in text:
        raise SystemExit(f"{page} lacks the markers {begin} ... {end}: restore them around the generated tables.")
    return text[: text.index(begin) + len(begin)] + f"\n{body}\n" + text[text.index(end) :]
