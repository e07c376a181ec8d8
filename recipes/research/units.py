"""A research run's resumable JSON: a header naming its rules, and one row per unit of work under ``"units"``.

The file is rewritten as each unit finishes (and as a unit saves partial rows), so a stopped run loses at most the
unit in progress; a rerun skips the units whose row says ``"done"``. Campaign v2's phases and claims and the
robustness study write theirs through `run_units`.

Several processes may run the same units on one file at once (one per core): each rewrite holds the file's lock
(``<name>.lock``), and a unit is worked on by the process holding its lock (``<name>.busy/<key>.lock``); the others
skip it. The locks are the kernel's advisory ones (`fcntl.flock`), so a killed process releases its own.
"""

from __future__ import annotations

import fcntl
import json
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

from hf_flatbias.results import write_json

Row = dict[str, Any]
Finish = Callable[[Row, float, float], tuple[Row, str]]


def read_units(path: Path) -> dict[str, Row]:
    """The units of a run's JSON (empty if none yet)."""
    return json.loads(path.read_text())["units"] if path.exists() else {}


@contextmanager
def file_lock(path: Path, *, wait: bool = True) -> Iterator[bool]:
    """Hold the exclusive lock of ``path`` (the file is created empty if absent) for the block; yields whether it
    is held, which is always so when ``wait``; with ``wait=False`` a lock another process holds yields False."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def rewrite_lock(path: Path) -> Path:
    """The lock a process holds while it rewrites the JSON at ``path``."""
    return path.with_name(f"{path.name}.lock")


def busy_lock(path: Path, key: str) -> Path:
    """The lock a process holds while it works on ``key`` of the JSON at ``path``."""
    return path.with_name(f"{path.name}.busy") / f"{key.replace('/', '+')}.lock"


def write_unit(path: Path, key: str, row: Row, header: dict[str, Any]) -> None:
    """Rewrite ``path`` with ``row`` as unit ``key`` (other units as they are on disk, another process's included)."""
    with file_lock(rewrite_lock(path)):
        units = read_units(path)
        units[key] = row
        write_json(path, {**header, "units": units})


def rules_constants(rules: ModuleType) -> dict[str, Any]:
    """The constants a rules module exports (its ``__all__``), by name: what a run's header records."""
    return {name: getattr(rules, name) for name in rules.__all__}


def done_this_run(row: Row, seconds: float, cpu_seconds: float) -> tuple[Row, str]:
    """`run_units`' default finish: the row marked done with this run's wall-clock seconds, nothing more logged."""
    return {**row, "status": "done", "seconds_this_run": seconds}, ""


def run_units(
    path: Path,
    units: Sequence[tuple[str, Callable[[Callable[[Row], None]], Row]]],
    header: dict[str, Any],
    tag: str,
    finish: Finish = done_this_run,
) -> dict[str, Row]:
    """Run each ``(key, work)`` in order unless its row on disk is done or another process is working on it.
    ``work(save)`` returns the unit's row and may ``save`` partial rows first (written with ``status: "running"``);
    ``finish(row, seconds, cpu_seconds)`` gives the row written as done and a note for the log line
    (`done_this_run` unless the run records more). Returns the units on disk: a unit another process holds is
    not done there yet."""
    for key, work in units:
        with file_lock(busy_lock(path, key), wait=False) as mine:
            if read_units(path).get(key, {}).get("status") == "done":
                print(f"[{tag}] {key}: done, skipped", flush=True)
                continue
            if not mine:
                print(f"[{tag}] {key}: another process is running it, skipped", flush=True)
                continue

            def save(row: Row, key: str = key) -> None:
                write_unit(path, key, {**row, "status": "running"}, header)

            wall, cpu = time.perf_counter(), time.process_time()
            row = work(save)
            done, note = finish(row, time.perf_counter() - wall, time.process_time() - cpu)
            write_unit(path, key, done, header)
            print(f"[{tag}] {key}: done{note}", flush=True)
    return read_units(path)
