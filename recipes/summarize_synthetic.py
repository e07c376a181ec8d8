"""Print the synthetic recipes' results.json files as the markdown tables of docs/reproduction/synthetic.md.

python recipes/summarize_synthetic.py outputs/pcfg_continue_training/results.json outputs/pcfg_optimizers/results.json
"""

from __future__ import annotations

import sys
from pathlib import Path

from hf_flatbias.cli import run_recipe
from hf_flatbias.experiments import summarize


def main(argv=None) -> None:
    paths = sys.argv[1:] if argv is None else argv
    print("\n\n".join(summarize(Path(p)) for p in paths))


if __name__ == "__main__":
    run_recipe(main)
