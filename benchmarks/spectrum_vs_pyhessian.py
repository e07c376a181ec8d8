"""The largest Hessian eigenvalues side by side with PyHessian (Yao et al., 2020) on the same model, data and loss.

PyHessian is a benchmark-only dependency (``pip install pyhessian``; nothing of it is in hf_flatbias). Both measure
the Hessian of the mean cross-entropy of the data labels at one masked position per context, over all parameters,
on one batch: PyHessian's ``hessian(model, criterion, data=(inputs, targets)).eigenvalues(top_n=k)`` (power
iteration, deflation for k > 1, stopping when the value changes by less than ``tol`` relatively) against
``estimate_top_eigenvalues(..., matrix="hessian", k=k)`` (Lanczos with full reorthogonalisation, stopping when each
value's residual is below ``tol`` relatively, then one more product each to report the residuals).

The reference eigenvalues come from the same Lanczos on a float64 copy of the model, run to a relative residual of
1e-8 or 300 steps (its residuals are printed). Errors are relative to it; seconds are process CPU seconds (the machine
is shared, so wall time mostly measures the neighbours) and include building the gradient graph. Each setting runs
``--repeats`` times (different random starts) and the median is reported.

Model: a ~0.94M-parameter BERT (hidden 128, 2 layers, vocabulary 4,000), 32 contexts of 64 tokens with one masked
position each, fitted to them with ``--fit-steps`` Adam steps first: at random initialisation the most negative
eigenvalue has the largest magnitude, and power iteration returns that one rather than the largest.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/spectrum_vs_pyhessian.py
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from _common import build_model, masked_lm_rows
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from hf_flatbias.flatness import build_masked_contexts, estimate_top_eigenvalues
from hf_flatbias.flatness.contexts import TraceContexts
from hf_flatbias.flatness.lm import logits_at_positions


class LogitsAtMaskedPositions(nn.Module):
    """PyHessian calls ``model(inputs)``: the masked LM's logits at each context's masked position."""

    def __init__(self, model: nn.Module, contexts: TraceContexts) -> None:
        super().__init__()
        self.model = model
        indices = list(range(len(contexts)))
        self.batch = contexts.model_inputs(indices, model)
        self.positions = torch.tensor(contexts.positions)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        batch = {**self.batch, "input_ids": input_ids}
        with sdpa_kernel(SDPBackend.MATH):  # the fused CPU kernels have no double backward
            return logits_at_positions(self.model, batch, self.positions)[:, 0]


def pyhessian_top(model, contexts, k, tol, seed):
    from pyhessian import hessian

    wrapped = LogitsAtMaskedPositions(model, contexts)
    targets = torch.tensor(contexts.targets)
    torch.manual_seed(seed)
    start = time.process_time()
    computer = hessian(wrapped, nn.CrossEntropyLoss(), data=(wrapped.batch["input_ids"], targets), cuda=False)
    values, _ = computer.eigenvalues(maxIter=100, tol=tol, top_n=k)
    seconds = time.process_time() - start
    model.zero_grad(set_to_none=True)  # PyHessian leaves the graph-carrying gradients in .grad
    return sorted(values, reverse=True), seconds


def fit(model: nn.Module, contexts: TraceContexts, steps: int) -> float:
    """Adam on the contexts' loss, so the Hessian is measured near a minimum as on a trained checkpoint (at random
    initialisation its most negative eigenvalue dominates, which power iteration returns instead of the largest)."""
    wrapped = LogitsAtMaskedPositions(model, contexts)
    targets = torch.tensor(contexts.targets)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(steps):
        loss = nn.functional.cross_entropy(wrapped(wrapped.batch["input_ids"]), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.zero_grad(set_to_none=True)
    return loss.item()


def ours_top(model, rows, k, tol, seed):
    start = time.process_time()
    result = estimate_top_eigenvalues(model, rows, k=k, matrix="hessian", tol=tol, seed=seed, batch_size=len(rows))
    return result.eigenvalues, time.process_time() - start, result.n_matvecs


def relative_error(values, reference):
    return max(abs(v - r) / abs(r) for v, r in zip(values, reference, strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--n-contexts", type=int, default=32)
    parser.add_argument("--fit-steps", type=int, default=60)
    args = parser.parse_args()
    torch.set_num_threads(1)

    vocab, seq_len = 4000, 64
    model = build_model(128, 2, vocab, seq_len, head_size=64).eval()
    tokens = masked_lm_rows(args.n_contexts, seq_len, vocab)
    rows = build_masked_contexts(
        [{"input_ids": row["input_ids"]} for row in tokens], mask_token_id=4, n_contexts=args.n_contexts, seed=0
    )
    contexts = TraceContexts.from_rows(rows, causal=False)
    n_params = sum(p.numel() for p in model.parameters())
    loss = fit(model, contexts, args.fit_steps)
    print(
        f"model: {n_params:,} parameters, fitted {args.fit_steps} Adam steps to loss {loss:.3g}; {args.n_contexts} "
        f"contexts of {seq_len} tokens; CPU, 1 thread"
    )

    reference = estimate_top_eigenvalues(
        copy.deepcopy(model).double(), rows, k=3, matrix="hessian", tol=1e-8, max_iterations=300, batch_size=64
    )
    print(f"reference (float64 Lanczos): {reference.eigenvalues}, residuals {reference.residuals}")

    print("| k | method | tol | relative error of the k values (median) | CPU s (median) | products |")
    print("|---|---|---|---|---|---|")
    ratios = {}
    for k in (1, 3):
        truth = reference.eigenvalues[:k]
        runs = {}
        for name, tol in (("pyhessian", 1e-3), ("pyhessian", 1e-5), ("ours", 1e-4), ("ours", 1e-3)):
            errors, seconds, products = [], [], []
            for repeat in range(args.repeats):
                if name == "pyhessian":
                    values, spent = pyhessian_top(model, contexts, k, tol, seed=repeat)
                    products.append(float("nan"))
                else:
                    values, spent, matvecs = ours_top(model, rows, k, tol, seed=repeat)
                    products.append(matvecs)
                errors.append(relative_error(values, truth))
                if repeat == 0:
                    print(f"  {name} tol={tol:g} k={k}: {[round(v, 4) for v in values]}")
                seconds.append(spent)
            runs[(name, tol)] = (statistics.median(errors), statistics.median(seconds))
            print(
                f"| {k} | {name} | {tol:g} | {statistics.median(errors):.2e} (max {max(errors):.2e}) | "
                f"{statistics.median(seconds):.2f} | {statistics.median(products):g} |"
            )
        ratios[k] = runs[("pyhessian", 1e-3)][1] / runs[("ours", 1e-4)][1]
    for k, ratio in ratios.items():
        print(f"top{k}_time_ratio_pyhessian_default_over_ours={ratio:.2f}")


if __name__ == "__main__":
    main()
