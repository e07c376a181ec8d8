"""The Fisher trace and top eigenvalue side by side with curvlinops (Dangel et al.) on the same model and batches.

curvlinops is a benchmark-only dependency (``pip install curvlinops-for-pytorch``; nothing of it is in hf_flatbias).
Its ``GGNLinearOperator`` with cross-entropy (mean reduction) is the generalised Gauss-Newton
``mean_c J_c^T (diag p_c - p_c p_c^T) J_c``: for softmax cross-entropy the Fisher, whose trace is the paper's measure
and what ``estimate_hessian_trace`` estimates over the same contexts. Its data here are the same contexts in batches of
``--batch-size``, each input packing the token ids and the predicted position.

- Trace: ``hutchinson_trace`` (3 and 9 products) and ``hutchpp_trace`` (9) on that operator against
  ``estimate_hessian_trace`` (``per_sample``) with sampled labels (2 draws) and with random signs at the logits (2 and
  1 draws, ``output_probe="rademacher"``), arms interleaved within each of ``--repeats`` seeds. Efficiency is
  ``mean squared error x median CPU seconds`` per estimate (lower is better), in two settings:
  *fixed*: the same ``--n-contexts`` contexts every time, error against their own trace (only the estimators' own
  sampling noise counts; curvlinops' operator is built once, not timed);
  *fresh*: ``--n-contexts`` contexts drawn anew from the pool of ``--n-pool`` per seed, error against the pool's
  trace (the variation between contexts counts too; the operator is built on them inside the timed estimate).
  The references are ``per_sample`` with ``--reference-draws`` draws of random signs per context (their draw noise
  is printed); curvlinops' means are an independent check that both measure the same matrix.
- Top eigenvalue: ``scipy.sparse.linalg.eigsh`` (ARPACK's implicitly restarted Lanczos, as curvlinops' examples use)
  on ``GGNLinearOperator.to_scipy()`` against ``estimate_top_eigenvalues(matrix="fisher")``, both at relative tolerance
  1e-4, errors against our float64 run at 1e-8.

Model: a BERT masked LM (hidden 128, 2 layers, vocabulary 4,000: 0.94M parameters) fitted ``--fit-steps`` Adam steps
to the pool's contexts of 64 tokens (as `spectrum_vs_pyhessian.py`). CPU seconds, one thread.

    OMP_NUM_THREADS=1 PYTHONPATH=.:<curvlinops folder> python benchmarks/curvlinops_side_by_side.py

Last lines: ``trace_efficiency_ratio[SETTING][THEIRS / OURS]=X`` (their mse x seconds over ours: above 1, ours is
ahead) and ``top_eigenvalue_time_ratio=X``.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
from collections.abc import Callable

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from _common import build_model, masked_lm_rows  # noqa: E402
from spectrum_vs_pyhessian import fit  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from hf_flatbias.flatness import (  # noqa: E402
    TraceContexts,
    build_masked_contexts,
    estimate_hessian_trace,
    estimate_top_eigenvalues,
)
from hf_flatbias.flatness.lm import logits_at_positions  # noqa: E402


class LogitsFromPackedInput(nn.Module):
    """curvlinops calls ``model(X)`` on a tensor: the token ids with the predicted position as a last column."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, packed: torch.Tensor) -> torch.Tensor:
        ids, positions = packed[:, :-1], packed[:, -1]
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        with sdpa_kernel(SDPBackend.MATH):  # forward-mode products need the math kernel
            return logits_at_positions(self.model, batch, positions)[:, 0]


def curvlinops_data(contexts: TraceContexts, batch_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    data = []
    for start in range(0, len(contexts), batch_size):
        indices = range(start, min(start + batch_size, len(contexts)))
        ids = torch.stack([torch.as_tensor(contexts.input_ids[i]) for i in indices])
        positions = torch.tensor([[contexts.positions[i]] for i in indices])
        data.append((torch.cat([ids, positions], dim=1), torch.tensor([contexts.targets[i] for i in indices])))
    return data


class CountingOperator:
    """A SciPy operator that counts its products."""

    def __init__(self, operator) -> None:
        from scipy.sparse.linalg import LinearOperator

        self.count = 0
        wrapped = operator.to_scipy()

        def matvec(x):
            self.count += 1
            return wrapped @ x

        self.scipy = LinearOperator(wrapped.shape, matvec=matvec, dtype=wrapped.dtype)


def ggn_operator(model: nn.Module, rows: list[dict], batch_size: int):
    """curvlinops' GGN (the Fisher here) of the contexts ``rows``."""
    from curvlinops import GGNLinearOperator

    params = [p for p in model.parameters() if p.requires_grad]
    contexts = TraceContexts.from_rows(rows, causal=False)
    data = curvlinops_data(contexts, batch_size)
    return GGNLinearOperator(
        LogitsFromPackedInput(model), nn.CrossEntropyLoss(), params, data, check_deterministic=False
    )


def reference_trace(model: nn.Module, rows: list[dict], draws: int, batch_size: int) -> tuple[float, float]:
    """The Fisher trace of ``rows`` by ``per_sample`` with many logit-space draws (the least noisy unbiased arm) and
    its error: the rows are fixed, so only the draw noise ``sqrt(draw variance / (draws x contexts))``."""
    estimate = estimate_hessian_trace(
        model, rows, n_draws=draws, batch_size=batch_size, seed=999, output_probe="rademacher", progress=False
    )
    return estimate.mean, (estimate.draw_variance / (draws * len(rows))) ** 0.5


def ours(output_probe: str, n_draws: int) -> Callable:
    def run(model, rows, seed, batch_size, ggn):
        estimate = estimate_hessian_trace(
            model, rows, n_draws=n_draws, batch_size=batch_size, seed=seed, output_probe=output_probe
        )
        return estimate.mean

    return run


def theirs(kind: str, products: int) -> Callable:
    def run(model, rows, seed, batch_size, ggn):
        from curvlinops import hutchinson_trace, hutchpp_trace

        # on fresh contexts the operator is built on them, inside the timed estimate
        operator = ggn if ggn is not None else ggn_operator(model, rows, batch_size)
        estimate = hutchinson_trace if kind == "hutchinson" else hutchpp_trace
        return float(estimate(operator, products))

    return run


OURS_LABEL, OURS_PROBED = "ours, sampled labels, 2 draws", "ours, logit-space probes, 2 draws"
ARMS = {
    OURS_LABEL: ours("label", 2),
    OURS_PROBED: ours("rademacher", 2),
    "ours, logit-space probes, 1 draw": ours("rademacher", 1),
    "curvlinops hutchinson, 3 products": theirs("hutchinson", 3),
    "curvlinops hutchinson, 9 products": theirs("hutchinson", 9),
    "curvlinops hutch++, 9 products": theirs("hutchpp", 9),
}


def compare_traces(model, pool, args, *, fresh: bool) -> dict[str, float]:
    """Every arm's mean squared error x median CPU seconds per estimate over ``args.repeats`` seeds, arms
    interleaved within each seed. Fixed: the first ``--n-contexts`` contexts of the pool every time, error against
    their own trace. Fresh: ``--n-contexts`` contexts drawn anew from the pool per seed (without replacement), error
    against the whole pool's trace, so that the variation between contexts counts."""
    fixed_rows = pool[: args.n_contexts]
    target_rows = pool if fresh else fixed_rows
    reference, reference_error = reference_trace(model, target_rows, args.reference_draws, args.batch_size)
    start = time.process_time()
    fixed_ggn = None if fresh else ggn_operator(model, fixed_rows, args.batch_size)
    setup = time.process_time() - start
    what = f"fresh {args.n_contexts} of {len(pool)} contexts per seed" if fresh else f"fixed {args.n_contexts} contexts"
    print(f"\n{what}: reference trace {reference:.4f} (draw noise {reference_error:.2g})"
          + ("" if fresh else f"; curvlinops operator set-up {setup:.2f} CPU s, not counted"))  # fmt: skip
    values = {name: [] for name in ARMS}
    seconds = {name: [] for name in ARMS}
    for seed in range(args.repeats):
        if fresh:
            chosen = torch.randperm(len(pool), generator=torch.Generator().manual_seed(1000 + seed))[: args.n_contexts]
            rows = [pool[int(i)] for i in chosen]
        else:
            rows = fixed_rows
        for name, run in ARMS.items():
            torch.manual_seed(seed)
            start = time.process_time()
            values[name].append(run(model, rows, seed, args.batch_size, fixed_ggn))
            seconds[name].append(time.process_time() - start)
    print(f"| method ({what}) | mean | RMS error | CPU s per estimate | mse x CPU s |")
    print("|---|---|---|---|---|")
    efficiency = {}
    for name in ARMS:
        mse = statistics.mean((v - reference) ** 2 for v in values[name])
        efficiency[name] = mse * statistics.median(seconds[name])
        print(
            f"| {name} | {statistics.mean(values[name]):.2f} | {mse**0.5:.3g} | {statistics.median(seconds[name]):.3f} "
            f"| {efficiency[name]:.3g} |",
            flush=True,
        )
    return efficiency


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=16)
    parser.add_argument("--n-contexts", type=int, default=16)
    parser.add_argument("--n-pool", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--fit-steps", type=int, default=60)
    parser.add_argument("--reference-draws", type=int, default=64)
    parser.add_argument("--settings", default="fixed,fresh", help="Which of fixed,fresh to run.")
    parser.add_argument("--skip-eigenvalue", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    from scipy.sparse.linalg import eigsh

    vocab, seq_len = 4000, 64
    model = build_model(128, 2, vocab, seq_len, head_size=64).eval()
    tokens = masked_lm_rows(args.n_pool, seq_len, vocab)
    pool = build_masked_contexts(
        [{"input_ids": row["input_ids"]} for row in tokens], mask_token_id=4, n_contexts=args.n_pool, seed=0
    )
    loss = fit(model, TraceContexts.from_rows(pool, causal=False), args.fit_steps)
    params = [p for p in model.parameters() if p.requires_grad]
    print(
        f"model: {sum(p.numel() for p in params):,} parameters, fitted {args.fit_steps} Adam steps to the pool of "
        f"{args.n_pool} contexts of {seq_len} tokens (loss {loss:.3g}); {args.n_contexts} contexts per estimate in "
        f"batches of {args.batch_size}; {args.repeats} seeds; CPU, {torch.get_num_threads()} thread(s), load average "
        f"{os.getloadavg()[0]:.1f}",
        flush=True,
    )
    efficiency = {
        setting: compare_traces(model, pool, args, fresh=setting == "fresh") for setting in args.settings.split(",")
    }
    for setting, measured in efficiency.items():
        for name, value in measured.items():
            for mine in (OURS_LABEL, OURS_PROBED):
                if name.startswith("curvlinops"):
                    print(f"trace_efficiency_ratio[{setting}][{name} / {mine}]={value / measured[mine]:.3g}")
    if args.skip_eigenvalue:
        return

    rows = pool[: args.n_contexts]
    truth = estimate_top_eigenvalues(
        copy.deepcopy(model).double(), rows, matrix="fisher", tol=1e-8, max_iterations=300, batch_size=args.batch_size
    ).top
    start = time.process_time()
    top = estimate_top_eigenvalues(model, rows, matrix="fisher", tol=1e-4, batch_size=args.batch_size)
    ours_seconds = time.process_time() - start
    counting = CountingOperator(ggn_operator(model, rows, args.batch_size))
    start = time.process_time()
    (their_top,) = eigsh(counting.scipy, k=1, which="LA", tol=1e-4, return_eigenvectors=False)
    their_seconds = time.process_time() - start
    print("| top eigenvalue | value | relative error | CPU s | products |")
    print("|---|---|---|---|---|")
    print(f"| ours (Lanczos, tol 1e-4) | {top.top:.6g} | {abs(top.top - truth) / truth:.2e} | {ours_seconds:.2f} | "
          f"{top.n_matvecs} |")  # fmt: skip
    print(f"| curvlinops + eigsh (tol 1e-4) | {their_top:.6g} | {abs(their_top - truth) / truth:.2e} | "
          f"{their_seconds:.2f} | {counting.count} |")  # fmt: skip
    print(f"top_eigenvalue_time_ratio={their_seconds / ours_seconds:.3g}")


if __name__ == "__main__":
    main()
