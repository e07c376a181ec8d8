"""What the `per_sample` trace holds after its forward, by item (issue 35: the trace's working memory against a
training pass's), counted tensor by tensor, each storage once:

- ``graph``: the tensors the forward's autograd graph saves for the backward (weights and buffers left out);
- ``outputs_not_in_graph``: the recorded layer outputs the graph does not save, which the recorder held until the end
  of the measurement before it held them weakly (issue 35, sixth pass; now freed as the forward goes);
- ``coefficients``: the elementwise norms' ``d output / d weight`` (RMSNorm), held per call;
- ``largest_output_gradient``: the largest single gradient at a recorded output, what one draw's streamed backward
  holds per layer in flight on top of the backward's own tensors.

Models as in `trace_floor.py`; ``--layers N`` builds the same widths with N layers (a cheaper proxy).

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/trace_memory_breakdown.py --model llama341m --n-contexts 16

The peak resident set of the whole call comes from `trace_floor.py --memory-only`; run it with
``MALLOC_MMAP_THRESHOLD_=65536`` to take glibc's heap out (every large tensor mapped on its own and handed back when
freed), which leaves the tensors' own peak.
"""

from __future__ import annotations

import argparse
import collections
import json
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import _common  # noqa: E402
import torch  # noqa: E402
import trace_floor  # noqa: E402

from hf_flatbias.flatness import TraceContexts  # noqa: E402
from hf_flatbias.flatness.ghost import GhostNormRecorder  # noqa: E402
from hf_flatbias.flatness.lm import logits_at_positions, measured_parameters  # noqa: E402

MIB = 2**20


def build(name: str, layers: int | None) -> torch.nn.Module:
    if layers is None or not name.startswith("llama"):
        return trace_floor.build(name).eval()
    hidden, _, heads, kv_heads, mlp, tied = _common.LLAMA_SHAPES[name]
    _common.LLAMA_SHAPES[f"{name}-{layers}"] = (hidden, layers, heads, kv_heads, mlp, tied)
    return _common.llama_shape(f"{name}-{layers}").eval()


def breakdown(model: torch.nn.Module, n_contexts: int, seq_len: int) -> dict[str, float]:
    rows = trace_floor.rows_for(model, n_contexts, seq_len)
    contexts = TraceContexts.from_rows(rows, causal=model.config.model_type != "bert")
    indices = list(range(len(contexts)))
    batch = contexts.model_inputs(indices, model)
    positions = torch.tensor(contexts.positions)
    resident = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in resident:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    recorder = GhostNormRecorder(model, measured_parameters(model))
    recorder.batch_size = len(indices)
    outputs: list[torch.Tensor] = []  # the recorded (anchored) outputs, held here to be counted

    def keep(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> None:
        if isinstance(output, torch.Tensor) and output.requires_grad:
            outputs.append(output)

    with torch.enable_grad(), recorder, torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        # after the recorder's own hook, which it puts first
        handles = [module.register_forward_hook(keep) for module in recorder._kinds]
        logits_at_positions(model, batch, positions)
        for handle in handles:
            handle.remove()
    found: dict[str, dict[int, int]] = collections.defaultdict(dict)
    for output in outputs:
        storage = output.untyped_storage()
        if storage.data_ptr() not in saved:
            found["outputs_not_in_graph"][storage.data_ptr()] = storage.nbytes()
    for call in recorder.calls:
        for coefficient in call.coefficients.values():
            storage = coefficient.untyped_storage()
            found["coefficients"][storage.data_ptr()] = storage.nbytes()
    largest = max((output.numel() * output.element_size() for output in outputs), default=0)
    return {
        "calls": len(recorder.calls),
        "graph_mib": sum(saved.values()) / MIB,
        **{f"{key}_mib": sum(value.values()) / MIB for key, value in found.items()},
        "largest_output_gradient_mib": largest / MIB,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama341m")
    parser.add_argument("--layers", type=int, default=None, help="same widths, this many layers")
    parser.add_argument("--n-contexts", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=64)
    args = parser.parse_args()
    model = build(args.model, args.layers)
    result = {"model": args.model, "layers": args.layers, **breakdown(model, args.n_contexts, args.seq_len)}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
