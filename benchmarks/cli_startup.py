"""How long ``hf-flatbias --help`` and each ``hf-flatbias COMMAND --help`` take to answer (issue 17: < 1.5 s).

Each is a fresh process, run several times; the median is printed beside two references measured in the same run:
an empty interpreter (the floor) and importing the package's trainer (what every command paid before the imports
were made lazy). Usage::

    python benchmarks/cli_startup.py [--runs 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from hf_flatbias.cli import COMMANDS  # noqa: E402


def median_seconds(argv: list[str], runs: int) -> float:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run(argv, env=env, check=True, stdout=subprocess.DEVNULL)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="processes per command (default: %(default)s)")
    args = parser.parse_args()

    python = [sys.executable]
    empty = median_seconds([*python, "-c", "pass"], args.runs)
    eager = median_seconds([*python, "-c", "import hf_flatbias.trainer"], args.runs)
    print(f"load average {os.getloadavg()[0]:.1f}, {os.cpu_count()} cores, median of {args.runs} runs")
    print(f"{'command':<38} {'seconds':>8} {'x empty python':>15}")
    print(f"{'python -c pass':<38} {empty:>8.2f} {1.0:>15.1f}")
    print(f"{'python -c import hf_flatbias.trainer':<38} {eager:>8.2f} {eager / empty:>15.1f}")
    names = [command.__name__.rsplit(".", 1)[1] for command in COMMANDS]
    for argv in [["--help"]] + [[name, "--help"] for name in names]:
        seconds = median_seconds([*python, "-m", "hf_flatbias.cli", *argv], args.runs)
        print(f"{'hf-flatbias ' + ' '.join(argv):<38} {seconds:>8.2f} {seconds / empty:>15.1f}")


if __name__ == "__main__":
    main()
