"""The command-line flags every synthetic recipe shares (argparse), ``--smoke`` sizes, and what the flags build."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from .language import LanguageSetup, setup_language
from .runs import RunSpec


def add_common_arguments(parser: argparse.ArgumentParser, *, steps: int, eval_every: int) -> None:
    """The flags of every synthetic recipe; ``steps`` and ``eval_every`` are the recipe's own defaults."""
    parser.add_argument("--language", choices=["pcfg", "hmm"], default="pcfg")
    parser.add_argument("--steps", type=int, default=steps, help="optimizer steps of each run")
    parser.add_argument("--eval-every", type=int, default=eval_every, help="steps between evaluated checkpoints")
    parser.add_argument("--batch-size", type=int, default=64)
    # defaults: the runs of docs/reproduction/synthetic.md, sized so a 30,000-step run fits in 30 minutes on 2 cores
    parser.add_argument("--learning-rate", type=float, default=2e-3)
    parser.add_argument("--hidden", type=int, default=64, help="BERT hidden size (64 x 2 layers: 0.11M parameters)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=None, help="attention heads (default: hidden // 32)")
    parser.add_argument("--n-train", type=int, default=400_000, help="training sentences")
    parser.add_argument("--n-contexts", type=int, default=2000, help="masked validation contexts for the loss")
    parser.add_argument("--n-probe", type=int, default=2000, help="sentences to fit the probe (and as many to score)")
    parser.add_argument("--trace-contexts", type=int, default=1000, help="contexts of the trace estimate (0: skip)")
    parser.add_argument("--trace-draws", type=int, default=2, help="labels drawn per context for the trace")
    parser.add_argument(
        "--probe-pooling",
        choices=["mean", "cls", "concat"],
        default="concat",
        help="encoder features for the probe: all positions of the last layer concatenated (the paper's linear "
        "probe), their mean, or the [CLS] vector",
    )
    parser.add_argument(
        "--mask-probability",
        type=float,
        default=0.0,
        help="chance of masking each word in training; 0: exactly one masked word per sentence (the paper's "
        "objective, whose optimum is the entropy floor)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", type=Path, default=None)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (under 2 minutes) for tests")


def add_target_loss_argument(parser: argparse.ArgumentParser) -> None:
    """``--target-loss``: the matched-loss stop of `RunSpec.target_loss`."""
    parser.add_argument(
        "--target-loss",
        type=float,
        default=None,
        help="stop each model at its first checkpoint whose one-mask loss is at or below this (matched loss); "
        "default: train every model for --steps",
    )


def apply_smoke(args: argparse.Namespace) -> None:
    """Shrink everything so the whole recipe runs in well under 2 minutes on one thread."""
    args.steps, args.eval_every = 20, 10
    args.batch_size, args.hidden, args.layers = 16, 32, 1
    args.n_train, args.n_contexts, args.n_probe = 400, 64, 100
    args.trace_contexts, args.trace_draws = 8, 1


def parse_recipe_arguments(
    parser: argparse.ArgumentParser, argv: Sequence[str] | None, default_language: str
) -> argparse.Namespace:
    """Parse a recipe's arguments with ``--language`` defaulting to ``default_language``; ``--smoke`` shrinks them.

    Also runs PyTorch on one thread unless ``OMP_NUM_THREADS`` says otherwise: the recipes' tiny models run many
    times slower with two threads on a shared machine.
    """
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    parser.set_defaults(language=default_language)
    args = parser.parse_args(argv)
    if args.smoke:
        apply_smoke(args)
    return args


def default_output_dir(args: argparse.Namespace, name: str, root: str = "outputs") -> Path:
    """``--output-dir``, else ``<root>/<name>`` (an ignored folder); a ``--smoke`` run gets ``<name>-smoke``, so it
    never overwrites the results of a real run."""
    if args.output_dir is not None:
        return Path(args.output_dir)
    return Path(root) / (f"{name}-smoke" if args.smoke else name)


def setup_language_from_args(args: argparse.Namespace, *, train_columns: Sequence[str] = ()) -> LanguageSetup:
    """``setup_language`` with the sizes, seed and probe pooling of ``add_common_arguments``."""
    return setup_language(
        args.language,
        n_train=args.n_train,
        n_contexts=args.n_contexts,
        n_probe=args.n_probe,
        seed=args.seed,
        probe_pooling=args.probe_pooling,
        train_columns=train_columns,
    )


def run_spec_arguments(args: argparse.Namespace) -> dict[str, Any]:
    """The ``RunSpec`` fields every recipe takes from its arguments (warm-up: a tenth of the steps, at most 100)."""
    return dict(
        steps=args.steps,
        eval_every=args.eval_every,
        batch_size=args.batch_size,
        learning_rate=args.learning_rate,
        warmup_steps=min(100, args.steps // 10),
        hidden=args.hidden,
        layers=args.layers,
        heads=args.heads,
        seed=args.seed,
        mask_probability=args.mask_probability,
    )


def add_paper_protocol_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags the paper-shaped protocol's recipes share (grammar gate, C1): grammar, model, optimizer, sizes."""
    parser.add_argument("--concentration", type=float, default=1.0, help="Dirichlet concentration of the grammar")
    parser.add_argument("--warmup-steps", type=int, default=500)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--learning-rate", type=float, default=2e-3, help="peak (gate) or constant (C1 trunk) rate")
    parser.add_argument("--weight-decay", type=float, default=0.01, help="AdamW's (the released code's 0.01)")
    parser.add_argument("--hidden", type=int, default=64, help="BERT hidden size (64 x 3 layers: 0.17M parameters)")
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--heads", type=int, default=None, help="attention heads (default: hidden // 32)")
    parser.add_argument("--n-train", type=int, default=400_000, help="training sentences")
    parser.add_argument("--n-kl", type=int, default=1000, help="held-out sentences of the KL (every position)")
    parser.add_argument("--n-probe", type=int, default=2000, help="probe fit and test sentences each (>= 5 words)")
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda", "auto"],
        default="cpu",
        help="where the models train and are measured (auto: cuda when present); probes fit on the CPU",
    )
    parser.add_argument("--output-dir", type=Path, default=None)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, seconds (tests)")


def paper_run_spec(
    args: argparse.Namespace, *, label: str, seed: int, eval_every: int, lr_scheduler_type: str
) -> RunSpec:
    """The run `add_paper_protocol_arguments` describes: the released code's AdamW (beta2 0.98) and our sizes."""
    return RunSpec(
        label=label,
        steps=args.steps,
        eval_every=eval_every,
        batch_size=args.batch_size,
        learning_rate=args.learning_rate,
        warmup_steps=args.warmup_steps,
        lr_scheduler_type=lr_scheduler_type,
        adam_beta2=0.98,
        weight_decay=args.weight_decay,
        hidden=args.hidden,
        layers=args.layers,
        heads=args.heads,
        seed=seed,
        use_cpu=trains_on_cpu(args.device),
    )


def apply_paper_smoke(args: argparse.Namespace) -> None:
    """`add_paper_protocol_arguments`'s sizes for a test that runs in seconds."""
    args.warmup_steps, args.batch_size, args.hidden, args.layers = 5, 16, 32, 1
    args.n_train, args.n_kl, args.n_probe = 400, 16, 60


def trains_on_cpu(device: str) -> bool:
    """Whether ``--device`` (cpu / cuda / auto) means the CPU; asking for cuda without one is an error, raised now."""
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is visible here; pass --device auto or cpu.")
    return device == "cpu" or not torch.cuda.is_available()
