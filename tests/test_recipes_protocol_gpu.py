"""recipes/pcfg_protocol_gpu.py: its CPU dry run end to end, and the budget that kills what runs past the deadline."""

import json
import sys
import time


def test_protocol_gpu_dry_run_writes_gate_and_c1(recipes, tmp_path):
    completed = recipes.run(
        "pcfg_protocol_gpu.py",
        "--dry-run",
        "--candidates",
        "0:1",
        "--seeds",
        "0",
        "--output-dir",
        str(tmp_path / "out"),
        tmp_path=tmp_path,
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    summary = json.loads((tmp_path / "out" / "protocol_gpu.json").read_text())
    assert summary["device"] == "cpu"
    # only what was asked ran: one candidate in the gate table, one seed in C1 (--smoke used to widen both)
    assert [(r["grammar_seed"], r["concentration"]) for r in summary["gate"]["table"]] == [(0, 1.0)]
    assert summary["c1_finished_seeds"] == [0]
    assert summary["c1_grammar"]["gated"] == (summary["gate"]["chosen"] is not None)
    results = json.loads((tmp_path / "out" / "c1" / "c1_results.json").read_text())
    assert list(results["seeds"]) == ["0"]
    assert summary["c1_verdict"] == results["verdict"]
    assert "grammar   lexical" in completed.stdout and "C1 (1 seeds: [0])" in completed.stdout


def test_run_concurrently_kills_at_the_deadline_and_keeps_finished_runs(recipes, tmp_path):
    protocol = recipes.load("pcfg_protocol_gpu")
    start = time.monotonic()
    outcome = protocol.run_concurrently(
        {
            "quick": [sys.executable, "-c", "pass"],
            "endless": [sys.executable, "-c", "import time; time.sleep(120)"],
        },
        start + 5,
        tmp_path / "logs",
    )
    assert outcome["quick"] == {**outcome["quick"], "returncode": 0, "killed": False}
    assert outcome["endless"]["killed"] and outcome["endless"]["returncode"] != 0
    assert time.monotonic() - start < 60
    assert (tmp_path / "logs" / "endless.log").exists()
