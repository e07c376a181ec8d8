"""How far apart the three Adam-preconditioned SAM forms (``sam_preconditioner``) move the parameters, beside how far
SAM moves them from AdamW: the smoke setting of ``recipes/sam_variants_comparison.py`` (the tiny BERT and Llama of
`research.sam_variants`, 256 PCFG sentences, batch 32, AdamW lr 2e-3, rho 0.05, seed 0, 4 steps).

For each pair of runs: the largest absolute parameter difference after the steps, and the Euclidean distance between
the two parameter vectors relative to how far AdamW moved from the initialisation. Adam's early updates are about
``lr`` per coordinate whatever the gradient's size, so the largest difference saturates near ``2 * lr * steps`` for
any pair whose update sign differs in a single coordinate (here 1.6e-2 would be the ceiling); the relative distance
does not. Either says whether the choice among the forms matters as much as SAM itself at this scale, nothing about
which form trains better.

    cd recipes && OMP_NUM_THREADS=1 PYTHONPATH=..:. python -m research.preconditioner_forms
"""

from __future__ import annotations

import argparse
import itertools
import tempfile

import torch

from hf_flatbias.config import FlatBiasConfig
from hf_flatbias.synthetic.data import MaskedWordCollator
from hf_flatbias.trainer import FlatBiasTrainer

from .sam_variants import RHO, CausalCollator, Setting, tiny_model

FORMS = ("adam", "adam_stored_moment", "adam_preconditioned_ball")


def trained_parameters(setting: Setting, kind: str, overrides: dict, *, steps: int, seed: int) -> torch.Tensor:
    """The flattened parameters after ``steps`` updates, trained as `research.sam_variants.run_one` trains."""
    model = tiny_model(kind, setting.vocab_size, 32, seed)
    collator = MaskedWordCollator(0.15, seed=seed) if kind == "bert" else CausalCollator()
    with tempfile.TemporaryDirectory() as output_dir:
        config = FlatBiasConfig(
            output_dir=output_dir,
            max_steps=steps,
            per_device_train_batch_size=32,
            learning_rate=2e-3,
            lr_scheduler_type="cosine",
            warmup_steps=1,
            optim="adamw_torch",
            adam_beta2=0.98,
            weight_decay=0.01,
            max_grad_norm=1.0,
            save_strategy="no",
            report_to="none",
            use_cpu=True,
            seed=seed,
            disable_tqdm=True,
            remove_unused_columns=False,
            **overrides,
        )
        FlatBiasTrainer(
            model=model, args=config, train_dataset=setting.train.select_columns(["input_ids"]), data_collator=collator
        ).train()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    setting = Setting(n_train=256, n_eval=16, trace_contexts=8)
    table = {}
    initial = {
        kind: torch.cat(
            [p.detach().reshape(-1) for p in tiny_model(kind, setting.vocab_size, 32, args.seed).parameters()]
        )
        for kind in ("bert", "llama")
    }
    for kind, method in itertools.product(("bert", "llama"), ("sam", "functional_sam")):
        runs = {"adamw": {"flatness_method": "none"}, "none": {"flatness_method": method, "sam_rho": RHO}}
        runs |= {form: {"flatness_method": method, "sam_rho": RHO, "sam_preconditioner": form} for form in FORMS}
        params = {
            name: trained_parameters(setting, kind, o, steps=args.steps, seed=args.seed) for name, o in runs.items()
        }
        moved = float((params["adamw"] - initial[kind]).norm())
        for a, b in itertools.combinations(params, 2):
            difference = params[a] - params[b]
            table[f"{kind} {method}: {a} vs {b}"] = (float(difference.abs().max()), float(difference.norm()) / moved)
    print(f"{'pair':70s} {'max |diff|':>10s} {'||diff|| / ||adamw - init||':>28s}")
    for key, (largest, relative) in table.items():
        print(f"{key:70s} {largest:10.2e} {relative:28.3f}")
    return table


if __name__ == "__main__":
    main()
