"""Function-preserving enlargement: embed a small BERT or GPT-2 into a larger architecture of the same family.

Hessian traces of models with different parameter counts are not comparable: a larger model has more directions to
be sharp in. Liu et al. (2023, App. B.4) therefore embed every smaller model into the largest architecture, without
changing the function it computes, and compare traces there. This module does that embedding.

How each kind of growth keeps the function (in eval mode):

* **Wider hidden size** ``D = k * d``. Every hidden vector of the large model is ``k`` stacked copies of the small
  model's vector. LayerNorm over the stacked copies sees the same mean and variance, so with its gain and bias
  replicated it returns stacked copies again. A linear map that *reads* a hidden vector has its input weights
  replicated and divided by ``k`` (the ``k`` copies are summed); one that *writes* a hidden vector has its output
  rows replicated. The tied MLM / LM decoder reads the output of the last LayerNorm with the (replicated, undivided)
  word embeddings, so that LayerNorm's gain and bias are divided by ``k`` instead.
* **Wider intermediate (feed-forward) size** ``I' = m * I``: every unit is replicated ``m`` times and the output
  projection reads each copy with weight ``1/m``.
* **More or wider attention heads**: target head ``j`` computes source head ``j mod h``; a head dimension grown by an
  integer factor holds repeated copies of the source head's query/key/value, and the query is rescaled so that the
  attention logits (scaled by ``1/sqrt(head_dim)``) are unchanged.
* **More layers**, appended after the last source layer, with every weight matrix and bias zeroed. In a pre-LN block
  (GPT-2) the residual then passes through unchanged. In BERT's post-LN block the residual passes through a
  LayerNorm, which is the identity only on an already normalized vector: the LayerNorm that precedes the new layers
  is given unit gain and zero bias, the new layers' LayerNorms too, and the last new layer's output LayerNorm takes
  over the original gain and bias. This is exact up to ``layer_norm_eps`` (1e-12 in BERT).
* Vocabulary and token types must match; more positions are allowed (the extra position embeddings are zero and
  unused by sequences the small model could read).

What the embedding does to the Hessian (Fisher) trace: the function is the same, the parameter space is not. Every
weight *matrix* keeps its squared-gradient contribution exactly (``k**2`` blocks, each with ``1/k`` of the gradient),
but a vector or embedding row that is *written* ``k`` times (embeddings, LayerNorm gains and biases, biases) splits its
gradient over ``k`` copies and contributes ``1/k`` of what it did. Traces of models embedded into one architecture
are therefore comparable with each other, but not with the traces in their own architectures, and a model
replicated more times has its vector part scaled down more.

Only integer growth factors are function-preserving with LayerNorm (a zero-padded hidden vector would change its mean
and variance), so other shapes are rejected with a ``ValueError`` before anything is allocated.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

__all__ = ["enlarge", "check_enlargeable"]


@dataclass(frozen=True)
class _Sizes:
    hidden: int
    heads: int
    intermediate: int
    layers: int
    vocab: int
    positions: int


@dataclass(frozen=True)
class _Family:
    """Where a model family keeps its sizes, and which settings must agree for the function to be preserved."""

    hidden: str
    heads: str
    layers: str
    positions: str
    must_match: tuple[str, ...]

    def sizes(self, config: PretrainedConfig) -> _Sizes:
        hidden = int(getattr(config, self.hidden))
        if config.model_type == "gpt2":
            intermediate = config.n_inner if config.n_inner is not None else 4 * hidden
        else:
            intermediate = config.intermediate_size
        return _Sizes(
            hidden=hidden,
            heads=int(getattr(config, self.heads)),
            intermediate=int(intermediate),
            layers=int(getattr(config, self.layers)),
            vocab=int(config.vocab_size),
            positions=int(getattr(config, self.positions)),
        )


_FAMILIES = {
    "bert": _Family(
        hidden="hidden_size",
        heads="num_attention_heads",
        layers="num_hidden_layers",
        positions="max_position_embeddings",
        must_match=(
            "hidden_act",
            "layer_norm_eps",
            "type_vocab_size",
            "position_embedding_type",
            "is_decoder",
            "add_cross_attention",
            "tie_word_embeddings",
        ),
    ),
    "gpt2": _Family(
        hidden="n_embd",
        heads="n_head",
        layers="n_layer",
        positions="n_positions",
        must_match=(
            "activation_function",
            "layer_norm_epsilon",
            "scale_attn_weights",
            "scale_attn_by_inverse_layer_idx",
            "add_cross_attention",
            "tie_word_embeddings",
        ),
    ),
}


def check_enlargeable(source_config: PretrainedConfig, target_config: PretrainedConfig) -> None:
    """Raise a `ValueError` naming the fix if `source_config` cannot be embedded into `target_config` exactly.

    Supported: BERT (``model_type="bert"``) and GPT-2 (``"gpt2"``) models, grown by integer factors in hidden size,
    intermediate size, number of heads and head dimension, with at least as many layers and positions and the same
    vocabulary.
    """
    model_type = getattr(source_config, "model_type", None)
    if model_type not in _FAMILIES:
        raise ValueError(
            f"enlarge supports model_type in {sorted(_FAMILIES)}, got {model_type!r}; convert the model to one of "
            "these architectures first."
        )
    if getattr(target_config, "model_type", None) != model_type:
        raise ValueError(
            f"target_config.model_type={getattr(target_config, 'model_type', None)!r} differs from the model's "
            f"{model_type!r}; enlarge only grows a model within its own family."
        )
    family = _FAMILIES[model_type]
    for name in family.must_match:
        source_value, target_value = getattr(source_config, name, None), getattr(target_config, name, None)
        if source_value != target_value:
            raise ValueError(
                f"target_config.{name}={target_value!r} but the model has {source_value!r}; they must be equal for "
                f"the enlarged model to compute the same function (set target_config.{name}={source_value!r})."
            )
    if model_type == "gpt2" and getattr(source_config, "reorder_and_upcast_attn", False) != getattr(
        target_config, "reorder_and_upcast_attn", False
    ):
        raise ValueError("target_config.reorder_and_upcast_attn must equal the model's.")
    small, large = family.sizes(source_config), family.sizes(target_config)

    def require_multiple(what: str, source_value: int, target_value: int) -> None:
        if target_value < source_value or target_value % source_value:
            raise ValueError(
                f"target {what}={target_value} must be a positive integer multiple of the model's {source_value} "
                f"(e.g. {2 * source_value}): LayerNorm statistics are only preserved by replicating whole copies."
            )

    require_multiple(family.hidden, small.hidden, large.hidden)
    require_multiple("intermediate size", small.intermediate, large.intermediate)
    require_multiple(family.heads, small.heads, large.heads)
    for label, sizes in (("model", small), ("target", large)):
        if sizes.hidden % sizes.heads:
            raise ValueError(
                f"{label} {family.hidden}={sizes.hidden} is not divisible by {family.heads}={sizes.heads}; "
                "choose a head count that divides the hidden size."
            )
    require_multiple("head dimension", small.hidden // small.heads, large.hidden // large.heads)
    if large.layers < small.layers:
        raise ValueError(
            f"target {family.layers}={large.layers} is smaller than the model's {small.layers}; enlarge only adds "
            "layers."
        )
    if large.vocab != small.vocab:
        raise ValueError(
            f"target vocab_size={large.vocab} differs from the model's {small.vocab}; set it to {small.vocab} (new "
            "tokens would change the softmax)."
        )
    if large.positions < small.positions:
        raise ValueError(
            f"target {family.positions}={large.positions} is smaller than the model's {small.positions}; set it to at "
            f"least {small.positions}."
        )


@dataclass(frozen=True)
class _Axis:
    """How one dimension of a target tensor is filled: target position -> source position, times a scale."""

    index: torch.Tensor
    scale: torch.Tensor


class _AxisPlan:
    """The index maps of every kind of dimension for one (source, target) pair of sizes."""

    def __init__(self, small: _Sizes, large: _Sizes, query_scale: float):
        self.hidden_factor = large.hidden // small.hidden
        self.intermediate_factor = large.intermediate // small.intermediate
        self.heads_layout = self._heads_index(small, large)
        self.query_scale = query_scale
        self.small, self.large = small, large

    @staticmethod
    def _heads_index(small: _Sizes, large: _Sizes) -> torch.Tensor:
        small_head_dim, large_head_dim = small.hidden // small.heads, large.hidden // large.heads
        position = torch.arange(large.hidden)
        head, within = position // large_head_dim, position % large_head_dim
        # Target head j repeats source head j mod h; its dimension holds repeated copies of the source head's.
        return (head % small.heads) * small_head_dim + within % small_head_dim

    def axis(self, kind: str, reads: bool) -> _Axis:
        """``reads``: the dimension is summed over by the layer (an input), so its copies share the weight."""
        if kind == "hidden":
            index, copies = torch.arange(self.large.hidden) % self.small.hidden, self.hidden_factor
        elif kind == "heads":
            # Each source dimension appears (large.heads / small.heads) * (head-dim factor) = hidden_factor times.
            index, copies = self.heads_layout, self.hidden_factor
        elif kind == "intermediate":
            index = torch.arange(self.large.intermediate) % self.small.intermediate
            copies = self.intermediate_factor
        elif kind == "positions":
            index = torch.arange(self.large.positions).clamp(max=self.small.positions - 1)
            scale = (torch.arange(self.large.positions) < self.small.positions).to(torch.float64)
            return _Axis(index, scale)
        else:
            raise AssertionError(kind)
        scale = torch.full((len(index),), 1.0 / copies if reads else 1.0, dtype=torch.float64)
        return _Axis(index, scale)

    def query_axis(self) -> _Axis:
        """Queries: the heads layout, scaled so that q.k / sqrt(head_dim) is unchanged by a longer head."""
        axis = self.axis("heads", reads=False)
        return _Axis(axis.index, axis.scale * self.query_scale)

    def fused_qkv_axis(self) -> _Axis:
        """GPT-2's ``c_attn`` writes [query | key | value], each in the heads layout."""
        axes = [self.query_axis(), self.axis("heads", reads=False), self.axis("heads", reads=False)]
        offsets = [0, self.small.hidden, 2 * self.small.hidden]
        index = torch.cat([axis.index + offset for axis, offset in zip(axes, offsets, strict=True)])
        return _Axis(index, torch.cat([axis.scale for axis in axes]))


def _expand(source: torch.Tensor, axes: dict[int, _Axis], extra_scale: float = 1.0) -> torch.Tensor:
    result = source.detach().to(torch.float64)
    for dim, axis in axes.items():
        result = result.index_select(dim, axis.index.to(result.device))
        shape = [1] * result.dim()
        shape[dim] = -1
        result = result * axis.scale.to(result.device).view(shape)
    return (result * extra_scale).to(source.dtype)


# Each rule: parameter-name pattern (after the layer number is replaced by {L}) -> {dim: (axis kind, reads)}.
# Axis kinds: hidden, heads, intermediate, positions, query (heads layout with the query rescale), qkv (GPT-2 fused).
_BERT_RULES: dict[str, dict[int, tuple[str, bool]]] = {
    r"embeddings\.word_embeddings\.weight": {1: ("hidden", False)},
    r"embeddings\.position_embeddings\.weight": {0: ("positions", False), 1: ("hidden", False)},
    r"embeddings\.token_type_embeddings\.weight": {1: ("hidden", False)},
    r"embeddings\.LayerNorm\.(weight|bias)": {0: ("hidden", False)},
    r"encoder\.layer\.{L}\.attention\.self\.query\.weight": {0: ("query", False), 1: ("hidden", True)},
    r"encoder\.layer\.{L}\.attention\.self\.query\.bias": {0: ("query", False)},
    r"encoder\.layer\.{L}\.attention\.self\.(key|value)\.weight": {0: ("heads", False), 1: ("hidden", True)},
    r"encoder\.layer\.{L}\.attention\.self\.(key|value)\.bias": {0: ("heads", False)},
    r"encoder\.layer\.{L}\.attention\.output\.dense\.weight": {0: ("hidden", False), 1: ("heads", True)},
    r"encoder\.layer\.{L}\.attention\.output\.dense\.bias": {0: ("hidden", False)},
    r"encoder\.layer\.{L}\.attention\.output\.LayerNorm\.(weight|bias)": {0: ("hidden", False)},
    r"encoder\.layer\.{L}\.intermediate\.dense\.weight": {0: ("intermediate", False), 1: ("hidden", True)},
    r"encoder\.layer\.{L}\.intermediate\.dense\.bias": {0: ("intermediate", False)},
    r"encoder\.layer\.{L}\.output\.dense\.weight": {0: ("hidden", False), 1: ("intermediate", True)},
    r"encoder\.layer\.{L}\.output\.dense\.bias": {0: ("hidden", False)},
    r"encoder\.layer\.{L}\.output\.LayerNorm\.(weight|bias)": {0: ("hidden", False)},
    r"pooler\.dense\.weight": {0: ("hidden", False), 1: ("hidden", True)},
    r"pooler\.dense\.bias": {0: ("hidden", False)},
    r"cls\.predictions\.transform\.dense\.weight": {0: ("hidden", False), 1: ("hidden", True)},
    r"cls\.predictions\.transform\.dense\.bias": {0: ("hidden", False)},
    r"cls\.predictions\.transform\.LayerNorm\.(weight|bias)": {0: ("hidden", False)},
    # The decoder reads the transform LayerNorm, whose output already carries the 1/k (see _DECODER_INPUT_NORMS).
    r"cls\.predictions\.decoder\.weight": {1: ("hidden", False)},
    r"cls\.predictions\.(decoder\.)?bias": {},
    r"cls\.seq_relationship\.weight": {1: ("hidden", True)},
    r"cls\.seq_relationship\.bias": {},
    r"classifier\.weight": {1: ("hidden", True)},
    r"classifier\.bias": {},
}

# GPT-2's Conv1D stores weights as (in_features, out_features).
_GPT2_RULES: dict[str, dict[int, tuple[str, bool]]] = {
    r"wte\.weight": {1: ("hidden", False)},
    r"wpe\.weight": {0: ("positions", False), 1: ("hidden", False)},
    r"h\.{L}\.ln_(1|2)\.(weight|bias)": {0: ("hidden", False)},
    r"h\.{L}\.attn\.c_attn\.weight": {0: ("hidden", True), 1: ("qkv", False)},
    r"h\.{L}\.attn\.c_attn\.bias": {0: ("qkv", False)},
    r"h\.{L}\.attn\.c_proj\.weight": {0: ("heads", True), 1: ("hidden", False)},
    r"h\.{L}\.attn\.c_proj\.bias": {0: ("hidden", False)},
    r"h\.{L}\.mlp\.c_fc\.weight": {0: ("hidden", True), 1: ("intermediate", False)},
    r"h\.{L}\.mlp\.c_fc\.bias": {0: ("intermediate", False)},
    r"h\.{L}\.mlp\.c_proj\.weight": {0: ("intermediate", True), 1: ("hidden", False)},
    r"h\.{L}\.mlp\.c_proj\.bias": {0: ("hidden", False)},
    r"ln_f\.(weight|bias)": {0: ("hidden", False)},
    r"lm_head\.weight": {1: ("hidden", False)},
    r"score\.weight": {1: ("hidden", True)},
}

_PREFIXES = {"bert": ("bert.", ""), "gpt2": ("transformer.", "")}


def _strip_prefix(name: str, model_type: str) -> str:
    for prefix in _PREFIXES[model_type]:
        if prefix and name.startswith(prefix):
            return name[len(prefix) :]
    return name


def _compiled_rules(model_type: str) -> list[tuple[re.Pattern[str], dict[int, tuple[str, bool]]]]:
    rules = _BERT_RULES if model_type == "bert" else _GPT2_RULES
    return [(re.compile(pattern.replace("{L}", r"(?P<layer>\d+)") + "$"), axes) for pattern, axes in rules.items()]


def _layer_of(name: str) -> int | None:
    match = re.search(r"(?:^|\.)(?:layer|h)\.(\d+)\.", name)
    return int(match.group(1)) if match else None


def enlarge(model: PreTrainedModel, target_config: PretrainedConfig) -> PreTrainedModel:
    """Return a model of `target_config`'s (larger) architecture that computes the same function as `model`.

    The returned model has `model`'s class, dtype, device and train/eval mode. In eval mode its logits (MLM,
    causal LM, or classification) equal `model`'s up to float rounding; its hidden states are ``k`` stacked copies of
    `model`'s (``k`` = hidden-size factor). See the module docstring for how each kind of growth is embedded (Liu et
    al., 2023, App. B.4: replicated weights, added residual blocks with zeroed parameters).

    Args:
        model: A BERT (`BertModel`, `BertForMaskedLM`, `BertForPreTraining`, `BertForSequenceClassification`) or
            GPT-2 (`GPT2Model`, `GPT2LMHeadModel`, `GPT2ForSequenceClassification`) model.
        target_config: The larger configuration, of the same ``model_type``. Hidden size, intermediate size, number
            of heads and head dimension must be integer multiples of the model's; layers and positions at least as
            many; vocabulary and all activation / normalisation settings equal.

    Raises:
        ValueError: if the target shape cannot hold `model` exactly, or the architecture is not supported; raised
            before the large model is built.
    """
    source_config = model.config
    check_enlargeable(source_config, target_config)
    model_type = source_config.model_type
    family = _FAMILIES[model_type]
    small, large = family.sizes(source_config), family.sizes(target_config)
    head_dim_factor = (large.hidden // large.heads) // (small.hidden // small.heads)
    logits_scaled_by_head_dim = model_type != "gpt2" or source_config.scale_attn_weights
    query_scale = head_dim_factor**-0.5 if logits_scaled_by_head_dim else 1.0 / head_dim_factor
    plan = _AxisPlan(small, large, query_scale)
    rules = _compiled_rules(model_type)

    source_tensors = dict(model.named_parameters())
    reference = next(model.parameters())
    # Built in the model's dtype before filling: copying float64 weights into float32 would round them.
    target_model = type(model)(target_config).to(dtype=reference.dtype)
    persistent_buffers = set(target_model.state_dict()) - {name for name, _ in target_model.named_parameters()}
    persistent_buffers &= {name for name, _ in target_model.named_buffers()}
    if persistent_buffers:
        raise ValueError(
            f"enlarge does not know how to carry the buffers {sorted(persistent_buffers)} of {type(model).__name__}."
        )
    decoder_norm = _decoder_input_norm(target_model, model_type)

    with torch.no_grad():
        for name, target_tensor in target_model.named_parameters():
            short = _strip_prefix(name, model_type)
            prefix = name[: len(name) - len(short)]
            matched = next((m for m in ((rule.match(short), axes) for rule, axes in rules) if m[0]), None)
            if matched is None:
                raise ValueError(
                    f"enlarge does not know how to expand parameter {name!r} of {type(model).__name__}; supported "
                    "heads are the MLM / causal LM / pre-training / sequence-classification heads."
                )
            match, axes = matched
            layer = int(match.group("layer")) if "layer" in match.groupdict() else None
            if layer is not None and layer >= small.layers:
                value = _new_layer_value(
                    short, prefix, layer, target_tensor.shape, small, large, model_type, plan, source_tensors
                )
            elif (
                model_type == "bert"
                and large.layers > small.layers
                and short.startswith(_post_ln_carrier(small.layers))
            ):
                # Post-LN: the new layers only pass a normalized vector through (see module docstring).
                value = _unit_layer_norm(short, target_tensor.shape)
            else:
                extra_scale = 1.0 / plan.hidden_factor if decoder_norm and name.startswith(decoder_norm) else 1.0
                expanded_axes = {dim: _resolve_axis(plan, kind, reads) for dim, (kind, reads) in axes.items()}
                value = _expand(source_tensors[name], expanded_axes, extra_scale)
            target_tensor.copy_(value)
    target_model.tie_weights()
    target_model.to(device=reference.device)
    target_model.train(model.training)
    return target_model


def _decoder_input_norm(target_model: nn.Module, model_type: str) -> str | None:
    """Name prefix of the LayerNorm that a vocabulary decoder reads, or None for a model without one."""
    if model_type == "bert":
        return (
            "cls.predictions.transform.LayerNorm."
            if hasattr(getattr(target_model, "cls", None), "predictions")
            else None
        )
    return "transformer.ln_f." if hasattr(target_model, "lm_head") else None


def _post_ln_carrier(source_layers: int) -> str:
    """The LayerNorm whose output the appended BERT layers receive (prefix-free name)."""
    return f"encoder.layer.{source_layers - 1}.output.LayerNorm." if source_layers else "embeddings.LayerNorm."


def _resolve_axis(plan: _AxisPlan, kind: str, reads: bool) -> _Axis:
    if kind == "query":
        return plan.query_axis()
    if kind == "qkv":
        return plan.fused_qkv_axis()
    return plan.axis(kind, reads)


def _unit_layer_norm(name: str, shape: torch.Size) -> torch.Tensor:
    return torch.ones(shape) if name.endswith("weight") else torch.zeros(shape)


def _new_layer_value(
    short: str,
    prefix: str,
    layer: int,
    shape: torch.Size,
    small: _Sizes,
    large: _Sizes,
    model_type: str,
    plan: _AxisPlan,
    source_tensors: dict[str, torch.Tensor],
) -> torch.Tensor:
    """An appended layer: every matrix and bias zero; LayerNorms pass the residual through."""
    if ".LayerNorm." not in short and ".ln_" not in short:
        return torch.zeros(shape)
    is_block_output_norm = short.startswith(f"encoder.layer.{layer}.output.LayerNorm.")
    if model_type == "bert" and layer == large.layers - 1 and is_block_output_norm:
        # The last appended post-LN layer takes over the gain and bias of the LayerNorm that now passes through.
        carrier = prefix + _post_ln_carrier(small.layers) + short.rsplit(".", 1)[-1]
        return _expand(source_tensors[carrier], {0: plan.axis("hidden", reads=False)})
    return _unit_layer_norm(short, shape)
