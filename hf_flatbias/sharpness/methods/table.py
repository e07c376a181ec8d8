"""The flatness methods in one table: what each is called, what the card calls it, the config fields it reads, where
it runs (engines, ``torch.compile``, trl's trainers, peft adapters) and the class that takes its steps.

The config (its choices, help and checks), the engine checks (`hf_flatbias.sharpness.support`), the model card (titles
and recorded hyperparameters) and the trl trainers all read `METHOD_TABLE`. Adding a method is its module in this
package (a `FlatnessMethod` subclass) and one `MethodSpec` entry here.

Kept free of torch and transformers, as `hf_flatbias.measures.MEASURE_TABLE` is: cards are read and the command line
builds its parser without torch. Each entry names its class as ``"module:Class"``, imported only when a trainer runs
the method.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Mapping
from typing import Any

ENGINES = ("single_process", "ddp", "zero0", "zero1", "zero2", "zero3", "fsdp2")
"""Where a step can run: one process, DDP, DeepSpeed ZeRO stage 0-3, FSDP2 (``fully_shard``)."""

DEEPSPEED_ENGINES = ("zero0", "zero1", "zero2", "zero3")

TRL_TRAINERS = ("sft", "dpo")
"""The trl trainers a method can run in: `FlatBiasSFTTrainer` and `FlatBiasDPOTrainer`."""

FAMILIES = ("none", "sam", "penalty")
"""``none``: the host's plain step; ``sam``: a step at weights moved by a perturbation of radius ``sam_rho``;
``penalty``: a curvature penalty added to the loss."""

# The options of the SAM step itself (the perturbation's geometry, rows, parameters, window and radius schedule).
# A config carries those its trainer reads (`FlatnessArguments.sam_step_option_names`): sam_kept_softmax_mib, the
# budget of DPO's head for the rows it keeps, is FlatBiasDPOConfig's only, so only a DPO run's card records it.
SAM_STEP_OPTION_NAMES = (
    "sam_preconditioner",
    "sam_ascent_fraction",
    "sam_parameters",
    "sam_kept_softmax_mib",
    "sam_start_step",
    "sam_end_step",
    "sam_rho_schedule",
    "sam_rho_warmup_steps",
)
SAM_WINDOW_OPTIONS = ("sam_start_step", "sam_end_step", "sam_rho_schedule", "sam_rho_warmup_steps")
"""The step options that say on which updates, and at which radius, the perturbation is taken."""


@dataclasses.dataclass(frozen=True)
class MethodSpec:
    """One flatness method.

    Attributes:
        name: its value of ``flatness_method``.
        title: how the model card names it (its hyperparameters follow in parentheses).
        help: what it does, in a clause of the config's help.
        method_class: ``"module:Class"``, the `FlatnessMethod` subclass that takes its steps.
        family: one of `FAMILIES`.
        options: the config fields it reads, which its model card records (and no others).
        step_options: the options of `SAM_STEP_OPTION_NAMES` it reads (the others must stay at their defaults).
        engines: the `ENGINES` it runs on exactly, each tested against a reference.
        fsdp2_per_rank: whether ``sam_perturbation='per_rank'`` runs under FSDP2.
        batch_scope: whether it takes ``sam_scope='batch'``.
        torch_compile: whether it runs with ``torch_compile=True``.
        trl_trainers: the `TRL_TRAINERS` it runs in.
        activation_offloading: whether its step runs inside trl's activation-offloading context.
        adapters: whether it trains peft adapters.
        needs_logit_gradient: whether its step differentiates the loss with respect to the logits (dL/dF), which a
            trl SFT loss only offers through trl's fused LM head.
        optimizers: the values of ``optim`` it can run with (it reads their state); empty: any.
        passes_per_step: forward/backward passes of one of its micro-batch steps.
        refusals: for each engine, ``"deepspeed"`` (every ZeRO stage), ``"torch_compile"``, trl trainer,
            ``"activation_offloading"``, ``"adapters"`` or ``"optim"`` it does not support, the one-line reason and
            fix.
    """

    name: str
    title: str
    help: str
    method_class: str
    family: str
    options: tuple[str, ...] = ()
    step_options: tuple[str, ...] = ()
    engines: tuple[str, ...] = ENGINES
    fsdp2_per_rank: bool = False
    batch_scope: bool = False
    torch_compile: bool = True
    trl_trainers: tuple[str, ...] = TRL_TRAINERS
    activation_offloading: bool = False
    adapters: bool = True
    needs_logit_gradient: bool = False
    optimizers: tuple[str, ...] = ()
    passes_per_step: int = 2
    refusals: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def load_class(self) -> type:
        """The `FlatnessMethod` subclass (imports torch)."""
        module, name = self.method_class.split(":")
        return getattr(importlib.import_module(module), name)

    def refusal_of_optim(self, optim: str) -> str | None:
        """Why ``optim`` (the training arguments' value) is refused, with the fix; ``None`` when it is accepted."""
        if not self.optimizers or optim in self.optimizers:
            return None
        return self.refusals["optim"] + f" (got optim={optim!r})"

    def refusal(self, what: str) -> str | None:
        """Why ``what`` (an engine, ``"torch_compile"``, a trl trainer, ``"activation_offloading"``, ``"adapters"``)
        is refused, with the fix, in one line; ``None`` when the method supports it."""
        if what in ENGINES:
            supported = what in self.engines
        elif what == "torch_compile":
            supported = self.torch_compile
        elif what in TRL_TRAINERS:
            supported = what in self.trl_trainers
        elif what == "activation_offloading":
            supported = self.activation_offloading
        elif what == "adapters":
            supported = self.adapters
        elif what == "optim":
            raise KeyError("which optim values a method takes is its `optimizers`; ask `refusal_of_optim`.")
        else:
            raise KeyError(f"{what!r} is not something a method supports; one of {[*ENGINES, *_FEATURES]}.")
        if supported:
            return None
        if what in self.refusals:
            return self.refusals[what]
        return self.refusals["deepspeed"]  # a ZeRO stage, refused with DeepSpeed as a whole


_FEATURES = ("torch_compile", *TRL_TRAINERS, "activation_offloading", "adapters")


def _offloading_refused(name: str) -> str:
    # trl enters its offloading context in its own training_step, which a two-pass flatness step does not call
    return (
        f"activation_offloading=True is not supported with flatness_method={name!r}: its two-pass step runs outside "
        "trl's offloading context. Set activation_offloading=False (or use gradient_checkpointing to save "
        "activation memory)."
    )


def _penalty(name: str, title: str, help: str, method_class: str, **support: Any) -> MethodSpec:
    return MethodSpec(
        name=name,
        title=title,
        help=help,
        method_class=method_class,
        family="penalty",
        options=("penalty_lambda", "penalty_fd_step"),
        engines=("single_process", "ddp", "zero0", "zero1", "zero2", "fsdp2"),
        refusals={
            "zero3": f"flatness_method={name!r} is not supported under ZeRO-3: its step adds a term linear in the "
            "whole parameters, which ZeRO-3 only holds inside a forward. Use ZeRO stage 0-2, or 'sam' (which "
            "supports ZeRO-3).",
            "activation_offloading": _offloading_refused(name),
            **support.pop("refusals", {}),
        },
        **support,
    )


_SAM_OPTIONS = ("sam_rho", "sam_every_k")

METHOD_TABLE: dict[str, MethodSpec] = {
    spec.name: spec
    for spec in (
        MethodSpec(
            name="none",
            title="none (plain optimizer steps)",
            help="the plain Trainer step",
            method_class="hf_flatbias.sharpness.methods.base:NoFlatnessMethod",
            family="none",
            passes_per_step=1,
            fsdp2_per_rank=True,
            batch_scope=True,
            activation_offloading=True,
        ),
        MethodSpec(
            name="sam",
            title="SAM",
            help="sharpness-aware minimization (Foret et al., 2021), the gradient taken at w + rho * g / ||g||",
            method_class="hf_flatbias.sharpness.methods.sam:Sam",
            family="sam",
            options=_SAM_OPTIONS,
            step_options=SAM_STEP_OPTION_NAMES,
            fsdp2_per_rank=True,
            batch_scope=True,
            refusals={"activation_offloading": _offloading_refused("sam")},
        ),
        MethodSpec(
            name="asam",
            title="ASAM",
            help="adaptive SAM (Kwon et al., 2021), the neighbourhood scaled elementwise by |w| + asam_eta for every "
            "trainable parameter, biases and LayerNorms included (the official ASAM code scales only weights; "
            "asam_eta=0 reproduces davda54/sam's adaptive mode)",
            method_class="hf_flatbias.sharpness.methods.sam:Asam",
            family="sam",
            options=("sam_rho", "asam_eta", "sam_every_k"),
            # ASAM's |w| scaling is its own geometry: no second preconditioner on top of it
            step_options=tuple(name for name in SAM_STEP_OPTION_NAMES if name != "sam_preconditioner"),
            fsdp2_per_rank=True,
            batch_scope=True,
            refusals={"activation_offloading": _offloading_refused("asam")},
        ),
        MethodSpec(
            name="functional_sam",
            title="Functional-SAM",
            help="Functional-SAM (Singh et al., ICML 2025), SAM's perturbation but the update is the backward of "
            "<F(w + e), dL/dF at w> with F the logits, which keeps the Jacobian's change and drops the logit path "
            "of SAM's gradient",
            method_class="hf_flatbias.sharpness.methods.sam:FunctionalSam",
            family="sam",
            options=_SAM_OPTIONS,
            # it needs dL/dF at w on every row, so its first pass cannot be cut to a share of them, and its second
            # pass differentiates a surrogate, not the head's log-probabilities
            step_options=tuple(
                name for name in SAM_STEP_OPTION_NAMES if name not in ("sam_ascent_fraction", "sam_kept_softmax_mib")
            ),
            engines=("single_process", "ddp", "zero0", "zero1", "zero2", "zero3"),
            batch_scope=True,
            torch_compile=False,
            needs_logit_gradient=True,
            refusals={
                # not yet checked under FSDP2 against a reference: refused rather than risked (issue 25)
                "fsdp2": "flatness_method='functional_sam' is not supported under FSDP2 yet (its first pass "
                "differentiates the logits of the sharded model, which has no exact test there); use DDP (accelerate "
                "launch --multi_gpu) or DeepSpeed ZeRO-2/3.",
                "torch_compile": "flatness_method='functional_sam' is not supported with torch_compile=True: its "
                "first pass takes dL/dF, the loss's gradient with respect to the logits, but a compiled forward "
                "returns the loss and the logits as separate outputs of one graph, so the loss does not depend on "
                "the logits tensor it returns. Set torch_compile=False (and no torch_compile_backend/mode), or use "
                "'sam', whose steps are tested equal to eager under compile.",
                "activation_offloading": _offloading_refused("functional_sam"),
            },
        ),
        MethodSpec(
            name="looksam",
            title="LookSAM",
            help="LookSAM (Liu et al., CVPR 2022), a SAM update every sam_every_k updates and one-pass updates in "
            "between that reuse the stored SAM direction",
            method_class="hf_flatbias.sharpness.methods.looksam:LookSam",
            family="sam",
            options=("sam_rho", "sam_every_k", "looksam_alpha"),
            engines=("single_process", "ddp"),
            refusals={
                "deepspeed": "flatness_method='looksam' is not supported with DeepSpeed (it reads and edits "
                "param.grad, which ZeRO keeps in its own buffers); use 'sam' with sam_every_k=1, or run LookSAM with "
                "DDP (accelerate launch --multi_gpu) or a single process.",
                "fsdp2": "flatness_method='looksam' is not supported under FSDP2: its reuse updates edit param.grad "
                "between the backward and the optimizer step and keep a direction over the whole parameters. Use "
                "'sam' (with sam_every_k for a cheaper schedule), or run LookSAM with DDP (accelerate launch "
                "--multi_gpu).",
                "activation_offloading": _offloading_refused("looksam"),
            },
        ),
        _penalty(
            "fisher_penalty",
            "Fisher-trace penalty",
            "adds penalty_lambda x the sampled-label Fisher trace of the micro-batch to the loss",
            "hf_flatbias.sharpness.methods.fisher_penalty:FisherPenalty",
            trl_trainers=("sft",),
            refusals={
                "dpo": "flatness_method='fisher_penalty' samples next-token labels, which DPO's preference loss does "
                "not have; use 'sam', 'asam', 'looksam' or 'grad_norm_penalty' with DPO, or fisher_penalty with SFT."
            },
        ),
        _penalty(
            "grad_norm_penalty",
            "gradient-norm penalty",
            "adds penalty_lambda x ||grad L|| (Zhao et al., ICML 2022)",
            "hf_flatbias.sharpness.methods.grad_norm_penalty:GradNormPenalty",
        ),
        MethodSpec(
            name="momentum_sam",
            title="Momentum-SAM",
            help="Momentum-SAM (Becker et al., arXiv 2401.12033), the gradient taken at w - rho * d / ||d|| with d "
            "the optimizer's coming update read from its state (AdamW: m_hat / (sqrt(v_hat) + eps), weight decay "
            "left out; SGD: the momentum buffer), so a step is one forward/backward; the first update, before the "
            "optimizer has state, is plain; the logged loss is the loss at the perturbed weights; needs optim in "
            "adamw_torch, adamw_torch_fused, or sgd with optim_args='momentum=...'",
            method_class="hf_flatbias.sharpness.methods.momentum_sam:MomentumSam",
            family="sam",
            options=_SAM_OPTIONS,
            step_options=SAM_WINDOW_OPTIONS,
            engines=("single_process", "ddp"),
            batch_scope=True,
            torch_compile=True,
            trl_trainers=TRL_TRAINERS,
            activation_offloading=False,
            adapters=True,
            optimizers=("adamw_torch", "adamw_torch_fused", "sgd"),
            passes_per_step=1,
            refusals={
                "deepspeed": "flatness_method='momentum_sam' is not supported with DeepSpeed: it reads the "
                "optimizer's moments per parameter, which ZeRO keeps in its own flat partitions. Use DDP (accelerate "
                "launch --multi_gpu) or a single process.",
                "fsdp2": "flatness_method='momentum_sam' is not supported under FSDP2 yet (its direction's norm over "
                "sharded optimizer state has no exact test there); use DDP (accelerate launch --multi_gpu) or a "
                "single process.",
                "activation_offloading": "activation_offloading=True is not supported with "
                "flatness_method='momentum_sam' (not tested there); set activation_offloading=False.",
                "optim": "flatness_method='momentum_sam' reads the coming update from the optimizer's state, which it "
                "can for torch's AdamW and for SGD with momentum; set optim='adamw_torch', 'adamw_torch_fused' or "
                "'sgd' (with optim_args='momentum=0.9').",
            },
        ),
    )
}
"""Every flatness method, by name, in the order the config's choices list them."""

FLATNESS_METHODS = tuple(METHOD_TABLE)
"""The values of ``flatness_method``."""

FLATNESS_METHOD_HYPERPARAMETERS: dict[str, tuple[str, ...]] = {
    name: spec.options for name, spec in METHOD_TABLE.items()
}
"""Each method's config fields: a model card records these and no others (no sam_rho on a penalty run)."""

SAM_METHODS = tuple(name for name, spec in METHOD_TABLE.items() if spec.family == "sam")
PENALTY_METHODS = tuple(name for name, spec in METHOD_TABLE.items() if spec.family == "penalty")

SAM_STEP_OPTIONS: dict[str, tuple[str, ...]] = {
    name: spec.step_options for name, spec in METHOD_TABLE.items() if spec.step_options
}
"""The methods that read options of the SAM step, and which; the card records them with the training settings."""

TORCH_COMPILE_REFUSALS: dict[str, str] = {
    name: spec.refusals["torch_compile"] for name, spec in METHOD_TABLE.items() if not spec.torch_compile
}
"""Flatness methods refused with ``torch_compile``, each with its reason (the others are tested equal to eager)."""


def method_spec(name: str) -> MethodSpec:
    """The entry of ``flatness_method=name``; a one-line ``ValueError`` naming the choices for an unknown name."""
    spec = METHOD_TABLE.get(name) if isinstance(name, str) else None
    if spec is None:
        raise ValueError(f"flatness_method={name!r} is not supported; choose one of {list(FLATNESS_METHODS)}.")
    return spec


def check_method_supports(name: str, what: str) -> None:
    """Raise the one-line ``ValueError`` of `MethodSpec.refusal` when method ``name`` does not support ``what``."""
    reason = method_spec(name).refusal(what)
    if reason is not None:
        raise ValueError(reason)


__all__ = [
    "DEEPSPEED_ENGINES",
    "ENGINES",
    "FAMILIES",
    "FLATNESS_METHODS",
    "FLATNESS_METHOD_HYPERPARAMETERS",
    "METHOD_TABLE",
    "PENALTY_METHODS",
    "SAM_METHODS",
    "SAM_STEP_OPTIONS",
    "SAM_STEP_OPTION_NAMES",
    "SAM_WINDOW_OPTIONS",
    "TORCH_COMPILE_REFUSALS",
    "TRL_TRAINERS",
    "MethodSpec",
    "check_method_supports",
    "method_spec",
]
