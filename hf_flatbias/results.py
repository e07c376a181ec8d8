"""Results as indented JSON, as ``hf-flatbias demo`` and the research recipes write them."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def write_json(path: Path, payload: dict[str, Any]) -> None:
    """``payload`` as indented JSON at ``path`` (numpy numbers as floats), creating its folder.

    Written whole or not at all (a sibling file renamed over ``path``): a run killed mid-write, as a resumable
    run stopped at a deadline is, leaves the previous file readable. The sibling is named by the process, so two
    processes writing one path never rename each other's half-written file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    partial.write_text(json.dumps(payload, indent=2, default=float))
    os.replace(partial, path)
