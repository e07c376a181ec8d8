"""Reaching the optimum on a CPU: distil a masked LM on the exact conditionals of a synthetic language.

Training from scratch on sampled tokens approaches the entropy floor as a power law of small exponent (issue 23's
pilots: KL 0.058 after 5,000 steps of the 3-level grammar, 0.01 out of reach of a CPU). The paper's theorem starts
*at* a minimiser and studies the drift from there; this module gets there by a route of our own, not the paper's
training: cross-entropy to the exact conditional ``Pr(x_t = . | x_-t)`` (soft targets, no label-sampling noise), one
``[MASK]`` per row, sentences drawn uniformly with replacement from a pool whose every position's conditional is
computed once (`hf_flatbias.synthetic.conditionals`). [`distil_to_saturation`] stops as soon as a held-out stop set
(separate from the sentences results are measured on) is saturated, or extends the decay when it is not yet.

[`soft_masked_lm_loss`] and [`distillation_batches`] are the numerical core; the loop is plain PyTorch (no label
columns for the Trainer to carry, and ~15% faster than the Trainer path on this CPU).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hf_flatbias.synthetic.tokenizer import CLS_ID, MASK_ID, N_SPECIAL, PAD_ID, SEP_ID

from .saturation import measure_saturation


@dataclass
class ConditionalPool:
    """Sentences with the exact conditional at every position: the distillation's training data.

    Attributes:
        word_ids: ``(n, T)`` word indices, ``-1`` after each sentence's end.
        lengths: ``(n,)`` words per sentence.
        conditionals: ``(n, T, n_words)`` float32 ``Pr(x_t = w | x_-t)`` (`cached_conditionals`).
    """

    word_ids: np.ndarray
    lengths: np.ndarray
    conditionals: np.ndarray

    def __post_init__(self) -> None:
        if self.conditionals.shape[:2] != self.word_ids.shape or self.lengths.shape != (len(self.word_ids),):
            raise ValueError(
                f"conditionals {self.conditionals.shape} must be (n, T, n_words) for word_ids {self.word_ids.shape} "
                f"and lengths (n,) {self.lengths.shape}."
            )


def soft_masked_lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean ``-sum_v p(v) log softmax(logits)_v`` over rows: ``(B, V)`` logits at the masked positions, ``(B, V)``
    targets over the whole vocabulary (zero at the special tokens, so mass put there is paid for, as the KL pays)."""
    if logits.shape != targets.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} must match.")
    return -(targets * torch.log_softmax(logits.float(), dim=-1)).sum(-1).mean()


def masked_rows(word_ids: np.ndarray, lengths: np.ndarray, positions: np.ndarray) -> dict[str, torch.Tensor]:
    """``[CLS] words [SEP]`` rows padded to the longest, word ``positions[i]`` of row ``i`` replaced by ``[MASK]``.

    Returns ``input_ids``, ``attention_mask`` and ``mask_index`` (the token index of each row's mask).
    """
    width = int(lengths.max()) + 2
    inside = np.arange(width - 2)[None, :] < lengths[:, None]
    ids = np.full((len(lengths), width), PAD_ID, dtype=np.int64)
    ids[:, 0] = CLS_ID
    ids[:, 1:-1] = np.where(inside, word_ids[:, : width - 2] + N_SPECIAL, PAD_ID)
    rows = np.arange(len(lengths))
    ids[rows, lengths + 1] = SEP_ID
    ids[rows, positions + 1] = MASK_ID
    input_ids = torch.as_tensor(ids)
    return {
        "input_ids": input_ids,
        "attention_mask": (input_ids != PAD_ID).long(),
        "mask_index": torch.as_tensor(positions + 1),
    }


def distillation_batches(
    pool: ConditionalPool, *, batch_size: int, vocab_size: int, seed: int
) -> Iterator[dict[str, torch.Tensor]]:
    """Endless batches: sentences uniform with replacement, one uniform position masked, its exact conditional as
    ``targets`` ``(B, vocab_size)`` (words at token ``N_SPECIAL + w``)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}.")
    n_words = pool.conditionals.shape[-1]
    if vocab_size < N_SPECIAL + n_words:
        raise ValueError(f"vocab_size {vocab_size} is smaller than the special tokens plus {n_words} words.")
    rng = np.random.default_rng(seed)
    while True:
        sentences = rng.integers(0, len(pool.lengths), size=batch_size)
        lengths = pool.lengths[sentences]
        positions = (rng.random(batch_size) * lengths).astype(np.int64)
        batch = masked_rows(pool.word_ids[sentences], lengths, positions)
        targets = torch.zeros(batch_size, vocab_size)
        targets[:, N_SPECIAL : N_SPECIAL + n_words] = torch.as_tensor(pool.conditionals[sentences, positions])
        batch["targets"] = targets
        yield batch


def distillation_rates(peak: float, warmup_steps: int, steps: int) -> np.ndarray:
    """Linear warm-up to ``peak`` over ``warmup_steps``, then linear decay to 0 at ``steps`` (the paper's shape)."""
    if steps < 1 or not 0 <= warmup_steps < steps:
        raise ValueError(f"need steps >= 1 and 0 <= warmup_steps < steps, got {steps} and {warmup_steps}.")
    i = np.arange(steps, dtype=np.float64)
    warm = (i + 1) / max(warmup_steps, 1)
    decay = (steps - i) / (steps - warmup_steps)
    return peak * np.where(i < warmup_steps, warm, decay)


def distil_to_saturation(
    model: torch.nn.Module,
    pool: ConditionalPool,
    stop_set: ConditionalPool,
    *,
    steps: int = 8000,
    learning_rate: float = 2e-3,
    warmup_steps: int = 200,
    batch_size: int = 128,
    weight_decay: float = 0.01,
    adam_beta2: float = 0.98,
    max_grad_norm: float = 1.0,
    check_every: int = 500,
    check_from: int | None = None,
    extensions: Sequence[tuple[int, float]] = ((4000, 5e-4), (4000, 2.5e-4)),
    extend_below: float | None = None,
    seed: int = 0,
    checkpoint: Path | str | None = None,
    checkpoint_every: int = 500,
    log: bool = True,
) -> dict[str, Any]:
    """Distil ``model`` in place until ``stop_set`` is saturated (`SaturationResult.saturated`).

    The first segment decays ``learning_rate`` to 0 over ``steps``; each extension ``(steps, peak)`` then decays
    again from its own peak (the Adam moments carry over), used only while the stop set is not saturated. The KL is
    checked every ``check_every`` steps from ``check_from`` (default: three quarters of the first segment) and at
    each segment's end; training stops at the first saturated check. ``extend_below``: the extensions run only if
    the first segment ended at or below this stop-set KL (a budget for languages far from the tier; None: always).
    ``checkpoint``: a file the state (weights, Adam, step, history) is saved to every ``checkpoint_every`` steps and
    resumed from, so a stopped run ends exactly as an uninterrupted one would; the caller deletes it when done.

    Returns:
        ``{"saturated", "steps", "seconds", "cpu_seconds", "stop_kl": SaturationResult dict, "history": [{step, kl,
        ci_high, learning_rate, seconds, cpu_seconds}]}`` (``cpu_seconds``: this process's CPU time since the start,
        the cost on a shared machine; both clocks count the resumed runs together).
    """
    if check_every < 1 or checkpoint_every < 1:
        raise ValueError(f"check_every and checkpoint_every must be >= 1, got {check_every} and {checkpoint_every}.")
    check_from = 3 * steps // 4 if check_from is None else check_from
    vocab_size = model.get_output_embeddings().weight.shape[0]
    decay, no_decay = [], []
    for name, parameter in model.named_parameters():
        # the Trainer's convention: no weight decay on biases and LayerNorm weights
        (no_decay if name.endswith("bias") or "LayerNorm" in name else decay).append(parameter)
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=learning_rate,
        betas=(0.9, adam_beta2),
    )
    batches = distillation_batches(pool, batch_size=batch_size, vocab_size=vocab_size, seed=seed)
    device = next(model.parameters()).device
    segments = [(distillation_rates(learning_rate, warmup_steps, steps), check_from)]
    segments += [(distillation_rates(peak, 0, n), 0) for n, peak in extensions]
    # one row per step: (segment, index in it, rate, whether the stop set is measured after it)
    schedule = [
        (number, i, float(rate), i == len(rates) - 1 or (i + 1 >= first and (i + 1) % check_every == 0))
        for number, (rates, first) in enumerate(segments)
        for i, rate in enumerate(rates)
    ]
    state = {"step": 0, "history": [], "result": None, "seconds": 0.0, "cpu_seconds": 0.0}
    checkpoint = None if checkpoint is None else Path(checkpoint)
    if checkpoint is not None and checkpoint.exists():
        state = torch.load(checkpoint, weights_only=False)
        model.load_state_dict(state.pop("model"))
        optimizer.load_state_dict(state.pop("optimizer"))
        torch.set_rng_state(state.pop("rng"))
        for _ in range(state["step"]):
            next(batches)  # the same batches as an uninterrupted run from here on
        if log:
            print(f"  distillation resumed at step {state['step']}", flush=True)
    start, cpu_start = time.perf_counter() - state["seconds"], time.process_time() - state["cpu_seconds"]
    history, result = state["history"], state["result"]
    model.train()
    for step, (number, i, rate, check) in enumerate(schedule[state["step"] :], start=state["step"] + 1):
        if i == 0 and number == 1 and extend_below is not None and result.kl > extend_below:
            break
        batch = {name: tensor.to(device) for name, tensor in next(batches).items()}
        for group in optimizer.param_groups:
            group["lr"] = rate
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        picked = logits[torch.arange(len(logits), device=device), batch["mask_index"]]
        loss = soft_masked_lm_loss(picked, batch["targets"])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if check:
            result = measure_saturation(model, stop_set.word_ids, stop_set.conditionals, stop_set.lengths, seed=step)
            model.train()
            history.append(
                {
                    "step": step,
                    "kl": result.kl,
                    "ci_high": result.ci_high,
                    "learning_rate": rate,
                    "seconds": time.perf_counter() - start,
                    "cpu_seconds": time.process_time() - cpu_start,
                }
            )
            if log:
                print(
                    f"  distil step {step}: stop-set KL {result.kl:.4f} (upper {result.ci_high:.4f}) "
                    f"lr {rate:.2e} [{time.perf_counter() - start:.0f} s]",
                    flush=True,
                )
        state.update(step=step, result=result)
        if result is not None and result.saturated:
            break
        if checkpoint is not None and step % checkpoint_every == 0:
            _save_state(
                checkpoint, model, optimizer, state, time.perf_counter() - start, time.process_time() - cpu_start
            )
    model.eval()
    return {
        "saturated": bool(result.saturated),
        "steps": state["step"],
        "seconds": time.perf_counter() - start,
        "cpu_seconds": time.process_time() - cpu_start,
        "stop_kl": result.to_dict(),
        "history": history,
    }


def _save_state(path: Path, model, optimizer, state: dict[str, Any], seconds: float, cpu_seconds: float) -> None:
    """The distillation's state, written whole or not at all (a kill mid-write leaves the previous one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.partial")
    payload = {**state, "seconds": seconds, "cpu_seconds": cpu_seconds, "rng": torch.get_rng_state()}
    torch.save({**payload, "model": model.state_dict(), "optimizer": optimizer.state_dict()}, partial)
    partial.replace(path)
