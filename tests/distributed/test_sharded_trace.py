"""The trace of a model FSDP2 or ZeRO-3 keeps sharded, in 2 and 4 CPU processes over gloo, against one plain process.

One ``torch.distributed.run`` launch per engine and process count of `tests/helpers/sharded_trace_script.py`
measures every case on
the float64 tiny Llama sharded per decoder layer (FSDP2) or per module with nothing kept whole (ZeRO-3); the engine
gathers and frees the parameters per pass, as in training. Each estimate must equal the one-process estimate of the
unsharded model on the same contexts and draws (relative 1e-12: float64, and each context is measured whole by one
rank; 4 processes split the 7 contexts 2/2/2/1, so one rank pads its share), and no parameter may be left gathered
after the measurement. What would need the whole model or gradient on
a rank is refused by name before any pass.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.distributed.test_distributed import free_port
from tests.helpers.distributed_sam_script import causal_rows, tiny_causal_lm_float64

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "tests" / "helpers" / "sharded_trace_script.py"

MEASURED = {
    "per_sample": {"n_draws": 2, "batch_size": 2},
    # batches of 3 over 7 contexts: the ranks' shares (4 and 3 + 1 padding) split into batches unlike one process's
    "per_sample_by_group": {"n_draws": 2, "batch_size": 3, "by_group": True},
    "per_sample_rademacher": {"n_draws": 3, "batch_size": 2, "output_probe": "rademacher"},
    "naive": {"n_draws": 2, "estimator": "naive"},
}
REFUSED = {
    "naive_by_group": ({"n_draws": 2, "estimator": "naive", "by_group": True}, "whole gradient"),
    "hutchinson": ({"n_draws": 2, "estimator": "hutchinson"}, "per-context estimator"),
}
CASES = [{"name": name, "trace": trace} for name, trace in MEASURED.items()] + [
    {"name": name, "trace": trace} for name, (trace, _) in REFUSED.items()
]
#: Each count is one launch per engine (module-scoped fixtures); 4 processes put one context on a rank of its own
PROCESS_COUNTS = [2, 4]


@dataclass
class Runs:
    """Where one launch wrote its ranks' results, and how many processes it ran."""

    out_dir: Path
    n_processes: int


def launch(engine: str, n_processes: int, out_dir: Path) -> Runs:
    cases_file = out_dir / "cases.json"
    cases_file.write_text(json.dumps(CASES))
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_")}
    env.update(PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", HF_HUB_OFFLINE="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(n_processes), "--master_port"]
    command += [str(free_port()), str(SCRIPT), engine, str(cases_file), str(out_dir)]
    # 4 processes share 2 cores here: each launch may take twice as long
    timeout = 300 * n_processes
    completed = subprocess.run(command, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout)
    (out_dir / "launch.log").write_text(completed.stdout + completed.stderr)
    if completed.returncode != 0:
        pytest.fail(f"launch failed ({completed.returncode}):\n{completed.stderr[-4000:]}")
    return Runs(out_dir, n_processes)


@pytest.fixture(scope="module", params=PROCESS_COUNTS, ids=lambda n: f"{n}processes")
def fsdp2_runs(request, tmp_path_factory) -> Runs:
    return launch("fsdp2", request.param, tmp_path_factory.mktemp(f"sharded_fsdp2_{request.param}"))


@pytest.fixture(scope="module", params=PROCESS_COUNTS, ids=lambda n: f"{n}processes")
def zero3_runs(request, tmp_path_factory) -> Runs:
    pytest.importorskip("deepspeed")
    return launch("zero3", request.param, tmp_path_factory.mktemp(f"sharded_zero3_{request.param}"))


def results(runs: Runs, name: str) -> list[dict]:
    return [json.loads((runs.out_dir / f"{name}.rank{r}.json").read_text()) for r in range(runs.n_processes)]


def check_equals_one_process(runs: Runs, name: str) -> None:
    from hf_flatbias.flatness import estimate_hessian_trace

    ranks = results(runs, name)
    assert ranks[0]["world_size"] == runs.n_processes and "error" not in ranks[0], ranks[0].get("error")
    # every rank holds the same estimate: the per-context values are gathered from all ranks
    assert all(rank["mean"] == ranks[0]["mean"] and rank["stderr"] == ranks[0]["stderr"] for rank in ranks)
    one_process = estimate_hessian_trace(tiny_causal_lm_float64(), causal_rows(), **MEASURED[name])
    assert ranks[0]["n_contexts"] == one_process.n_contexts == len(causal_rows())
    assert ranks[0]["mean"] == pytest.approx(one_process.mean, rel=1e-12)
    assert ranks[0]["stderr"] == pytest.approx(one_process.stderr, rel=1e-12)
    if one_process.by_group is not None:
        expected = {group: value.mean for group, value in one_process.by_group.items()}
        assert ranks[0]["by_group"] == pytest.approx(expected, rel=1e-12)
        assert len(expected) == 5  # embeddings, two blocks, final norm, output layer: the blocks were found
    # never the whole model at once (the root unit or the embeddings and one decoder layer at most), and the engine
    # freed every parameter it gathered: none is left whole on a rank
    model = tiny_causal_lm_float64()
    whole_model = sum(p.numel() for p in model.parameters())
    root = [model.model.embed_tokens, model.model.norm, model.lm_head]
    most = sum(p.numel() for module in [*root, model.model.layers[0]] for p in module.parameters())
    assert 0 < max(rank["most_gathered"] for rank in ranks) <= most < 0.7 * whole_model
    assert [rank["whole_after"] for rank in ranks] == [0] * runs.n_processes


def check_refused(runs: Runs, name: str) -> None:
    for rank in results(runs, name):
        assert REFUSED[name][1] in rank.get("error", ""), rank


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("name", list(MEASURED))
def test_fsdp2_trace_equals_one_process(fsdp2_runs, name):
    check_equals_one_process(fsdp2_runs, name)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("name", list(REFUSED))
def test_fsdp2_refuses_what_needs_the_whole_model(fsdp2_runs, name):
    check_refused(fsdp2_runs, name)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.deepspeed
@pytest.mark.parametrize("name", list(MEASURED))
def test_zero3_trace_equals_one_process(zero3_runs, name):
    check_equals_one_process(zero3_runs, name)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.deepspeed
@pytest.mark.parametrize("name", list(REFUSED))
def test_zero3_refuses_what_needs_the_whole_model(zero3_runs, name):
    check_refused(zero3_runs, name)
