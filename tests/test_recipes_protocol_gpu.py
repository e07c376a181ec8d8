"""recipes/pcfg_protocol_gpu.py, campaign v2 at the GPU's shape: its dry run on the CPU writes the starts' and pilots'
JSON whose decisions recompute by the rules, a command killed at its deadline is resumed by the next (finished units
skipped), and the claims phase runs every claim at the driver's widths through the CPU campaign's functions."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

pytest.importorskip("transformers")

from research import campaign_v2 as cv2  # noqa: E402
from research import claims_v2 as cl  # noqa: E402
from research import claims_v2_report as report  # noqa: E402
from research import ruler_reads as rr  # noqa: E402
from research import rules_v2  # noqa: E402


def test_the_gpu_shape_changes_the_shape_only_and_trains_on_the_device(recipes, tmp_path):
    protocol = recipes.load("pcfg_protocol_gpu")
    cpu = cv2.Sizes()
    changed = {f.name for f in dataclasses.fields(cpu) if getattr(protocol.GPU_SIZES, f.name) != getattr(cpu, f.name)}
    # every schedule length, ladder and material size stays the rules' (and v1's); only the shape moves
    assert changed == {"shape", "widths", "base_width", "layers", "batch_size", "first_decay", "v1_starts"}
    assert protocol.GPU_SIZES.base_width in protocol.GPU_SIZES.widths and protocol.GPU_SIZES.v1_starts is None
    args = protocol.parse_arguments(["--device", "cpu"])
    assert args.results_dir.name == "campaign_v2_gpu" and args.phases == list(protocol.PHASES)
    assert protocol.campaign_sizes(args) == protocol.GPU_SIZES  # the CPU device is the dataclass's default
    assert protocol.parse_arguments(["--dry-run", "--output-dir", str(tmp_path)]).results_dir == tmp_path / "results"
    with pytest.raises(SystemExit):
        protocol.parse_arguments(["--phases", "starts,claimz"])
    with pytest.raises(SystemExit):  # the CPU campaign's results are never written by this driver
        protocol.parse_arguments(["--results-dir", str(cv2.RESULTS)])
    # a results folder of other sizes is refused before any process starts
    results = tmp_path / "other"
    sizes = {k: str(v) for k, v in dataclasses.asdict(protocol.GPU_SIZES).items() if k != "device"}
    calls = {"sizes": sizes, "ruler": dataclasses.asdict(rr.RULER_SMOKE), "calls": [{"seconds": 1.0}]}
    results.mkdir()
    (results / "gpu_calls.json").write_text(json.dumps(calls))
    with pytest.raises(SystemExit, match="other sizes or ruler"):
        protocol.main(["--dry-run", "--results-dir", str(results), "--output-dir", str(tmp_path)])
    # the continued runs train where the sizes say (the Trainer picks the accelerator unless told the CPU)
    from hf_flatbias.synthetic import build_model

    start = build_model(40, hidden=32, layers=1, seed=0)
    assert cv2.continued_spec(0, start, 1e-4, 10, cpu).use_cpu
    assert not cv2.continued_spec(0, start, 1e-4, 10, dataclasses.replace(cpu, device="cuda")).use_cpu


def _skipped(stdout: str) -> set[str]:
    return set(re.findall(r"^\[(?:starts|pilots)\] (\S+): done, skipped$", stdout, flags=re.MULTILINE))


def _done(path) -> set[str]:
    return {key for key, row in cv2.read_units(path).items() if row["status"] == "done"}


@pytest.mark.slow  # three runs of the recipe (about 4 minutes on 2 shared cores)
def test_dry_run_writes_starts_and_pilots_by_the_rules_and_resumes_after_the_deadline(recipes, tmp_path):
    out = tmp_path / "out"
    command = ["pcfg_protocol_gpu.py", "--dry-run", "--phases", "starts,pilots", "--output-dir", str(out)]
    results = out / "results"
    # 1. the starts phase under a budget too short for its 15 starts (about 4 s each here, after ~20 s of setup):
    # the child is killed, what it finished stays readable
    first = recipes.run(*command[:3], "starts", *command[4:], "--budget-minutes", "1", tmp_path=tmp_path)
    assert first.returncode == 0, first.stdout + first.stderr
    calls = json.loads((results / "gpu_calls.json").read_text())["calls"]
    finished_first = _done(results / "starts.json") if (results / "starts.json").exists() else set()
    assert finished_first, "no start finished within a minute: this machine is too slow for the test's budget"
    assert calls[0]["killed"] or len(finished_first) == 3 * len(rules_v2.SEEDS), calls[0]
    assert calls[0]["phases"] == ["starts"] and calls[0]["standing"]["starts_done"] == len(finished_first)
    # 2. the same command resumes: the units the first finished are skipped, the rest run to the end
    second = recipes.run(*command, tmp_path=tmp_path)
    assert second.returncode == 0, second.stdout + second.stderr
    assert _skipped(second.stdout) == finished_first
    widths = (32, 64, 16)  # DRY_RUN_SIZES: the driver's widths, never the CPU campaign's
    starts = cv2.read_units(results / "starts.json")
    assert set(starts) == {cv2.start_key(w, s) for w in widths for s in rules_v2.SEEDS}
    for key, row in starts.items():
        assert row["status"] == "done" and row["base"] == "fresh model, v1's first decay to its end", key
        for decay in row["decays"]:
            assert decay["margin_met"] == cv2.meets_margin(decay["stop_kl"], decay["stop_ci_high"]), key
        met = [d for d in row["decays"] if d["margin_met"]]
        best = met[0] if met else min(row["decays"], key=lambda d: d["stop_kl"])
        assert row["margin_met"] == bool(met) and row["chosen_decay"] == best["decay"], key
        assert len(row["decays"]) <= 1 + rules_v2.MAX_EXTENSIONS and "probe_accuracy" not in row["measured"]
        assert (out / "starts" / key / "start" / "config.json").exists()
    pilots = cv2.read_units(results / "pilots.json")
    assert list(pilots) == ["c1_dose", *(f"c2_rate/h{w}" for w in widths), "c3_dropout", "c5_weight"]
    dose = pilots["c1_dose"]
    assert dose["width"] == widths[0] and dose["start_trace"] == starts["h32/seed0"]["measured"]["fisher_trace"]
    ladder = recipes.load("pcfg_protocol_gpu").DRY_RUN_SIZES.dose_ladder
    assert dose["choice"] == json.loads(json.dumps(cv2.choose_dose(dose["start_trace"], dose["rows"], ladder)))
    for key, row in pilots.items():
        assert row["status"] == "done", key
        if key != "c1_dose":
            again = cv2.choose_largest_saturated(row["ladder"], row["rows"], fallback_smallest=key.startswith("c2"))
            assert row["choice"] == again, key
    calls = json.loads((results / "gpu_calls.json").read_text())["calls"]
    assert not calls[1]["killed"] and calls[1]["returncode"] == 0
    assert calls[1]["standing"]["starts_done"] == calls[1]["standing"]["starts_planned"] == len(starts)
    # 3. everything finished: a third command skips every unit and leaves the JSON as it was
    before = (results / "starts.json").read_text(), (results / "pilots.json").read_text()
    third = recipes.run(*command, tmp_path=tmp_path)
    assert third.returncode == 0, third.stdout + third.stderr
    assert _skipped(third.stdout) == set(starts) | set(pilots)
    assert ((results / "starts.json").read_text(), (results / "pilots.json").read_text()) == before


@pytest.mark.slow  # every claim's runs and reads at the smoke sizes, in-process (about 2.5 minutes here)
def test_dry_run_claims_at_the_drivers_widths_recompute_and_resume(recipes, tmp_path, monkeypatch):
    protocol = recipes.load("pcfg_protocol_gpu")
    # one seed, and tiers wide enough that the smoke models count as saturated: every claim's rule compares
    monkeypatch.setattr(rules_v2, "SEEDS", (0,))
    for name in ("SATURATED_KL", "SATURATED_KL_UPPER", "MARGIN_KL", "MARGIN_KL_UPPER"):
        monkeypatch.setattr(rules_v2, name, 1e9)
    args = protocol.parse_arguments(["--dry-run", "--output-dir", str(tmp_path / "out"), "--only-seeds", "0"])
    protocol.run_phases(args)
    widths = protocol.DRY_RUN_SIZES.widths
    claims_dir = args.results_dir / "claims"
    runs = cv2.read_units(claims_dir / "runs.json")
    expected = {"c1/seed0", "c5/seed0", *(f"c2/h{w}/seed0" for w in widths)}
    assert expected <= set(runs) and all(row["status"] == "done" for row in runs.values())
    for claim in rules_v2.CLAIMS:
        payload = json.loads((claims_dir / f"{claim}.json").read_text())
        again = report.claim_verdicts(claim, payload["records"], payload["pilots"], payload["layers"])
        assert json.loads(json.dumps(again)) == {k: payload[k] for k in again}, claim
    c2 = json.loads((claims_dir / "C2.json").read_text())["records"]["sizes"]
    assert set(c2) == {str(w) for w in widths} and all("fisher_trace_enlarged" in r["0"] for r in c2.values())
    c4 = json.loads((claims_dir / "C4.json").read_text())["records"]
    assert c4["starts"]["0"]["key"] == f"start/h{widths[0]}/seed0" and c4["starts"]["0"]["reads"]["probe"]
    reads = json.loads((claims_dir / "reads.json").read_text())
    assert reads["ruler"] == dataclasses.asdict(rr.RULER_SMOKE)
    assert {f"baseline/{name}" for name in rules_v2.C4_BASELINES} <= set(reads["reads"])
    # a second command trains and reads nothing
    monkeypatch.setattr(cl, "train_with_branches", lambda *a, **k: pytest.fail("a finished claim unit was retrained"))
    monkeypatch.setattr(cv2, "train_with_branches", lambda *a, **k: pytest.fail("a finished pilot was retrained"))
    monkeypatch.setattr(cv2, "_decay", lambda *a, **k: pytest.fail("a finished start was distilled again"))
    monkeypatch.setattr(rr, "probe_test_accuracy", lambda *a, **k: pytest.fail("a finished split was read again"))
    protocol.run_phases(args)
