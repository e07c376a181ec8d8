"""Exact inference in a [`PCFG`]: sentence probabilities, masked-token conditionals, parse posteriors and the
released code's task labels, from the inside pass and its gradient.

The inside probability ``Z(x)`` of a sentence is linear in the one-hot vector of the word at every position, so the
derivative of ``Z`` with respect to that vector at ``(t, w)`` is ``Pr(x_-t, x_t = w)``, whatever word stands at
``t``. One inside pass plus one backward pass therefore gives the masked-token conditional ``Pr(x_t = w | x_-t)`` at
*every* position at once. The inside pass itself is written with span matrices: ``M_A[i, j]`` is the inside
probability of nonterminal ``A`` over words ``[i, j)``, and a rule ``A -> B C D`` contributes
``p * (M_B @ M_C @ M_D)``, the matrix product summing over the split points.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from .tokenizer import MASKED_WORD, PAD_WORD

#: label of tasks B/C when no nonterminal derives the prefix (the released code falls back to ``S1``)
UNPARSABLE_LABEL = 0


class PCFGInside:
    """The exact-inference methods of [`PCFG`], which builds the rule tables the inside pass reads
    (``_build_tables``)."""

    def _inside(self, word_ids: torch.Tensor, lengths: torch.Tensor, *, track: bool = False):
        """Inside probabilities of a padded batch.

        Returns ``(Z (b,), word indicator (b, T, n_words), span matrices per level (b, n_l, T+1, T+1),
        Pr(x | sentence type) (b, n_types))``. With ``track`` the indicator requires grad and the span matrices retain
        theirs: the gradient of ``Z`` is the outside probability of everything.
        """
        b = word_ids.shape[0]
        indicator = torch.nn.functional.one_hot(word_ids.clamp(min=0), self.n_words).to(torch.float64)
        # a masked position is marginalised over all words, a padding position matches none
        indicator = torch.where((word_ids == MASKED_WORD)[..., None], torch.ones_like(indicator), indicator)
        indicator = torch.where((word_ids == PAD_WORD)[..., None], torch.zeros_like(indicator), indicator)
        if track:
            indicator.requires_grad_(True)
        n_levels = len(self.level_sizes)
        spans: list[torch.Tensor] = [None] * n_levels
        for level in range(n_levels - 1, -1, -1):
            matrices = None
            if level < n_levels - 1:
                matrices = self._combine_children(level, spans[level + 1])
            word_probs = self.emissions if level == n_levels - 1 else None
            if level < n_levels - 1 and self.lexical is not None and self.lexical[level].any():
                word_probs = self.lexical[level]
            if word_probs is not None:
                leaf = indicator @ torch.as_tensor(word_probs.T)  # (b, T, n_l): probability of A -> x_t
                diagonal = torch.diag_embed(leaf.permute(0, 2, 1), offset=1)  # spans [t, t+1)
                matrices = diagonal if matrices is None else matrices + diagonal
            if track:
                matrices.retain_grad()
            spans[level] = matrices
        likelihood = spans[0][torch.arange(b), :, 0, lengths]  # (b, n_types)
        z = likelihood @ torch.as_tensor(self.root_probs)
        return z, indicator, spans, likelihood

    def _combine_children(self, level: int, child: torch.Tensor) -> torch.Tensor:
        """Inside span matrices of level ``level`` from its rules over the span matrices ``child`` of the next."""
        binary = self._binary_weights[level]
        if binary is not None:
            # contracting the rule tensor with the right child first leaves one large matrix product per sentence
            right = torch.einsum("abc,nckj->nabkj", binary, child)
            return torch.einsum("nbik,nabkj->naij", child, right)
        children = torch.as_tensor(self._unique_children[level])
        rule_lengths = (children >= 0).sum(1)
        product = child[:, children[:, 0]]
        for j in range(1, children.shape[1]):
            has_child = rule_lengths > j
            if bool(has_child.all()):
                product = product @ child[:, children[:, j]]
            else:
                extended = product[:, has_child] @ child[:, children[has_child, j]]
                product = product.clone()
                product[:, has_child] = extended
        return torch.einsum("brij,rp->bpij", product, torch.as_tensor(self._unique_weights[level]))

    @staticmethod
    def _as_batch(word_ids, lengths=None) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(word_ids, (list, tuple)) and word_ids and not np.isscalar(word_ids[0]):
            t_max = max(len(s) for s in word_ids)
            padded = np.full((len(word_ids), t_max), PAD_WORD, dtype=np.int64)
            for i, s in enumerate(word_ids):
                padded[i, : len(s)] = s
            word_ids = padded
        ids = torch.as_tensor(np.asarray(word_ids), dtype=torch.long)
        if ids.ndim == 1:
            ids = ids[None]
        if lengths is None:
            lengths = (ids != PAD_WORD).sum(1)
        lengths = torch.as_tensor(np.asarray(lengths), dtype=torch.long)
        if (ids[:, : int(lengths.max())] == PAD_WORD).sum() != (lengths.max() - lengths).sum():
            raise ValueError("word_ids must be padded with -1 only after each sentence's last word.")
        return ids, lengths

    def _length_batches(self, word_ids, lengths, batch_size: int, min_width: int = 0):
        """``(rows, word ids cut to the batch's longest sentence, lengths)`` over batches of similar length.

        Sorting by length keeps the cubic inside pass from paying for the longest sentence in every batch.
        """
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}.")
        ids, lengths = self._as_batch(word_ids, lengths)
        order = np.argsort(lengths.numpy(), kind="stable")
        for start in range(0, len(order), batch_size):
            rows = torch.as_tensor(order[start : start + batch_size])
            chunk, chunk_lengths = ids[rows], lengths[rows]
            width = max(int(chunk_lengths.max()), min_width)
            if width > chunk.shape[1]:
                chunk = torch.nn.functional.pad(chunk, (0, width - chunk.shape[1]), value=PAD_WORD)
            yield rows.numpy(), chunk[:, :width], chunk_lengths

    def sentence_probability(self, word_ids, lengths=None, *, batch_size: int = 256) -> np.ndarray:
        """``Pr(x)`` of each sentence (``-2`` entries are marginalised over all words)."""
        out = np.zeros(len(self._as_batch(word_ids, lengths)[0]))
        for rows, chunk, chunk_lengths in self._length_batches(word_ids, lengths, batch_size):
            with torch.no_grad():
                out[rows] = self._inside(chunk, chunk_lengths)[0].numpy()
        return out

    def masked_conditionals(self, word_ids, lengths=None, *, batch_size: int = 256) -> np.ndarray:
        """Exact ``Pr(x_t = w | x_-t)`` for every position ``t`` and word ``w``.

        Args:
            word_ids: ``(n, T)`` word indices padded with ``-1`` (or a list of sentences); entries equal to ``-2``
                are masked and marginalised, so a sentence with one ``-2`` at ``t`` gives the MLM's target
                distribution at ``t``, and the conditional at an observed position ignores that position's word.
            lengths: ``(n,)`` sentence lengths; inferred from the padding when omitted.
            batch_size: sentences per inside pass (memory grows as ``batch * rules * T^2``).

        Returns:
            ``(n, T, n_words)`` float64 array; rows of padding positions are zero.
        """
        ids, _ = self._as_batch(word_ids, lengths)
        out = np.zeros((len(ids), ids.shape[1], self.n_words))
        for rows, chunk, chunk_lengths in self._length_batches(word_ids, lengths, batch_size):
            # outside probabilities are gradients of the inside pass: needed even when called under no_grad
            with torch.enable_grad():
                z, indicator, _, _ = self._inside(chunk, chunk_lengths, track=True)
                if not torch.all(z > 0):
                    raise ValueError("some sentences have probability 0 under this grammar: they cannot come from it.")
                (joint,) = torch.autograd.grad(z.sum(), indicator)  # Pr(x_-t, x_t = w)
            total = joint.sum(-1, keepdim=True)
            cond = torch.where(total > 0, joint / total.clamp(min=1e-300), torch.zeros_like(joint))
            out[rows, : chunk.shape[1]] = cond.numpy()
        return out

    def span_label_posterior(self, word_ids, lengths=None, *, span_length: int, batch_size: int = 256) -> np.ndarray:
        """``Pr(a node labelled A spans the first span_length words | x)`` for every global nonterminal ``A``.

        This is the parse-based definition of tasks B and C: the label is well defined for a sentence when the
        posterior puts (almost) all its mass on one nonterminal.

        Returns:
            ``(n, sum(level_sizes))`` array; a row sums to the probability that the span is a constituent at all.
        """
        out = np.zeros((len(self._as_batch(word_ids, lengths)[0]), self.n_symbols))
        offsets = self.level_offsets
        for rows, chunk, chunk_lengths in self._length_batches(word_ids, lengths, batch_size, min_width=span_length):
            with torch.enable_grad():
                z, _, spans, _ = self._inside(chunk, chunk_lengths, track=True)
                z.sum().backward()
            for level, m in enumerate(spans):
                joint = (m * m.grad)[:, :, 0, span_length]
                if level == 0:
                    # a sentence type spans the first words only when it spans the whole sentence
                    joint = joint * (chunk_lengths == span_length)[:, None]
                post = joint / z[:, None]
                out[rows, offsets[level] : offsets[level] + self.level_sizes[level]] = post.detach().numpy()
        return out

    def sentence_type_likelihood(self, word_ids, lengths=None, *, batch_size: int = 256) -> np.ndarray:
        """``Pr(x | sentence type)`` of each sentence and type: ``(n, n_types)``, the root's prior left out."""
        out = np.zeros((len(self._as_batch(word_ids, lengths)[0]), self.n_sentence_types))
        for rows, chunk, chunk_lengths in self._length_batches(word_ids, lengths, batch_size):
            with torch.no_grad():
                out[rows] = self._inside(chunk, chunk_lengths)[3].numpy()
        return out

    def sentence_type_posterior(self, word_ids, lengths=None, *, batch_size: int = 256) -> np.ndarray:
        """``Pr(sentence type | x)``: the parse-based label of task A."""
        joint = self.sentence_type_likelihood(word_ids, lengths, batch_size=batch_size) * self.root_probs
        return joint / joint.sum(1, keepdims=True)

    def prefix_inside(self, word_ids, lengths=None, *, prefix_length: int, batch_size: int = 256) -> np.ndarray:
        """Inside probability of every nonterminal over the first ``prefix_length`` words alone: ``(n, n_symbols)``.

        No outside term: the rest of the sentence is ignored, as in the released code's ``inside_partial``. Columns
        are global nonterminal ids; a sentence shorter than ``prefix_length`` gets a row of zeros.
        """
        return self._inside_summaries(word_ids, lengths, (prefix_length,), batch_size)[1][0]

    def _inside_summaries(
        self, word_ids, lengths, prefix_lengths: Sequence[int], batch_size: int
    ) -> tuple[np.ndarray, list[np.ndarray]]:
        """``Pr(x | sentence type)`` and the prefix inside probabilities of each ``k``, from one inside pass."""
        if any(k < 1 for k in prefix_lengths):
            raise ValueError(f"prefix lengths must be >= 1, got {list(prefix_lengths)}.")
        n = len(self._as_batch(word_ids, lengths)[0])
        likelihood = np.zeros((n, self.n_sentence_types))
        prefixes = [np.zeros((n, self.n_symbols)) for _ in prefix_lengths]
        widest = max(prefix_lengths, default=0)
        for rows, chunk, chunk_lengths in self._length_batches(word_ids, lengths, batch_size, min_width=widest):
            with torch.no_grad():
                _, _, spans, chunk_likelihood = self._inside(chunk, chunk_lengths)
            likelihood[rows] = chunk_likelihood.numpy()
            for out, k in zip(prefixes, prefix_lengths, strict=True):
                out[rows] = torch.cat([m[:, :, 0, k] for m in spans], dim=1).numpy()
        return likelihood, prefixes

    def task_labels(
        self, word_ids, lengths=None, *, prefix_lengths: dict[str, int] | None = None, batch_size: int = 256
    ) -> dict[str, np.ndarray]:
        """The released code's downstream labels, from the sentence alone (not from the tree that generated it).

        * ``task_a``: the sentence type ``T`` maximising ``Pr(x | T)`` (no prior), the released ``inside``.
        * ``task_b`` / ``task_c``: the global nonterminal id with the largest inside probability over the first 4 / 2
          words alone, over all nonterminals; ``UNPARSABLE_LABEL`` (the first sentence type, ``S1`` in the released
          code) when no nonterminal derives those words. This is the released ``inside_partial``.

        Ties go to the lowest id, as ``max`` over the released code's ordered dictionary does.

        Args:
            word_ids, lengths: sentences as for [`masked_conditionals`] (no masked entries).
            prefix_lengths: ``{column: k}`` of the prefix tasks; default ``{"task_b": 4, "task_c": 2}``.
        """
        if prefix_lengths is None:
            prefix_lengths = {"task_b": 4, "task_c": 2}
        likelihood, prefixes = self._inside_summaries(word_ids, lengths, list(prefix_lengths.values()), batch_size)
        labels = {"task_a": likelihood.argmax(1)}
        for column, inside in zip(prefix_lengths, prefixes, strict=True):
            labels[column] = np.where(inside.max(1) > 0, inside.argmax(1), UNPARSABLE_LABEL)
        return labels

    def target_conditionals(self, word_ids, positions, lengths=None) -> np.ndarray:
        """``Pr(x_t = . | x_-t)`` at ``positions[i]`` of sentence ``i``: ``(n, n_words)``."""
        ids, lengths = self._as_batch(word_ids, lengths)
        rows = torch.arange(len(ids))
        return self.masked_conditionals(ids, lengths)[rows.numpy(), np.asarray(positions)]

    def entropy_bound(self, word_ids, positions, lengths=None, *, batch_size: int = 256) -> float:
        """Mean of ``-log Pr(x_t | x_-t)`` over the given (sentence, position) pairs, in nats.

        With one masked position per sentence this is the smallest expected MLM loss any model can reach on those
        contexts (it equals the conditional entropy in expectation): the saturation regime's floor.
        """
        ids, lengths = self._as_batch(word_ids, lengths)
        positions = np.asarray(positions)
        cond = self.masked_conditionals(ids, lengths, batch_size=batch_size)
        rows = np.arange(len(ids))
        p = cond[rows, positions, ids.numpy()[rows, positions]]
        return float(-np.log(p).mean())
