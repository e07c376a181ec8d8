"""Processes run against a wall-clock deadline: what a driver with a fixed budget per command (one GPU command of
about ten minutes) runs its resumable work in. A process still running at the deadline is killed with its children;
the work it finished is on disk (each unit's JSON written whole as it finishes) and a rerun resumes from there."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

#: most CPU threads one process gets: the models' tiny CPU ops (features, probes) slow down with more, badly so on a
#: shared machine (a smoke merge took 15 s on one thread and 248 s on two here)
MAX_THREADS = 4


def threads_each(processes: int) -> int:
    """CPU threads for each of ``processes`` concurrent processes: an equal share of half the cores, 1 to 4."""
    return max(1, min(MAX_THREADS, (os.cpu_count() or 1) // (2 * max(1, processes))))


def run_concurrently(
    commands: dict[str, list[str]], deadline: float, log_dir: Path | None, pythonpath: str
) -> dict[str, dict]:
    """Start every command at once (an equal share of the CPU threads each, ``pythonpath`` as PYTHONPATH); kill
    those still running at ``deadline`` (`time.monotonic`). Each command's output goes to ``log_dir/NAME.log``, or
    to this process's stdout when ``log_dir`` is None.

    Returns ``{name: {"returncode", "seconds", "killed"}}``.
    """
    threads = str(threads_each(len(commands)))
    env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "PYTHONPATH": pythonpath}
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
    started, processes, logs = time.monotonic(), {}, {}
    for name, command in commands.items():
        # closed below, after the process ends
        logs[name] = None if log_dir is None else open(log_dir / f"{name}.log", "w")  # noqa: SIM115
        processes[name] = subprocess.Popen(
            command, stdout=logs[name], stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    outcome = {}
    for name, process in processes.items():
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
            killed = False
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)  # its own session: this process and its children only
            process.wait()
            killed = True
        if logs[name] is not None:
            logs[name].close()
        outcome[name] = {"returncode": process.returncode, "seconds": time.monotonic() - started, "killed": killed}
        where = "" if log_dir is None else f" (log {log_dir / f'{name}.log'})"
        print(
            f"  {name}: {'killed at the deadline' if killed else f'exit {process.returncode}'} "
            f"after {outcome[name]['seconds']:.0f} s{where}",
            flush=True,
        )
    return outcome
