"""What the ghost norms recompute at every draw that the forward already fixed (issue 35), and what keeping it costs.

`GhostNormRecorder.parameter_uses` runs once per draw. Of its work, only the LayerNorm normalisation of each norm
layer's recorded input does not depend on the draw (the layer inputs of dense layers and the token ids are views of
tensors the forward holds; their Gram matrices are already cached across draws by `GramCache`). Three ways to get
that normalisation, swapped into the recorder in one process and timed round by round on the 2-draw trace
(`compute_trace_samples`, random-sign cotangents, the model in eval mode):

- ``recompute``: ``F.layer_norm`` of the recorded input at every draw (the shipped code);
- ``cache-normalized``: the normalised input formed at the first draw and kept for the later ones (exact, but it holds
  one activation-sized tensor per LayerNorm call until the call ends);
- ``cache-moments``: each position's mean and reciprocal standard deviation kept (two numbers per position), the
  normalised input re-formed from them at later draws (equal to ``F.layer_norm`` to float rounding, not bit for bit).

``--memory`` also runs each arm in a fresh process (a 2-context warm-up, then one measured call) and prints its peak
resident set above the start of the call (`large_model_trace.PeakMemory`).

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/ghost_forward_fixed.py --model bert15m --rounds 8
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import types

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from large_model_trace import PeakMemory  # noqa: E402
from trace_floor import arm_function, build, rows_for  # noqa: E402

import hf_flatbias.flatness.ghost as ghost  # noqa: E402

ARMS = ("recompute", "cache-normalized", "cache-moments")


class LayerNormSource:
    """Stands in for ``torch.nn.functional`` inside `hf_flatbias.flatness.ghost`, whose only use of it is the
    normalisation in `GhostNormRecorder.parameter_uses`; ``clear()`` between estimates."""

    def __init__(self, arm: str) -> None:
        self.arm = arm
        self._kept: dict[tuple, object] = {}

    def clear(self) -> None:
        self._kept.clear()

    def layer_norm(self, x, shape, weight, bias, eps):
        if self.arm == "recompute":
            return F.layer_norm(x, shape, weight, bias, eps)
        key = (x.data_ptr(), tuple(x.shape), tuple(x.stride()))
        kept = self._kept.get(key)
        if self.arm == "cache-normalized":
            if kept is None:
                kept = self._kept[key] = F.layer_norm(x, shape, weight, bias, eps)
            return kept
        if kept is None:
            normalized, mean, rstd = torch.native_layer_norm(x, shape, weight, bias, eps)
            self._kept[key] = (mean, rstd)
            return normalized
        mean, rstd = kept
        return (x - mean) * rstd


def install(arm: str) -> LayerNormSource:
    source = LayerNormSource(arm)
    ghost.F = types.SimpleNamespace(layer_norm=source.layer_norm)
    return source


def timing(name: str, n_contexts: int, seq_len: int, rounds: int) -> dict:
    model = build(name).eval()
    trace = arm_function(name, "trace2", model, rows_for(model, n_contexts, seq_len))
    uses_seconds = [0.0]
    shipped_uses = ghost.GhostNormRecorder.parameter_uses

    def timed_uses(self, calls=None):
        start = time.process_time()
        try:
            return shipped_uses(self, calls)
        finally:
            uses_seconds[0] += time.process_time() - start

    ghost.GhostNormRecorder.parameter_uses = timed_uses
    seconds = {arm: [] for arm in ARMS}
    uses = {arm: [] for arm in ARMS}
    try:
        install("recompute")
        trace()  # the model's one-context check runs here, untimed
        for _ in range(rounds):
            for arm in ARMS:
                source = install(arm)
                uses_seconds[0] = 0.0
                start = time.process_time()
                trace()
                seconds[arm].append(time.process_time() - start)
                uses[arm].append(uses_seconds[0])
                source.clear()
            print(json.dumps({arm: [seconds[arm][-1], uses[arm][-1]] for arm in ARMS}), flush=True)
    finally:
        ghost.GhostNormRecorder.parameter_uses = shipped_uses
        ghost.F = F
    return {"seconds": seconds, "parameter_uses": uses}


def memory_child(name: str, arm: str, n_contexts: int, seq_len: int) -> None:
    model = build(name).eval()
    install(arm)
    arm_function(name, "trace2", model, rows_for(model, 2, seq_len, seed=1))()
    run = arm_function(name, "trace2", model, rows_for(model, n_contexts, seq_len))
    with PeakMemory(torch.device("cpu")) as peak:
        run()
    print(json.dumps({"peak_bytes": peak.peak}))


def spread(values: list[float], digits: int = 3) -> str:
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="bert15m", help="a model of benchmarks/trace_floor.py")
    parser.add_argument("--n-contexts", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--memory", action="store_true")
    parser.add_argument("--no-timing", action="store_true")
    parser.add_argument("--memory-child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if args.memory_child:
        memory_child(args.model, args.memory_child, args.n_contexts, args.seq_len)
        return
    load = os.getloadavg()
    print(f"{args.model}, {args.n_contexts} x {args.seq_len} tokens, 2 draws, load average {load[0]:.1f}")
    if not args.no_timing:
        result = timing(args.model, args.n_contexts, args.seq_len, args.rounds)
        seconds, uses = result["seconds"], result["parameter_uses"]
        print(f"\n| arm | trace CPU s | / recompute, same round | parameter_uses CPU s ({args.rounds} rounds) |")
        print("|---|---|---|---|")
        for arm in ARMS:
            ratio = [s / r for s, r in zip(seconds[arm], seconds["recompute"], strict=True)]
            print(f"| {arm} | {spread(seconds[arm])} | {spread(ratio, 4)} | {spread(uses[arm], 4)} |")
    if args.memory:
        print("\n| arm | peak MiB above the call's start |\n|---|---|")
        for arm in ARMS:
            out = subprocess.run(
                [sys.executable, __file__, "--model", args.model, "--memory-child", arm,
                 "--n-contexts", str(args.n_contexts), "--seq-len", str(args.seq_len)],
                capture_output=True, text=True, check=True,
            )  # fmt: skip
            peak = json.loads(out.stdout.strip().splitlines()[-1])["peak_bytes"]
            print(f"| {arm} | {peak / 2**20:.0f} |", flush=True)
    load = os.getloadavg()
    print(f"\nload average at the end {load[0]:.1f}")


if __name__ == "__main__":
    main()
