"""recipes/pcfg_protocol_gpu_v1.py (campaign v1 at the GPU's shape): its CPU dry run end to end (starts, rate pilot,
C1, merge), the deadline that kills what runs past it (`research.deadline`, shared with the v2 driver)."""

import json
import sys
import time

import numpy as np
import pytest


@pytest.mark.slow  # a whole recipe's smoke run (minutes on CI's 2 cores); its parts are tested by the fast tests
def test_protocol_gpu_dry_run_writes_starts_rate_and_c1(recipes, tmp_path):
    completed = recipes.run(
        "pcfg_protocol_gpu_v1.py", "--dry-run", "--seeds", "0", "--output-dir", str(tmp_path / "out"),
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
    from research.deadline import run_concurrently

    start = time.monotonic()
    outcome = run_concurrently(
        {
            "quick": [sys.executable, "-c", "pass"],
            "endless": [sys.executable, "-c", "import time; time.sleep(120)"],
        },
        start + 5,
        tmp_path / "logs",
        pythonpath="",
    )
    assert outcome["quick"] == {**outcome["quick"], "returncode": 0, "killed": False}
    assert outcome["endless"]["killed"] and outcome["endless"]["returncode"] != 0
    assert time.monotonic() - start < 60
    assert (tmp_path / "logs" / "endless.log").exists()


def test_ruler_c1_reads_the_records_v2s_rule_compares(recipes, tmp_path):
    """v2's ruler read-out of a v1 work folder: the start and the first and last compared branches are read on the
    same splits, nothing else, and the verdicts recompute from ruler_c1.json's records."""
    protocol = recipes.load("pcfg_protocol_gpu_v1")
    from research import verdicts_v2

    from hf_flatbias.synthetic import PCFG, build_model, make_tokenizer

    vocabulary = len(make_tokenizer(PCFG.paper_shaped(0).words()))
    seed_dir = tmp_path / "out" / "work" / "seed0"
    saturation = {"ci_high": 0.008}
    build_model(vocabulary, hidden=32, layers=1, seed=0).save_pretrained(seed_dir / "start")
    start = {"measured": {"kl": 0.006, "saturation": saturation, "fisher_trace": 100.0}}
    (seed_dir / "start" / "start.json").write_text(json.dumps(start))
    records = []
    for step, kl in [(10, 0.007), (20, 0.009), (30, 0.0085), (40, 0.012)]:  # step 40 leaves the saturated tier
        build_model(vocabulary, hidden=32, layers=1, seed=step).save_pretrained(
            seed_dir / "c1" / "branches" / f"step-{step}"
        )
        records.append({"step": step, "kl": kl, "saturation": {"ci_high": kl + 0.001}, "fisher_trace": 100.0 - step})
    (seed_dir / "c1" / "result.json").write_text(json.dumps({"records": records}))
    args = protocol.parse_arguments(["--dry-run", "--seeds", "0", "--output-dir", str(tmp_path / "out")])
    verdicts = protocol.ruler_c1(args, tmp_path / "out")
    reads = json.loads((tmp_path / "out" / "ruler_reads.json").read_text())["reads"]
    # saturated tier: steps 10-30 compared (first 10, last 30); the matched tier compares the same three
    assert set(reads) == {"start/seed0", "c1/seed0/step-10", "c1/seed0/step-30"}
    assert verdicts["saturated"]["per_seed"]["0"]["compared_steps"] == [10, 20, 30]
    assert verdicts["saturated"]["verdict"] == verdicts_v2.NOT_SATURATED  # one seed of the rules' four
    probe = {key: reads[key]["readouts"]["probe"] for key in reads}
    gain = np.mean([probe["c1/seed0/step-30"][r]["mean"] - probe["c1/seed0/step-10"][r]["mean"] for r in ("0", "1")])
    assert verdicts["saturated"]["per_seed_difference"]["0"] == pytest.approx(gain)
    saved = json.loads((tmp_path / "out" / "ruler_c1.json").read_text())
    assert saved["verdicts"]["saturated"] == json.loads(json.dumps(verdicts_v2.c1_verdict(saved["seeds"], 1)))
