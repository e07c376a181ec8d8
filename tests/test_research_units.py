"""The research runs' resumable JSON shared by several processes (`research.units`, `ruler_reads.ReadStore`): two real
processes on one run file do every unit exactly once between them, a unit another process holds is skipped and run
later, and two read stores on one file keep each other's splits."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from research import units as u

REPO = Path(__file__).resolve().parents[1]

WORKER = """
import os, time
from pathlib import Path
from research.units import run_units  # recipes/ is on PYTHONPATH, as pytest's pythonpath puts it on the tests' path

folder = Path({folder!r})
(folder / f"ready-{{os.getpid()}}").touch()
while not (folder / "go").exists():  # both processes start their units together
    time.sleep(0.01)

def unit(key):
    def work(save):
        save({{"began": key}})
        time.sleep(0.3)
        with open(folder / "log", "a") as log:
            log.write(f"{{key}} {{os.getpid()}}\\n")
        return {{"pid": os.getpid()}}
    return work

run_units(folder / "run.json", [(f"u/{{k}}", unit(f"u/{{k}}")) for k in range(8)], {{"rules": "test"}}, "test")
"""


def test_two_processes_share_one_run_file_and_do_each_unit_once(tmp_path):
    script = WORKER.format(folder=str(tmp_path))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "recipes"), os.environ.get("PYTHONPATH")])),
    }
    workers = [subprocess.Popen([sys.executable, "-c", script], env=env) for _ in range(2)]
    deadline = time.monotonic() + 120
    while len(list(tmp_path.glob("ready-*"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    (tmp_path / "go").touch()
    assert [w.wait(timeout=120) for w in workers] == [0, 0]
    logged = [line.split() for line in (tmp_path / "log").read_text().splitlines()]
    assert sorted(key for key, _ in logged) == [f"u/{k}" for k in range(8)]  # each unit once
    assert {pid for _, pid in logged} == {str(w.pid) for w in workers}  # and both processes worked
    units = u.read_units(tmp_path / "run.json")
    assert {key: row["status"] for key, row in units.items()} == {f"u/{k}": "done" for k in range(8)}
    assert all(str(row["pid"]) == pid for (key, pid) in logged for row in [units[key]])


def test_a_unit_another_process_holds_is_skipped_then_run(tmp_path):
    path, ran = tmp_path / "run.json", []

    def unit(key):
        def work(save):
            ran.append(key)
            return {}

        return work

    plan = [(key, unit(key)) for key in ("a", "b/1", "c")]
    with u.file_lock(
        u.busy_lock(path, "b/1"), wait=False
    ) as held:  # another open file: flock treats it as another holder
        assert held
        units = u.run_units(path, plan, {}, "test")
    assert ran == ["a", "c"] and "b/1" not in units
    units = u.run_units(path, plan, {}, "test")
    assert ran == ["a", "c", "b/1"] and all(row["status"] == "done" for row in units.values())


def test_two_read_stores_on_one_file_keep_each_others_splits(tmp_path):
    pytest.importorskip("transformers")
    from research import ruler_reads as rr

    sizes = rr.RULER_SMOKE
    first, second = rr.ReadStore(tmp_path / "reads.json", sizes), rr.ReadStore(tmp_path / "reads.json", sizes)
    row = {"A": 0.5, "B": 0.5, "C": 0.5, "mean": 0.5}
    first.entry("h64/x", "x")["readouts"]["probe"] = {"0": row}
    first.spend("h64/x", 2.0)
    first.save()
    held = second.entry("h64/x", "x")["readouts"].setdefault("probe", {})  # as read_record holds its read-out
    held["1"] = {**row, "mean": 0.6}
    second.spend("h64/x", 3.0)
    second.entry("h64/y", "y")["readouts"]["layer0"] = {"0": row}
    second.spend("h64/y", 1.0)
    second.save()
    assert held is second.reads["h64/x"]["readouts"]["probe"] and set(held) == {"0", "1"}
    first.save()  # nothing new of its own: it takes up the other's
    on_disk = json.loads((tmp_path / "reads.json").read_text())["reads"]
    for reads in (on_disk, first.reads, second.reads):
        assert set(reads["h64/x"]["readouts"]["probe"]) == {"0", "1"} and "h64/y" in reads
        assert reads["h64/x"]["cpu_seconds"] == 5.0 and reads["h64/y"]["cpu_seconds"] == 1.0
