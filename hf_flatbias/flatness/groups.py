"""Where the trace sits: the measured parameters split into groups whose traces add up to the whole.

The squared norm of a gradient is the sum of the squared norms of its parts over disjoint parameter sets, so the
trace splits exactly into per-group traces (the diagonal blocks of the Fisher). The default groups of a transformer
LM follow its forward: ``embeddings`` (everything of the base model before its blocks), ``block.0``, ``block.1``, ...
(the repeated layers), ``final_norm`` (the base model's parameters after the blocks), ``head`` (the LM head's own
layers, e.g. BERT's transform) and ``output_layer``: the decoder's own term, the squared norm of the gradient the
decoder to the vocabulary receives from its own use. With tied input and output embeddings the shared matrix's
trace is that own term plus the embedding lookup's term and their cross term; the latter two stay in
``embeddings``. The output-layer term grows as the model grows confident, whatever happens to the layers below it,
which is why it is reported apart.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torch import nn

from .lm import check_lm_model

EMBEDDINGS_GROUP = "embeddings"
FINAL_NORM_GROUP = "final_norm"
HEAD_GROUP = "head"
OUTPUT_LAYER_GROUP = "output_layer"

GroupOf = Callable[[str], str]
"""A grouping rule: parameter name (as in ``model.named_parameters()``) to group name."""


@dataclass(frozen=True)
class ParameterGroups:
    """The groups a trace is split into: ``names`` in report order, the group index of each measured parameter
    (by identity) and the index of the output-layer term, where the decoder's own term goes."""

    names: tuple[str, ...]
    index_of: dict[int, int]
    output_layer: int

    def __len__(self) -> int:
        return len(self.names)


def _block_list(base: nn.Module) -> tuple[str, nn.ModuleList] | None:
    """The base model's repeated layers: the outermost `nn.ModuleList` holding the most parameters."""
    best = None
    for name, module in base.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0:
            size = sum(int(getattr(p, "ds_numel", p.numel())) for p in module.parameters())  # ZeRO-3: 0 locally
            if size > 0 and (best is None or size > best[0]):
                best = (size, name, module)
    return None if best is None else (best[1], best[2])


def default_group_of(model: nn.Module) -> GroupOf:
    """The default rule for a transformer LM (see the module docstring), as a function of the parameter name."""
    base = getattr(model, "base_model", model)
    base_prefix = next((name for name, module in model.named_modules() if module is base), "")
    found = _block_list(base)
    block_prefix = "" if found is None else ".".join(filter(None, [base_prefix, found[0]])) + "."
    seen_block = False
    groups: dict[str, str] = {}
    for name, _ in model.named_parameters():
        if block_prefix and name.startswith(block_prefix):
            seen_block = True
            groups[name] = f"block.{name[len(block_prefix) :].split('.', 1)[0]}"
        elif base_prefix and not name.startswith(base_prefix + "."):
            groups[name] = HEAD_GROUP
        else:
            groups[name] = FINAL_NORM_GROUP if seen_block else EMBEDDINGS_GROUP
    return lambda name: groups.get(name, HEAD_GROUP)


def parameter_groups(
    model: nn.Module, params: Sequence[nn.Parameter], group_of: GroupOf | None = None
) -> ParameterGroups:
    """Group every parameter of ``params`` by name with ``group_of`` (`default_group_of` by default).

    The decoder's weight and bias join the output-layer group, except a weight tied to another use (the input
    embedding), which stays in its own group and gives the output-layer group only the decoder's own term.
    """
    rule = default_group_of(model) if group_of is None else group_of
    decoder = check_lm_model(model)
    wanted = {id(p) for p in params}
    get_input = getattr(model, "get_input_embeddings", None)
    input_embeddings = get_input() if callable(get_input) else None
    shared = {id(p) for p in input_embeddings.parameters()} if input_embeddings is not None else set()
    own_decoder = {id(p) for p in decoder.parameters(recurse=False) if id(p) not in shared}
    names: list[str] = []
    index_of: dict[int, int] = {}
    for name, param in model.named_parameters():
        if id(param) not in wanted:
            continue
        group = OUTPUT_LAYER_GROUP if id(param) in own_decoder else rule(name)
        if not isinstance(group, str) or not group:
            raise ValueError(f"The grouping rule gave {group!r} for '{name}'; it must return a non-empty group name.")
        if group not in names:
            names.append(group)
        index_of[id(param)] = names.index(group)
    if OUTPUT_LAYER_GROUP not in names:
        names.append(OUTPUT_LAYER_GROUP)
    # the output-layer term last, the forward's order otherwise
    ordered = [n for n in names if n != OUTPUT_LAYER_GROUP] + [OUTPUT_LAYER_GROUP]
    position = {n: ordered.index(n) for n in names}
    return ParameterGroups(
        names=tuple(ordered),
        index_of={key: position[names[i]] for key, i in index_of.items()},
        output_layer=len(ordered) - 1,
    )
