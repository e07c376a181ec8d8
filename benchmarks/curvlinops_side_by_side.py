"""The Fisher trace and top eigenvalue side by side with curvlinops (Dangel et al.) on the same model and batches.

curvlinops is a benchmark-only dependency (``pip install curvlinops-for-pytorch``; nothing of it is in hf_flatbias).
Its ``GGNLinearOperator`` with cross-entropy (mean reduction) is the generalised Gauss-Newton
``mean_c J_c^T (diag p_c - p_c p_c^T) J_c``: for softmax cross-entropy the Fisher, whose trace is the paper's measure
and what ``estimate_hessian_trace`` estimates over the same contexts. Its data here are the same contexts in batches of
``--batch-size``, each input packing the token ids and the predicted position.

- Trace: ``hutchinson_trace`` and ``hutchpp_trace`` on that operator against ``estimate_hessian_trace``
  (``per_sample``, 2 draws). The contexts are fixed, so every estimator's error is its own sampling noise: the
  reference is ``per_sample`` with ``--reference-draws`` draws (its error is printed), and a curvlinops mean far from
  it would say the two do not measure the same matrix. Efficiency is ``mean squared error x CPU seconds`` over
  ``--repeats`` seeds (lower is better).
- Top eigenvalue: ``scipy.sparse.linalg.eigsh`` (ARPACK's implicitly restarted Lanczos, as curvlinops' examples use)
  on ``GGNLinearOperator.to_scipy()`` against ``estimate_top_eigenvalues(matrix="fisher")``, both at relative tolerance
  1e-4, errors against our float64 run at 1e-8.

Model: a BERT masked LM (hidden 128, 2 layers, vocabulary 4,000: 0.94M parameters) fitted ``--fit-steps`` Adam steps
to its contexts (as `spectrum_vs_pyhessian.py`), 32 contexts of 64 tokens. CPU seconds, one thread.

    OMP_NUM_THREADS=1 PYTHONPATH=.:<curvlinops folder> python benchmarks/curvlinops_side_by_side.py

Last lines: ``trace_efficiency_ratio[NAME]=X`` (their mse x seconds over ours) and ``top_eigenvalue_time_ratio=X``.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--n-contexts", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--fit-steps", type=int, default=60)
    parser.add_argument("--reference-draws", type=int, default=256)
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    from curvlinops import GGNLinearOperator, hutchinson_trace, hutchpp_trace
    from scipy.sparse.linalg import eigsh

    vocab, seq_len = 4000, 64
    model = build_model(128, 2, vocab, seq_len, head_size=64).eval()
    tokens = masked_lm_rows(args.n_contexts, seq_len, vocab)
    rows = build_masked_contexts(
        [{"input_ids": row["input_ids"]} for row in tokens], mask_token_id=4, n_contexts=args.n_contexts, seed=0
    )
    contexts = TraceContexts.from_rows(rows, causal=False)
    loss = fit(model, contexts, args.fit_steps)
    params = [p for p in model.parameters() if p.requires_grad]
    print(
        f"model: {sum(p.numel() for p in params):,} parameters, fitted {args.fit_steps} Adam steps to loss {loss:.3g}; "
        f"{args.n_contexts} contexts of {seq_len} tokens in batches of {args.batch_size}; CPU, "
        f"{torch.get_num_threads()} thread(s), load average {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    wrapped = LogitsFromPackedInput(model)
    start = time.process_time()
    ggn = GGNLinearOperator(
        wrapped, nn.CrossEntropyLoss(), params, curvlinops_data(contexts, args.batch_size), check_deterministic=False
    )
    setup_seconds = time.process_time() - start

    reference = estimate_hessian_trace(model, rows, n_draws=args.reference_draws, batch_size=args.batch_size, seed=999)
    # the contexts are fixed: only the draw noise, sqrt(draw variance / (draws x contexts)), is the reference's error
    reference_error = (reference.draw_variance / (args.reference_draws * args.n_contexts)) ** 0.5
    print(f"reference trace {reference.mean:.4f} (draw noise {reference_error:.2g}), {reference.seconds:.0f} s")

    methods = {
        "ours per_sample, 2 draws": lambda seed: (
            estimate_hessian_trace(model, rows, n_draws=2, batch_size=args.batch_size, seed=seed).mean
        ),
        "curvlinops hutchinson, 3 products": lambda seed: float(hutchinson_trace(ggn, 3)),
        "curvlinops hutchinson, 9 products": lambda seed: float(hutchinson_trace(ggn, 9)),
        "curvlinops hutch++, 9 products": lambda seed: float(hutchpp_trace(ggn, 9)),
    }
    print("| method | mean | RMS error | CPU s per estimate | mse x CPU s |")
    print("|---|---|---|---|---|")
    efficiency = {}
    for name, run in methods.items():
        values, seconds = [], []
        for seed in range(args.repeats):
            torch.manual_seed(seed)
            start = time.process_time()
            values.append(run(seed))
            seconds.append(time.process_time() - start)
        mse = statistics.mean((v - reference.mean) ** 2 for v in values)
        efficiency[name] = mse * statistics.median(seconds)
        print(
            f"| {name} | {statistics.mean(values):.3f} | {mse**0.5:.3g} | {statistics.median(seconds):.2f} | "
            f"{efficiency[name]:.3g} |",
            flush=True,
        )
    print(f"curvlinops operator set-up: {setup_seconds:.2f} CPU s (not counted above)")

    truth = estimate_top_eigenvalues(
        copy.deepcopy(model).double(), rows, matrix="fisher", tol=1e-8, max_iterations=300, batch_size=args.batch_size
    ).top
    start = time.process_time()
    ours = estimate_top_eigenvalues(model, rows, matrix="fisher", tol=1e-4, batch_size=args.batch_size)
    ours_seconds = time.process_time() - start
    counting = CountingOperator(ggn)
    start = time.process_time()
    (theirs,) = eigsh(counting.scipy, k=1, which="LA", tol=1e-4, return_eigenvectors=False)
    their_seconds = time.process_time() - start
    print("| top eigenvalue | value | relative error | CPU s | products |")
    print("|---|---|---|---|---|")
    print(f"| ours (Lanczos, tol 1e-4) | {ours.top:.6g} | {abs(ours.top - truth) / truth:.2e} | {ours_seconds:.2f} | "
          f"{ours.n_matvecs} |")  # fmt: skip
    print(f"| curvlinops + eigsh (tol 1e-4) | {theirs:.6g} | {abs(theirs - truth) / truth:.2e} | {their_seconds:.2f} | "
          f"{counting.count} |")  # fmt: skip
    ours_name = "ours per_sample, 2 draws"
    for name, value in efficiency.items():
        if name != ours_name:
            print(f"trace_efficiency_ratio[{name}]={value / efficiency[ours_name]:.3g}")
    print(f"top_eigenvalue_time_ratio={their_seconds / ours_seconds:.3g}")


if __name__ == "__main__":
    main()
