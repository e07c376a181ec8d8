"""The package's modules import one another without a cycle: counting imports inside functions, which hide one until
it bites (``sharpness/engines.py`` <-> ``sharpness/fsdp_per_rank.py``), and the ``"module:name"`` strings of the
registries, which import as surely as an import statement does (``measures.py`` <-> ``flatness/beyond_trace.py``;
``constants.py`` re-exporting the method table, which names the methods' modules, which import ``constants.py``;
issue 58). Read from the source with ``ast``; nothing is imported."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import hf_flatbias

PACKAGE = Path(hf_flatbias.__file__).parent
REGISTRY_STRING = re.compile(r"(hf_flatbias(?:\.\w+)+)(?::\w+)?")


def module_files(root: Path = PACKAGE) -> dict[str, Path]:
    modules = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the modules it imports (at any depth of its code) or names in a registry string."""
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
                targets.update(
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names
                )
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                match = REGISTRY_STRING.fullmatch(node.value)
                if match:
                    targets.add(match.group(1))
        graph[name] = {target for target in targets if target in modules and target != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, without recursion)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            for successor in successors:
                if successor not in index:
                    index[successor] = low[successor] = len(index)
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(graph[successor]))))
                    break
                if successor in on_stack:
                    low[node] = min(low[node], index[successor])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(component)
    return found


def test_the_package_has_no_import_cycle():
    found = cycles(import_graph(module_files()))
    assert not found, f"import cycles (function-level imports and registry strings count): {found}"


def test_a_cycle_through_a_function_level_import_or_a_registry_string_is_found(tmp_path):
    package = tmp_path / "hf_flatbias"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "a.py").write_text("def f():\n    from .sub.b import g\n")
    (package / "sub" / "b.py").write_text("from .. import a\n")
    (package / "table.py").write_text('ENTRY = "hf_flatbias.sub.c:compute"\n')
    (package / "sub" / "c.py").write_text("from ..table import ENTRY\n")
    (package / "d.py").write_text("from .sub.c import ENTRY\n")  # imports into a cycle, is not in it
    found = cycles(import_graph(module_files(package)))
    assert sorted(map(sorted, found)) == [
        ["hf_flatbias.a", "hf_flatbias.sub.b"],
        ["hf_flatbias.sub.c", "hf_flatbias.table"],
    ]


def test_no_module_imports_a_private_name_of_another():
    """A name a module shares is public in that module (issue 58: ``spectrum._prepare``, ``config._is_number``, ...
    were imported elsewhere, so renaming them broke modules that looked unrelated)."""
    reaches = []
    for name, path in module_files().items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("hf_flatbias")):
                private = [alias.name for alias in node.names if alias.name.startswith("_") and alias.name[:2] != "__"]
                reaches += [f"{name}: {'.' * node.level}{node.module or ''}.{alias}" for alias in private]
    assert not reaches, reaches
