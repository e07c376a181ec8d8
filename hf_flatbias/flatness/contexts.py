"""Contexts for the Hessian-trace estimators: one predicted position per context, chosen with a seeded generator.

The paper (Liu et al., 2023, App. B.1) measures the trace on masked-LM contexts ``x_-t``: a sequence with one
position ``t`` replaced by the mask token, the model predicting that position. For causal LMs nothing is masked:
the prefix before ``t`` is the context. Both kinds come out in the same row format, ``input_ids``,
``attention_mask`` and ``labels`` with -100 everywhere except the one predicted position (for causal LMs the labels
follow transformers' convention: ``labels[t]`` is the token predicted from the positions before ``t``), plus
``token_type_ids`` when the tokenized rows have them.

`build_masked_contexts` writes such rows; `TraceContexts.from_rows` reads them back into what the estimators run on.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..constants import IGNORE_INDEX
from .lm import check_lm_model, is_causal_lm, model_device


def context_generator(seed: int, index: int) -> torch.Generator:
    """A CPU generator that depends only on ``(seed, index)``, so context ``index`` draws the same numbers whichever
    batch or process computes it."""
    generator = torch.Generator()
    generator.manual_seed((seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9 + 1) % (2**63 - 1))
    return generator


def _as_list(values: Any) -> list[int]:
    if isinstance(values, torch.Tensor):
        return values.reshape(-1).tolist()
    return [int(v) for v in values]


def build_masked_contexts(
    rows: Iterable[Mapping[str, Any]],
    *,
    mask_token_id: int | None,
    causal: bool = False,
    n_contexts: int | None = None,
    seed: int = 0,
    special_token_ids: Sequence[int] = (),
    keep_columns: Sequence[str] = (),
    positions_per_sequence: int = 1,
) -> list[dict[str, list[int]]]:
    """Turn tokenized rows into trace contexts with exactly one labelled position each (``positions_per_sequence``
    of them for causal LMs that ask for more).

    Args:
        rows: mappings with ``input_ids`` and optionally ``attention_mask``, ``token_type_ids`` and
            ``completion_mask`` (trl's column: 1 on the tokens a fine-tuning loss trains; only those positions are
            then predicted). Other keys are ignored; existing ``labels`` are replaced. A list or a `datasets.Dataset`.
        mask_token_id: the tokenizer's mask id; required for masked LMs, unused for causal LMs.
        causal: build causal-LM contexts (no masking; the labelled position is predicted from its prefix, so
            position 0 is never chosen).
        n_contexts: how many contexts; context ``i`` uses row ``i % len(rows)``, so asking for more contexts than
            rows reuses rows with other positions. Default: one per row.
        seed: contexts depend only on ``(seed, i)``.
        special_token_ids: tokens never chosen as the predicted position (e.g. ``[CLS]``, ``[SEP]``, padding).
        keep_columns: columns of the rows copied as they are into each context (a measure that groups contexts, such
            as gradient alignment's source column); a row without one of them is refused.
        positions_per_sequence: causal LMs only: label this many distinct positions of each row, drawn without
            replacement, for ``estimate_hessian_trace(..., positions_per_sequence=...)`` to read in one backward.

    Returns:
        A list of rows ``{"input_ids", "attention_mask", "labels"}`` (lists of ints), with the row's
        ``token_type_ids`` too when it has them (BERT's segment ids; the model must see them as it was trained).

    Raises:
        ValueError: no rows, a masked LM without a mask id, or a row without any position that can be predicted.
    """
    rows = list(rows)
    if not rows:
        raise ValueError("build_masked_contexts got no rows: pass a non-empty list or datasets.Dataset.")
    if not causal and mask_token_id is None:
        raise ValueError(
            "Masked-LM contexts need mask_token_id (e.g. tokenizer.mask_token_id); pass causal=True for causal LMs."
        )
    if n_contexts is None:
        n_contexts = len(rows)
    if n_contexts < 1:
        raise ValueError(f"n_contexts must be >= 1 (got {n_contexts}).")
    check_positions_per_sequence(positions_per_sequence, causal=causal)
    excluded = {int(t) for t in special_token_ids}
    first_allowed = 1 if causal else 0
    contexts = []
    for index in range(n_contexts):
        row = rows[index % len(rows)]
        if "input_ids" not in row:
            raise ValueError(f"Row {index % len(rows)} has no 'input_ids'; tokenize the data first.")
        input_ids = _as_list(row["input_ids"])
        attention_mask = _as_list(row["attention_mask"]) if "attention_mask" in row else [1] * len(input_ids)
        predictable = _as_list(row["completion_mask"]) if "completion_mask" in row else attention_mask
        candidates = [
            t
            for t in range(first_allowed, len(input_ids))
            if attention_mask[t] and predictable[t] and input_ids[t] not in excluded
        ]
        if not candidates:
            raise ValueError(
                f"Row {index % len(rows)} has no position that can be predicted (all padding, special tokens or "
                f"outside its completion_mask{', or a single token for a causal LM' if causal else ''}); drop such "
                "rows first."
            )
        if len(candidates) < positions_per_sequence:
            raise ValueError(
                f"Row {index % len(rows)} has {len(candidates)} positions that can be predicted, fewer than "
                f"positions_per_sequence={positions_per_sequence}: lower positions_per_sequence or drop short rows."
            )
        generator = context_generator(seed, index)
        if positions_per_sequence == 1:  # the one-position draw as it always was: the same contexts for a seed
            chosen = [candidates[int(torch.randint(len(candidates), (1,), generator=generator))]]
        else:
            chosen = sorted(
                candidates[c]
                for c in torch.randperm(len(candidates), generator=generator)[:positions_per_sequence].tolist()
            )
        labels = [IGNORE_INDEX] * len(input_ids)
        for position in chosen:
            labels[position] = input_ids[position]
        position = chosen[0]
        masked = list(input_ids)
        if not causal:
            masked[position] = int(mask_token_id)
        context = {"input_ids": masked, "attention_mask": list(attention_mask), "labels": labels}
        if "token_type_ids" in row:
            context["token_type_ids"] = _as_list(row["token_type_ids"])
        for column in keep_columns:
            if column not in row:
                raise ValueError(f"Row {index % len(rows)} has no {column!r} column; give every row one.")
            context[column] = row[column]
        contexts.append(context)
    return contexts


def check_positions_per_sequence(positions_per_sequence: object, *, causal: bool) -> None:
    """`ValueError` naming the fix for a ``positions_per_sequence`` that is not a positive integer, or above 1 for a
    masked LM (whose one-mask contexts are different inputs: they share no forward)."""
    if isinstance(positions_per_sequence, bool) or not isinstance(positions_per_sequence, int):
        raise ValueError(f"positions_per_sequence must be an integer >= 1 (got {positions_per_sequence!r}).")
    if positions_per_sequence < 1:
        raise ValueError(f"positions_per_sequence must be >= 1 (got {positions_per_sequence}).")
    if positions_per_sequence > 1 and not causal:
        raise ValueError(
            f"positions_per_sequence={positions_per_sequence} needs a causal LM: a masked LM's contexts each mask "
            "their own position, so they share no forward. Use positions_per_sequence=1 for masked LMs."
        )


@dataclass
class TraceContexts:
    """Contexts ready for the estimators: one predicted position each.

    ``input_ids[i]`` is trimmed to what the model must see (for causal LMs the prefix before the predicted token),
    ``positions[i]`` is where the logits are read, ``targets[i]`` the data token there, ``rows[i]`` the row it came
    from (a causal LM's contexts of one row are prefixes of the longest: one forward can read them all).
    """

    input_ids: list[torch.Tensor]
    attention_mask: list[torch.Tensor]
    token_type_ids: list[torch.Tensor] | None
    positions: list[int]
    targets: list[int]
    causal: bool
    rows: list[int] | None = None

    def __len__(self) -> int:
        return len(self.positions)

    @classmethod
    def from_rows(cls, rows: Iterable[Mapping[str, Any]], *, causal: bool) -> TraceContexts:
        """Each labelled position (``labels != -100``) of each row becomes one context.

        Raises:
            ValueError: a row without ``input_ids``/``labels`` or without any labelled position.
        """
        input_ids, attention_mask, token_type_ids, positions, targets, row_of = [], [], [], [], [], []
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
                row_of.append(row_index)
        if not positions:
            raise ValueError("No contexts: the dataset is empty.")
        types = token_type_ids if has_token_types else None
        return cls(input_ids, attention_mask, types, positions, targets, causal, rows=row_of)

    def model_inputs(self, indices: Sequence[int], model: nn.Module) -> dict[str, torch.Tensor]:
        """Right-padded tensors for the contexts ``indices``; padding is masked out, so its value does not matter."""
        pad_id = getattr(getattr(model, "config", None), "pad_token_id", None) or 0
        length = max(len(self.input_ids[i]) for i in indices)
        device = model_device(model)
        input_ids = torch.full((len(indices), length), pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(indices), length), dtype=torch.long)
        token_type_ids = torch.zeros((len(indices), length), dtype=torch.long) if self.token_type_ids else None
        for row, i in enumerate(indices):
            n = len(self.input_ids[i])
            input_ids[row, :n] = self.input_ids[i]
            attention_mask[row, :n] = self.attention_mask[i]
            if token_type_ids is not None:
                token_type_ids[row, :n] = self.token_type_ids[i]
        batch = {"input_ids": input_ids.to(device), "attention_mask": attention_mask.to(device)}
        if token_type_ids is not None:
            batch["token_type_ids"] = token_type_ids.to(device)
        return batch


def sequence_units(contexts: TraceContexts, indices: Sequence[int], positions_per_sequence: int) -> list[list[int]]:
    """The contexts ``indices`` grouped into sampling units of at most ``positions_per_sequence`` consecutive
    contexts of one row, each unit measured with one forward and one backward per draw; one context per unit at 1.

    Raises:
        ValueError: more than one position per unit on masked-LM contexts, or more positions asked for than any
            row labels.
    """
    check_positions_per_sequence(positions_per_sequence, causal=contexts.causal)
    if positions_per_sequence == 1:
        return [[i] for i in indices]
    rows = contexts.rows if contexts.rows is not None else list(range(len(contexts)))
    units: list[list[int]] = []
    for i in indices:
        if units and len(units[-1]) < positions_per_sequence and rows[units[-1][-1]] == rows[i]:
            units[-1].append(i)
        else:
            units.append([i])
    longest = max(len(unit) for unit in units)
    if longest < positions_per_sequence:
        raise ValueError(
            f"positions_per_sequence={positions_per_sequence} but the rows label at most {longest} positions each: "
            f"build rows with build_masked_contexts(..., causal=True, positions_per_sequence={positions_per_sequence})"
            " or lower positions_per_sequence."
        )
    return units


def prepare_contexts(
    model: nn.Module, dataset: Iterable[Mapping[str, Any]], n_contexts: int | None, causal: bool | None
) -> tuple[TraceContexts, int]:
    """The rows' contexts (causal as the model is, unless ``causal`` says) and how many to use, as every measure
    reads them; `ValueError` on a model without an LM head or a bad ``n_contexts``."""
    check_lm_model(model)
    contexts = TraceContexts.from_rows(dataset, causal=is_causal_lm(model) if causal is None else causal)
    if n_contexts is None:
        return contexts, len(contexts)
    if isinstance(n_contexts, bool) or not isinstance(n_contexts, int) or not 1 <= n_contexts <= len(contexts):
        raise ValueError(f"n_contexts={n_contexts!r} but the data holds {len(contexts)} contexts (labelled positions).")
    return contexts, n_contexts
