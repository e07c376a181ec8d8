"""Counting which LM head trl's trainers run: ours (`label_log_probs`, which forms the head's gradients in the
forward) or trl's own fused kernel. Shared by the in-process trl tests and the launched distributed script."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def head_paths_counted() -> Iterator[dict]:
    """Inside the block, count the trl fused-head adapter's `label_log_probs` calls (``"head_gradient_forwards"``),
    with the bytes of ``softmax - onehot`` each may keep to its backward (``"kept_bytes"``), and trl's fused-kernel
    calls (``"trl_kernel_calls"``)."""
    import trl.trainer.utils as trl_utils

    import hf_flatbias.integrations.trl_fused_head as integration

    counts: dict = {"head_gradient_forwards": 0, "kept_bytes": [], "trl_kernel_calls": 0}
    label_log_probs, kernel = integration.label_log_probs, trl_utils._ChunkedLogProbFunction

    def counted_head(*args, **kwargs):
        counts["head_gradient_forwards"] += 1
        counts["kept_bytes"].append(kwargs.get("kept_bytes", 0))
        return label_log_probs(*args, **kwargs)

    def counted_kernel(*args):
        counts["trl_kernel_calls"] += 1
        return kernel.apply(*args)

    integration.label_log_probs = counted_head
    trl_utils._ChunkedLogProbFunction = type("CountedKernel", (), {"apply": staticmethod(counted_kernel)})
    try:
        yield counts
    finally:
        integration.label_log_probs, trl_utils._ChunkedLogProbFunction = label_log_probs, kernel
