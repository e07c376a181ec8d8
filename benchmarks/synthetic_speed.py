"""How fast the synthetic languages are built and solved exactly, against the issue's budget.

Prints wall seconds of each stage and its ratio to the budget (100k PCFG sentences as a Dataset in under 60 s);
the exact-inference rows give sentences per second so the cost of an entropy floor on N contexts can be read off.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/synthetic_speed.py
"""

from __future__ import annotations

import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from hf_flatbias.synthetic import HMM, PCFG, Dyck, build_pcfg_dataset  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def main() -> None:
    pcfg = PCFG.from_seed(0)
    sample, t_sample = timed(lambda: pcfg.sample(100_000, seed=1))
    _, t_dataset = timed(lambda: build_pcfg_dataset(pcfg, 100_000, 2_000, seed=0))
    print(f"PCFG sample 100k sentences:         {t_sample:7.2f} s  ({t_sample / 60:.3f} of the 60 s budget)")
    print(f"PCFG build_pcfg_dataset 100k + 2k:  {t_dataset:7.2f} s  ({t_dataset / 60:.3f} of the 60 s budget)")
    n = 1000
    _, t_cond = timed(lambda: pcfg.masked_conditionals(sample.word_ids[:n], sample.lengths[:n]))
    print(
        f"PCFG exact conditionals (all positions): {n / t_cond:7.1f} sentences/s (mean length "
        f"{sample.lengths[:n].mean():.1f})"
    )
    hmm = HMM.from_seed(0)
    hmm_sample, t_hmm = timed(lambda: hmm.sample(100_000, 24, seed=0))
    _, t_fb = timed(lambda: hmm.masked_conditionals(hmm_sample.word_ids[:10_000]))
    print(f"HMM sample 100k x 24:               {t_hmm:7.2f} s")
    print(f"HMM exact conditionals:             {10_000 / t_fb:9.0f} sequences/s")
    dyck = Dyck(n_types=2, length=16)
    words, t_dyck = timed(lambda: dyck.sample(100_000, seed=0).word_ids)
    positions = np.random.default_rng(0).integers(0, 16, 2000)
    _, t_dyck_cond = timed(lambda: dyck.masked_conditionals(words[:2000], positions))
    print(f"Dyck sample 100k x 16:              {t_dyck:7.2f} s")
    print(f"Dyck exact conditionals:            {2000 / t_dyck_cond:9.0f} strings/s")


if __name__ == "__main__":
    main()
