"""How much the flatness card adds to a checkpoint save.

FlatBiasTrainer renders and writes the card (Jinja template, YAML metadata) on every save. This script times, in
one run and interleaved, `save_model` of a plain `Trainer` and of `FlatBiasTrainer` on the same BERT, plus the card
alone, and prints the ratios.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/card_overhead.py [--hidden 128 --layers 2 --repeats 20]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from transformers import BertConfig, BertForMaskedLM, Trainer, TrainingArguments

from hf_flatbias import FlatBiasConfig
from hf_flatbias.trainer import FlatBiasTrainer


def median_seconds(action, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        action()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--repeats", type=int, default=20)
    options = parser.parse_args()
    torch.set_num_threads(1)

    config = BertConfig(
        vocab_size=options.vocab,
        hidden_size=options.hidden,
        num_hidden_layers=options.layers,
        num_attention_heads=max(1, options.hidden // 64),
        intermediate_size=4 * options.hidden,
    )
    model = BertForMaskedLM(config)
    with tempfile.TemporaryDirectory() as root:
        common = dict(report_to=[], use_cpu=True, disable_tqdm=True)
        plain = Trainer(model=model, args=TrainingArguments(f"{root}/plain", **common))
        flat = FlatBiasTrainer(model=model, args=FlatBiasConfig(f"{root}/flat", flatness_method="sam", **common))
        flat.state.log_history = [{"loss": 3.0, "step": 1}, {"flatness/hessian_trace": 10.0, "step": 1}]

        rounds = {"plain": [], "flat": [], "card": []}
        for _ in range(3):  # interleave so that load changes on a shared machine hit both alike
            rounds["plain"].append(median_seconds(lambda: plain.save_model(f"{root}/plain_out"), options.repeats))
            rounds["flat"].append(median_seconds(lambda: flat.save_model(f"{root}/flat_out"), options.repeats))
            rounds["card"].append(median_seconds(lambda: flat.flatness_card().save(f"{root}/card"), options.repeats))
    plain_s, flat_s, card_s = (statistics.median(rounds[key]) for key in ("plain", "flat", "card"))
    print(
        f"model: BERT hidden={options.hidden} layers={options.layers} vocab={options.vocab}, "
        f"{model.num_parameters():,} parameters; median of {options.repeats} saves x 3 interleaved rounds"
    )
    print(f"Trainer.save_model:         {plain_s * 1e3:8.2f} ms")
    print(f"FlatBiasTrainer.save_model: {flat_s * 1e3:8.2f} ms  (ratio to Trainer: {flat_s / plain_s:.2f}x)")
    print(
        f"flatness card alone:        {card_s * 1e3:8.2f} ms  (share of a FlatBiasTrainer save: {card_s / flat_s:.1%})"
    )


if __name__ == "__main__":
    main()
