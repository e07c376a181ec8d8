"""per_sample on ~100M-parameter models built from configs: contexts/s against a batched forward+backward of the same
batches, peak memory, and the batch size ``batch_size="auto"`` picks under a stated memory budget, in one run.

Models: a BERT-base-sized masked LM (hidden 768, 12 layers, vocabulary 30,522: 110M parameters) and a Llama-style
causal LM (hidden 768, 12 layers, 12 query / 4 key-value heads, gated MLP 2,048, vocabulary 32,000, tied head: 100M).
Contexts are random tokens with one predicted position each. The reference is what a training step on the
same contexts costs: the stock forward (logits at every position), the loss at the predicted positions and a backward
filling the weight gradients, on the same length-sorted batches. The goal is a ratio >= 0.9 at one draw per context.

Peak memory is the process's peak resident memory above what it held before the measurement on CPU (freed memory
returned with malloc_trim, the peak reset through /proc/self/clear_refs; Linux), ``torch.cuda.max_memory_allocated``
on a GPU. It is compared with what the auto batch size planned for: bytes per context x batch size, plus the full
gradient (and a float64 copy of its largest tensor) the estimator's one-context check holds once.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/large_model_trace.py --n-contexts 16 --seq-len 64

``--n-draws 1,2`` measures each draw count on the same contexts and batches against one reference pass. Each row also
gives the process's resident high-water mark (weights included): over the model's build and warm-up (the one-context
check's full gradient is held there) and within the trace's and the reference's measured calls.

Last lines: ``ratio[MODEL:CONTEXTS:DRAWS]=X`` (per_sample contexts/s over reference contexts/s).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from _common import LLAMA_SHAPES, llama_shape  # noqa: E402
from transformers import BertConfig, BertForMaskedLM  # noqa: E402

from hf_flatbias.flatness import TraceContexts, compute_trace_samples  # noqa: E402
from hf_flatbias.flatness.contexts import build_masked_contexts  # noqa: E402
from hf_flatbias.flatness.lm import evaluation_mode  # noqa: E402
from hf_flatbias.flatness.memory import (  # noqa: E402
    auto_batch_size,
    one_context_check_bytes,
    per_sample_bytes_per_context,
)

MASK_ID, FIRST_WORD = 4, 5


def build(name: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    if name == "bert":
        torch.manual_seed(0)
        return BertForMaskedLM(BertConfig(attn_implementation="sdpa")).to(dtype)
    return llama_shape("llama100m" if name == "llama" else name, dtype)


def contexts_for(model: torch.nn.Module, name: str, n: int, seq_len: int) -> TraceContexts:
    generator = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    rows = [{"input_ids": torch.randint(FIRST_WORD, vocab, (seq_len,), generator=generator).tolist()} for _ in range(n)]
    causal = name != "bert"
    rows = build_masked_contexts(rows, mask_token_id=None if causal else MASK_ID, causal=causal, seed=0)
    return TraceContexts.from_rows(rows, causal=causal)


def padded(contexts: TraceContexts, group: list[int], device: torch.device) -> dict[str, torch.Tensor]:
    length = max(len(contexts.input_ids[i]) for i in group)
    ids = torch.zeros(len(group), length, dtype=torch.long)
    mask = torch.zeros(len(group), length, dtype=torch.long)
    for row, i in enumerate(group):
        ids[row, : len(contexts.input_ids[i])] = contexts.input_ids[i]
        mask[row, : len(contexts.input_ids[i])] = 1
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device)}


def reference_pass(model: torch.nn.Module, contexts: TraceContexts, batch_size: int) -> None:
    """A training step's forward and backward on the same length-sorted batches as per_sample."""
    device = next(model.parameters()).device
    ordered = sorted(range(len(contexts)), key=lambda i: len(contexts.input_ids[i]))
    for start in range(0, len(ordered), batch_size):
        group = ordered[start : start + batch_size]
        logits = model(**padded(contexts, group, device)).logits
        rows = torch.arange(len(group), device=device)
        positions = torch.tensor([contexts.positions[i] for i in group], device=device)
        targets = torch.tensor([contexts.targets[i] for i in group], device=device)
        torch.nn.functional.cross_entropy(logits[rows, positions].float(), targets).backward()
    model.zero_grad(set_to_none=True)


class PeakMemory:
    """Peak memory of a block above what was in use when it started."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.peak = 0
        self.resident_peak = -1  # the process's resident high-water mark within the block, weights included (CPU)

    @staticmethod
    def _rss(field: str) -> int:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field):
                    return int(line.split()[1]) * 1024
        return 0

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
        else:
            # freed memory stays resident in malloc's pools and later blocks reuse it unseen: hand it back first
            try:
                ctypes.CDLL("libc.so.6").malloc_trim(0)
            except OSError:
                pass
            try:
                with open("/proc/self/clear_refs", "w") as refs:
                    refs.write("5")  # resets the peak resident size (VmHWM)
            except OSError:
                pass
            self._base = self._rss("VmRSS:")
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device) - self._base
        else:
            self.resident_peak = self._rss("VmHWM:")
            self.peak = self.resident_peak - self._base


def timed(fn) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def measure(
    name: str,
    model: torch.nn.Module,
    *,
    n_contexts: int,
    seq_len: int,
    memory_budget_gib: float,
    device: torch.device,
    n_draws: tuple[int, ...] = (1,),
    reference: bool = True,
) -> list[dict]:
    """per_sample at each of ``n_draws`` draw counts and (with ``reference``) the reference pass once, on the same
    contexts and batches, one row per draw count; ``name`` "bert" means a masked LM, anything else a causal LM."""
    model = model.to(device)
    n_params = sum(p.numel() for p in model.parameters())
    contexts = contexts_for(model, name, n_contexts, seq_len)
    indices = list(range(len(contexts)))
    budget = int(memory_budget_gib * 2**30)
    traces = {}
    with evaluation_mode(model):
        longest = max(indices, key=lambda i: len(contexts.input_ids[i]))
        per_context = per_sample_bytes_per_context(model, contexts, longest)
        batch_size = auto_batch_size(model, contexts, indices, memory_budget=budget)
        check_bytes = one_context_check_bytes(model)
        # warm-up on one small batch of each, so neither pays for lazy initialisation
        warm = TraceContexts(**{**contexts.__dict__, "input_ids": contexts.input_ids[:2]})
        warm.positions, warm.targets = contexts.positions[:2], contexts.targets[:2]
        for draws in n_draws:
            compute_trace_samples(model, warm, n_draws=draws, batch_size=2)
        if reference:
            reference_pass(model, warm, 2)
        warmup_resident_peak = PeakMemory._rss("VmHWM:") if device.type == "cpu" else -1
        for draws in n_draws:
            samples = []
            with PeakMemory(device) as trace_memory:
                wall, cpu = timed(
                    lambda draws=draws, samples=samples: samples.append(
                        compute_trace_samples(model, contexts, n_draws=draws, batch_size=batch_size, seed=0)
                    )
                )
            traces[draws] = (samples[0], trace_memory, wall, cpu)
        reference_wall = reference_cpu = float("nan")
        reference_memory = PeakMemory(device)
        reference_memory.peak = -1
        if reference:
            with reference_memory:
                reference_wall, reference_cpu = timed(lambda: reference_pass(model, contexts, batch_size))
    rows = []
    for draws, (sample, trace_memory, trace_wall, trace_cpu) in traces.items():
        # one thread on CPU: CPU seconds are the compute; wall seconds also count waiting for a shared core
        trace_s, reference_s = (trace_wall, reference_wall) if device.type == "cuda" else (trace_cpu, reference_cpu)
        rows.append(
            {
                "model": name,
                "parameters": n_params,
                "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
                "n_draws": draws,
                "trace_mean": float(sample.values.mean()),
                "contexts": len(contexts),
                "sequence_length": seq_len,
                "memory_budget_bytes": budget,
                "auto_batch_size": batch_size,
                "predicted_bytes_per_context": per_context,
                "predicted_working_bytes": per_context * batch_size + check_bytes,
                "trace_peak_bytes": trace_memory.peak,
                "reference_peak_bytes": reference_memory.peak,
                "warmup_resident_peak_bytes": warmup_resident_peak,
                "trace_resident_peak_bytes": trace_memory.resident_peak,
                "reference_resident_peak_bytes": reference_memory.resident_peak,
                "trace_seconds": trace_s,
                "reference_seconds": reference_s,
                "trace_wall_seconds": trace_wall,
                "reference_wall_seconds": reference_wall,
                "trace_seconds_per_context": trace_s / len(contexts),
                "reference_seconds_per_context": reference_s / len(contexts),
                "trace_contexts_per_second": len(contexts) / trace_s,
                "reference_contexts_per_second": len(contexts) / reference_s,
                "ratio": reference_s / trace_s,
                # where the trace's wall time goes: the recorded forward, and the backward to the layer outputs
                "trace_forward_wall_seconds": sample.forward_seconds,
                "trace_draw_wall_seconds": sample.draw_seconds,
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--models", default="bert,llama", help=f"comma-separated: bert, llama (= llama100m), {', '.join(LLAMA_SHAPES)}"
    )
    parser.add_argument("--n-contexts", default="64", help="comma-separated: each model is measured at each count")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--n-draws", default="1", help="comma-separated: each draw count on the same contexts")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--no-reference", action="store_true", help="time the trace only (no training pass)")
    parser.add_argument("--memory-budget-gib", type=float, default=4.0, help="working memory on top of the weights")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    results = []
    for name in args.models.split(","):
        model = build(name, getattr(torch, args.dtype))
        for n_contexts in (int(n) for n in args.n_contexts.split(",")):
            rows = measure(
                name,
                model,
                n_contexts=n_contexts,
                seq_len=args.seq_len,
                memory_budget_gib=args.memory_budget_gib,
                device=device,
                n_draws=tuple(int(d) for d in args.n_draws.split(",")),
                reference=not args.no_reference,
            )
            for row in rows:
                print(json.dumps(row), flush=True)
            results.extend(rows)
        del model
    print(
        f"device {device}, {torch.get_num_threads()} thread(s), {args.seq_len} tokens per context, {args.n_draws} "
        f"draw(s), {args.dtype}"
    )
    print(
        "| model | parameters | contexts | draws | auto batch | predicted MiB | trace peak MiB | reference peak MiB "
        "| resident high-water MiB: warm-up / trace / reference | trace s/context | reference s/context "
        "| trace / training fwd+bwd |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        resident = " / ".join(
            f"{r[key] / 2**20:.0f}"
            for key in ("warmup_resident_peak_bytes", "trace_resident_peak_bytes", "reference_resident_peak_bytes")
        )
        print(
            f"| {r['model']} | {r['parameters'] / 1e6:.1f}M | {r['contexts']} | {r['n_draws']} | "
            f"{r['auto_batch_size']} | {r['predicted_working_bytes'] / 2**20:.0f} | "
            f"{r['trace_peak_bytes'] / 2**20:.0f} | {r['reference_peak_bytes'] / 2**20:.0f} | {resident} | "
            f"{r['trace_seconds_per_context']:.3f} | {r['reference_seconds_per_context']:.3f} | {1 / r['ratio']:.3f} |"
        )
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=2)
    for r in results:
        split = r["trace_forward_wall_seconds"] + r["trace_draw_wall_seconds"]
        print(
            f"{r['model']} x {r['contexts']}, {r['n_draws']} draw(s): trace wall time in the recorded forward "
            f"{r['trace_forward_wall_seconds'] / split:.0%}, in the backward to the layer outputs and the norms "
            f"{r['trace_draw_wall_seconds'] / split:.0%}"
        )
    for r in results:
        print(f"ratio[{r['model']}:{r['contexts']}:{r['n_draws']}]={r['ratio']:.3f}")


if __name__ == "__main__":
    main()
