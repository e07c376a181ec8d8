"""Cost of the distillation targets: exact conditionals at every position, per language, in sentences per CPU-second.

One pass per sentence (PCFG: inside pass and its gradient; HMM: forward-backward) gives every position at once;
the ratio row compares it with masking one position at a time (one inside pass per position, the single-mask route)
on the same sentences, in the same run. A distillation step of H64-L3 at batch 128 costs ~60 ms, so a target
rate of a few thousand sentences/s is ~1% of a campaign.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/distillation_targets.py
"""

from __future__ import annotations

import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from hf_flatbias.synthetic import HMM, PCFG  # noqa: E402
from hf_flatbias.synthetic.conditionals import cached_conditionals  # noqa: E402
from hf_flatbias.synthetic.tokenizer import MASKED_WORD  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def rate(fn, n: int, *args) -> float:
    """Sentences per CPU-second of ``fn(*args)`` in this process (one thread), so a loaded shared machine does not
    skew it."""
    start = time.process_time()
    fn(*args)
    return n / (time.process_time() - start)


def one_position_at_a_time(grammar: PCFG, word_ids: np.ndarray, lengths: np.ndarray) -> None:
    for t in range(int(lengths.max())):
        rows = np.flatnonzero(lengths > t)
        masked = word_ids[rows].copy()
        masked[:, t] = MASKED_WORD
        grammar.masked_conditionals(masked, lengths[rows])


def main() -> None:
    languages = {
        "3-level PCFG (5 symbols/level, 50 words)": PCFG.paper_shaped(
            0, n_levels=3, symbols_per_level=5, n_words=50, binary_rules_per_symbol=10
        ),
        "paper-shaped PCFG (4 levels, 200 words)": PCFG.paper_shaped(0),
    }
    for name, grammar in languages.items():
        n = 5000 if "3-level" in name else 1000
        sample = grammar.sample(n, seed=1)
        all_positions = rate(cached_conditionals, n, grammar, sample.word_ids, sample.lengths)
        k = n // 5
        single = rate(one_position_at_a_time, k, grammar, sample.word_ids[:k], sample.lengths[:k])
        print(
            f"{name:44s} {all_positions:8.0f} sentences/s all positions; one position at a time {single:7.0f}/s "
            f"(x{all_positions / single:.1f}); mean length {sample.lengths.mean():.1f}"
        )
    hmm = HMM.from_seed(0, n_states=20, n_words=40)
    words = hmm.sample(20_000, 12, seed=1).word_ids
    print(
        f"{'20-state HMM (40 words, length 12)':44s} {rate(cached_conditionals, 20_000, hmm, words):8.0f} "
        "sentences/s all positions (forward-backward)"
    )


if __name__ == "__main__":
    main()
