"""One training run of a synthetic experiment: its spec, the `FlatBiasConfig` fields it sets, and the device."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hf_flatbias.constants import DEFAULT_SAM_RHO


@dataclass
class RunSpec:
    """One training run of a recipe."""

    label: str
    steps: int
    eval_every: int
    batch_size: int = 64
    learning_rate: float = 2e-3
    warmup_steps: int = 100
    # the paper's shape is AdamW with beta2 0.98 and a linear decay to 0 ("linear"); constant suits a trunk that
    # anneal-to-evaluate branches (`branches`) are taken from
    lr_scheduler_type: str = "constant_with_warmup"
    adam_beta2: float = 0.999
    dropout: float = 0.0
    weight_decay: float = 0.0
    flatness_method: str = "none"
    sam_rho: float = DEFAULT_SAM_RHO
    hidden: int = 64
    layers: int = 2
    seed: int = 0
    heads: int | None = None  # attention heads; None: build_model's default, hidden // 32
    # train wrap_model(model) (e.g. an AdversarialPretrainingModel around it) while measuring the masked LM itself
    wrap_model: Callable[[Any], torch.nn.Module] | None = None
    task_column: str | None = None  # a training column the collator hands the model as ``task_labels``
    # train on the CPU (the recipes' default); False lets the Trainer pick the accelerator (a GPU run)
    use_cpu: bool = True


def trainer_settings(spec: RunSpec, output_dir: Path) -> dict[str, Any]:
    """`FlatBiasConfig` fields of ``spec``: one process (the CPU unless ``spec.use_cpu`` is False), no checkpoints,
    no reports (a recipe adds its own)."""
    return dict(
        output_dir=str(output_dir),
        max_steps=spec.steps,
        per_device_train_batch_size=spec.batch_size,
        learning_rate=spec.learning_rate,
        lr_scheduler_type=spec.lr_scheduler_type,
        adam_beta2=spec.adam_beta2,
        warmup_steps=spec.warmup_steps,
        weight_decay=spec.weight_decay,
        flatness_method=spec.flatness_method,
        sam_rho=spec.sam_rho,
        save_strategy="no",
        report_to=[],
        logging_steps=max(1, spec.eval_every),
        disable_tqdm=True,
        seed=spec.seed,
        use_cpu=spec.use_cpu,
        dataloader_num_workers=0,
    )


def trains_on_cpu(device: str) -> bool:
    """Whether ``--device`` (cpu / cuda / auto) means the CPU; asking for cuda without one is an error, raised now."""
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is visible here; pass --device auto or cpu.")
    return device == "cpu" or not torch.cuda.is_available()
