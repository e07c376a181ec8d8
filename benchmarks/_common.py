"""Builders shared by the benchmark scripts: a step timer, a masked-LM BERT and random masked-LM rows.

The scripts run as ``python benchmarks/NAME.py`` (or under ``accelerate launch``), which puts this folder first on
``sys.path``, so they import this module as ``_common``.
"""

from __future__ import annotations

import time

import torch
from transformers import BertConfig, BertForMaskedLM, TrainerCallback


class StepTimer(TrainerCallback):
    """Time of every optimizer step, in ``durations``: wall time by default, or any ``clock`` (``time.process_time``
    for this process's CPU time, which load from other jobs on a shared machine inflates less)."""

    def __init__(self, clock=time.perf_counter):
        self.durations: list[float] = []
        self._clock = clock
        self._start = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        self._start = self._clock()

    def on_step_end(self, args, state, control, **kwargs):
        self.durations.append(self._clock() - self._start)


def build_model(hidden: int, layers: int, vocab: int, seq_len: int, *, head_size: int) -> BertForMaskedLM:
    """BERT masked LM seeded with 0: ``max(1, hidden // head_size)`` heads, feed-forward 4 x hidden."""
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // head_size),
        intermediate_size=4 * hidden,
        max_position_embeddings=seq_len,
    )
    return BertForMaskedLM(config)


def masked_lm_rows(n: int, seq_len: int, vocab: int) -> list[dict[str, torch.Tensor]]:
    """Random tokens in [5, vocab), 15% of positions masked (token 4) and labelled, the rest -100; seed 0."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, vocab, (n, seq_len), generator=g)
    masked = torch.rand(ids.shape, generator=g) < 0.15
    labels = torch.where(masked, ids, torch.full_like(ids, -100))
    return [{"input_ids": ids[i].masked_fill(masked[i], 4), "labels": labels[i]} for i in range(n)]
