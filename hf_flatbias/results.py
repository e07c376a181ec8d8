"""Results as indented JSON, as ``hf-flatbias demo`` and the research recipes write them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_json(path: Path, payload: dict[str, Any]) -> None:
    """``payload`` as indented JSON at ``path`` (numpy numbers as floats), creating its folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=float))
