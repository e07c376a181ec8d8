"""The one way this package defers imports: a package's names load from their modules on first use.

`hf-flatbias --help` and a wrong GLUE task name are answered without importing torch and transformers (seconds);
only the command that runs pays for them, as in transformers' and trl's own packages.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any


def lazy_module_attributes(
    package: str, module_of_name: Mapping[str, str], submodules: Iterable[str] = ()
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of ``package``, which import each name from its module when first asked.

    Args:
        package: the package's ``__name__``.
        module_of_name: each public name and the module, relative to ``package``, that defines it.
        submodules: the package's modules reachable as attributes without being imported first.
    """
    submodules = frozenset(submodules)

    def __getattr__(name: str) -> Any:
        if name in submodules:
            return importlib.import_module(f".{name}", package)
        if name not in module_of_name:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module_of_name[name], package), name)
        setattr(sys.modules[package], name, value)  # later look-ups skip __getattr__
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(module_of_name) | submodules)

    return __getattr__, __dir__
