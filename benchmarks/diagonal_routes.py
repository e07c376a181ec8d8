"""Routes to a cheaper `estimate_fisher_diagonal` (issue 35, fourth pass), each measured against today's exact
diagonal in one process, arms interleaved round by round, CPU seconds.

``--part materialise`` (route 1, exact): the per-sample gradients ``G_b = X_b^T D_b`` of every dense layer, for both
draws of one 2-draw call on the 15M BERT (16 x 64 tokens), captured from a real call; then materialised and squared
as today (one batched product per draw) against one product per sample for all draws, ``X_b^T [D_b1 | D_b2]`` (the
draws' output gradients concatenated along the output axis), and the products alone, each way. Both ways' diagonals
and per-sample norms are compared.

``--part variance`` (route 2, unbiased, not exact): with K draws, ``(sum_k G_bk)^2 / K`` elementwise is unbiased for
the Fisher diagonal, since the draws' cotangents are independent with mean zero, and needs one materialisation per
context instead of K. The per-draw trace values still come from each draw (by the trace's own Gram route). It is
implemented here by wrapping the estimator's call to `add_squared_gradients`: the draws' output gradients are summed
and materialised once, at the last draw, divided by ``sqrt(K)``. Measured: bias and variance per element over seeds
against `exact_fisher_diagonal` on the tests' tiny models, and at 15M against a many-draw reference; CPU seconds
per call at 15M, interleaved with the trace and the exact diagonal at 1 and 2 draws. Efficiency = summed variance
over elements x CPU seconds (lower is better).

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/diagonal_routes.py --part materialise --rounds 5
    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/diagonal_routes.py --part variance
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from trace_floor import build, rows_for  # noqa: E402

import hf_flatbias.flatness.estimators.per_sample as per_sample  # noqa: E402
import hf_flatbias.flatness.ghost_diagonal as ghost_diagonal  # noqa: E402
from hf_flatbias.flatness import compute_trace_samples, estimate_fisher_diagonal  # noqa: E402
from hf_flatbias.flatness.contexts import TraceContexts  # noqa: E402
from hf_flatbias.flatness.exact import exact_fisher_diagonal  # noqa: E402
from hf_flatbias.flatness.ghost import OuterFactors  # noqa: E402
from hf_flatbias.flatness.ghost_diagonal import _DENSE_CHUNK_ELEMENTS, _dense_squares, add_squared_gradients  # noqa: E402
from hf_flatbias.flatness.lm import evaluation_mode  # noqa: E402


def cpu_seconds(fn) -> float:
    start = time.process_time()
    fn()
    return time.process_time() - start


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


# --- route 1: one product per sample for all draws -------------------------------------------------------------------


def captured_dense_uses(model, rows, n_draws: int = 2) -> list[tuple[tuple[int, int], list[OuterFactors]]]:
    """Each single-use dense parameter's factors for every draw of one diagonal call: ``(shape, [draw factors])``."""
    draws: list[dict] = []

    def capture(recorder, totals, **kwargs):
        draws.append(
            {
                key: (use.param.shape, use.outer[0][1])
                for key, use in recorder.parameter_uses().items()
                if len(use.outer) == 1 and use.outer[0][1].left is not None and use.outer[0][1].right.shape[1] > 1
            }
        )
        return add_squared_gradients(recorder, totals, **kwargs)

    with patched(per_sample, "add_squared_gradients", capture):
        estimate_fisher_diagonal(model, rows, n_draws=n_draws, batch_size=len(rows), seed=0)
    return [(tuple(draws[0][key][0]), [draw[key][1] for draw in draws]) for key in draws[0]]


def per_draw_squares(uses, products_only: bool = False):
    results = []
    for shape, factors in uses:
        out = torch.zeros(shape, dtype=torch.float64)
        if products_only:
            rows, cols = shape
            step = max(1, _DENSE_CHUNK_ELEMENTS // (rows * cols))
            for f in factors:
                for start in range(0, f.right.shape[0], step):
                    torch.bmm(f.left[start : start + step].transpose(1, 2), f.right[start : start + step])
            continue
        norms = torch.stack([_dense_squares([f], shape, out=out, weight=1.0) for f in factors], dim=1)
        results.append((out, norms))
    return results


def concatenated_squares(uses, products_only: bool = False):
    """The same sums from one product per sample for all draws: the draws' output gradients side by side."""
    results = []
    for (rows, cols), factors in uses:
        draws = len(factors)
        shared_left = all(f.left is factors[0].left for f in factors)
        if shared_left:  # Conv1D: the input is on the left, the output gradient on the right
            left, right = factors[0].left, torch.cat([f.right for f in factors], dim=2)
        else:
            left, right = torch.cat([f.left for f in factors], dim=2), factors[0].right
        step = max(1, _DENSE_CHUNK_ELEMENTS // (draws * rows * cols))
        total, norms = None, []
        for start in range(0, left.shape[0], step):
            product = torch.bmm(left[start : start + step].transpose(1, 2), right[start : start + step])
            if products_only:
                continue
            product.square_()
            b = product.shape[0]
            split = product.view(b, rows, draws, cols) if shared_left else product.view(b, draws, rows, cols)
            norms.append(split.sum(dim=(1, 3)) if shared_left else split.sum(dim=(2, 3)))
            chunk = product.sum(dim=0)
            total = chunk if total is None else total.add_(chunk)
        if products_only:
            continue
        summed = total.view(rows, draws, cols).sum(dim=1) if shared_left else total.view(draws, rows, cols).sum(dim=0)
        results.append((summed.double(), torch.cat(norms)))
    return results


def materialise(args) -> None:
    model = build("bert15m").eval()
    rows = rows_for(model, args.n_contexts, args.seq_len)
    uses = captured_dense_uses(model, rows)
    elements = sum(f.left.shape[0] * shape[0] * shape[1] for shape, fs in uses for f in fs)
    flops = sum(2 * f.left.shape[0] * f.left.shape[1] * shape[0] * shape[1] for shape, fs in uses for f in fs)
    print(f"{len(uses)} dense parameters x {len(uses[0][1])} draws, {elements / 1e6:.0f}M per-sample entries")
    a, b = per_draw_squares(uses), concatenated_squares(uses)
    worst_total = max(float((x[0] - y[0]).abs().max() / x[0].abs().max()) for x, y in zip(a, b, strict=True))
    worst_norm = max(float(((x[1] - y[1]).abs() / x[1].abs()).max()) for x, y in zip(a, b, strict=True))
    print(f"concatenated vs per draw: diagonal max relative difference {worst_total:.1e}, norms {worst_norm:.1e}")
    arms = {
        "per draw, products only": lambda: per_draw_squares(uses, products_only=True),
        "concatenated, products only": lambda: concatenated_squares(uses, products_only=True),
        "per draw (today)": lambda: per_draw_squares(uses),
        "concatenated": lambda: concatenated_squares(uses),
    }
    seconds = {name: [] for name in arms}
    for _ in range(args.rounds):
        for name, fn in arms.items():
            seconds[name].append(cpu_seconds(fn))
    for name, values in seconds.items():
        print(f"| {name} | {spread(values)} | {flops / statistics.median(values) / 1e9:.1f} GFLOP/s |")
    print(f"load average {os.getloadavg()}")


# --- route 2: one materialisation of the draws' sum ------------------------------------------------------------------


@contextmanager
def patched(module, name, replacement):
    original = getattr(module, name)
    setattr(module, name, replacement)
    try:
        yield
    finally:
        setattr(module, name, original)


def summed_draws_add(recorder, totals, *, weight, split_self_terms_of, own_in_diagonal, _state={}):  # noqa: B006
    """Stands in for `add_squared_gradients` inside the estimator: this draw's per-sample norms by the trace's Gram
    route; the output gradients summed over draws and, at the last draw, ``(sum_k G_k / sqrt(K))^2`` added once."""
    draws = round(1.0 / weight)
    state = _state.setdefault(id(recorder), {"count": 0, "sums": None})
    grads = [call.grad_output for call in recorder.calls]
    if state["sums"] is None:
        state["sums"] = [None if g is None else g.clone() for g in grads]
    else:
        state["sums"] = [s if g is None else s.add_(g) for s, g in zip(state["sums"], grads, strict=True)]
    state["count"] += 1
    norms = recorder.squared_norm_terms(split_self_terms_of, own_terms=own_in_diagonal)
    if state["count"] == draws:
        recorder.set_grad_outputs([None if s is None else s.div_(math.sqrt(draws)) for s in state["sums"]])
        add_squared_gradients(
            recorder, totals, weight=1.0, split_self_terms_of=split_self_terms_of, own_in_diagonal=own_in_diagonal
        )
        recorder.set_grad_outputs(grads)
        del _state[id(recorder)]
    return norms


def summed_draws_diagonal(model, rows, **kwargs):
    with patched(per_sample, "add_squared_gradients", summed_draws_add):
        return estimate_fisher_diagonal(model, rows, **kwargs)


def _flat(diagonal: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([diagonal[k].reshape(-1) for k in sorted(diagonal)])


def moments(fn, seeds) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-element mean and (unbiased) variance over seeds of a diagonal estimate, float64."""
    total = total_sq = None
    for seed in seeds:
        value = _flat(fn(seed).diagonal)
        total = value.clone() if total is None else total.add_(value)
        total_sq = value.square() if total_sq is None else total_sq.add_(value.square())
    n = len(seeds)
    mean = total / n
    return mean, (total_sq - n * mean.square()) / (n - 1)


def tiny_models():
    from tests.test_flatness_diagonal import MODELS, _contexts

    for name in ("bert_tied", "gpt2", "llama_tied"):
        model = MODELS[name]()
        yield name, model, _contexts(model, 6)


def variance(args) -> None:
    arms = {
        "exact, 2 draws": lambda m, r, s: estimate_fisher_diagonal(m, r, n_draws=2, seed=s, batch_size=len(r)),
        "exact, 1 draw": lambda m, r, s: estimate_fisher_diagonal(m, r, n_draws=1, seed=s, batch_size=len(r)),
        "summed draws, 2 draws": lambda m, r, s: summed_draws_diagonal(m, r, n_draws=2, seed=s, batch_size=len(r)),
    }
    # unbiased: E ||mean - exact||^2 = summed variance / seeds, so their ratio is about 1 (chi-square over elements)
    print(
        "| model | arm | ||mean - exact||^2 / (summed variance / seeds) | max |z| where exact > 1e-3 max (rounding "
        "floor 1e-6) | ||mean - exact|| / ||exact|| | summed variance |"
    )
    print("|---|---|---|---|---|---|")
    for name, model, contexts in tiny_models() if args.tiny_seeds else ():
        exact = _flat(exact_fisher_diagonal(model, contexts))
        for arm, fn in arms.items():
            mean, var = moments(lambda s, fn=fn, m=model, c=contexts: fn(m, c, s), range(args.tiny_seeds))
            ratio = float((mean - exact).square().sum() / (var.sum() / args.tiny_seeds))
            large = (exact.abs() > 1e-3 * exact.abs().max()) & (var > 0)  # var 0: the decoder's own terms, exact
            # with a floor of float32 rounding: entries taken in exact expectation vary by rounding only
            z = (mean - exact)[large].abs() / (var[large] / args.tiny_seeds + (1e-6 * exact[large]).square()).sqrt()
            rel = float((mean - exact).norm() / exact.norm())
            print(
                f"| {name} | {arm} | {ratio:.2f} | {float(z.max()):.2f} | {rel:.2e} | {float(var.sum()):.4g} |",
                flush=True,
            )

    model = build("bert15m").eval()
    rows = rows_for(model, args.n_contexts, args.seq_len)
    contexts = TraceContexts.from_rows(rows, causal=False)

    def trace2():
        with evaluation_mode(model):
            compute_trace_samples(model, contexts, n_draws=2, batch_size=len(rows), seed=0)

    timed = {"trace, 2 draws": trace2, **{arm: (lambda fn=fn: fn(model, rows, 0)) for arm, fn in arms.items()}}
    for fn in timed.values():
        fn()  # warm-up: the model's one-context check runs here
    seconds = {arm: [] for arm in timed}
    for _ in range(args.rounds):
        for arm, fn in timed.items():
            seconds[arm].append(cpu_seconds(fn))
    print(f"\n15M BERT, {args.n_contexts} x {args.seq_len} tokens, {args.rounds} rounds, CPU s:")
    for arm, values in seconds.items():
        over = [v / t for v, t in zip(values, seconds["trace, 2 draws"], strict=True)]
        print(f"| {arm} | {spread(values)} | / trace {spread(over)} |", flush=True)
    print(f"load average {os.getloadavg()}", flush=True)

    reference = _flat(
        estimate_fisher_diagonal(model, rows, n_draws=args.reference_draws, seed=10_000, batch_size=len(rows)).diagonal
    )
    print(f"\n15M BERT, {args.seeds} seeds per arm, reference {args.reference_draws} draws:")
    print("| arm | summed variance | median over varying elements of variance / exact 2 draws' | relative L2 of mean - "
          "reference | CPU s (median) | variance x CPU s / exact 2 draws' |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    found = {}
    for arm, fn in arms.items():
        found[arm] = moments(lambda s, fn=fn: fn(model, rows, s), range(args.seeds))
    base_var = found["exact, 2 draws"][1]
    base_cost = float(base_var.sum()) * statistics.median(seconds["exact, 2 draws"])
    for arm, (mean, var) in found.items():
        cost = float(var.sum()) * statistics.median(seconds[arm])
        # entries whose draws vary (the decoder's own terms alone, in rows no context looked up, vary by rounding)
        keep = base_var > (1e-5 * found["exact, 2 draws"][0]).square()
        median_ratio = float((var[keep] / base_var[keep]).median())
        rel = float((mean - reference).norm() / reference.norm())
        print(
            f"| {arm} | {float(var.sum()):.4g} | {median_ratio:.2f} | {rel:.3e} | "
            f"{statistics.median(seconds[arm]):.2f} | {cost / base_cost:.2f} |"
        )
    print(f"load average {os.getloadavg()}")


# --- route 3: positions whose output gradient is zero ----------------------------------------------------------------


def reaching(args) -> None:
    """Whole calls: the trace at 2 draws, the diagonal summing every position, the diagonal over reaching positions
    only (today's code), interleaved."""
    model = build(args.model).eval()
    rows = rows_for(model, args.n_contexts, args.seq_len)
    contexts = TraceContexts.from_rows(rows, causal=model.config.model_type != "bert")

    def trace2():
        with evaluation_mode(model):
            compute_trace_samples(model, contexts, n_draws=2, batch_size=len(rows), seed=0)

    def diagonal():
        return estimate_fisher_diagonal(model, rows, n_draws=2, batch_size=len(rows), seed=0)

    def every_position():
        with patched(ghost_diagonal, "_reaching_positions", lambda factors, input_is_left: factors):
            return diagonal()

    arms = {
        "trace, 2 draws": trace2,
        "diagonal, every position": every_position,
        "diagonal, reaching positions": diagonal,
    }
    a, b = _flat(every_position().diagonal), _flat(diagonal().diagonal)  # also the warm-up
    print(f"{args.model}: reaching vs every position, diagonal max relative difference "
          f"{float((a - b).abs().max() / a.abs().max()):.1e}")  # fmt: skip
    trace2()
    seconds = {arm: [] for arm in arms}
    for _ in range(args.rounds):
        for arm, fn in arms.items():
            seconds[arm].append(cpu_seconds(fn))
    print(f"{args.model}, {args.n_contexts} x {args.seq_len} tokens, {args.rounds} rounds, CPU s:")
    for arm, values in seconds.items():
        over = [v / t for v, t in zip(values, seconds["trace, 2 draws"], strict=True)]
        print(f"| {arm} | {spread(values)} | / trace {spread(over)} |", flush=True)
    print(f"load average {os.getloadavg()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=("materialise", "variance", "reaching"), required=True)
    parser.add_argument("--model", default="bert15m", help="--part reaching: a model of trace_floor.py")
    parser.add_argument("--n-contexts", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tiny-seeds", type=int, default=400, help="0: the 15M model only")
    parser.add_argument("--seeds", type=int, default=8, help="seeds per arm at 15M")
    parser.add_argument("--reference-draws", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    {"materialise": materialise, "variance": variance, "reaching": reaching}[args.part](args)


if __name__ == "__main__":
    main()
