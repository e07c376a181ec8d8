"""The flatness methods, one module each, and the one table that names them (`table.METHOD_TABLE`).

A method is a `FlatnessMethod` subclass: its ``training_step`` runs one micro-batch's passes, and its
``state_dict``/``load_state_dict`` carry what it remembers between updates through checkpoints. It takes its numbers
from `hf_flatbias.sharpness` and `hf_flatbias.tensors` and reaches the trainer only through `FlatnessHost`, so the
same class runs inside `Trainer` and trl's trainers alike.

A new method is a module here plus one `MethodSpec` entry in `table.METHOD_TABLE` (its name, title, options, what it
supports and its class as ``"module:Class"``). Importing this package does not import torch: the table is read by
the config and by model cards, and the classes are imported when a trainer asks for them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .table import METHOD_TABLE, MethodSpec, method_spec

if TYPE_CHECKING:
    from .base import FlatnessHost, FlatnessMethod, NoFlatnessMethod

_FROM_BASE = ("FlatnessHost", "FlatnessMethod", "NoFlatnessMethod")


def __getattr__(name: str) -> Any:
    # the classes import torch: only on first use, so that the table stays importable without it
    if name in _FROM_BASE:
        return getattr(importlib.import_module(".base", __name__), name)
    if name == "FLATNESS_METHOD_CLASSES":
        return {method: spec.load_class() for method, spec in METHOD_TABLE.items()}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "FLATNESS_METHOD_CLASSES",
    "METHOD_TABLE",
    "FlatnessHost",
    "FlatnessMethod",
    "MethodSpec",
    "NoFlatnessMethod",
    "method_spec",
]
