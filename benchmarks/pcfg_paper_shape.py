"""The paper-shaped PCFG: generation and exact-inference speed, and how much of each task word identity alone gives.

Prints, for ``PCFG.paper_shaped(--grammar-seed)``:

* wall seconds to sample ``--n-sample`` sentences (the released code generates 2x10^8; a CPU run needs ~10^6);
* sentences per second of the released code's labels (one inside pass) and of the exact conditionals at every
  position (inside + one backward pass);
* the *lexical baseline*: a linear probe on one-hot (position, word) features of a fixed width (the grammar's longest
  sentence), fitted on ``--n-probe`` sentences, its inverse regularisation chosen on a validation split of the same
  size, scored on a third split; sentences of 5+ words, as the released ``generate_downstream.py`` keeps.
  A pre-trained model's probe has to beat this to show that it learned anything beyond the words.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/pcfg_paper_shape.py
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
# the probe baseline is the research code's (recipes/research), imported as the recipes import it
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from research import MIN_PROBE_WORDS, onehot_position_word  # noqa: E402

from hf_flatbias.probe import probe_accuracy  # noqa: E402
from hf_flatbias.synthetic import PCFG  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grammar-seed", type=int, default=0, help="seed of PCFG.paper_shaped")
    parser.add_argument("--n-sample", type=int, default=1_000_000, help="sentences to time the sampler on")
    parser.add_argument("--n-probe", type=int, default=4000, help="sentences of each probe split (fit/select/test)")
    parser.add_argument("--n-conditionals", type=int, default=500, help="sentences to time exact conditionals on")
    args = parser.parse_args(argv)
    grammar = PCFG.paper_shaped(args.grammar_seed)

    start = time.perf_counter()
    sample = grammar.sample(args.n_sample, seed=1)
    t_sample = time.perf_counter() - start
    print(f"sample {args.n_sample:,} sentences: {t_sample:.1f} s ({args.n_sample / t_sample:,.0f} sentences/s)")
    print(f"  lengths {sample.lengths.min()}-{sample.lengths.max()}, mean {sample.lengths.mean():.2f}")

    keep = np.flatnonzero(sample.lengths >= MIN_PROBE_WORDS)[: 3 * args.n_probe]
    word_ids, lengths = sample.word_ids[keep], sample.lengths[keep]
    start = time.perf_counter()
    labels = grammar.task_labels(word_ids, lengths)
    t_labels = time.perf_counter() - start
    print(f"task labels (one inside pass): {len(keep) / t_labels:.0f} sentences/s")
    n_cond = args.n_conditionals
    start = time.perf_counter()
    grammar.masked_conditionals(word_ids[:n_cond], lengths[:n_cond])
    t_cond = time.perf_counter() - start
    print(f"exact conditionals at every position: {n_cond / t_cond:.0f} sentences/s")

    features = onehot_position_word(word_ids, lengths, grammar.max_length, grammar.n_words)
    splits = np.array_split(np.arange(len(keep)), 3)
    for task, y in labels.items():
        fit, select, test = splits
        scores = {
            c: probe_accuracy(
                features[fit], y[fit], test_features=features[select], test_labels=y[select], regularization=c
            ).accuracy
            for c in (0.0001, 0.001, 0.01, 0.1, 1.0)
        }
        best = max(scores, key=scores.get)
        result = probe_accuracy(
            features[fit], y[fit], test_features=features[test], test_labels=y[test], regularization=best
        )
        print(
            f"lexical baseline {task}: {result.accuracy:.3f} [{result.ci_low:.3f}, {result.ci_high:.3f}] "
            f"(C={best}; {result.n_classes} classes, majority {result.chance:.3f})"
        )


if __name__ == "__main__":
    main()
