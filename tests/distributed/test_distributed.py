"""FlatBiasTrainer's SAM/ASAM with real processes: DDP over gloo and DeepSpeed ZeRO 0-3 on CPU, 1 and 2 ranks.

Each launch runs `tests/helpers/distributed_sam_script.py` once for all cases (starting processes is what costs time);
the tests below compare its saved weights with a plain-PyTorch SAM written here, on the same global batches.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.distributed_sam_script import classification_rows, tiny_classifier, token_weighted_rows
from tests.helpers.tiny_models import stack, tiny_mlm

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "tests" / "helpers" / "distributed_sam_script.py"
CONFIGS = REPO_ROOT / "recipes" / "configs"
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
LAUNCH_TIMEOUT_S = 1200

pytestmark = pytest.mark.distributed

# Defaults of the launched runs (see distributed_sam_script.base_arguments): SGD lr 0.1, 3 steps, rho 0.05,
# 2 examples per process and micro-batch, sequential data.
PER_DEVICE = 2
STEPS = 3
LR = 0.1

SAM_CASES = {
    "sam_micro_acc1": {},
    "sam_batch_acc2": {"sam_scope": "batch", "gradient_accumulation_steps": 2},
    "asam_micro_acc2": {"flatness_method": "asam", "sam_rho": 0.5, "gradient_accumulation_steps": 2},
    "asam_batch_acc2": {
        "flatness_method": "asam",
        "sam_rho": 0.5,
        "sam_scope": "batch",
        "gradient_accumulation_steps": 2,
    },
    "sam_per_rank_acc2": {"sam_perturbation": "per_rank", "gradient_accumulation_steps": 2},
    "sam_per_rank_batch_acc2": {"sam_perturbation": "per_rank", "sam_scope": "batch", "gradient_accumulation_steps": 2},
}
ENGINES = ["ddp", "zero0", "zero1", "zero2", "zero3"] if HAS_DEEPSPEED else ["ddp"]


def supported(engine: str, variant: str) -> bool:
    return not (engine == "zero3" and "per_rank" in variant)


TWO_PROCESS_CASES = [
    {"name": f"{engine}-{variant}", "engine": engine, "args": args}
    for engine in ENGINES
    for variant, args in SAM_CASES.items()
    if supported(engine, variant)
]
if HAS_DEEPSPEED:
    TWO_PROCESS_CASES += [
        {"name": "zero3-plain", "engine": "zero3", "args": {"flatness_method": "none"}},
        {"name": "zero2-resume", "engine": "zero2", "resume_from_step": 2},
        {
            "name": "zero3-resume",
            "engine": "zero3",
            "args": {"sam_scope": "batch", "gradient_accumulation_steps": 2},
            "resume_from_step": 2,
        },
        {"name": "zero3-per_rank-rejected", "engine": "zero3", "args": {"sam_perturbation": "per_rank"}},
        {"name": "zero2-bf16-rejected", "engine": "zero2", "deepspeed_overrides": {"bf16.enabled": True}},
    ]
# grad_norm_penalty with penalty_lambda = penalty_fd_step = h is the SAM step with rho = h (an exact reference);
# fisher_penalty samples labels, so its DeepSpeed runs are compared with its DDP run.
PENALTY_CASES = {
    "grad_norm_penalty_acc2": {
        "flatness_method": "grad_norm_penalty",
        "penalty_lambda": 0.05,
        "penalty_fd_step": 0.05,
        "gradient_accumulation_steps": 2,
    },
    "fisher_penalty_acc2": {
        "flatness_method": "fisher_penalty",
        "penalty_lambda": 0.1,
        "penalty_fd_step": 0.01,
        "gradient_accumulation_steps": 2,
    },
}
PENALTY_ENGINES = ["ddp", "zero1", "zero2"] if HAS_DEEPSPEED else ["ddp"]
PENALTY_TWO_PROCESS_CASES = [
    {"name": f"{engine}-{variant}", "engine": engine, "args": args}
    for engine in PENALTY_ENGINES
    for variant, args in PENALTY_CASES.items()
]
if HAS_DEEPSPEED:
    PENALTY_TWO_PROCESS_CASES += [
        {
            "name": "zero3-grad_norm_penalty-rejected",
            "engine": "zero3",
            "args": PENALTY_CASES["grad_norm_penalty_acc2"],
        },
        {"name": "zero2-looksam-rejected", "engine": "zero2", "args": {"flatness_method": "looksam"}},
    ]
TWO_PROCESS_CASES += PENALTY_TWO_PROCESS_CASES

TRACE_CASES = [
    {"name": "trace-ddp-per_sample", "engine": "ddp", "kind": "trace", "trace": {"n_draws": 2, "batch_size": 2}},
]
if HAS_DEEPSPEED:
    TRACE_CASES += [
        {
            "name": "trace-zero2-per_sample",
            "engine": "zero2",
            "kind": "trace",
            "trace": {"n_draws": 2, "batch_size": 2},
        },
        {
            "name": "trace-zero3-naive",
            "engine": "zero3",
            "kind": "trace",
            "trace": {"n_draws": 2, "estimator": "naive"},
        },
        {
            "name": "trace-zero3-per_sample",
            "engine": "zero3",
            "kind": "trace",
            "trace": {"n_draws": 2, "batch_size": 2, "by_group": True},
        },
    ]
TRACE_CALLBACK_CASE = {
    "name": "tracecb-ddp",
    "engine": "ddp",
    "kind": "trace_callback",
    # no time budget: every context is measured, as the one-process estimate is
    "trace": {"n_contexts": 7, "n_draws": 2, "batch_size": 2, "max_overhead": None},
}
TWO_PROCESS_CASES += [*TRACE_CASES, TRACE_CALLBACK_CASE]
if HAS_DEEPSPEED:
    TWO_PROCESS_CASES.append(
        {
            "name": "tracecb-zero3-summed-rejected",
            "engine": "zero3",
            "kind": "trace_callback",
            "trace": {"n_contexts": 7, "n_draws": 2, "estimator": "summed"},
        }
    )
# The callback's critical sharpness along AdamW's next update (with weight decay) and its trace, in float64
# (`tiny_causal_lm_float64`) so that the reduction orders stay far below the line search's decisions; the update is
# measured per unit learning rate (the step runs at 0) with the moments of that step. Under ZeRO-3 it is DeepSpeed's
# update, stepped on float32 masters. No clipping (the tests' max_grad_norm 0): the Trainer clips outside torch's
# optimizer, DeepSpeed inside its step, which the measured update follows.
CRITICAL_ARGS = {"optim": "adamw_torch", "weight_decay": 0.1}
CRITICAL_TRACE = {
    "n_contexts": 7,
    "n_draws": 1,
    "batch_size": 2,
    "max_overhead": None,
    "also_measure": ["critical_sharpness"],
    "measure_settings": {"critical_batch_size": 4},
}
CRITICAL_CALLBACK_ZERO3_CASE = {
    "name": "criticalcb-zero3",
    "engine": "zero3",
    "kind": "trace_callback",
    "task": "causal_lm_float64",
    "args": CRITICAL_ARGS,
    "trace": CRITICAL_TRACE,
}
if HAS_DEEPSPEED:
    TWO_PROCESS_CASES.append(CRITICAL_CALLBACK_ZERO3_CASE)
# BERT's masked LM ignores num_items_in_batch: its loss is weighted by the update's tokens over both ranks, which hold
# unequal label counts. Each is compared with the one-process step on the same 8 rows (reference_token_weighted_sgd).
TOKEN_WEIGHTED_VARIANTS = {
    "none_acc2": {"flatness_method": "none", "gradient_accumulation_steps": 2},
    "sam_batch_acc2": {"sam_scope": "batch", "gradient_accumulation_steps": 2},
    "sam_micro_acc2": {"gradient_accumulation_steps": 2},
}
TOKEN_WEIGHTED_ENGINES = {"ddp": list(TOKEN_WEIGHTED_VARIANTS)}
if HAS_DEEPSPEED:
    TOKEN_WEIGHTED_ENGINES.update(zero2=["none_acc2", "sam_batch_acc2"], zero3=["sam_batch_acc2"])
TOKEN_WEIGHTED_CASES = [
    {"name": f"{engine}-mlm-{variant}", "engine": engine, "task": "masked_lm", "args": TOKEN_WEIGHTED_VARIANTS[variant]}
    for engine, variants in TOKEN_WEIGHTED_ENGINES.items()
    for variant in variants
]
# Without the token count summed over ranks, each rank weighs its own tokens: the average of per-rank means, which
# the tolerance of the token-weighted tests must tell apart from the one-process step.
PER_RANK_TOKENS_CASE = {
    "name": "ddp-mlm-sam_batch_acc2-per_rank_tokens",
    "engine": "ddp",
    "task": "masked_lm",
    "args": {**TOKEN_WEIGHTED_VARIANTS["sam_batch_acc2"], "average_tokens_across_devices": False},
}
TWO_PROCESS_CASES += [*TOKEN_WEIGHTED_CASES, PER_RANK_TOKENS_CASE]
SAM_TWO_PROCESS_CASES = [c for c in TWO_PROCESS_CASES if c.get("kind", "sam") == "sam"]
SAM_REFERENCE_CASES = [
    c for c in SAM_TWO_PROCESS_CASES if c not in PENALTY_TWO_PROCESS_CASES and c.get("task") != "masked_lm"
]

# The user's path: the engine set up by `accelerate launch --config_file accelerate_deepspeed_zero3.yaml`.
LAUNCHER_CASE = {"name": "launcher-zero3-sam_batch_acc2", "engine": "launcher", "args": SAM_CASES["sam_batch_acc2"]}
# DDP in one process is the in-process single-process path (tests/test_trainer_sam.py)
ONE_PROCESS_CASES = [
    {"name": f"{engine}-{variant}", "engine": engine, "args": SAM_CASES[variant]}
    for engine in ENGINES
    if engine != "ddp"
    for variant in ("sam_batch_acc2", "asam_micro_acc2")
]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def launch(config: str, cases: list[dict], out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    cases_file = out_dir / "cases.json"
    cases_file.write_text(json.dumps(cases))
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_")}
    # a free port, not the config's: other test sessions on the machine may be launching at the same time
    port = free_port()
    env.update(
        PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", HF_HUB_OFFLINE="1", MASTER_PORT=str(port)
    )
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(CONFIGS / config),
        "--main_process_port",
        str(port),
        str(SCRIPT),
        str(cases_file),
        str(out_dir),
    ]
    completed = subprocess.run(
        command, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S
    )
    (out_dir / "launch.log").write_text(completed.stdout + completed.stderr)
    if completed.returncode != 0:
        pytest.fail(f"launch failed ({completed.returncode}):\n{completed.stderr[-4000:]}")
    return out_dir


class TwoProcessRuns:
    """Launches the 2-process cases lazily, DDP and DeepSpeed cases separately, so that a run selecting only the
    DDP tests (``-m "distributed and not deepspeed"``) pays for one small launch."""

    def __init__(self, tmp_path_factory):
        self._tmp_path_factory = tmp_path_factory
        self._dirs: dict[str, Path] = {}

    def __call__(self, name: str) -> Path:
        engine = next(c for c in TWO_PROCESS_CASES if c["name"] == name)["engine"]
        group = "ddp" if engine == "ddp" else "deepspeed"
        if group not in self._dirs:
            cases = [c for c in TWO_PROCESS_CASES if (c["engine"] == "ddp") == (group == "ddp")]
            out_dir = self._tmp_path_factory.mktemp(f"two_processes_{group}")
            self._dirs[group] = launch("accelerate_cpu_2proc.yaml", cases, out_dir)
        return self._dirs[group]


@pytest.fixture(scope="session")
def two_process_runs(tmp_path_factory) -> TwoProcessRuns:
    return TwoProcessRuns(tmp_path_factory)


@pytest.fixture(scope="session")
def one_process_runs(tmp_path_factory) -> Path:
    return launch("accelerate_cpu_1proc.yaml", ONE_PROCESS_CASES, tmp_path_factory.mktemp("one_process"))


@pytest.fixture(scope="session")
def launcher_runs(tmp_path_factory) -> Path:
    return launch("accelerate_deepspeed_zero3.yaml", [LAUNCHER_CASE], tmp_path_factory.mktemp("launcher"))


def load(runs: Path | TwoProcessRuns, name: str, rank: int = 0) -> dict[str, dict[str, torch.Tensor]]:
    out_dir = runs(name) if isinstance(runs, TwoProcessRuns) else runs
    path = out_dir / f"{name}.rank{rank}.pt"
    if not path.exists():
        error = out_dir / f"{name}.rank{rank}.error"
        pytest.fail(error.read_text() if error.exists() else f"{path.name} missing; see {out_dir / 'launch.log'}")
    return torch.load(path)


# ---------------------------------------------------------------------------------------- independent reference


def reference_sam_sgd(
    *,
    world_size: int,
    flatness_method: str = "sam",
    sam_rho: float = 0.05,
    sam_scope: str = "micro_batch",
    gradient_accumulation_steps: int = 1,
    sam_perturbation: str = "global",
    eta: float = 0.01,
) -> dict[str, torch.Tensor]:
    """SGD with SAM/ASAM on ``world_size`` simulated ranks, as the textbook and the options define it.

    Micro-batch ``m`` of rank ``r`` holds rows ``(m * world_size + r) * PER_DEVICE`` onwards (how accelerate
    shards a sequential loader); each rank's loss is its mean divided by the accumulation steps, and gradients are
    averaged over ranks. ``global``: one perturbation from the rank-averaged first gradient; ``per_rank``: rank r
    is perturbed along its own first gradient.
    """
    if flatness_method != "none":
        assert flatness_method in ("sam", "asam")
    model = tiny_classifier()
    rows = classification_rows()
    params = [p for p in model.parameters() if p.requires_grad]
    k = gradient_accumulation_steps
    adaptive = flatness_method == "asam"

    def batch(micro_index: int, rank: int) -> dict[str, torch.Tensor]:
        start = (micro_index * world_size + rank) * PER_DEVICE
        chunk = rows[start : start + PER_DEVICE]
        return {key: torch.stack([row[key] for row in chunk]) for key in chunk[0]}

    def grad(b) -> list[torch.Tensor]:
        loss = model(**b).loss / k
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        return [torch.zeros_like(p) if g is None else g.detach() for p, g in zip(params, grads, strict=True)]

    def add(*gradient_lists):
        return [sum(gs) for gs in zip(*gradient_lists, strict=True)]

    def rank_mean(gradient_lists):
        return [g / len(gradient_lists) for g in add(*gradient_lists)]

    def direction(g):
        scales = [p.detach().abs() + eta if adaptive else torch.ones_like(p) for p in params]
        norm = math.sqrt(sum(float(((s * x) ** 2).sum()) for s, x in zip(scales, g, strict=True)))
        return [sam_rho * s * s * x / norm for s, x in zip(scales, g, strict=True)]

    def grad_at(eps, b):
        saved = [p.detach().clone() for p in params]
        with torch.no_grad():
            for p, e in zip(params, eps, strict=True):
                p.add_(e)
        g = grad(b)
        with torch.no_grad():
            for p, s in zip(params, saved, strict=True):
                p.copy_(s)
        return g

    def first_gradient(micro_indices, rank):
        """What defines rank ``rank``'s perturbation: its own or the rank average, one or all micro-batches."""
        sources = ranks if sam_perturbation == "global" else [rank]
        return add(*[rank_mean([grad(batch(m, q)) for q in sources]) for m in micro_indices])

    ranks = range(world_size)
    for step in range(STEPS):
        micro = [step * k + j for j in range(k)]
        total = [torch.zeros_like(p) for p in params]
        if sam_scope == "batch":
            eps = {r: direction(first_gradient(micro, r)) for r in ranks}
        for m in micro:
            if sam_scope == "micro_batch":
                eps = {r: direction(first_gradient([m], r)) for r in ranks}
            if flatness_method == "none":
                second = rank_mean([grad(batch(m, r)) for r in ranks])
            else:
                second = rank_mean([grad_at(eps[r], batch(m, r)) for r in ranks])
            total = add(total, second)
        with torch.no_grad():
            for p, g in zip(params, total, strict=True):
                p.sub_(LR * g)
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def reference_token_weighted_sgd(
    *,
    flatness_method: str = "sam",
    sam_scope: str = "micro_batch",
    gradient_accumulation_steps: int = 1,
    sam_rho: float = 0.05,
    world_size: int = 2,
    **ignored,
) -> tuple[dict[str, torch.Tensor], list[tuple[float, float]]]:
    """SGD with SAM on one process, the loss of each update being the mean over all its labelled tokens.

    Micro-batch ``j`` of an update gathers micro-batch ``j`` of every rank: ``world_size * PER_DEVICE`` consecutive
    rows (see `reference_sam_sgd`). Its share of the update's loss is BERT's own token mean over its rows, weighted
    by its label count over the update's. Returns the parameters and, per update, the loss at ``w`` and the loss
    at ``w + e`` (summed over the micro-batches, each at its own perturbation in micro-batch scope).
    """
    assert flatness_method in ("none", "sam")
    model = tiny_mlm()
    rows = token_weighted_rows()
    params = [p for p in model.parameters() if p.requires_grad]
    k, size = gradient_accumulation_steps, world_size * PER_DEVICE

    def n_labels(b) -> int:
        return int((b["labels"] != -100).sum())

    def loss_and_grad(batches, n_update, eps=()):
        saved = [p.detach().clone() for p in params]
        with torch.no_grad():
            for p, e in zip(params, eps, strict=False):
                p.add_(e)
        loss = sum(model(**b).loss * n_labels(b) / n_update for b in batches)
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        with torch.no_grad():
            for p, w in zip(params, saved, strict=True):
                p.copy_(w)
        grads = [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads, strict=True)]
        return float(loss.detach()), grads

    def perturbation(g):
        norm = math.sqrt(sum(float((x * x).sum()) for x in g))
        return [sam_rho * x / norm for x in g]

    losses = []
    for step in range(STEPS):
        micro = [stack(rows[(step * k + j) * size : (step * k + j + 1) * size]) for j in range(k)]
        n_update = sum(n_labels(b) for b in micro)
        scopes = [micro] if sam_scope == "batch" or flatness_method == "none" else [[b] for b in micro]
        total, clean, perturbed = [torch.zeros_like(p) for p in params], 0.0, 0.0
        for batches in scopes:
            loss_w, g = loss_and_grad(batches, n_update)
            clean += loss_w
            if flatness_method == "sam":
                loss_w, g = loss_and_grad(batches, n_update, perturbation(g))
                perturbed += loss_w
            total = [t + x for t, x in zip(total, g, strict=True)]
        losses.append((clean, perturbed))
        with torch.no_grad():
            for p, g in zip(params, total, strict=True):
                p.sub_(LR * g)
    return {name: p.detach().clone() for name, p in model.named_parameters()}, losses


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[n] - b[n]).abs().max()) for n in a)


def logits_sam_cases(kind: str, engine: str, steps: int) -> list[dict]:
    """The launched script's output-layer SAM ("logits-SAM") cases for trl's ``kind`` trainer ("sft" or "dpo") under
    ``engine``: ``steps`` updates at accumulation 1 and 2."""
    return [
        {
            "name": f"{engine}-{kind}-head_sam_acc{k}",
            "engine": engine,
            "kind": kind,
            "args": {"sam_parameters": "output_layer", "max_steps": steps, "gradient_accumulation_steps": k},
        }
        for k in (1, 2)
    ]


def assert_float32_master_rounding_apart(
    zero3: dict[str, torch.Tensor], one: dict[str, torch.Tensor], updates: int
) -> None:
    """ZeRO-3's trained weights against one float64 process's: float32 numbers (DeepSpeed's float32 master weights
    written back into the float64 model), within 2 float32 units of each tensor's largest weight per update."""
    assert max_difference(zero3, {name: p.float().double() for name, p in zero3.items()}) == 0.0, "float32 masters"
    float32_unit = torch.finfo(torch.float32).eps
    for name, trained in one.items():
        bound = 2 * updates * float32_unit * float(trained.abs().max())
        assert float((zero3[name] - trained).abs().max()) <= bound, name


def float32_units_apart(zero3: dict[str, torch.Tensor], one: dict[str, torch.Tensor]) -> float:
    """The largest distance between the two runs' tensors, in float32 units of each tensor's largest weight (the unit
    of `assert_float32_master_rounding_apart`, which allows 2 per update)."""
    unit = torch.finfo(torch.float32).eps
    return max(
        float((zero3[name] - weights).abs().max()) / (unit * float(weights.abs().max()))
        for name, weights in one.items()
    )


def per_rank_perturbation(updates: list[list[dict]], *, paired: bool = False) -> list[list[dict]]:
    """One process's updates (micro-batches of both ranks' rows) with each micro-batch cut into its 2 ranks' rows, so
    that a reference perturbing per micro-batch perturbs by each rank's own rows' gradient (the deliberate fault).

    accelerate gives rank r every second batch of ``PER_DEVICE`` rows, so the first ``PER_DEVICE`` rows of one
    process's micro-batch are rank 0's. With ``paired`` (DPO), a micro-batch is its pairs' chosen rows then their
    rejected rows in the same order, and a rank keeps its pairs' chosen and rejected rows together. Each piece then
    counts its rows' share of the update's loss, as long as the loss normalises by the whole update (SFT's token
    count over all of an update's batches; DPO's pair mean over a batch divided by the update's batch count, which
    the cut doubles as it halves the pairs)."""
    blocks = 2 if paired else 1
    return [
        [
            {key: value.unflatten(0, (blocks, 2, PER_DEVICE))[:, rank].flatten(0, 1) for key, value in batch.items()}
            for batch in update
            for rank in (0, 1)
        ]
        for update in updates
    ]


def marks_for(engine: str) -> list:
    return [pytest.mark.deepspeed] if engine.startswith("zero") else []


# ---------------------------------------------------------------------------------------- tests


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(c, id=c["name"], marks=marks_for(c["engine"]))
        for c in SAM_REFERENCE_CASES
        if "rejected" not in c["name"] and "resume" not in c["name"]
    ],
)
def test_two_processes_match_reference(two_process_runs, case):
    params = load(two_process_runs, case["name"])["params"]
    reference = reference_sam_sgd(world_size=2, **case.get("args", {}))
    assert max_difference(params, reference) < 1e-5


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(c, id=c["name"], marks=marks_for(c["engine"]))
        for c in SAM_TWO_PROCESS_CASES
        if "rejected" not in c["name"]
    ],
)
def test_ranks_end_bit_identical(two_process_runs, case):
    rank0, rank1 = load(two_process_runs, case["name"], 0), load(two_process_runs, case["name"], 1)
    for key in rank0:
        assert all(torch.equal(rank0[key][n], rank1[key][n]) for n in rank0[key]), key


@pytest.mark.parametrize(
    "case",
    [pytest.param(c, id=c["name"], marks=marks_for(c["engine"])) for c in ONE_PROCESS_CASES],
)
def test_one_process_matches_reference(one_process_runs, case):
    params = load(one_process_runs, case["name"])["params"]
    reference = reference_sam_sgd(world_size=1, **case.get("args", {}))
    assert max_difference(params, reference) < 1e-5


def test_reference_tells_the_variants_apart():
    """The 1e-5 tolerance above is meaningful: SAM, plain SGD, the scopes and per-rank all differ by more."""
    sam = reference_sam_sgd(world_size=2, gradient_accumulation_steps=2)
    for other in ({"flatness_method": "none"}, {"sam_scope": "batch"}, {"sam_perturbation": "per_rank"}):
        assert max_difference(sam, reference_sam_sgd(world_size=2, gradient_accumulation_steps=2, **other)) > 1e-4


@pytest.mark.deepspeed
def test_zero3_plain_step_differs_from_sam(two_process_runs):
    plain = load(two_process_runs, "zero3-plain")["params"]
    assert max_difference(plain, reference_sam_sgd(world_size=2, flatness_method="none")) < 1e-5
    assert max_difference(plain, load(two_process_runs, "zero3-sam_micro_acc1")["params"]) > 1e-4


@pytest.mark.deepspeed
@pytest.mark.parametrize("name", ["zero2-resume", "zero3-resume"])
def test_checkpoint_resume_continues_exactly(two_process_runs, name):
    saved = load(two_process_runs, name)
    assert max_difference(saved["resumed_params"], saved["params"]) < 1e-6
    args = next(c for c in TWO_PROCESS_CASES if c["name"] == name).get("args", {})
    assert max_difference(saved["resumed_params"], reference_sam_sgd(world_size=2, **args)) < 1e-5


@pytest.mark.deepspeed
@pytest.mark.parametrize(
    "name,match",
    [
        ("zero3-per_rank-rejected", "per_rank"),
        ("zero2-bf16-rejected", "fp32 weights only"),
        ("zero3-grad_norm_penalty-rejected", "ZeRO-3"),
        ("zero2-looksam-rejected", "looksam"),
        ("tracecb-zero3-summed-rejected", "per-context estimator"),
    ],
)
def test_unsupported_deepspeed_setups_fail_at_start(two_process_runs, name, match):
    for rank in (0, 1):
        error = two_process_runs(name) / f"{name}.rank{rank}.error"
        assert error.exists(), f"{name} trained instead of raising"
        assert match in error.read_text()


@pytest.mark.deepspeed
@pytest.mark.parametrize(
    "case",
    [c for c in TWO_PROCESS_CASES if c["engine"].startswith("zero") and "rejected" not in c["name"]],
    ids=lambda c: c["name"],
)
def test_runs_used_the_engine_they_asked_for(two_process_runs, case):
    """A DeepSpeed config silently ignored would make every DeepSpeed test above a DDP test."""
    path = two_process_runs(case["name"]) / f"{case['name']}.rank0.json"
    info = json.loads(path.read_text())
    assert info["zero_stage"] == int(case["engine"].removeprefix("zero")) and info["world_size"] == 2


@pytest.mark.deepspeed
def test_accelerate_launch_with_the_zero3_recipe_config(launcher_runs):
    info = json.loads((launcher_runs / f"{LAUNCHER_CASE['name']}.rank0.json").read_text())
    assert info["zero_stage"] == 3 and info["world_size"] == 2
    rank0, rank1 = (load(launcher_runs, LAUNCHER_CASE["name"], rank)["params"] for rank in (0, 1))
    assert all(torch.equal(rank0[n], rank1[n]) for n in rank0)
    assert max_difference(rank0, reference_sam_sgd(world_size=2, **LAUNCHER_CASE["args"])) < 1e-5


@pytest.mark.parametrize(
    "case",
    [pytest.param(c, id=c["name"], marks=marks_for(c["engine"])) for c in TRACE_CASES if "rejected" not in c["name"]],
)
def test_trace_across_processes_equals_one_process(two_process_runs, case):
    """Each rank measured its share of the contexts; the gathered estimate is the one-process estimate."""
    from hf_flatbias.flatness import TraceContexts, compute_trace_samples, estimate_hessian_trace
    from tests.helpers.distributed_sam_script import masked_rows, tiny_masked_lm

    out_dir = two_process_runs(case["name"])
    infos = [json.loads((out_dir / f"{case['name']}.rank{rank}.json").read_text()) for rank in (0, 1)]
    for info in infos:
        info["estimate"].pop("seconds")
    assert infos[0]["estimate"] == infos[1]["estimate"]
    assert infos[0]["world_size"] == 2
    one_process = estimate_hessian_trace(tiny_masked_lm(), masked_rows(), **case["trace"])
    shared = infos[0]["estimate"]
    assert shared["n_contexts"] == one_process.n_contexts == len(masked_rows())
    assert shared["mean"] == pytest.approx(one_process.mean, rel=1e-6)
    assert shared["stderr"] == pytest.approx(one_process.stderr, rel=1e-5)
    if case["trace"].get("by_group"):
        assert list(shared["by_group"]) == list(one_process.by_group)
        for group, part in one_process.by_group.items():
            assert shared["by_group"][group]["mean"] == pytest.approx(part.mean, rel=1e-6, abs=1e-9), group
    # context by context, in the original order (fp32 batches of different composition: 1e-6 relative)
    gathered = load(two_process_runs, case["name"])["per_context_values"]
    model = tiny_masked_lm().eval()
    reference = compute_trace_samples(model, TraceContexts.from_rows(masked_rows(), causal=False), **case["trace"])
    torch.testing.assert_close(gathered, reference.values, rtol=1e-6, atol=0)


@pytest.mark.parametrize("engine", [pytest.param(e, marks=marks_for(e)) for e in PENALTY_ENGINES])
def test_grad_norm_penalty_with_lambda_equal_to_step_is_sam(two_process_runs, engine):
    name = f"{engine}-grad_norm_penalty_acc2"
    params = load(two_process_runs, name)["params"]
    reference = reference_sam_sgd(world_size=2, sam_rho=0.05, gradient_accumulation_steps=2)
    assert max_difference(params, reference) < 1e-5


@pytest.mark.deepspeed
@pytest.mark.parametrize("engine", [e for e in PENALTY_ENGINES if e != "ddp"])
def test_fisher_penalty_under_deepspeed_equals_ddp(two_process_runs, engine):
    deepspeed = load(two_process_runs, f"{engine}-fisher_penalty_acc2")["params"]
    ddp = load(two_process_runs, "ddp-fisher_penalty_acc2")["params"]
    assert max_difference(deepspeed, ddp) < 1e-5
    # and the penalty did something: the plain SGD run lands elsewhere
    plain = reference_sam_sgd(world_size=2, flatness_method="none", gradient_accumulation_steps=2)
    assert max_difference(ddp, plain) > 1e-4


def test_trace_callback_logs_the_one_process_estimate(two_process_runs):
    """HessianTraceCallback runs on every rank; each logs the estimate of all contexts, as one process would."""
    from hf_flatbias.flatness import estimate_hessian_trace
    from tests.helpers.distributed_sam_script import tiny_masked_lm

    name = TRACE_CALLBACK_CASE["name"]
    infos = [json.loads((two_process_runs(name) / f"{name}.rank{rank}.json").read_text()) for rank in (0, 1)]
    assert infos[0]["world_size"] == 2 and infos[0]["logged_trace"] == infos[1]["logged_trace"]
    trace = TRACE_CALLBACK_CASE["trace"]
    one_process = estimate_hessian_trace(
        tiny_masked_lm(), infos[0]["contexts"], n_draws=trace["n_draws"], batch_size=trace["batch_size"]
    )
    assert infos[0]["estimate"]["n_contexts"] == one_process.n_contexts == trace["n_contexts"]
    assert infos[0]["logged_trace"] == [pytest.approx(one_process.mean, rel=1e-6)]


def assert_critical_callback_equals_one_process(out_dir: Path, case: dict, tmp_path: Path) -> None:
    """Both ranks logged the same critical sharpness and trace, and they are those of the same trainer and callback in
    this process (one process, the global batch per step, torch's AdamW)."""
    from tests.helpers.distributed_sam_script import Case, base_arguments, run_trace_callback_case

    two = [json.loads((out_dir / f"{case['name']}.rank{rank}.json").read_text()) for rank in (0, 1)]
    assert two[0]["world_size"] == 2
    for run in two:
        run["measures"]["critical_sharpness"].pop("seconds")
    assert two[0]["measures"] == two[1]["measures"] and two[0]["logged_trace"] == two[1]["logged_trace"]
    values = base_arguments(str(tmp_path))
    values.update(case.get("args", {}), per_device_train_batch_size=2 * PER_DEVICE, use_cpu=True)
    one = run_trace_callback_case(Case(**{**case, "engine": "ddp"}), values)
    sharded, whole = two[0]["measures"]["critical_sharpness"], one["measures"]["critical_sharpness"]
    assert sharded["direction"] == whole["direction"] == "AdamW"
    assert sharded["n_batches"] == sharded["n_converged"] == 2
    assert sharded["n_forward_passes"] == whole["n_forward_passes"]
    assert sharded["per_batch"] == pytest.approx(whole["per_batch"], rel=1e-9)
    assert two[0]["logged_trace"] == pytest.approx(one["logged_trace"], rel=1e-9)


@pytest.mark.deepspeed
def test_critical_sharpness_callback_under_zero3_follows_deepspeeds_update_as_one_process(two_process_runs, tmp_path):
    name = CRITICAL_CALLBACK_ZERO3_CASE["name"]
    assert_critical_callback_equals_one_process(two_process_runs(name), CRITICAL_CALLBACK_ZERO3_CASE, tmp_path)


def token_weighted_param(case: dict):
    return pytest.param(case, id=case["name"], marks=marks_for(case["engine"]))


def test_ranks_hold_unequal_label_counts():
    """What the token-weighted cases rely on: in every update, rank 0 and rank 1 hold different numbers of labels."""
    rows = token_weighted_rows()
    k, size = 2, 2 * PER_DEVICE
    for step in range(STEPS):
        counts = [0, 0]
        for j in range(k):
            for rank in (0, 1):
                start = (step * k + j) * size + rank * PER_DEVICE
                counts[rank] += sum(int((row["labels"] != -100).sum()) for row in rows[start : start + PER_DEVICE])
        assert counts[0] != counts[1], (step, counts)


@pytest.mark.parametrize("case", [token_weighted_param(c) for c in TOKEN_WEIGHTED_CASES])
def test_token_weighted_two_processes_equal_one_process_on_the_global_batch(two_process_runs, case):
    saved = load(two_process_runs, case["name"])
    info = json.loads((two_process_runs(case["name"]) / f"{case['name']}.rank0.json").read_text())
    assert info["token_weighted_loss"] and info["world_size"] == 2
    reference, _ = reference_token_weighted_sgd(**case["args"])
    assert max_difference(saved["params"], reference) < 1e-6


@pytest.mark.parametrize("case", [token_weighted_param(c) for c in TOKEN_WEIGHTED_CASES])
def test_logged_losses_are_those_of_the_global_batch(two_process_runs, case):
    """``loss`` and ``sam/perturbed_loss`` are means over both ranks' tokens, the same on every rank."""
    _, reference = reference_token_weighted_sgd(**case["args"])
    for rank in (0, 1):
        info = json.loads((two_process_runs(case["name"]) / f"{case['name']}.rank{rank}.json").read_text())
        logged = [entry for entry in info["log_history"] if "loss" in entry]
        assert [entry["loss"] for entry in logged] == pytest.approx([clean for clean, _ in reference], rel=1e-5)
        if case["args"].get("flatness_method", "sam") == "sam":
            perturbed = [entry["sam/perturbed_loss"] for entry in logged]
            assert perturbed == pytest.approx([loss for _, loss in reference], rel=1e-5)


def test_token_weighted_reference_tells_the_weightings_apart(two_process_runs):
    """The 1e-6 tolerance is meaningful: the average of per-rank means (tokens not summed over ranks), SAM in the
    other scope and the plain step all land farther from the one-process token-weighted step."""
    args = PER_RANK_TOKENS_CASE["args"]
    per_rank_means = load(two_process_runs, PER_RANK_TOKENS_CASE["name"])["params"]
    reference, _ = reference_token_weighted_sgd(**args)
    assert max_difference(per_rank_means, reference) > 1e-4
    plain, _ = reference_token_weighted_sgd(**{**args, "flatness_method": "none"})
    micro, _ = reference_token_weighted_sgd(**{**args, "sam_scope": "micro_batch"})
    assert max_difference(plain, reference) > 1e-4 and max_difference(micro, reference) > 1e-4
