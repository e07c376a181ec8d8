"""SAM, the flatness penalties and the trace callback inside trl's `SFTTrainer` and `DPOTrainer`.

`FlatnessTrainerMixin` owns ``training_step`` (trl's trainers only wrap it); what differs from the plain `Trainer` is
what trl's ``compute_loss`` does besides the loss, handled through the mixin's hooks:

* it records metrics on every call (token accuracy, entropy, token counts; DPO's rewards and margins): the second
  pass of a step runs with them suspended, so every logged metric is the clean pass's, recorded once, and its fused
  LM head computes only what the loss reads (the log-probabilities, and DPO's WPO weights), not the fields that feed
  the metrics (entropy, mean logit, top-1), which cost an elementwise pass over every logits tile;
* SFT's forward returns per-token log-probabilities of the labels (a fused LM head), not logits: the Fisher penalty
  takes the logits from the model's ordinary forward, and Functional-SAM computes ``dL/dF`` and its surrogate in
  chunks from the backbone's hidden states (`hf_flatbias.sharpness.fused_head`), without the logits;
* DPO computes the reference model's log-probabilities inside the loss: they are computed once per micro-batch at
  the start of a flatness step and both passes read them, as with ``precompute_ref_log_probs=True``;
* trl's fused head recomputes its logits in the backward (four head products per pass): for output-layer SAM with the
  trunk replayed, the passes run a fused forward whose head forms its gradients without that recompute
  (`forward_with_head_gradients`, in `hf_flatbias.integrations.trl_fused_head` with what else is read from trl's code;
  two products in the first pass, three in the second): SFT's in the forward, DPO's in the backward from each row's
  ``softmax - onehot`` kept from the forward (its per-token weights are known only after the loss).
"""

from __future__ import annotations

import contextlib
import math
from collections import defaultdict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from torch import nn
from transformers.trainer_utils import unwrap_peft_model

try:
    from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer
except ImportError as error:  # pragma: no cover - exercised in a subprocess without trl
    raise ImportError(f'hf_flatbias\'s trl integration needs trl: pip install "hf_flatbias[trl]" ({error}).') from error

from ..config import FlatnessArguments
from ..measure_settings import is_number
from ..sharpness.fused_head import FusedHeadOutputs
from ..sharpness.methods.table import check_method_supports, method_spec
from ..trainer import FlatnessTrainerMixin
from .trl_fused_head import (
    forward_with_head_gradients,
    fused_forward_without_metrics,
    why_head_gradients_stay_in_backward,
)

_REFERENCE_KEYS = ("ref_chosen_logps", "ref_rejected_logps")


def check_trl_support(method: str, trl_trainer: str, activation_offloading: bool) -> None:
    """The one-line refusal of the method table when ``method`` cannot run in ``trl_trainer`` (`TRL_TRAINERS`) or
    with trl's activation offloading; the configs ask when they are made, the trainers again for a config made
    elsewhere (a plain `TrainingArguments`, a trl config)."""
    check_method_supports(method, trl_trainer)
    if activation_offloading:
        check_method_supports(method, "activation_offloading")


class _TrlFlatnessArguments(FlatnessArguments):
    #: Which of the table's trl trainers (`TRL_TRAINERS`) the config is for.
    _trl_trainer: ClassVar[str]

    def _validate_flatness_arguments(self) -> None:
        super()._validate_flatness_arguments()
        # at config time, before a model or data set is loaded for a trainer that would refuse the method
        check_trl_support(self.flatness_method, self._trl_trainer, bool(getattr(self, "activation_offloading", False)))


@dataclass
class FlatBiasSFTConfig(_TrlFlatnessArguments, SFTConfig):
    """trl's [`~trl.SFTConfig`] (its defaults kept) with the flatness options of [`FlatBiasConfig`]."""

    _trl_trainer = "sft"


@dataclass
class FlatBiasDPOConfig(_TrlFlatnessArguments, DPOConfig):
    """trl's [`~trl.DPOConfig`] (its defaults kept) with the flatness options of [`FlatBiasConfig`], and the one
    option only `FlatBiasDPOTrainer` reads: how much of its LM head's ``softmax - onehot`` output-layer SAM keeps."""

    _trl_trainer = "dpo"

    sam_kept_softmax_mib: float = field(
        default=512.0,
        metadata={
            "help": "Output-layer SAM in FlatBiasDPOTrainer with one trunk forward per step: MiB for the LM head's "
            "softmax - onehot of each pass's trained rows (rows x vocabulary values in float32, float64 for a "
            "float64 model; e.g. 4,096 response tokens of a 32k vocabulary take 512 MiB), kept from the head's "
            "forward to its backward, where DPO's per-sequence weights are known: the head's gradient then takes "
            "one product instead of trl's recomputed logits (two head products in the first pass, three in the "
            "second, against trl's three and four). Rows beyond it recompute their logits in the backward, as trl's "
            "fused head does; 0 keeps trl's head. Held until that pass's backward, never in both passes at once; the "
            "default is the size of one tile of trl's fused head (4,096 positions x 32,768 vocabulary entries)."
        },
    )

    def _numeric_field_types(self) -> dict[str, type]:
        return {**super()._numeric_field_types(), "sam_kept_softmax_mib": float}

    def _validate_sam_step_options(self) -> None:
        budget = self.sam_kept_softmax_mib
        if not is_number(budget) or not math.isfinite(budget) or budget < 0:
            raise ValueError(
                f"sam_kept_softmax_mib must be a finite number >= 0 (got {budget!r}); 0 keeps trl's fused LM head."
            )
        super()._validate_sam_step_options()  # with the rule shared by every option: only for the methods reading it


class _TrlTrainerMixin:
    """What trl's SFT and DPO trainers share: metrics in ``self._metrics[mode]`` and a running
    ``_total_train_tokens``; tags (``_tag_names``) that their model cards carry."""

    #: Which of the table's trl trainers (`TRL_TRAINERS`) this is.
    _trl_trainer: str

    def __init__(self, model=None, args=None, **kwargs: Any):
        check_trl_support(
            getattr(args, "flatness_method", "none"),
            self._trl_trainer,
            bool(getattr(args, "activation_offloading", False)),
        )
        super().__init__(model=model, args=args, **kwargs)
        # the model trl gave its fused LM head, and the forward a step's second pass runs instead of trl's
        self._fused_head_model = unwrap_peft_model(self.model)
        self._forward_without_metrics = fused_forward_without_metrics(
            self._fused_head_model, ("log_sum_sq_probs",) if getattr(self, "use_weighting", False) else ()
        )
        self._metrics_suspended = False

    def flatness_card(self, **card_kwargs: Any):
        given = card_kwargs.get("tags") or self._flatness_card_metadata.get("tags") or []
        card_kwargs["tags"] = [*self._tag_names, *([given] if isinstance(given, str) else given)]
        return super().flatness_card(**card_kwargs)

    def scaled_loss_and_function(self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch):
        """The loss through trl's fused LM head, with what Functional-SAM needs of it: the backbone's hidden states
        (kept by a forward hook) and the head's labels and label log-probabilities (kept from the policy's first fused
        forward). trl's own ``return_outputs=True`` would run a further forward for the full logits, which is what the
        fused head avoids."""
        core = unwrap_peft_model(self.accelerator.unwrap_model(model))
        kept: dict[str, Any] = {}
        fused_forward = core.forward  # trl's fused head, bound to the model; peft calls it directly, not through hooks

        def keep_outputs(*args: Any, **kwargs: Any) -> Any:
            outputs = fused_forward(*args, **kwargs)
            if kwargs.get("fused_lm_head") and "outputs" not in kept:
                kept.update(outputs=outputs, labels=kwargs.get("labels"), shift_labels=kwargs.get("shift_labels"))
            return outputs

        def keep_hidden(module: nn.Module, args: Any, output: Any) -> None:
            kept.setdefault("hidden", output.last_hidden_state)

        handle = core.base_model.register_forward_hook(keep_hidden)
        core.forward = keep_outputs
        try:
            with self.compute_loss_context_manager():
                loss = self.compute_loss(model, dict(inputs), num_items_in_batch=num_items_in_batch)
        finally:
            core.forward = fused_forward
            handle.remove()
        outputs = kept.get("outputs")
        if getattr(outputs, "log_probs", None) is None or "hidden" not in kept:
            raise ValueError(
                f"flatness_method='functional_sam' found no fused LM head output in {type(self).__name__}'s loss "
                "(trl's add_fused_lm_head); use 'sam' with this model or loss."
            )
        if kept["shift_labels"] is not None:  # pre-shifted (context parallelism): every position is scored as is
            hidden, labels = kept["hidden"], kept["shift_labels"]
        else:
            hidden, labels = kept["hidden"][:, :-1], kept["labels"][:, 1:]
        function = FusedHeadOutputs(
            hidden=hidden,
            labels=labels.to(hidden.device),
            mask=outputs.label_mask,
            log_probs=outputs.log_probs,
            head=core.get_output_embeddings(),
        )
        return self.scale_for_accumulation(loss, num_items_in_batch), function

    @contextlib.contextmanager
    def host_metrics_suspended(self) -> Iterator[None]:
        """Metrics recorded here are dropped, and the policy's fused head skips the fields only metrics read."""
        metrics, total_tokens = self._metrics, self._total_train_tokens
        self._metrics = {mode: defaultdict(list) for mode in metrics}
        model, own_forward = self._fused_head_model, self._fused_head_model.__dict__.get("forward")
        if self._forward_without_metrics is not None:
            model.forward = self._forward_without_metrics
        self._metrics_suspended = True
        try:
            yield
        finally:
            self._metrics_suspended = False
            self._metrics, self._total_train_tokens = metrics, total_tokens
            if self._forward_without_metrics is not None:
                model.forward = own_forward

    @contextlib.contextmanager
    def _head_scored_by_label_log_probs(self, kept_bytes: int = 0) -> Iterator[None]:
        """Both passes of a replayed output-layer SAM step score the policy's head with `forward_with_head_gradients`
        (the first with trl's metrics, the second without)."""
        model = self._fused_head_model
        own_forward = model.__dict__.get("forward")
        model.forward = forward_with_head_gradients(model, lambda: not self._metrics_suspended, kept_bytes)
        try:
            yield
        finally:
            if own_forward is None:
                del model.forward
            else:
                model.forward = own_forward


class FlatBiasSFTTrainer(_TrlTrainerMixin, FlatnessTrainerMixin, SFTTrainer):
    """trl's [`~trl.SFTTrainer`] whose steps seek flat minima; takes a [`FlatBiasSFTConfig`].

    Every flatness method works with every SFT data format (language modeling, prompt-completion with the
    completion-only loss, packing): the steps differentiate whatever loss `SFTTrainer.compute_loss` returns.
    ``fisher_penalty`` samples its labels at the positions the loss trains (the completion with
    ``completion_only_loss``) from the model's ordinary logits, one extra forward per pass.
    """

    flatness_config_class = FlatBiasSFTConfig
    _tag_names = [*SFTTrainer._tag_names, "hf_flatbias"]
    _trl_trainer = "sft"

    def trace_context_rows(self, row: Mapping[str, Any]) -> list[dict[str, Any]]:
        """`HessianTraceCallback`'s rows of one prepared row: each packed document on its own, predicted where the
        loss trains (``labels != -100``: the completion with the completion-only loss)."""
        lengths = list(row.get("seq_lengths") or [len(row["input_ids"])])
        documents, start = [], 0
        for length in lengths:
            document = {"input_ids": list(row["input_ids"][start : start + length])}
            if "labels" in row:
                document["completion_mask"] = [int(label != -100) for label in row["labels"][start : start + length]]
            elif "completion_mask" in row:
                document["completion_mask"] = list(row["completion_mask"][start : start + length])
            documents.append(document)
            start += length
        return documents

    def __init__(self, model=None, args=None, **kwargs: Any):
        method = getattr(args, "flatness_method", "none")
        if method_spec(method).needs_logit_gradient:
            if kwargs.get("compute_loss_func") is not None or getattr(args, "label_smoothing_factor", 0) > 0:
                # then trl computes the loss from the full logits of a second forward, not from the fused head
                raise ValueError(
                    f"flatness_method={method!r} in FlatBiasSFTTrainer reads dL/dF through trl's fused LM head, "
                    "which compute_loss_func and label_smoothing_factor > 0 bypass; drop them or use 'sam'."
                )
        super().__init__(model=model, args=args, **kwargs)

    def head_gradients_in_forward(self):
        """Output-layer SAM with the trunk replayed: both passes run `forward_with_head_gradients` (the first
        computes trl's metrics there, the second none), unless the model or the loss is one it does not cover."""
        if self._forward_without_metrics is None:
            return None, "the model has no trl fused LM head"
        if self.args.loss_type != "nll":
            return None, (
                f"loss_type={self.args.loss_type!r} weights each token by its probability, which the head's "
                "gradient would have to know before the loss"
            )
        if self.aux_loss_enabled:
            return None, "the router's load-balancing loss (a mixture of experts) is added in trl's fused forward"
        reason = why_head_gradients_stay_in_backward(self._fused_head_model)
        return (None, reason) if reason is not None else (self._head_scored_by_label_log_probs, None)

    def loss_and_outputs(self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch):
        loss = self.compute_loss(model, dict(inputs), num_items_in_batch=num_items_in_batch)
        # SFT's fused head returns no logits; without `fused_lm_head` the model runs its own forward
        outputs = model(**{key: value for key, value in inputs.items() if key != "labels"}, use_cache=False)
        return loss, outputs


class FlatBiasDPOTrainer(_TrlTrainerMixin, FlatnessTrainerMixin, DPOTrainer):
    """trl's [`~trl.DPOTrainer`] whose steps seek flat minima; takes a [`FlatBiasDPOConfig`].

    The reference log-probabilities of a micro-batch are computed once, at the start of its step (or read from the
    dataset with ``precompute_ref_log_probs=True``), and both passes use them: the second pass at ``w + e`` runs the
    policy only. ``fisher_penalty`` is refused: DPO's loss has no next-token labels to sample the Fisher from.
    """

    flatness_config_class = FlatBiasDPOConfig
    _tag_names = [*DPOTrainer._tag_names, "hf_flatbias"]
    _trl_trainer = "dpo"

    def __init__(self, model, ref_model=None, args=None, **kwargs: Any):
        # DPOTrainer takes ref_model second; the mixin's signature is (model, args, ...); the method's support of DPO
        # is checked by _TrlTrainerMixin, from the method table
        super().__init__(model=model, ref_model=ref_model, args=args, **kwargs)

    def trace_context_rows(self, row: Mapping[str, Any]) -> list[dict[str, Any]]:
        """`HessianTraceCallback`'s row of one preference pair: the chosen response after its prompt, predicted on
        the response."""
        prompt, chosen = list(row["prompt_ids"]), list(row["chosen_ids"])
        return [{"input_ids": prompt + chosen, "completion_mask": [0] * len(prompt) + [1] * len(chosen)}]

    def head_gradients_in_forward(self):
        """Output-layer SAM with the trunk replayed: both passes run `forward_with_head_gradients` with the rows'
        ``softmax - onehot`` kept to the backward (``sam_kept_softmax_mib``), since DPO weighs each sequence's tokens
        by a factor its loss knows only once both sequences of a pair are summed; trl's fused head where that is 0
        or the model or loss is one it does not cover."""
        budget = self.args.sam_kept_softmax_mib
        if budget == 0:
            return None, "sam_kept_softmax_mib=0 keeps trl's fused LM head"
        if self._forward_without_metrics is None:
            return None, "the model has no trl fused LM head"
        if self.use_weighting:
            return None, "use_weighting=True (WPO) reads the head's log_sum_sq_probs, which that head does not compute"
        if self.aux_loss_enabled:
            return None, "the router's load-balancing loss (a mixture of experts) is added in trl's fused forward"
        reason = why_head_gradients_stay_in_backward(self._fused_head_model)
        if reason is not None:
            return None, reason
        kept_bytes = int(budget * 2**20)
        return (lambda: self._head_scored_by_label_log_probs(kept_bytes)), None

    def _add_values_shared_by_passes(self, model: nn.Module, inputs: dict[str, Any]) -> dict[str, Any]:
        if self.precompute_ref_logps or all(key in inputs for key in _REFERENCE_KEYS):
            return inputs
        reference = self.ref_model if self.ref_model is not None else self.model
        chosen, rejected = self.compute_ref_log_probs(reference, self._prepare_inputs(inputs))
        inputs.update(ref_chosen_logps=chosen, ref_rejected_logps=rejected)
        return inputs

    def prepare_flatness_inputs(self, model: nn.Module, inputs: dict[str, Any]) -> dict[str, Any]:
        prepared = super().prepare_flatness_inputs(model, inputs)
        if not self.precompute_ref_logps:
            # Computed here, already on the device: under DeepSpeed the Trainer casts a batch's floating tensors to
            # the engine's dtype (float32: flatness steps refuse half precision there), which rounds those of a
            # float64 model, where plain trl computes them inside its loss, uncast
            prepared.update({key: inputs[key] for key in _REFERENCE_KEYS})
        return prepared

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self.precompute_ref_logps or not all(key in inputs for key in _REFERENCE_KEYS):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        # a flatness step added the reference log-probabilities: read them as a precomputed reference
        self.precompute_ref_logps = True
        try:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        finally:
            self.precompute_ref_logps = False


__all__ = ["FlatBiasDPOConfig", "FlatBiasDPOTrainer", "FlatBiasSFTConfig", "FlatBiasSFTTrainer"]
