"""recipes/pcfg_protocol_gpu.py: its CPU dry run end to end (starts, rate pilot, C1, merge) and the deadline
that kills what runs past it."""

import json
import sys
import time


def test_protocol_gpu_dry_run_writes_starts_rate_and_c1(recipes, tmp_path):
    completed = recipes.run(
        "pcfg_protocol_gpu.py", "--dry-run", "--seeds", "0", "--output-dir", str(tmp_path / "out"),
        "--later-claims", "c5", tmp_path=tmp_path,
    )  # fmt: skip
    assert completed.returncode == 0, completed.stdout + completed.stderr
    summary = json.loads((tmp_path / "out" / "protocol_gpu.json").read_text())
    assert summary["device"] == "cpu"
    # only what was asked ran: one seed's start, the pilot, one seed's continued training
    assert list(summary["starts_runs"]) == ["start_seed0"] and list(summary["c1_runs"]) == ["c1_seed0"]
    assert summary["c1_finished_seeds"] == [0]
    results = json.loads((tmp_path / "out" / "results" / "continued_training.json").read_text())
    assert list(results["seeds"]) == ["0"] and results["planned_seeds"] == [0]
    assert summary["c1_verdict"] == results["verdict"]
    assert summary["continued_training_rate"] == results["continued_training_rate"] is not None
    assert list(summary["c5_runs"]) == ["c5_seed0"] and "c3_runs" not in summary
    adversarial = json.loads((tmp_path / "out" / "results" / "adversarial.json").read_text())
    assert list(adversarial["seeds"]) == ["0"] and summary["c5_verdict"] == adversarial["verdict"]
    assert "C1 (1 seeds finished)" in completed.stdout and "seed 0: start KL" in completed.stdout
    # campaign v2's ruler read-out of C1: both tiers' verdicts, from the records in ruler_c1.json
    ruler = json.loads((tmp_path / "out" / "ruler_c1.json").read_text())
    assert list(ruler["seeds"]) == ["0"] and len(ruler["seeds"]["0"]["branches"]) == len(
        results["seeds"]["0"]["branches"]
    )
    assert summary["ruler_c1"] == {tier: row["verdict"] for tier, row in ruler["verdicts"].items()}


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
