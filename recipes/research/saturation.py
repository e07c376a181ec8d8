"""Saturation: how far a masked LM's conditionals are from the exact ones of a synthetic language.

The paper's loss measure (released code, ``pcfg/calculate_loss.py``) masks every position of every held-out sentence
in turn and scores the model's prediction ``q`` against the *exact* conditional ``p = Pr(x_t | x_-t)``:
``-sum_w p(w) log q(w)``, averaged over all positions of all sentences. Its floor, reached at ``q = p``, is the
conditional entropy; the gap is ``KL(p || q)``, which is what "saturated" is judged on here. ``q`` is the model's
softmax over its whole vocabulary read at the word tokens, as in the released code, so mass a model puts on special
tokens counts against it.

[`measure_saturation`] runs a model; [`saturation`] is the numerical core on arrays and knows nothing of models.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import torch

from hf_flatbias.synthetic.tokenizer import CLS_ID, MASK_ID, N_SPECIAL, PAD_ID, PAD_WORD, SEP_ID

#: a branch is saturated when its mean KL is at most this (nats) ...
SATURATED_KL = 0.010
#: ... and the upper end of its bootstrap interval at most this
SATURATED_KL_UPPER = 0.015


@dataclass(frozen=True)
class SaturationResult:
    """Mean KL(exact conditional || model) over every position of held-out sentences, each masked in turn.

    Attributes:
        kl: mean KL over all (sentence, position) pairs, in nats.
        ci_low, ci_high: percentile bootstrap interval of ``kl`` over sentences at ``confidence``.
        confidence: level of the interval.
        cross_entropy: mean ``-sum_w p(w) log q(w)``: the released code's loss against the exact conditionals.
        entropy: mean ``-sum_w p(w) log p(w)``: the floor of ``cross_entropy`` (``kl = cross_entropy - entropy``).
        n_sentences, n_positions: sentences and masked positions measured.
    """

    kl: float
    ci_low: float
    ci_high: float
    confidence: float
    cross_entropy: float
    entropy: float
    n_sentences: int
    n_positions: int

    @property
    def saturated(self) -> bool:
        """``kl <= SATURATED_KL`` and ``ci_high <= SATURATED_KL_UPPER``."""
        return self.kl <= SATURATED_KL and self.ci_high <= SATURATED_KL_UPPER

    def to_dict(self) -> dict[str, float | int | bool]:
        return {**asdict(self), "saturated": self.saturated}


def positionwise_kl(true_conditionals: np.ndarray, model_log_probs: np.ndarray) -> np.ndarray:
    """``KL(p || q) = sum_w p(w) (log p(w) - log q(w))`` at every position: ``(..., n_words) -> (...)``.

    Words with ``p(w) = 0`` contribute nothing (``0 log 0 = 0``), whatever ``q`` is there.
    """
    p = np.asarray(true_conditionals, dtype=np.float64)
    log_q = np.asarray(model_log_probs, dtype=np.float64)
    if p.shape != log_q.shape:
        raise ValueError(f"true_conditionals {p.shape} and model_log_probs {log_q.shape} must have the same shape.")
    positive = p > 0
    log_p = np.log(np.where(positive, p, 1.0))
    return np.where(positive, p * (log_p - log_q), 0.0).sum(-1)


def saturation(
    true_conditionals: np.ndarray,
    model_log_probs: np.ndarray,
    lengths: np.ndarray,
    *,
    n_bootstrap: int = 2000,
    confidence: float = 0.95,
    seed: int = 0,
) -> SaturationResult:
    """Mean KL over all positions of the sentences, with a bootstrap interval that resamples sentences.

    Args:
        true_conditionals: ``(n, T, n_words)`` exact ``Pr(x_t = w | x_-t)`` (e.g. ``PCFG.masked_conditionals``).
        model_log_probs: ``(n, T, n_words)`` the model's log-probability of each word with position ``t`` masked.
        lengths: ``(n,)`` words of each sentence; positions from ``lengths[i]`` on are ignored.
        n_bootstrap: bootstrap resamples of the sentences (positions of one sentence move together, being dependent).
        confidence: level of the percentile interval.
        seed: seed of the resampling.
    """
    p = np.asarray(true_conditionals, dtype=np.float64)
    lengths = np.asarray(lengths, dtype=np.int64)
    if p.ndim != 3 or lengths.shape != (p.shape[0],):
        raise ValueError(f"expected (n, T, n_words) conditionals and (n,) lengths, got {p.shape} and {lengths.shape}.")
    if lengths.min() < 1 or lengths.max() > p.shape[1]:
        raise ValueError(f"lengths must be in [1, {p.shape[1]}] (the conditionals' width).")
    if n_bootstrap < 1 or not 0 < confidence < 1:
        raise ValueError(f"need n_bootstrap >= 1 and 0 < confidence < 1, got {n_bootstrap} and {confidence}.")
    inside = np.arange(p.shape[1])[None, :] < lengths[:, None]
    log_q = np.where(inside[..., None], model_log_probs, 0.0)
    if not np.isfinite(log_q).all():
        raise ValueError("model_log_probs must be finite at every position inside the sentences.")
    kl = np.where(inside, positionwise_kl(p, log_q), 0.0).sum(1)
    positive = p > 0
    entropy = np.where(inside, -np.where(positive, p * np.log(np.where(positive, p, 1.0)), 0.0).sum(-1), 0.0).sum(1)
    n_positions = int(lengths.sum())
    rng = np.random.default_rng(seed)
    n = len(lengths)
    counts = rng.multinomial(n, np.full(n, 1.0 / n), size=n_bootstrap)
    resampled = (counts @ kl) / (counts @ lengths)
    tail = (1 - confidence) / 2
    low, high = np.quantile(resampled, [tail, 1 - tail])
    mean_kl = float(kl.sum() / n_positions)
    mean_entropy = float(entropy.sum() / n_positions)
    return SaturationResult(
        kl=mean_kl,
        ci_low=float(low),
        ci_high=float(high),
        confidence=confidence,
        cross_entropy=mean_kl + mean_entropy,
        entropy=mean_entropy,
        n_sentences=n,
        n_positions=n_positions,
    )


def every_position_masked(word_ids: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One token row per (sentence, position), ``[CLS] words [SEP]`` with that word replaced by ``[MASK]``.

    Returns ``(input_ids (N, T + 2), sentence index (N,), masked word position (N,))`` with
    ``N = sum(lengths)``, rows padded with ``[PAD]``.
    """
    word_ids = np.asarray(word_ids, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    sentence = np.repeat(np.arange(len(lengths)), lengths)
    position = np.arange(len(sentence)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    width = int(lengths.max())
    words = word_ids[sentence, :width]
    inside = np.arange(width)[None, :] < lengths[sentence, None]
    rows = np.full((len(sentence), width + 2), PAD_ID, dtype=np.int64)
    rows[:, 0] = CLS_ID
    rows[:, 1:-1] = np.where(inside, words + N_SPECIAL, PAD_ID)
    rows[np.arange(len(sentence)), lengths[sentence] + 1] = SEP_ID
    rows[np.arange(len(sentence)), position + 1] = MASK_ID
    return rows, sentence, position


@torch.no_grad()
def model_masked_log_probs(
    model: torch.nn.Module,
    word_ids: np.ndarray,
    lengths: np.ndarray | None = None,
    *,
    n_words: int | None = None,
    batch_size: int = 1024,
) -> np.ndarray:
    """A masked LM's ``log q(x_t = w | x_-t)`` at every position of every sentence, each masked in turn.

    Args:
        model: a masked LM on the token ids of ``make_tokenizer`` (``model(input_ids=, attention_mask=).logits``).
        word_ids: ``(n, T)`` word indices padded with ``-1``.
        lengths: ``(n,)`` sentence lengths; inferred from the padding when omitted.
        n_words: words of the language; default: the model's vocabulary minus the special tokens.
        batch_size: masked rows per forward pass.

    Returns:
        ``(n, T, n_words)`` float64 log-softmax over the model's whole vocabulary, read at the word tokens; zero at
        padding positions. The model runs in eval mode and its mode is restored afterwards.
    """
    word_ids = np.asarray(word_ids, dtype=np.int64)
    if lengths is None:
        lengths = (word_ids != PAD_WORD).sum(1)
    lengths = np.asarray(lengths, dtype=np.int64)
    rows, sentence, position = every_position_masked(word_ids, lengths)
    # rows of similar length share a batch, so short sentences do not pay for the longest
    order = np.argsort(lengths[sentence], kind="stable")
    device = next(model.parameters()).device
    out = None
    was_training = model.training
    model.eval()
    try:
        for start in range(0, len(order), batch_size):
            batch = order[start : start + batch_size]
            width = int(lengths[sentence[batch]].max()) + 2
            ids = torch.as_tensor(rows[batch, :width], device=device)
            logits = model(input_ids=ids, attention_mask=(ids != PAD_ID).long()).logits
            picked = logits[
                torch.arange(len(batch), device=device), torch.as_tensor(position[batch] + 1, device=device)
            ]
            log_probs = torch.log_softmax(picked.double(), dim=-1).cpu().numpy()
            if out is None:
                vocabulary_words = log_probs.shape[-1] - N_SPECIAL
                n_words = vocabulary_words if n_words is None else n_words
                if not 1 <= n_words <= vocabulary_words:
                    raise ValueError(f"n_words must be in [1, {vocabulary_words}] (the model's word tokens).")
                out = np.zeros((len(lengths), word_ids.shape[1], n_words))
            out[sentence[batch], position[batch]] = log_probs[:, N_SPECIAL : N_SPECIAL + n_words]
    finally:
        model.train(was_training)
    return out


def measure_saturation(
    model: torch.nn.Module,
    word_ids: np.ndarray,
    true_conditionals: np.ndarray,
    lengths: np.ndarray | None = None,
    *,
    batch_size: int = 1024,
    n_bootstrap: int = 2000,
    confidence: float = 0.95,
    seed: int = 0,
) -> SaturationResult:
    """KL(exact || model) over every position of held-out sentences, each masked in turn, with a bootstrap interval.

    Args:
        model: the masked LM to measure.
        word_ids: ``(n, T)`` held-out sentences (word indices padded with ``-1``); the paper's protocol uses >= 1,000.
        true_conditionals: ``(n, T, n_words)`` their exact conditionals (``PCFG.masked_conditionals(word_ids)``),
            computed once and shared by every model measured on these sentences.
        lengths: ``(n,)`` sentence lengths; inferred from the padding when omitted.
        batch_size, n_bootstrap, confidence, seed: as in [`model_masked_log_probs`] and [`saturation`].
    """
    true_conditionals = np.asarray(true_conditionals)
    word_ids = np.asarray(word_ids, dtype=np.int64)
    if lengths is None:
        lengths = (word_ids != PAD_WORD).sum(1)
    if true_conditionals.shape[:2] != word_ids.shape:
        raise ValueError(
            f"true_conditionals {true_conditionals.shape} must be (n, T, n_words) for word_ids {word_ids.shape}."
        )
    log_q = model_masked_log_probs(model, word_ids, lengths, n_words=true_conditionals.shape[-1], batch_size=batch_size)
    return saturation(true_conditionals, log_q, lengths, n_bootstrap=n_bootstrap, confidence=confidence, seed=seed)
