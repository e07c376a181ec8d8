"""Training arguments for flatness-aware training."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field, fields

from transformers import TrainingArguments

from .constants import DEFAULT_SAM_RHO
from .measure_settings import is_number
from .sharpness.methods.table import (
    FLATNESS_METHOD_HYPERPARAMETERS,  # noqa: F401 - read from here by older callers
    FLATNESS_METHODS,
    METHOD_TABLE,
    SAM_METHODS,  # noqa: F401 - read from here by older callers
    SAM_STEP_OPTION_NAMES,
    TORCH_COMPILE_REFUSALS,  # noqa: F401 - read from here by older callers
    method_spec,
)
from .utils import quiet_deepspeed_without_accelerator

SAM_PRECONDITIONERS = ("none", "adam", "adam_stored_moment", "adam_preconditioned_ball")
SAM_RHO_SCHEDULES = ("constant", "linear_warmup")
# The optimizers whose state holds Adam's second moment as `exp_avg_sq`, `step` and the group's `betas`/`eps`.
ADAM_OPTIMIZERS = ("adamw_torch", "adamw_torch_fused", "adamw_torch_npu_fused", "adamw_torch_xla")
SAM_SCOPES = ("micro_batch", "batch")
SAM_PERTURBATIONS = ("global", "per_rank")


@dataclass
class FlatnessArguments:
    """The flatness-seeking options shared by every trainer config of this package, defined once.

    Not a config by itself: it is mixed in *before* a `TrainingArguments` subclass (``FlatnessArguments, SFTConfig``),
    so its fields come after the host's (``output_dir`` stays the first positional argument), the host keeps its own
    defaults (trl's `SFTConfig` sets other learning-rate and logging defaults than `TrainingArguments`), and these
    fields are checked before the host's ``__post_init__`` runs.
    """

    flatness_method: str = field(
        default="none",
        metadata={
            "help": "How training seeks flat minima. "
            + "; ".join(f"'{name}': {spec.help}" for name, spec in METHOD_TABLE.items())
            + ". "
            + " and ".join(f"'{name}'" for name, spec in METHOD_TABLE.items() if spec.passes_per_step == 1)
            + " take one forward/backward pass per step, the other methods two (see sam_every_k).",
            "choices": list(FLATNESS_METHODS),
        },
    )
    sam_rho: float = field(
        default=DEFAULT_SAM_RHO,
        metadata={
            "help": "Radius of the SAM/ASAM neighbourhood (Momentum-SAM: the length of its step along the coming "
            "update). ASAM usually needs a larger value (about 0.5-2)."
        },
    )
    asam_eta: float = field(
        default=0.01,
        metadata={
            "help": "ASAM's offset in T_w = |w| + eta, so that zero weights are still perturbed. T_w applies to every "
            "trainable parameter, biases included (the official ASAM code gives biases T = 1); asam_eta=0 gives "
            "davda54/sam's adaptive mode."
        },
    )
    sam_scope: str = field(
        default="micro_batch",
        metadata={
            "help": "Which gradient defines the perturbation under gradient accumulation. 'micro_batch': each "
            "micro-batch is perturbed along its own gradient (m-sharpness, cheapest); 'batch': the exact SAM step "
            "of the whole accumulated batch (the first gradient is accumulated over all micro-batches of the "
            "update, then every micro-batch is re-run at w + e). Both are identical without accumulation.",
            "choices": list(SAM_SCOPES),
        },
    )
    sam_perturbation: str = field(
        default="global",
        metadata={
            "help": "With several processes: 'global' averages the first gradient over processes so every rank "
            "applies the same perturbation (the single-process SAM step on the global batch); 'per_rank' lets each "
            "rank use its own gradient (m-sharpness across ranks, no extra communication).",
            "choices": list(SAM_PERTURBATIONS),
        },
    )

    sam_preconditioner: str = field(
        default="none",
        metadata={
            "help": "The geometry of the SAM/Functional-SAM perturbation. 'none': e = rho * g / ||g||. The Adam forms "
            "use P = sqrt(v_hat) + eps, Adam's denominator (g at the scale of a whole update under accumulation); "
            "Adam's update -lr * m / P is steepest descent in the norm ||d||_P = sqrt(d^T P d), and SAM's "
            "first-order ascent over that norm's ball, max g^T e subject to e^T P e <= r^2, is e = r * (g / P) / "
            "sqrt(g^T P^-1 g): the direction g / P. 'adam' (the default Adam form): that direction at Euclidean "
            "length rho, e = rho * (g / P) / ||g / P|| (rho means the same with and without a preconditioner), with "
            "this step's g folded into the optimizer's moment: v = beta2 * v_prev + (1 - beta2) * g^2, "
            "bias-corrected by 1 - beta2^(t + 1) (before the optimizer's first step P = |g| + eps, a sign-like "
            "perturbation as Adam's first update). 'adam_preconditioned_ball': the same P and direction, the "
            "radius measured in P's norm (||e||_P = rho). 'adam_stored_moment': 'adam' with the moment as the "
            "optimizer holds it, v_prev / (1 - beta2^t) (P = eps before its first step: plain SAM's direction; a "
            "coordinate with no gradient yet takes nearly the whole perturbation). Which form Singh et al. (ICML "
            "2025) use is not verified here. Needs optim in " + ", ".join(ADAM_OPTIMIZERS) + "; not under DeepSpeed "
            "(ZeRO keeps the moments in its own partitions) or Muon (no per-coordinate second moment).",
            "choices": list(SAM_PRECONDITIONERS),
        },
    )

    sam_ascent_fraction: float = field(
        default=1.0,
        metadata={
            "help": "Share f (0 < f <= 1) of each micro-batch's rows whose gradient defines the SAM/ASAM perturbation "
            "(Bahri et al., ACL 2022): the first ceil(f * rows) rows; the update's gradient still uses every row. "
            "A step costs about 1 + f forward/backward passes. With f < 1 the logged loss is that of the ascent rows "
            "(per labelled token for language models). Not for 'functional_sam', which needs dL/dF at w on every row."
        },
    )
    sam_parameters: str = field(
        default="all",
        metadata={
            "help": "Which trainable parameters the SAM perturbation moves (the norm of g is taken over them only): "
            "'all'; 'output_layer': the parameters of model.get_output_embeddings() (logits-SAM of Luo et al., 2026; "
            "with tied embeddings this is the input embedding too); or comma-separated fnmatch patterns of "
            "parameter names, e.g. '*.layer.1.*,cls.*'. The update still trains every trainable parameter. When "
            "only output-layer parameters move, the second pass reuses the first pass's trunk outputs (one trunk "
            "forward per step); it falls back to two whole forwards, said once in the log, when the trunk draws "
            "random numbers (dropout > 0), the head is tied to the input embedding, or with sam_scope='batch', "
            "sam_ascent_fraction < 1 or a compiled model."
        },
    )
    sam_start_step: int = field(
        default=0,
        metadata={"help": "First optimizer update (global step) that takes the SAM step; earlier updates are plain."},
    )
    sam_end_step: int = field(
        default=-1,
        metadata={
            "help": "Optimizer update at which the SAM window closes (updates >= sam_end_step are plain); -1 keeps "
            "SAM to the end of training."
        },
    )
    sam_rho_schedule: str = field(
        default="constant",
        metadata={
            "help": "How rho varies inside the SAM window. 'constant': sam_rho; 'linear_warmup': "
            "sam_rho * min(1, (t - sam_start_step + 1) / sam_rho_warmup_steps) at update t. The radius in use is "
            "logged as sam/rho.",
            "choices": list(SAM_RHO_SCHEDULES),
        },
    )
    sam_rho_warmup_steps: int = field(
        default=0,
        metadata={"help": "Length in optimizer updates of the 'linear_warmup' rho schedule (>= 1 for it, else 0)."},
    )

    sam_every_k: int = field(
        default=1,
        metadata={
            "help": "Run the SAM/ASAM/LookSAM second pass on every k-th optimizer update only (updates 0, k, 2k, ...); "
            "the updates in between are plain steps (LookSAM: its cheap reuse step; Momentum-SAM perturbs on those "
            "updates only). Costs about 1 + 1/k plain steps. 1 = every update."
        },
    )
    looksam_alpha: float = field(
        default=0.7,
        metadata={
            "help": "LookSAM's weight on the reused direction: between SAM updates the gradient is "
            "g + looksam_alpha * ||g|| * g_v / ||g_v||. The LookSAM paper uses 0.7."
        },
    )
    penalty_lambda: float = field(
        default=0.01,
        metadata={
            "help": "Weight of the explicit penalty: lambda x Tr F (sampled-label Fisher trace per labelled position) "
            "for 'fisher_penalty', lambda x ||grad L|| for 'grad_norm_penalty' (lambda = penalty_fd_step is then "
            "exactly SAM with rho = penalty_fd_step)."
        },
    )
    penalty_fd_step: float = field(
        default=0.01,
        metadata={
            "help": "Length h of the finite-difference step that replaces double backward in the penalties' "
            "gradient: H v ~ ||v|| (grad L(w + h v/||v||) - grad L(w)) / h. Too small loses float precision, too "
            "large biases the curvature; 0.01 suits float32 weights of O(0.02-1)."
        },
    )

    def __post_init__(self) -> None:
        self._convert_numeric_strings()
        self._validate_flatness_arguments()
        accelerator = quiet_deepspeed_without_accelerator()
        if self.dataloader_pin_memory and (self.use_cpu or not accelerator):
            # pinned memory only speeds copies to an accelerator; without one PyTorch warns on every epoch
            self.dataloader_pin_memory = False
        super().__post_init__()  # the host TrainingArguments (or trl config) next in the MRO

    def _convert_numeric_strings(self) -> None:
        # YAML 1.1 reads `sam_rho: 5e-2` (no dot) as the string "5e-2": accept a number written as text, refuse the
        # rest here rather than as a type error deep inside the first step
        for name, kind in self._numeric_field_types().items():
            value = getattr(self, name)
            if not isinstance(value, str):
                continue
            try:
                setattr(self, name, kind(value.strip()))
            except ValueError:
                raise ValueError(
                    f"{name} must be a number, got the string {value!r}; write it as a number, e.g. "
                    f"{name}={self.__dataclass_fields__[name].default!r}."
                ) from None

    def _numeric_field_types(self) -> dict[str, type]:
        """The numeric fields and their types (a config that adds its own extends this)."""
        return _NUMERIC_FIELDS

    def _validate_flatness_arguments(self) -> None:
        method_spec(self.flatness_method)  # an unknown name is refused with the choices
        if not is_number(self.sam_rho) or not math.isfinite(self.sam_rho) or self.sam_rho <= 0:
            raise ValueError(f"sam_rho must be a finite number > 0 (got {self.sam_rho!r}); the SAM paper uses 0.05.")
        if not is_number(self.asam_eta) or not math.isfinite(self.asam_eta) or self.asam_eta < 0:
            raise ValueError(f"asam_eta must be a finite number >= 0 (got {self.asam_eta!r}); ASAM uses 0.01.")
        if self.sam_scope not in SAM_SCOPES:
            raise ValueError(f"sam_scope={self.sam_scope!r} is not supported; choose one of {list(SAM_SCOPES)}.")
        if self.sam_perturbation not in SAM_PERTURBATIONS:
            raise ValueError(
                f"sam_perturbation={self.sam_perturbation!r} is not supported; choose one of {list(SAM_PERTURBATIONS)}."
            )
        self._validate_regularizer_arguments()
        self._validate_sam_step_options()
        # a backend or a mode turns torch_compile on in the host's __post_init__, which runs after this
        compile_fields = ("torch_compile", "torch_compile_backend", "torch_compile_mode")
        check_torch_compile_supports(self.flatness_method, any(getattr(self, name, None) for name in compile_fields))
        self._warn_about_unread_hyperparameters()

    def _validate_regularizer_arguments(self) -> None:
        if isinstance(self.sam_every_k, bool) or not isinstance(self.sam_every_k, int) or self.sam_every_k < 1:
            raise ValueError(
                f"sam_every_k must be an integer >= 1 (got {self.sam_every_k!r}); 1 runs SAM on every update."
            )
        if self.sam_every_k > 1 and "sam_every_k" not in METHOD_TABLE[self.flatness_method].options:
            readers = [name for name, spec in METHOD_TABLE.items() if "sam_every_k" in spec.options]
            raise ValueError(
                f"sam_every_k={self.sam_every_k} only applies to flatness_method in {readers}, not "
                f"{self.flatness_method!r}; leave sam_every_k=1."
            )
        if not is_number(self.looksam_alpha) or not math.isfinite(self.looksam_alpha):
            raise ValueError(f"looksam_alpha must be a finite number (got {self.looksam_alpha!r}); LookSAM uses 0.7.")
        if self.looksam_alpha < 0:
            raise ValueError(f"looksam_alpha must be >= 0 (got {self.looksam_alpha!r}); LookSAM uses 0.7.")
        for name in ("penalty_lambda", "penalty_fd_step"):
            value = getattr(self, name)
            if not is_number(value) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name} must be a finite number > 0 (got {value!r}); the default is 0.01.")
        if self.sam_scope != "micro_batch" and not METHOD_TABLE[self.flatness_method].batch_scope:
            batch_scoped = [name for name, spec in METHOD_TABLE.items() if spec.batch_scope and name != "none"]
            raise ValueError(
                f"flatness_method={self.flatness_method!r} works per micro-batch; set sam_scope='micro_batch' "
                f"(sam_scope='batch' is implemented for {', '.join(map(repr, batch_scoped))} only)."
            )

    def _validate_sam_step_options(self) -> None:
        if self.sam_preconditioner not in SAM_PRECONDITIONERS:
            raise ValueError(
                f"sam_preconditioner={self.sam_preconditioner!r} is not supported; choose one of "
                f"{list(SAM_PRECONDITIONERS)}."
            )
        if self.sam_rho_schedule not in SAM_RHO_SCHEDULES:
            raise ValueError(
                f"sam_rho_schedule={self.sam_rho_schedule!r} is not supported; choose one of {list(SAM_RHO_SCHEDULES)}."
            )
        fraction = self.sam_ascent_fraction
        if not is_number(fraction) or not math.isfinite(fraction) or not 0 < fraction <= 1:
            raise ValueError(f"sam_ascent_fraction must be in (0, 1] (got {fraction!r}); 1 uses every row.")
        for name, lowest in (("sam_start_step", 0), ("sam_end_step", -1), ("sam_rho_warmup_steps", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < lowest:
                raise ValueError(f"{name} must be an integer >= {lowest} (got {value!r}).")
        if self.sam_end_step != -1 and self.sam_end_step <= self.sam_start_step:
            raise ValueError(
                f"sam_end_step={self.sam_end_step} must be > sam_start_step={self.sam_start_step} (or -1 for the end "
                "of training)."
            )
        self._check_sam_window_fits_max_steps()
        if (self.sam_rho_schedule == "linear_warmup") != (self.sam_rho_warmup_steps > 0):
            raise ValueError(
                f"sam_rho_schedule={self.sam_rho_schedule!r} with sam_rho_warmup_steps={self.sam_rho_warmup_steps}: "
                "'linear_warmup' needs sam_rho_warmup_steps >= 1 and 'constant' needs 0."
            )
        if not isinstance(self.sam_parameters, str) or not self.sam_parameters.strip():
            raise ValueError(
                f"sam_parameters must be 'all', 'output_layer' or name patterns (got {self.sam_parameters!r})."
            )
        reads = METHOD_TABLE[self.flatness_method].step_options
        for name in self.sam_step_option_names:
            default = self.__dataclass_fields__[name].default
            if name not in reads and getattr(self, name) != default:
                users = [method for method, spec in METHOD_TABLE.items() if name in spec.step_options]
                raise ValueError(
                    f"{name}={getattr(self, name)!r} applies to flatness_method in {users}, not "
                    f"{self.flatness_method!r}; leave {name} at its default {default!r}."
                )
        optim = str(getattr(self.optim, "value", self.optim))
        refusal = METHOD_TABLE[self.flatness_method].refusal_of_optim(optim)
        if refusal is not None:
            raise ValueError(refusal)
        if self.sam_preconditioner != "none":
            if optim not in ADAM_OPTIMIZERS:
                raise ValueError(
                    f"sam_preconditioner={self.sam_preconditioner!r} reads Adam's second moment from the optimizer "
                    "state, but "
                    f"optim={optim!r}; "
                    f"use optim in {list(ADAM_OPTIMIZERS)} or sam_preconditioner='none'."
                )

    def _check_sam_window_fits_max_steps(self) -> None:
        # sam_start_step past the last update (global steps 0 .. max_steps - 1) trains without a single SAM step,
        # silently. With max_steps = -1 the number of updates comes from the data, which a config does not know.
        # The window [sam_start_step, sam_end_step) can also hold no multiple of sam_every_k.
        if "sam_start_step" not in METHOD_TABLE[self.flatness_method].step_options:
            return
        max_steps = getattr(self, "max_steps", -1)
        if isinstance(max_steps, int) and 0 < max_steps <= self.sam_start_step:
            raise ValueError(
                f"sam_start_step={self.sam_start_step} is not below max_steps={max_steps}: no update would take the "
                f"{self.flatness_method} step; lower sam_start_step below {max_steps} or raise max_steps."
            )
        first = -(-self.sam_start_step // self.sam_every_k) * self.sam_every_k  # first t >= start with t % k == 0
        stops = {"sam_end_step": self.sam_end_step} if self.sam_end_step != -1 else {}
        if isinstance(max_steps, int) and max_steps > 0:
            stops["max_steps"] = max_steps
        if stops and first >= min(stops.values()):
            name = min(stops, key=stops.get)
            raise ValueError(
                f"no update would take the {self.flatness_method} step: the first update t >= "
                f"sam_start_step={self.sam_start_step} with t % sam_every_k == 0 (sam_every_k={self.sam_every_k}) is "
                f"{first}, not below {name}={stops[name]}; lower sam_start_step or sam_every_k, or raise {name}."
            )

    def _warn_about_unread_hyperparameters(self) -> None:
        # penalty_lambda=0.1 with flatness_method="sam" is almost always a forgotten method, not a wish
        read = METHOD_TABLE[self.flatness_method].options
        unread = sorted(
            {
                name
                for spec in METHOD_TABLE.values()
                for name in spec.options
                if name not in read and getattr(self, name) != self.__dataclass_fields__[name].default
            }
        )
        if unread:
            readers = {name: [m for m, spec in METHOD_TABLE.items() if name in spec.options] for name in unread}
            given = ", ".join(f"{name}={getattr(self, name)!r} (read by {', '.join(readers[name])})" for name in unread)
            warnings.warn(
                f"flatness_method={self.flatness_method!r} ignores {given}: set the method that reads them, or leave "
                "them at their defaults.",
                UserWarning,
                stacklevel=5,  # the line that built the config, past __post_init__ and the dataclass __init__
            )

    @property
    def sam_step_option_names(self) -> tuple[str, ...]:
        """The options of the SAM step (``SAM_STEP_OPTION_NAMES``) this config carries: the shared ones, and those
        only its trainer reads (`FlatBiasDPOConfig`'s ``sam_kept_softmax_mib``)."""
        return tuple(name for name in SAM_STEP_OPTION_NAMES if name in self.__dataclass_fields__)

    @property
    def uses_sam(self) -> bool:
        return METHOD_TABLE[self.flatness_method].family == "sam"

    @property
    def uses_penalty(self) -> bool:
        return METHOD_TABLE[self.flatness_method].family == "penalty"


def check_torch_compile_supports(flatness_method: str, torch_compile: bool) -> None:
    """Raise a one-line ``ValueError`` when ``flatness_method`` cannot run with ``torch_compile`` (before training)."""
    reason = method_spec(flatness_method).refusal("torch_compile") if torch_compile else None
    if reason is not None:
        raise ValueError(reason)


_NUMERIC_FIELDS = {
    "sam_rho": float,
    "asam_eta": float,
    "sam_every_k": int,
    "sam_ascent_fraction": float,
    "sam_start_step": int,
    "sam_end_step": int,
    "sam_rho_warmup_steps": int,
    "looksam_alpha": float,
    "penalty_lambda": float,
    "penalty_fd_step": float,
}


@dataclass
class FlatBiasConfig(FlatnessArguments, TrainingArguments):
    """[`~transformers.TrainingArguments`] with the options of [`FlatBiasTrainer`]'s flatness-seeking steps.

    Every field can be given on the command line through [`~transformers.HfArgumentParser`] or in a YAML config,
    like any other training argument.
    """


def as_flatness_config(args: TrainingArguments | None, config_class: type[FlatnessArguments]) -> FlatnessArguments:
    """``args`` as ``config_class``: ``None`` gives its defaults; a config without the flatness fields means "no
    flatness method", with every value the user set kept."""
    if args is None:
        return config_class(output_dir="trainer_output")
    if isinstance(args, FlatnessArguments):
        return args
    if isinstance(args, TrainingArguments):
        init_fields = {f.name for f in fields(args) if f.init}
        accepted = {f.name for f in fields(config_class) if f.init}
        values = {name: getattr(args, name) for name in init_fields & accepted}
        return config_class(**values)
    raise TypeError(f"args must be a {config_class.__name__} or TrainingArguments, got {type(args).__name__}.")
