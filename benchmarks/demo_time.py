"""Wall time of ``hf-flatbias demo`` as a user runs it (issue 17: about two minutes on an idle 2-core machine).

One fresh process with the demo's defaults, in a temporary folder; printed beside the machine's load average, since
tiny models slow down sharply when the cores are shared. ``--threads`` reruns it with ``OMP_NUM_THREADS`` set, to
compare with the demo's own choice (one thread unless ``OMP_NUM_THREADS`` says otherwise). Usage::

    python benchmarks/demo_time.py [--threads 2] [--steps 600]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def demo_seconds(steps: int, threads: int | None) -> float:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    env.pop("OMP_NUM_THREADS", None)
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    with tempfile.TemporaryDirectory() as folder:
        argv = [sys.executable, "-m", "hf_flatbias.cli", "demo", "--output-dir", folder, "--steps", str(steps)]
        start = time.perf_counter()
        subprocess.run(argv, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600, help="optimizer steps of each run (the demo's default)")
    parser.add_argument("--threads", type=int, default=None, help="also time the demo with OMP_NUM_THREADS=N")
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    default = demo_seconds(args.steps, None)
    print(f"hf-flatbias demo --steps {args.steps}: {default:.1f} s (load average before: {load_before:.1f})")
    if args.threads is not None:
        forced = demo_seconds(args.steps, args.threads)
        print(
            f"with OMP_NUM_THREADS={args.threads}: {forced:.1f} s ({forced / default:.2f}x the demo's default, "
            f"load average {os.getloadavg()[0]:.1f})"
        )


if __name__ == "__main__":
    main()
