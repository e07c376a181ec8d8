"""Estimators of the paper's flatness measure, the trace of the Hessian of the pre-training loss.

Liu et al. (2023, App. B.1) measure ``Tr(H) = E_{x,t} E_{y ~ f(x_-t)} ||grad_theta log f(x_-t)_y||^2``: the trace of the
Fisher information, with ``y`` drawn from the model's own prediction at one masked position per context. It equals
the Hessian trace of the loss when the model outputs the true conditionals.

Estimators (``estimator=``):

- ``"per_sample"`` (default): per-context squared gradient norms for a whole batch of contexts from one forward and
  one backward per draw, with ghost norms (`hf_flatbias.flatness.ghost`); the LM head runs only at the predicted
  position, and the output layer's own term is replaced by its exact expectation over ``y``
  (``(1 - ||p||^2)(||h||^2 + 1)``), which removes most of the draw noise at no cost.
- ``"summed"``: ``||sum of the sampled-label gradients||^2 / count`` over a batch; unbiased because the score has
  mean zero, but the cross terms add variance.
- ``"hutchinson"``: ``v^T H v`` with Rademacher ``v`` on the loss of the *data* labels (what the paper's released code
  does). It estimates the Hessian trace of the data loss, which equals the Fisher trace only when the model's
  conditionals are the true ones.
- ``"naive"``: one forward and backward per draw; the reference loop, exact for any architecture.

Every estimator first produces `TraceSamples`: values per sampling unit (a context, or a batch of contexts for
``summed``/``hutchinson``) over a subset of context indices. Units can be computed on different processes and
concatenated before `summarize_trace_samples` turns them into a `TraceEstimate`; each context's random draws depend
only on ``(seed, context index)``.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from ..constants import DEFAULT_BATCH_SIZE, ESTIMATORS, RECOMMENDED_N_DRAWS
from .contexts import IGNORE_INDEX, context_generator
from .ghost import GhostNormRecorder


@dataclass
class TraceEstimate:
    """An estimate of the Hessian (Fisher) trace averaged over contexts.

    Attributes:
        mean: the estimate.
        stderr: its standard error, from the spread of per-unit means over contexts, so it counts both the
            variation between contexts and the draw noise; ``nan`` with a single unit.
        n_contexts: contexts used.
        n_draws: draws of ``y`` (or of ``v`` for ``hutchinson``) per context.
        estimator: which estimator produced it.
        seconds: wall-clock time of the estimate.
        draw_variance: mean over contexts of the one-draw variance within a context (per-context estimators,
            ``n_draws >= 2``), else ``None``.
        context_variance: variance of the per-context traces between contexts, draw noise removed, else ``None``.
        suggested_n_draws: the draws per context that minimise the error per second,
            ``sqrt(draw_variance / context_variance * forward_cost / draw_cost)``, when it could be measured.
    """

    mean: float
    stderr: float
    n_contexts: int
    n_draws: int
    estimator: str
    seconds: float
    draw_variance: float | None = None
    context_variance: float | None = None
    suggested_n_draws: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class TraceContexts:
    """Contexts ready for the estimators: one predicted position each.

    ``input_ids[i]`` is trimmed to what the model must see (for causal LMs the prefix before the predicted token),
    ``positions[i]`` is where the logits are read, ``targets[i]`` the data token there.
    """

    input_ids: list[torch.Tensor]
    attention_mask: list[torch.Tensor]
    token_type_ids: list[torch.Tensor] | None
    positions: list[int]
    targets: list[int]
    causal: bool

    def __len__(self) -> int:
        return len(self.positions)

    @classmethod
    def from_rows(cls, rows: Iterable[Mapping[str, Any]], *, causal: bool) -> TraceContexts:
        """Each labelled position (``labels != -100``) of each row becomes one context.

        Raises:
            ValueError: a row without ``input_ids``/``labels`` or without any labelled position.
        """
        input_ids, attention_mask, token_type_ids, positions, targets = [], [], [], [], []
        has_token_types = None
        for row_index, row in enumerate(rows):
            for key in ("input_ids", "labels"):
                if key not in row:
                    raise ValueError(
                        f"Row {row_index} has no '{key}'. Rows need input_ids, attention_mask and labels (-100 "
                        "except at the predicted positions); hf_flatbias.flatness.contexts.build_masked_contexts "
                        "builds them from tokenized text."
                    )
            ids = torch.as_tensor(row["input_ids"], dtype=torch.long).reshape(-1)
            labels = torch.as_tensor(row["labels"], dtype=torch.long).reshape(-1)
            mask = (
                torch.as_tensor(row["attention_mask"], dtype=torch.long).reshape(-1)
                if "attention_mask" in row
                else torch.ones_like(ids)
            )
            types = (
                torch.as_tensor(row["token_type_ids"], dtype=torch.long).reshape(-1)
                if "token_type_ids" in row
                else None
            )
            if has_token_types is None:
                has_token_types = types is not None
            labelled = (labels != IGNORE_INDEX).nonzero().flatten().tolist()
            if not labelled:
                raise ValueError(
                    f"Row {row_index} has no labelled position (all labels are -100): each context needs one "
                    "predicted position. Build contexts with hf_flatbias.flatness.contexts.build_masked_contexts."
                )
            attended = mask.nonzero().flatten()
            end = int(attended[-1]) + 1 if len(attended) else len(ids)
            for t in labelled:
                if causal:
                    if t == 0:
                        raise ValueError(f"Row {row_index}: a causal LM cannot predict position 0 (nothing before it).")
                    keep, position = t, t - 1
                else:
                    keep, position = max(end, t + 1), t
                input_ids.append(ids[:keep])
                attention_mask.append(mask[:keep])
                if has_token_types:
                    token_type_ids.append(types[:keep])
                positions.append(position)
                targets.append(int(labels[t]))
        if not positions:
            raise ValueError("No contexts: the dataset is empty.")
        return cls(input_ids, attention_mask, token_type_ids if has_token_types else None, positions, targets, causal)


@dataclass
class TraceSamples:
    """Raw estimator output over a subset of contexts, before aggregation.

    ``values[u, k]`` is draw ``k`` of sampling unit ``u``, an unbiased estimate of the mean trace over the unit's
    ``weights[u]`` contexts. Samples of disjoint index subsets concatenate (`TraceSamples.cat`).
    """

    values: torch.Tensor
    weights: torch.Tensor
    n_draws: int
    estimator: str
    forward_seconds: float = 0.0
    draw_seconds: float = 0.0

    @staticmethod
    def cat(parts: Sequence[TraceSamples]) -> TraceSamples:
        return TraceSamples(
            values=torch.cat([p.values for p in parts]),
            weights=torch.cat([p.weights for p in parts]),
            n_draws=parts[0].n_draws,
            estimator=parts[0].estimator,
            forward_seconds=sum(p.forward_seconds for p in parts),
            draw_seconds=sum(p.draw_seconds for p in parts),
        )


def summarize_trace_samples(samples: TraceSamples, *, seconds: float = float("nan")) -> TraceEstimate:
    """Weighted mean over units and its standard error (the ratio-estimator form; ``std / sqrt(n)`` for equal
    weights). Unit means vary by context and by draw, so the error covers both sources."""
    unit_means = samples.values.double().mean(dim=1)
    weights = samples.weights.double()
    n_units = unit_means.numel()
    total_weight = weights.sum()
    mean = float((weights * unit_means).sum() / total_weight)
    if n_units >= 2:
        spread = (weights.square() * (unit_means - mean).square()).sum() * n_units / (n_units - 1)
        stderr = float(spread.sqrt() / total_weight)
    else:
        stderr = float("nan")
    draw_variance = context_variance = suggested = None
    per_context_units = bool((samples.weights == 1).all())
    if per_context_units and samples.values.shape[1] >= 2 and n_units >= 2:
        draw_variance = float(samples.values.double().var(dim=1).mean())
        context_variance = max(float(unit_means.var()) - draw_variance / samples.values.shape[1], 0.0)
        if samples.forward_seconds > 0 and samples.draw_seconds > 0 and context_variance > 0:
            forward_per_context = samples.forward_seconds / n_units
            draw_per_context = samples.draw_seconds / (n_units * samples.values.shape[1])
            ratio = draw_variance / context_variance * forward_per_context / draw_per_context
            suggested = max(1, round(math.sqrt(ratio)))
    return TraceEstimate(
        mean=mean,
        stderr=stderr,
        n_contexts=int(samples.weights.sum()),
        n_draws=samples.n_draws,
        estimator=samples.estimator,
        seconds=seconds,
        draw_variance=draw_variance,
        context_variance=context_variance,
        suggested_n_draws=suggested,
    )


# ---------------------------------------------------------------------------------------------------------------------
# model plumbing


def is_causal_lm(model: nn.Module) -> bool:
    """Whether the model predicts the next token (its labels are shifted inside the forward). PEFT wrappers are
    looked through."""
    get_base_model = getattr(model, "get_base_model", None)
    base = get_base_model() if callable(get_base_model) else model
    name = type(base).__name__
    return (
        name in set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
        or name.endswith("ForCausalLM")
        or bool(getattr(getattr(base, "config", None), "is_decoder", False))
    )


def check_lm_model(model: nn.Module) -> nn.Module:
    """The model's output embedding (the decoder to the vocabulary), or a `ValueError` if it has no LM head."""
    get_output = getattr(model, "get_output_embeddings", None)
    decoder = get_output() if callable(get_output) else None
    if decoder is None:
        raise ValueError(
            f"{type(model).__name__} has no language-model head (get_output_embeddings() is None): the trace is "
            "defined on the pre-training loss. Load the checkpoint with AutoModelForMaskedLM or AutoModelForCausalLM."
        )
    return decoder


def _lm_head(model: nn.Module, decoder: nn.Module) -> nn.Module:
    """The outermost sub-module that holds the decoder and applies position-wise (e.g. BERT's ``cls``)."""
    base = getattr(model, "base_model", None)
    for _, child in model.named_children():
        if child is base:
            continue
        if child is decoder or any(m is decoder for m in child.modules()):
            return child
    return decoder


@contextlib.contextmanager
def _logits_only_at(model: nn.Module, positions: torch.Tensor) -> Iterator[None]:
    """Run the LM head on the predicted position of each row only: the stock forward computes logits for every
    position, most of the cost for a large vocabulary."""
    head = _lm_head(model, check_lm_model(model))
    rows = torch.arange(len(positions), device=positions.device)

    def select(module: nn.Module, args: tuple) -> tuple:
        hidden = args[0]
        if hidden.dim() != 3 or hidden.shape[0] != len(positions):
            raise ValueError(f"unexpected LM-head input of shape {tuple(hidden.shape)}")
        return (hidden[rows, positions].unsqueeze(1), *args[1:])

    handle = head.register_forward_pre_hook(select)
    try:
        yield
    finally:
        handle.remove()


@contextlib.contextmanager
def evaluation_mode(model: nn.Module) -> Iterator[None]:
    """``eval()`` for the measurement, then every sub-module back to its own previous mode."""
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training


@contextlib.contextmanager
def preserved_global_rng() -> Iterator[None]:
    """Leave torch's global CPU (and CUDA) random streams exactly as they were."""
    cpu_state = torch.random.get_rng_state()
    cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        torch.random.set_rng_state(cpu_state)
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("The model has no parameter with requires_grad=True: the trace is over trainable parameters.")
    return params


def _model_device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def _batch(model: nn.Module, contexts: TraceContexts, indices: Sequence[int]) -> dict[str, torch.Tensor]:
    """Right-padded tensors for the contexts ``indices``; padding is masked out, so its value does not matter."""
    pad_id = getattr(getattr(model, "config", None), "pad_token_id", None) or 0
    length = max(len(contexts.input_ids[i]) for i in indices)
    device = _model_device(model)
    input_ids = torch.full((len(indices), length), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(indices), length), dtype=torch.long)
    token_type_ids = torch.zeros((len(indices), length), dtype=torch.long) if contexts.token_type_ids else None
    for row, i in enumerate(indices):
        n = len(contexts.input_ids[i])
        input_ids[row, :n] = contexts.input_ids[i]
        attention_mask[row, :n] = contexts.attention_mask[i]
        if token_type_ids is not None:
            token_type_ids[row, :n] = contexts.token_type_ids[i]
    batch = {"input_ids": input_ids.to(device), "attention_mask": attention_mask.to(device)}
    if token_type_ids is not None:
        batch["token_type_ids"] = token_type_ids.to(device)
    return batch


def _selected_logits(model: nn.Module, batch: Mapping[str, torch.Tensor], positions: torch.Tensor) -> torch.Tensor:
    """Logits of shape (B, 1, V) at the predicted positions, with the graph kept for differentiation."""
    with _logits_only_at(model, positions):
        logits = model(**batch, use_cache=False).logits if is_causal_lm(model) else model(**batch).logits
    if logits.dim() != 3 or logits.shape[1] != 1:
        raise ValueError(f"{type(model).__name__} returned logits of shape {tuple(logits.shape)}; expected (B, 1, V).")
    return logits


def sample_labels(probs: torch.Tensor, indices: Sequence[int], n_draws: int, seed: int) -> torch.Tensor:
    """(B, n_draws) labels, row ``b`` drawn from ``probs[b]`` with the generator of context ``indices[b]``."""
    uniforms = torch.stack(
        [torch.rand(n_draws, generator=context_generator(seed, i), dtype=torch.float64) for i in indices]
    ).to(probs.device)
    cdf = probs.double().cumsum(dim=1)
    labels = torch.searchsorted(cdf, uniforms * cdf[:, -1:])
    return labels.clamp_(max=probs.shape[1] - 1)


def _squared_norm(tensors: Sequence[torch.Tensor | None]) -> torch.Tensor:
    present = [t for t in tensors if t is not None]
    return torch.stack([t.double().square().sum() for t in present]).sum()


def _check_vocabulary(model: nn.Module, contexts: TraceContexts, indices: Sequence[int]) -> None:
    weight = check_lm_model(model).weight
    vocab_size = getattr(weight, "ds_shape", weight.shape)[0]  # a ZeRO-3 parameter is empty between forwards
    largest = max(max(int(contexts.input_ids[i].max()), contexts.targets[i]) for i in indices)
    if largest >= vocab_size:
        raise ValueError(
            f"Token id {largest} is outside the model's vocabulary of {vocab_size}: the data was tokenized with a "
            "different tokenizer than the model's. Tokenize with the model's own tokenizer."
        )


# ---------------------------------------------------------------------------------------------------------------------
# estimators over a subset of contexts


def _per_sample_batch(
    model: nn.Module,
    contexts: TraceContexts,
    indices: Sequence[int],
    params: Sequence[nn.Parameter],
    n_draws: int,
    seed: int,
    exact_output_expectation: bool,
    validate: bool,
) -> tuple[torch.Tensor, float, float]:
    start = time.perf_counter()
    batch = _batch(model, contexts, indices)
    positions = torch.tensor([contexts.positions[i] for i in indices], device=batch["input_ids"].device)
    recorder = GhostNormRecorder(model, params)
    recorder.batch_size = len(indices)
    with recorder:
        logits = _selected_logits(model, batch, positions)
    probs = torch.softmax(logits.detach()[:, 0].double(), dim=-1)
    labels = sample_labels(probs, indices, n_draws, seed)
    outputs = recorder.outputs()
    decoder = check_lm_model(model)
    decoder_call = next((c for c in recorder.calls if c.module is decoder and c.output is logits), None)
    use_expectation = exact_output_expectation and decoder_call is not None
    trainable = {id(p) for p in params}
    if use_expectation:
        # E_y ||e_y - p||^2 = 1 - ||p||^2, times what multiplies the output gradient in the decoder's own term
        multiplier = torch.zeros(len(indices), dtype=torch.float64, device=probs.device)
        if id(decoder.weight) in trainable:
            multiplier += decoder_call.inputs.double().square().sum(dim=(1, 2))
        if getattr(decoder, "bias", None) is not None and id(decoder.bias) in trainable:
            multiplier += 1.0
        expected_output_term = (1.0 - probs.square().sum(dim=1)) * multiplier
    forward_seconds = time.perf_counter() - start

    start = time.perf_counter()
    values = torch.empty(len(indices), n_draws, dtype=torch.float64)
    for k in range(n_draws):
        cotangent = -probs.clone()
        cotangent[torch.arange(len(indices)), labels[:, k]] += 1.0
        grad_logits = cotangent.to(logits.dtype).unsqueeze(1)
        if validate and k == 0:
            recorder.check_unsupported_unused(logits, grad_logits)
        # no recorded output: none of the parameters reaches the logits, and every norm is zero
        grads = (
            torch.autograd.grad(
                logits, outputs, grad_outputs=grad_logits, retain_graph=k < n_draws - 1 or validate, allow_unused=True
            )
            if outputs
            else []
        )
        recorder.set_grad_outputs(grads)
        if use_expectation:
            values[:, k] = (recorder.squared_norms(exclude_self_terms_of=decoder_call) + expected_output_term).cpu()
        else:
            values[:, k] = recorder.squared_norms().cpu()
        if validate and k == 0:
            _validate_against_autograd(model, contexts, indices[0], params, int(labels[0, 0]), recorder)
            validate = False
    for call in recorder.calls:  # drop references to the graph
        call.grad_output = None
    return values, forward_seconds, time.perf_counter() - start


def _validate_against_autograd(
    model: nn.Module,
    contexts: TraceContexts,
    index: int,
    params: Sequence[nn.Parameter],
    label: int,
    recorder: GhostNormRecorder,
) -> None:
    """Compare the ghost norm of one context with a plain backward: catches a parameter the hooks cannot see (e.g.
    a weight reused outside its module) instead of returning a silently wrong trace."""
    ghost = float(recorder.squared_norms()[0])
    reference = float(_naive_squared_norms(model, contexts, index, params, torch.tensor([label]))[0])
    if not math.isclose(ghost, reference, rel_tol=1e-3, abs_tol=1e-6 * max(1.0, abs(reference))):
        unsupported = f" Parameters outside those layers: {recorder.unsupported[:8]}." if recorder.unsupported else ""
        raise ValueError(
            f"Per-sample gradient norms do not match a plain backward on {type(model).__name__} ({ghost:.6g} vs "
            f"{reference:.6g}): estimator='per_sample' sees the parameters of Linear, Conv1D, Embedding, LayerNorm "
            f"and elementwise norm layers used inside those layers only.{unsupported} Use estimator='naive' (exact "
            "for any model, slower), or freeze the other parameters (requires_grad=False) to leave them out of the "
            "trace."
        )


def _naive_squared_norms(
    model: nn.Module, contexts: TraceContexts, index: int, params: Sequence[nn.Parameter], labels: torch.Tensor
) -> torch.Tensor:
    """One stock forward (logits everywhere) and one backward per label."""
    batch = _batch(model, contexts, [index])
    values = torch.empty(len(labels), dtype=torch.float64)
    for k, label in enumerate(labels.tolist()):
        logits = model(**batch).logits[0, contexts.positions[index]]
        log_prob = torch.log_softmax(logits.float(), dim=-1)[label]
        values[k] = _squared_norm(torch.autograd.grad(log_prob, params, allow_unused=True)).cpu()
    return values


def _naive_context(
    model: nn.Module, contexts: TraceContexts, index: int, params: Sequence[nn.Parameter], n_draws: int, seed: int
) -> torch.Tensor:
    with torch.no_grad():
        logits = model(**_batch(model, contexts, [index])).logits[0, contexts.positions[index]]
    probs = torch.softmax(logits.double(), dim=-1).unsqueeze(0)
    labels = sample_labels(probs, [index], n_draws, seed)[0]
    return _naive_squared_norms(model, contexts, index, params, labels)


def _summed_batch(
    model: nn.Module,
    contexts: TraceContexts,
    indices: Sequence[int],
    params: Sequence[nn.Parameter],
    n_draws: int,
    seed: int,
) -> torch.Tensor:
    batch = _batch(model, contexts, indices)
    positions = torch.tensor([contexts.positions[i] for i in indices], device=batch["input_ids"].device)
    logits = _selected_logits(model, batch, positions)
    probs = torch.softmax(logits.detach()[:, 0].double(), dim=-1)
    labels = sample_labels(probs, indices, n_draws, seed)
    # gradient of sum_k log p(y_k) with respect to the logits: sum_k e_{y_k} - K p
    cotangent = -n_draws * probs
    cotangent.scatter_add_(1, labels, torch.ones_like(labels, dtype=cotangent.dtype))
    grads = torch.autograd.grad(logits, params, grad_outputs=cotangent.to(logits.dtype).unsqueeze(1), allow_unused=True)
    return (_squared_norm(grads) / (len(indices) * n_draws)).reshape(1, 1).cpu()


def _hutchinson_batch(
    model: nn.Module,
    contexts: TraceContexts,
    indices: Sequence[int],
    params: Sequence[nn.Parameter],
    n_draws: int,
    seed: int,
) -> torch.Tensor:
    batch = _batch(model, contexts, indices)
    positions = torch.tensor([contexts.positions[i] for i in indices], device=batch["input_ids"].device)
    targets = torch.tensor([contexts.targets[i] for i in indices], device=positions.device)
    # The fused CPU attention kernels have no double backward; the math kernel computes the same function.
    with sdpa_kernel(SDPBackend.MATH):
        logits = _selected_logits(model, batch, positions)[:, 0]
    loss = torch.nn.functional.cross_entropy(logits.float(), targets, reduction="sum")
    grads = torch.autograd.grad(loss, params, create_graph=True)
    generator = context_generator(seed, indices[0])
    values = torch.empty(1, n_draws, dtype=torch.float64)
    for k in range(n_draws):
        probes = [
            (torch.randint(0, 2, p.shape, generator=generator) * 2 - 1).to(device=p.device, dtype=p.dtype)
            for p in params
        ]
        hvp = torch.autograd.grad(grads, params, grad_outputs=probes, retain_graph=k < n_draws - 1, allow_unused=True)
        quadratic = sum(
            float((v.double() * h.double()).sum()) for v, h in zip(probes, hvp, strict=True) if h is not None
        )
        values[0, k] = quadratic / len(indices)
    return values


def _length_sorted_batches(contexts: TraceContexts, indices: Sequence[int], batch_size: int) -> list[list[int]]:
    ordered = sorted(indices, key=lambda i: len(contexts.input_ids[i]))
    return [ordered[start : start + batch_size] for start in range(0, len(ordered), batch_size)]


def _check_arguments(estimator: str, n_draws: int, batch_size: int | str) -> None:
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator={estimator!r} is not supported; choose one of {list(ESTIMATORS)}.")
    if not isinstance(n_draws, int) or n_draws < 1:
        raise ValueError(f"n_draws must be an integer >= 1 (got {n_draws!r}); {RECOMMENDED_N_DRAWS} is usually best.")
    if batch_size != "auto" and (not isinstance(batch_size, int) or batch_size < 1):
        raise ValueError(f"batch_size must be an integer >= 1 or 'auto' (got {batch_size!r}).")


def compute_trace_samples(
    model: nn.Module,
    contexts: TraceContexts,
    *,
    indices: Sequence[int] | None = None,
    n_draws: int = 50,
    estimator: str = "per_sample",
    seed: int = 0,
    batch_size: int | str = DEFAULT_BATCH_SIZE,
    exact_output_expectation: bool = True,
) -> TraceSamples:
    """Estimator values for the contexts ``indices`` (all by default), to be concatenated and summarized.

    The model must already be in the mode it is measured in (see `estimate_hessian_trace`). A process measuring a
    share of the contexts passes its own ``indices``; draws depend only on ``(seed, index)``.
    """
    _check_arguments(estimator, n_draws, batch_size)
    indices = list(range(len(contexts))) if indices is None else list(indices)
    if not indices:
        raise ValueError("compute_trace_samples got no context indices.")
    check_lm_model(model)
    _check_vocabulary(model, contexts, indices)
    params = trainable_parameters(model)
    forward_seconds = draw_seconds = 0.0
    parts = []
    with torch.enable_grad():
        if estimator == "naive":
            parts = [_naive_context(model, contexts, i, params, n_draws, seed).unsqueeze(0) for i in indices]
            weights = torch.ones(len(indices))
        else:
            if batch_size == "auto":
                from .memory import auto_batch_size

                batch_size = auto_batch_size(model, contexts, indices)
            batches = _length_sorted_batches(contexts, indices, batch_size)
            weights = torch.ones(len(indices))
            for number, group in enumerate(batches):
                if estimator == "per_sample":
                    values, forward_s, draw_s = _per_sample_batch(
                        model, contexts, group, params, n_draws, seed, exact_output_expectation, validate=number == 0
                    )
                    parts.append(values)
                    forward_seconds += forward_s
                    draw_seconds += draw_s
                elif estimator == "summed":
                    parts.append(_summed_batch(model, contexts, group, params, n_draws, seed))
                else:
                    parts.append(_hutchinson_batch(model, contexts, group, params, n_draws, seed))
            if estimator == "per_sample":
                # back from length order to the callers' order
                position_of = {index: n for n, index in enumerate(i for group in batches for i in group)}
                parts = [torch.cat(parts)[[position_of[i] for i in indices]]]
            else:
                weights = torch.tensor([float(len(group)) for group in batches])
    return TraceSamples(
        values=torch.cat(parts),
        weights=weights,
        n_draws=n_draws,
        estimator=estimator,
        forward_seconds=forward_seconds,
        draw_seconds=draw_seconds,
    )


def estimate_hessian_trace(
    model: nn.Module,
    dataset: Iterable[Mapping[str, Any]],
    *,
    n_contexts: int | None = None,
    n_draws: int = 50,
    estimator: str = "per_sample",
    seed: int = 0,
    batch_size: int | str = DEFAULT_BATCH_SIZE,
    exact_output_expectation: bool = True,
    causal: bool | None = None,
    across_processes: bool = False,
) -> TraceEstimate:
    """Estimate the paper's flatness measure, the trace of the Hessian (Fisher) of the pre-training loss.

    Args:
        model: a masked or causal LM (``...ForMaskedLM`` / ``...ForCausalLM``). The trace is over its trainable
            parameters. It is measured in ``eval()`` mode; every module's mode, the parameters' ``.grad`` and the
            global random streams are left as they were.
        dataset: rows with ``input_ids``, ``attention_mask`` and ``labels`` (-100 except at the predicted positions;
            each labelled position is one context), a list or a `datasets.Dataset`.
            `hf_flatbias.flatness.contexts.build_masked_contexts` makes such rows from tokenized text.
        n_contexts: use the first ``n_contexts`` contexts; all by default.
        n_draws: draws of ``y`` per context (Rademacher probes for ``hutchinson``). The default is the paper's 50;
            with ``per_sample`` about 2 gives the same error in several times less time (`TraceEstimate`'s
            ``suggested_n_draws`` reports the best value measured on your model).
        estimator: ``"per_sample"`` (default, fastest), ``"summed"``, ``"hutchinson"`` or ``"naive"`` (see the
            module docstring).
        seed: the draws of context ``i`` depend only on ``(seed, i)``.
        batch_size: contexts per forward, or ``"auto"``: as many as keep the measurement's working memory under
            80% of the free GPU memory (half the available RAM on CPU), measured on the longest context
            (`hf_flatbias.flatness.memory.auto_batch_size`, which also takes a stated budget).
        exact_output_expectation: with ``per_sample``, replace the output layer's own term by its exact expectation
            over ``y`` (unbiased, less noise). ``False`` gives the plain sampled norms, draw for draw equal to
            ``naive``.
        causal: whether the model is a causal LM; detected from the model class by default.
        across_processes: with several processes (DDP, DeepSpeed), every process calls this with the same
            arguments, measures every world-size-th context and gets the whole estimate: the one-process estimate
            on the same contexts and draws. Per-context estimators (``per_sample``, ``naive``) only; under
            DeepSpeed ZeRO-3 (partitioned parameters, the ranks kept in step) ``naive`` only.

    Returns:
        A `TraceEstimate`.

    Raises:
        ValueError: a model without an LM head, rows without a labelled position, ``n_draws < 1``, token ids outside
            the model's vocabulary, or too few contexts.
    """
    start = time.perf_counter()
    _check_arguments(estimator, n_draws, batch_size)
    check_lm_model(model)
    trainable_parameters(model)
    if causal is None:
        causal = is_causal_lm(model)
    contexts = TraceContexts.from_rows(dataset, causal=causal)
    if n_contexts is not None:
        if n_contexts < 1 or n_contexts > len(contexts):
            raise ValueError(
                f"n_contexts={n_contexts} but the data holds {len(contexts)} contexts (labelled positions)."
            )
        indices = list(range(n_contexts))
    else:
        indices = list(range(len(contexts)))
    _check_partitioned_model(model, estimator, across_processes)
    measure = dict(
        n_draws=n_draws,
        estimator=estimator,
        seed=seed,
        batch_size=batch_size,
        exact_output_expectation=exact_output_expectation,
    )
    with evaluation_mode(model), preserved_global_rng():
        if across_processes:
            samples = _samples_across_processes(model, contexts, indices, measure)
        else:
            samples = compute_trace_samples(model, contexts, indices=indices, **measure)
    return summarize_trace_samples(samples, seconds=time.perf_counter() - start)


def _check_partitioned_model(model: nn.Module, estimator: str, across_processes: bool) -> None:
    from .distributed import needs_lockstep

    if not needs_lockstep(model):
        return
    if not across_processes:
        raise ValueError(
            "The model's parameters are partitioned by DeepSpeed ZeRO-3: every forward is a collective over all "
            "processes. Call estimate_hessian_trace on every process with across_processes=True."
        )
    if estimator == "per_sample":
        raise ValueError(
            "estimator='per_sample' does not support DeepSpeed ZeRO-3 (its backward stops at layer outputs, where "
            "ZeRO-3 has already released the parameters). Use estimator='naive' under ZeRO-3 (same values, one "
            "backward per draw), or measure under ZeRO 0-2 / on the consolidated model in one process."
        )


def _samples_across_processes(
    model: nn.Module, contexts: TraceContexts, indices: list[int], measure: dict[str, Any]
) -> TraceSamples:
    from .distributed import gather_trace_samples, needs_lockstep, share_of_contexts, world

    rank, world_size = world()
    if world_size == 1:
        return compute_trace_samples(model, contexts, indices=indices, **measure)
    if measure["estimator"] not in ("per_sample", "naive"):
        raise ValueError(
            f"across_processes=True needs a per-context estimator ('per_sample' or 'naive'), got "
            f"{measure['estimator']!r}: its units are batches of contexts, which would differ from one process."
        )
    share = share_of_contexts(indices, rank, world_size, lockstep=needs_lockstep(model))
    local = compute_trace_samples(model, contexts, indices=share.indices, **measure) if share.indices else None
    return gather_trace_samples(local, share.n_measured, world_size)
