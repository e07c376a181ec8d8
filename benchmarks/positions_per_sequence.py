"""Several positions per sequence in one backward against one position per sequence, at equal sequences: the ratio
of error^2 x time of the trace estimate, on a Llama-family decoder built from a config, in one run.

``--n-sequences`` random-token rows of ``--seq-len`` tokens get ``--positions`` random labelled positions each, measured
with ``per_sample`` twice with the same draws: each position as its own context (one position per row, today's
default: a position drawn uniformly from a row is any of them) and each row's positions in one forward and one backward
per draw (``positions_per_sequence``). Both are unbiased for the same mean trace per position, so the error of each at
equal rows is its variance per row over the rows, times its seconds per row. The ratio is one position's error^2 x time
over several positions'; above 1 favours several. A 95% interval comes from resampling rows. The several-position
variance is split into the positions' own terms and the cross terms between them (the same draws make that exact).

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/positions_per_sequence.py --size llama15m --n-sequences 32

Last line: ``ratio[SIZE:POSITIONS]=X`` (error^2 x time, one position over several).
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from _common import LLAMA_SHAPES, llama_shape  # noqa: E402

from hf_flatbias.flatness import TraceContexts, compute_trace_samples  # noqa: E402
from hf_flatbias.flatness.contexts import build_masked_contexts  # noqa: E402
from hf_flatbias.flatness.lm import evaluation_mode  # noqa: E402

SIZES = {"llama4m": (128, 2, 4, 2, 344, True), **LLAMA_SHAPES}
"""``--size`` names: (hidden, layers, heads, key-value heads, MLP width, tied head), vocabulary 32,000."""


def random_rows(n_rows: int, length: int, seed: int) -> list[dict[str, list[int]]]:
    generator = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(1, 32_000, (length,), generator=generator).tolist()} for _ in range(n_rows)]


def measured(model, contexts, positions: int, n_draws: int, batch_size: int, seed: int) -> tuple[torch.Tensor, float]:
    """Per-unit values (mean over draws) and the seconds of the whole estimate (its forward and draw seconds
    printed)."""
    start = time.perf_counter()
    with evaluation_mode(model):
        samples = compute_trace_samples(
            model, contexts, n_draws=n_draws, seed=seed, batch_size=batch_size, positions_per_sequence=positions
        )
    seconds = time.perf_counter() - start
    print(f"    {positions} position(s) per unit: forward {samples.forward_seconds:.2f} s, "
          f"draws {samples.draw_seconds:.2f} s")  # fmt: skip
    return samples.values.double().mean(dim=1), seconds


def error_time_ratio(alone: torch.Tensor, alone_seconds: float, several: torch.Tensor, several_seconds: float) -> float:
    """(variance per row x seconds per row) of one position per row over that of several, at equal rows.

    ``alone`` (rows, P): each labelled position measured as its own context; one position drawn uniformly from a row
    is one of them, so their variance over every (row, position) is one position's variance per row, and a row costs
    ``alone_seconds / alone.numel()``. ``several`` (rows,): each row's positions in one backward, ``several_seconds``
    for all rows."""
    one = float(alone.reshape(-1).var()) * alone_seconds / alone.numel()
    return one / (float(several.var()) * several_seconds / len(several))


def resampled_interval(alone, alone_seconds, several, several_seconds, n_resamples: int = 2000) -> tuple[float, float]:
    """95% interval of `error_time_ratio` over rows resampled with replacement (both arms read the same rows)."""
    generator = torch.Generator().manual_seed(0)
    ratios = []
    for _ in range(n_resamples):
        picked = torch.randint(len(several), (len(several),), generator=generator)
        ratios.append(error_time_ratio(alone[picked], alone_seconds, several[picked], several_seconds))
    quantiles = torch.tensor([0.025, 0.975], dtype=torch.float64)
    low, high = torch.tensor(ratios, dtype=torch.float64).quantile(quantiles).tolist()
    return low, high


def build(size: str) -> torch.nn.Module:
    LLAMA_SHAPES.setdefault(size, SIZES[size])  # llama_shape reads its shapes there
    return llama_shape(size).eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="llama4m")
    parser.add_argument("--n-sequences", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--positions", type=int, default=16)
    parser.add_argument("--n-draws", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    model = build(args.size)
    n_params = sum(p.numel() for p in model.parameters())
    rows = random_rows(args.n_sequences, args.seq_len, args.seed)
    labelled = build_masked_contexts(
        rows, mask_token_id=None, causal=True, seed=args.seed, positions_per_sequence=args.positions
    )
    contexts = TraceContexts.from_rows(labelled, causal=True)
    warm = TraceContexts.from_rows(labelled[:2], causal=True)
    measured(model, warm, args.positions, 1, 2, args.seed)  # warm-up and the one-context check, untimed
    alone, alone_seconds = measured(model, contexts, 1, args.n_draws, args.batch_size, args.seed)
    several, several_seconds = measured(model, contexts, args.positions, args.n_draws, args.batch_size, args.seed)
    alone = alone.reshape(args.n_sequences, args.positions)
    # the draws depend on (seed, context) only: a row's value with several positions is the mean of its positions'
    # values alone (their own terms) plus the cross terms between positions
    own, cross = alone.mean(dim=1), several - alone.mean(dim=1)
    print(f"{args.size}: {n_params / 1e6:.1f}M parameters, {args.n_sequences} rows x {args.seq_len} tokens, "
          f"{args.n_draws} draw(s), batch {args.batch_size}")  # fmt: skip
    one_row_seconds = alone_seconds / alone.numel()
    several_row_seconds = several_seconds / args.n_sequences
    print(f"  1 position per row: mean {float(alone.mean()):.4g}, variance per row {float(alone.var()):.4g} "
          f"(between rows {float(alone.mean(dim=1).var() - alone.var(dim=1).mean() / args.positions):.4g}), "
          f"{one_row_seconds * 1e3:.1f} ms per row")  # fmt: skip
    print(f"  {args.positions} positions per row: mean {float(several.mean()):.4g}, variance per row "
          f"{float(several.var()):.4g} (own terms {float(own.var()):.4g}, cross terms {float(cross.var()):.4g}), "
          f"{several_row_seconds * 1e3:.1f} ms per row")  # fmt: skip
    print(f"  variance ratio {float(alone.var() / several.var()):.3g}, "
          f"time ratio {several_row_seconds / one_row_seconds:.3g}")  # fmt: skip
    ratio = error_time_ratio(alone, alone_seconds, several, several_seconds)
    low, high = resampled_interval(alone, alone_seconds, several, several_seconds)
    print(f"ratio[{args.size}:{args.positions}]={ratio:.3g} (95% [{low:.3g}, {high:.3g}])")


if __name__ == "__main__":
    main()
