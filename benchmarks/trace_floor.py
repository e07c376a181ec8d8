"""The trace at the floor (issue 35): `per_sample` at 1 and 2 draws, and `estimate_fisher_diagonal`, against a
training forward+backward on the same contexts, in CPU seconds of one process, arms interleaved round by round; and
each one's peak memory against the training pass's, in fresh processes.

Models are built from configs with random weights (nothing downloaded):

- ``bert15m``: BERT masked LM, hidden 256, 8 layers, 4 heads, feed-forward 1,024, vocabulary 30,522 (14.5M)
- ``bert110m``: BERT-base (hidden 768, 12 layers, vocabulary 30,522: 109.5M)
- ``llama100m``: Llama shape, hidden 768, 12 layers, 12 query / 4 key-value heads, gated MLP 2,048, vocabulary
  32,000, tied head (100.1M)
- ``bert335m``: BERT-large (hidden 1,024, 24 layers, 16 heads, feed-forward 4,096: 335M)
- ``llama341m``: Llama shape, hidden 1,024, 24 layers, 16 heads, gated MLP 2,816, vocabulary 32,000, tied head (341M)

Contexts: random tokens, one predicted position each (a [MASK] for BERT, the next token for Llama), ``--n-contexts``
of ``--seq-len`` tokens in one batch. The reference is a training step's forward (logits at every position) and
backward (weight gradients), the loss at the predicted positions. Each round times every arm once, in turn, after one
untimed call of each (the trace's first call on a model runs its one-context check against a plain backward; that
call's cost is printed apart as ``first call``). Ratios are arm / training pass within the same round; the table
gives min / median / max over rounds.

Memory: each arm runs in a fresh subprocess (model built, one warm-up call of the arm on 2 contexts), its peak
resident set above the resident set just before the measured call (freed memory handed back with malloc_trim, the
peak reset through /proc/self/clear_refs: `large_model_trace.PeakMemory`, Linux only). ``--memory-only`` skips the
timing (the 335M shapes' memory without their CPU minutes of timing).

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/trace_floor.py --models bert15m,bert110m,llama100m --rounds 3

``--per-call B`` also measures the fixed cost of a call (issue 35: at most 5% of a 32-context call): the public
`estimate_hessian_trace` on all ``--n-contexts`` rows in batches of B, against ``n_contexts / B`` calls on B rows each
(the same batches and draws), interleaved round by round; fixed cost per call = (split - whole) / (calls - 1).

Last lines: ``trace2_over_training[MODEL]=median`` and the like.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from _common import llama_100m, llama_shape  # noqa: E402
from large_model_trace import PeakMemory  # noqa: E402
from transformers import BertConfig, BertForMaskedLM  # noqa: E402

from hf_flatbias.flatness import TraceContexts, compute_trace_samples, estimate_hessian_trace  # noqa: E402
from hf_flatbias.flatness.contexts import build_masked_contexts  # noqa: E402
from hf_flatbias.flatness.diagonal import estimate_fisher_diagonal  # noqa: E402
from hf_flatbias.flatness.lm import evaluation_mode  # noqa: E402

MASK_ID, FIRST_WORD = 4, 5
ARMS = ("training", "trace1", "trace2", "diagonal")


def build(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "bert15m":
        return BertForMaskedLM(
            BertConfig(hidden_size=256, num_hidden_layers=8, num_attention_heads=4, intermediate_size=1024)
        )
    if name == "bert110m":
        return BertForMaskedLM(BertConfig())
    if name == "bert335m":
        return BertForMaskedLM(
            BertConfig(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096)
        )
    if name == "llama100m":
        return llama_100m()
    if name == "llama341m":
        return llama_shape(name)
    raise ValueError(f"unknown model {name!r}")


def rows_for(model: torch.nn.Module, n: int, seq_len: int, seed: int = 0) -> list[dict]:
    generator = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    rows = [{"input_ids": torch.randint(FIRST_WORD, vocab, (seq_len,), generator=generator).tolist()} for _ in range(n)]
    causal = model.config.model_type != "bert"
    return build_masked_contexts(rows, mask_token_id=None if causal else MASK_ID, causal=causal, seed=seed)


def training_pass(model: torch.nn.Module, contexts: TraceContexts) -> None:
    """A training step's forward and backward (no optimizer step) on all contexts in one batch."""
    group = list(range(len(contexts)))
    batch = contexts.model_inputs(group, model)
    logits = model(**batch).logits
    rows = torch.arange(len(group))
    positions = torch.tensor([contexts.positions[i] for i in group])
    targets = torch.tensor([contexts.targets[i] for i in group])
    torch.nn.functional.cross_entropy(logits[rows, positions].float(), targets).backward()
    model.zero_grad(set_to_none=True)


def arm_function(name: str, arm: str, model: torch.nn.Module, rows: list[dict]):
    contexts = TraceContexts.from_rows(rows, causal=model.config.model_type != "bert")
    n = len(contexts)
    if arm == "training":
        # in eval mode (no dropout), as the trace runs: the stricter reference
        return lambda: training_pass(model, contexts)
    if arm in ("trace1", "trace2"):
        draws = int(arm[-1])

        def run():
            with evaluation_mode(model):
                compute_trace_samples(model, contexts, n_draws=draws, batch_size=n, seed=0)

        return run
    if arm == "diagonal":
        return lambda: estimate_fisher_diagonal(model, rows, n_draws=2, batch_size=n, seed=0)
    raise ValueError(arm)


def cpu_seconds(fn) -> float:
    start = time.process_time()
    fn()
    return time.process_time() - start


def timing(name: str, arms: list[str], n_contexts: int, seq_len: int, rounds: int) -> dict:
    model = build(name).eval()
    params = sum(p.numel() for p in model.parameters())
    rows = rows_for(model, n_contexts, seq_len)
    functions = {arm: arm_function(name, arm, model, rows) for arm in arms}
    first = {arm: cpu_seconds(functions[arm]) for arm in arms}  # untimed warm-up; the trace's self-check runs here
    seconds = {arm: [] for arm in arms}
    print(json.dumps({"model": name, "first_call": first}), flush=True)
    for _ in range(rounds):
        for arm in arms:
            seconds[arm].append(cpu_seconds(functions[arm]))
        # each round as it ends: a run stopped by its time limit still leaves its finished rounds
        print(json.dumps({"model": name, "round": {arm: seconds[arm][-1] for arm in arms}}), flush=True)
    ratios = {
        arm: [s / t for s, t in zip(seconds[arm], seconds["training"], strict=True)]
        for arm in arms
        if arm != "training"
    }
    if "diagonal" in arms and "trace2" in arms:
        ratios["diagonal/trace2"] = [d / t for d, t in zip(seconds["diagonal"], seconds["trace2"], strict=True)]
    return {"model": name, "parameters": params, "first_call": first, "seconds": seconds, "ratios": ratios}


def per_call_cost(name: str, n_contexts: int, seq_len: int, rounds: int, batch: int) -> dict:
    """CPU seconds of one `estimate_hessian_trace` call on ``n_contexts`` rows against the same rows in calls of
    ``batch``: what each call pays besides its batches."""
    model = build(name).eval()
    rows = rows_for(model, n_contexts, seq_len)
    chunks = [rows[start : start + batch] for start in range(0, n_contexts, batch)]

    def whole():
        estimate_hessian_trace(model, rows, batch_size=batch, seed=0)

    def split():
        for chunk in chunks:
            estimate_hessian_trace(model, chunk, batch_size=batch, seed=0)

    whole()  # the first call on a model runs its one-context check: left out here, as a long run pays it once
    seconds = {"whole": [], "split": []}
    for _ in range(rounds):
        seconds["whole"].append(cpu_seconds(whole))
        seconds["split"].append(cpu_seconds(split))
        print(json.dumps({"model": name, "per_call_round": {k: v[-1] for k, v in seconds.items()}}), flush=True)
    fixed = [(s - w) / (len(chunks) - 1) for w, s in zip(seconds["whole"], seconds["split"], strict=True)]
    return {
        "model": name,
        "contexts": n_contexts,
        "batch": batch,
        "seconds": seconds,
        "fixed_per_call": fixed,
        "fixed_over_call": [f / w for f, w in zip(fixed, seconds["whole"], strict=True)],
    }


def memory_child(name: str, arm: str, n_contexts: int, seq_len: int) -> None:
    """In a fresh process: the peak resident set of one call of ``arm`` above the resident set before it."""
    model = build(name).eval()
    arm_function(name, arm, model, rows_for(model, 2, seq_len, seed=1))()  # warm-up (and the trace's self-check)
    run = arm_function(name, arm, model, rows_for(model, n_contexts, seq_len))
    with PeakMemory(torch.device("cpu")) as peak:
        run()
    print(json.dumps({"peak_bytes": peak.peak}))


def memory(name: str, arms: list[str], n_contexts: int, seq_len: int) -> dict[str, int]:
    peaks = {}
    for arm in arms:
        out = subprocess.run(
            [sys.executable, __file__, "--memory-child", f"{name}:{arm}", "--n-contexts", str(n_contexts),
             "--seq-len", str(seq_len)],
            capture_output=True, text=True, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
        )  # fmt: skip
        peaks[arm] = json.loads(out.stdout.strip().splitlines()[-1])["peak_bytes"]
    return peaks


def spread(values: list[float]) -> str:
    return f"{min(values):.2f} / {statistics.median(values):.2f} / {max(values):.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="bert15m,bert110m,llama100m")
    parser.add_argument("--arms", default="training,trace1,trace2", help=f"comma-separated of {', '.join(ARMS)}")
    parser.add_argument("--diagonal-models", default="bert15m", help="models that also time the Fisher diagonal")
    parser.add_argument("--n-contexts", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--memory-only", action="store_true", help="only the peak memory of each arm, no timing")
    parser.add_argument("--per-call", type=int, default=0, help="also the fixed cost per call, in batches of this")
    parser.add_argument("--json", default=None)
    parser.add_argument("--memory-child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if args.memory_child:
        name, arm = args.memory_child.split(":")
        memory_child(name, arm, args.n_contexts, args.seq_len)
        return
    results = []
    for name in args.models.split(",") if args.per_call else ():
        cost = per_call_cost(name, args.n_contexts, args.seq_len, args.rounds, args.per_call)
        print(json.dumps(cost), flush=True)
        print(
            f"{name}: {args.n_contexts} contexts in one call {spread(cost['seconds']['whole'])} CPU s, in "
            f"{args.n_contexts // args.per_call} calls {spread(cost['seconds']['split'])}; fixed cost per call "
            f"{spread(cost['fixed_per_call'])} CPU s\nper_call_fixed_over_call[{name}]="
            f"{statistics.median(cost['fixed_over_call']):.3f}",
            flush=True,
        )
    for name in args.models.split(",") if args.arms else ():
        arms = args.arms.split(",")
        if name in args.diagonal_models.split(",") and "diagonal" not in arms:
            arms.append("diagonal")
        if args.memory_only:
            arms = [a for a in arms if a != "diagonal"]
        result = {"model": name} if args.memory_only else timing(name, arms, args.n_contexts, args.seq_len, args.rounds)
        if not args.no_memory:
            result["peak_bytes"] = memory(name, [a for a in arms if a != "diagonal"], args.n_contexts, args.seq_len)
        results.append(result)
        print(json.dumps(result), flush=True)
    load = os.getloadavg()
    print(
        f"\n{torch.__version__}, {torch.get_num_threads()} thread(s), {args.n_contexts} contexts x {args.seq_len} "
        f"tokens in one batch, {args.rounds} rounds, load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}"
    )
    if any("ratios" in r for r in results):
        print(
            "| model | parameters | arm | CPU s (median) | first call CPU s | / training fwd+bwd (min / median / max) |"
        )
        print("|---|---|---|---|---|---|")
    for r in results:
        if "ratios" not in r:
            continue
        for arm, values in r["ratios"].items():
            seconds = r["seconds"].get(arm)
            median_s = f"{statistics.median(seconds):.2f}" if seconds else ""
            first = f"{r['first_call'][arm]:.2f}" if arm in r["first_call"] else ""
            print(f"| {r['model']} | {r['parameters'] / 1e6:.1f}M | {arm} | {median_s} | {first} | {spread(values)} |")
        print(f"| {r['model']} | | training | {statistics.median(r['seconds']['training']):.2f} | | 1 |")
    if results and not args.no_memory:
        print("\n| model | arm | peak MiB above start | / training pass |")
        print("|---|---|---|---|")
        for r in results:
            train = r["peak_bytes"]["training"]
            for arm, peak in r["peak_bytes"].items():
                print(f"| {r['model']} | {arm} | {peak / 2**20:.0f} | {peak / train:.2f} |")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=2)
    for r in results:
        for arm, values in r.get("ratios", {}).items():
            key = arm.replace("/", "_over_")
            print(f"{key}{'' if '/' in arm else '_over_training'}[{r['model']}]={statistics.median(values):.3f}")
        for arm, peak in r.get("peak_bytes", {}).items():
            if arm != "training":
                print(f"{arm}_memory_over_training[{r['model']}]={peak / r['peak_bytes']['training']:.3f}")


if __name__ == "__main__":
    main()
