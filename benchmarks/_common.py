"""Builders shared by the benchmark scripts: a step timer, a timed training run with its command line, interleaved
arms and their step ratios, a masked-LM BERT and random masked-LM rows.

The scripts run as ``python benchmarks/NAME.py`` (or under ``accelerate launch``), which puts this folder first on
``sys.path``, so they import this module as ``_common``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable, Hashable, Sequence

import torch
from transformers import BertConfig, BertForMaskedLM, LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback

WARMUP_STEPS = 2
"""Steps left out of a timing: the first ones pay for allocation and lazy initialisation."""

# What every timed run shares: the same optimizer, and nothing saved, logged or drawn that would land in a step's time.
TIMING_ARGUMENTS = dict(
    optim="adamw_torch",
    report_to="none",
    save_strategy="no",
    logging_strategy="no",
    use_cpu=True,
    disable_tqdm=True,
    dataloader_num_workers=0,
)


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


def timing_parser(description: str, quick_help: str) -> argparse.ArgumentParser:
    """The command line of a step-timing benchmark: ``--quick`` (smaller sizes) and ``--repeats``."""
    parser = argparse.ArgumentParser(description=description.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--repeats", type=int, default=None)
    return parser


def choose_sizes(args: argparse.Namespace, *, quick: tuple, full: tuple) -> tuple:
    """``quick`` or ``full`` as ``--quick`` says, each ``(sizes, repeats, steps, batch)``; ``--repeats`` overrides."""
    sizes, repeats, steps, batch = quick if args.quick else full
    return sizes, args.repeats or repeats, steps, batch


def run_timed_trainer(make_trainer: Callable[[str], Trainer], *, clock: Callable[[], float] = time.perf_counter):
    """Train the trainer that ``make_trainer(output_dir)`` builds, in a temporary folder, and return its step times
    after the first `WARMUP_STEPS`. Give its arguments `TIMING_ARGUMENTS`."""
    timer = StepTimer(clock)
    with tempfile.TemporaryDirectory() as output_dir:
        trainer = make_trainer(output_dir)
        trainer.add_callback(timer)
        trainer.train()
    return timer.durations[WARMUP_STEPS:]


def interleaved_step_times(
    arms: Sequence[Hashable], time_arm: Callable[[Hashable], list[float]], repeats: int
) -> dict[Hashable, list[list[float]]]:
    """Each arm's step times, one list per repeat: every repeat runs all the arms in turn (``time_arm(arm)`` returns
    one run's step times), so that load on a shared machine hits them alike."""
    times: dict[Hashable, list[list[float]]] = {arm: [] for arm in arms}
    for _ in range(repeats):
        for arm in arms:
            times[arm].append(time_arm(arm))
    return times


def median_step(per_repeat: list[list[float]]) -> float:
    """The median of an arm's step times over all its repeats."""
    return statistics.median(t for repeat in per_repeat for t in repeat)


def step_ratio(arm: list[list[float]], plain: list[list[float]]) -> tuple[float, float, float]:
    """An arm's median step over the plain arm's, and the range of the per-repeat ratios (each repeat's median over
    the plain arm's median in the same repeat)."""
    ratios = [statistics.median(a) / statistics.median(p) for a, p in zip(arm, plain, strict=True)]
    return median_step(arm) / median_step(plain), min(ratios), max(ratios)


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


# Llama shapes from 15M to 1.1B, random init: (hidden, layers, heads, key-value heads, MLP width, tied head). The 1.1B
# one is TinyLlama-1.1B's shape (untied head); the 341M one that of benchmarks/lanczos_memory.py.
LLAMA_SHAPES = {
    "llama15m": (256, 8, 4, 4, 688, True),
    "llama100m": (768, 12, 12, 4, 2048, True),
    "llama341m": (1024, 24, 16, 16, 2816, True),
    "llama1.1b": (2048, 22, 32, 4, 5632, False),
}


def llama_shape(name: str, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    """A Llama-family decoder of one of `LLAMA_SHAPES` (vocabulary 32,000), built from a config with random weights
    created directly in ``dtype`` (a 1.1B model never exists in float32 when bfloat16 is asked for)."""
    hidden, layers, heads, kv_heads, mlp, tied = LLAMA_SHAPES[name]
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=32_000,
        hidden_size=hidden,
        intermediate_size=mlp,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=2048,
        tie_word_embeddings=tied,
        pad_token_id=0,
    )
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        return LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)


def llama_100m() -> LlamaForCausalLM:
    """A ~100M-parameter Llama-family decoder built from a config (grouped-query attention, tied embeddings): the
    decoder shape the trace benchmarks measure beside BERT-base."""
    return llama_shape("llama100m")
