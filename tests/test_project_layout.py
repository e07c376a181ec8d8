"""The house's layout (issue 58): setup.cfg holds the package's metadata and pyproject.toml the build system and the
tools' settings, with no setting in both; tests reach recipes/ through pytest's `pythonpath`, never by editing
sys.path; the `smoke` and `research` markers; the research checkpoints within the size budget of the research guide."""

from __future__ import annotations

import ast
import configparser
import importlib.metadata
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import SMOKE, is_research_test
from packaging.requirements import Requirement

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pytest's own TOML reader
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
SETUP_CFG = configparser.ConfigParser()
SETUP_CFG.read(REPO / "setup.cfg")


def _lines(value: str, *, commas: bool = False) -> list[str]:
    """A setup.cfg list: one item a line (and, with ``commas``, comma-separated within a line)."""
    items = [item for line in value.splitlines() for item in (line.split(",") if commas else [line])]
    return [item.strip() for item in items if item.strip()]


# -- setup.cfg and pyproject.toml ------------------------------------------------------------------------------------


def test_setup_cfg_holds_the_metadata_and_pyproject_the_build_system_and_tools():
    assert set(PYPROJECT) == {"build-system", "tool"}, "the package metadata belongs in setup.cfg, not [project]"
    assert "setuptools" not in PYPROJECT["tool"], "setuptools' package settings belong in setup.cfg's [options]"
    assert set(PYPROJECT["tool"]) == {"ruff", "pytest"}
    assert set(SETUP_CFG.sections()) == {
        "metadata",
        "options",
        "options.packages.find",
        "options.package_data",
        "options.extras_require",
        "options.entry_points",
    }, "setup.cfg holds setuptools' declarative metadata only (the tools' settings are in pyproject.toml)"


def test_the_installed_metadata_is_setup_cfgs():
    """What `pip install -e .` recorded is what setup.cfg says (a stale install or another file's metadata fails)."""
    metadata, options = SETUP_CFG["metadata"], SETUP_CFG["options"]
    installed = importlib.metadata.metadata(metadata["name"])
    assert installed["Name"] == metadata["name"] and installed["Version"] == metadata["version"]
    assert installed["Summary"] == metadata["description"]
    assert installed["Requires-Python"] == options["python_requires"]
    extras = SETUP_CFG["options.extras_require"]
    expected = [_marker_free(requirement) for requirement in _lines(options["install_requires"])]
    expected += [f'{_marker_free(req)}; extra == "{extra}"' for extra in extras for req in _lines(extras[extra])]
    installed_requirements = importlib.metadata.requires(metadata["name"])
    assert sorted(map(_normalised, installed_requirements)) == sorted(map(_normalised, expected))
    assert sorted(installed.get_all("Provides-Extra")) == sorted(extras) and "test" in extras
    scripts = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="console_scripts")}
    name, target = (part.strip() for part in _lines(SETUP_CFG["options.entry_points"]["console_scripts"])[0].split("="))
    assert scripts[name] == target


def _marker_free(requirement: str) -> str:
    return requirement.split(";")[0].strip()


def _normalised(requirement: str) -> str:
    """One spelling per requirement (`<6,>=5.0` and `>=5.0,<6` are one)."""
    return str(Requirement(requirement))


def test_the_package_data_and_the_installed_files_agree():
    data = _lines(SETUP_CFG["options.package_data"]["hf_flatbias"], commas=True)
    for pattern in data:
        assert list((REPO / "hf_flatbias").glob(pattern)), f"setup.cfg's package_data {pattern} matches no file"


# -- how the tests find recipes/ ------------------------------------------------------------------------------------


def test_no_test_edits_sys_path():
    edits = re.compile(r"sys\.path\s*(\.\s*(insert|append|extend|remove)\s*\(|\[.*\]\s*=|\s*[+]?=)")
    offenders = [
        f"{path.relative_to(REPO)}:{number}"
        for path in sorted((REPO / "tests").rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if edits.search(line) and path.name != Path(__file__).name
    ]
    assert offenders == [], "use pytest's `pythonpath` setting in pyproject.toml (or PYTHONPATH for a subprocess)"


def test_the_research_code_imports_through_pytests_pythonpath():
    assert "recipes" in PYPROJECT["tool"]["pytest"]["ini_options"]["pythonpath"]
    import research

    assert Path(research.__file__).resolve().parent == REPO / "recipes" / "research"


# -- markers ---------------------------------------------------------------------------------------------------------


def test_smoke_and_research_are_registered_markers():
    registered = {line.split(":")[0] for line in PYPROJECT["tool"]["pytest"]["ini_options"]["markers"]}
    assert {"slow", "smoke", "research"} <= registered
    assert PYPROJECT["tool"]["pytest"]["ini_options"]["addopts"].startswith("-m 'not slow'")  # the README's default


def test_every_smoke_test_exists():
    for node in SMOKE:
        module, _, name = node.partition("::")
        path = REPO / "tests" / module
        assert path.is_file(), f"conftest.py's SMOKE names {node}, whose file is gone"
        functions = {item.name for item in ast.parse(path.read_text()).body if isinstance(item, ast.FunctionDef)}
        assert name.split("[")[0] in functions, f"conftest.py's SMOKE names {node}, which is gone"
    assert len({node.split("::")[0] for node in SMOKE}) >= 30, "one check per area"


def test_the_readmes_test_paragraph_is_one_dated_measurement_of_the_current_smoke_list():
    readme = (REPO / "README.md").read_text()
    paragraph = readme[readme.index("Run the tests:") : readme.index("## Quick start")]
    assert len(set(re.findall(r"\b20\d\d-\d\d-\d\d\b", paragraph))) == 1, "one measurement, one date"
    assert f"`pytest -m smoke` ran its {len(SMOKE)} tests" in " ".join(paragraph.split()), "the smoke list changed"


def test_the_marking_hook_passes_over_items_outside_tests(tmp_path):
    """A file run by path from elsewhere (or a doctest) is neither smoke nor research, and does not break collection."""
    from conftest import pytest_collection_modifyitems

    class Item:
        path, name, markers = tmp_path / "test_elsewhere.py", "test_x", []

        def add_marker(self, marker):
            self.markers.append(marker)

    Item.path.write_text("from research import units\n")
    item = Item()
    pytest_collection_modifyitems(None, [item])
    assert item.markers == []


def test_research_tests_are_found_by_what_they_import():
    tests = REPO / "tests"
    assert is_research_test(tests / "test_ruler_gate.py")  # imports research.ruler
    assert is_research_test(tests / "test_recipes_protocol_gpu_v1.py")  # runs a campaign's script
    assert not is_research_test(tests / "test_glue.py")
    assert not is_research_test(tests / "test_recipe_glue_compare.py")  # a product recipe, not the campaign's


# -- the research checkpoints' size budget ---------------------------------------------------------------------------

CHECKPOINT = re.compile(r"\.(safetensors|bin|pt|pth)$")
GUIDE = REPO / "docs" / "guides" / "reproduction.md"


def _budget() -> dict[str, int]:
    """The caps of the research guide's budget table, in MB, by its first column."""
    section = GUIDE.read_text().split("## What a campaign commits: the size budget", 1)[1]
    rows = re.findall(r"^\| (.+?) \| .+? \| (\d+) \|$", section, re.M)
    return {folder[1:-1] if re.fullmatch(r"`[^`]+`", folder) else folder: int(cap) for folder, cap in rows}


def _tracked_checkpoints() -> dict[str, int]:
    """Tracked checkpoint files under recipes/research with their sizes in bytes, from git's index."""
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    listed = subprocess.run(
        ["git", "ls-files", "-s", "--", "recipes/research"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout
    blobs = {line.split("\t", 1)[1]: line.split()[1] for line in listed.splitlines() if CHECKPOINT.search(line)}
    sizes = subprocess.run(
        ["git", "cat-file", "--batch-check=%(objectsize)"],
        cwd=REPO,
        input="".join(f"{blob}\n" for blob in blobs.values()),
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return dict(zip(blobs, map(int, sizes), strict=True))


def test_the_research_checkpoints_stay_within_the_guides_budget():
    budget, files = _budget(), _tracked_checkpoints()
    assert files, "no tracked research checkpoint found: the pattern or the folder is wrong"
    total = sum(files.values())
    assert total <= budget["all of `recipes/research` together"] * 10**6, f"{total / 1e6:.1f} MB over the total cap"
    results = "recipes/research/results/"
    by_folder: dict[str, int] = {}
    for path, size in files.items():
        folder = results + path[len(results) :].split("/")[0] if path.startswith(results) else path
        by_folder[folder] = by_folder.get(folder, 0) + size
    for folder, size in by_folder.items():
        cap = budget.get(folder, budget["any other folder under `recipes/research/results`"])
        assert size <= cap * 10**6, f"{folder} commits {size / 1e6:.1f} MB of checkpoints, over its {cap} MB cap"


def test_the_budget_table_is_read_as_written():
    assert _budget() == {
        "recipes/research/results/campaign_v2": 58,
        "recipes/research/results/saturated_start": 19,
        "any other folder under `recipes/research/results`": 10,
        "all of `recipes/research` together": 86,
    }
