"""The README's Quick start and the trl guide's example run as written: their python blocks, executed in order in an
empty folder; every guide the README links to exists."""

import importlib.util
import re

import pytest

from hf_flatbias.constants import TRACE_METRIC
from tests.conftest import REPO


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)


def quick_start_blocks() -> list[str]:
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## Quick start") :]
    section = section[: section.index("\n## ", 1)]
    return python_blocks(section)


def test_the_quick_start_runs_as_written(tmp_path, monkeypatch, capsys):
    blocks = quick_start_blocks()
    assert len(blocks) == 2
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__quick_start__"}
    for block in blocks:
        exec(compile(block, "README.md (Quick start)", "exec"), namespace)
    trainer = namespace["trainer"]
    traces = [entry[TRACE_METRIC] for entry in trainer.state.log_history if TRACE_METRIC in entry]
    assert len(traces) >= 3  # a short run logs the trace (every_n_steps fits max_steps)
    logged = {key for entry in trainer.state.log_history for key in entry}
    assert {"loss", "sam/first_grad_norm", "sam/perturbation_norm"} <= logged  # what the snippet's comment promises
    assert (tmp_path / "bert-sam" / "README.md").is_file() and (tmp_path / "bert-sam" / "model.safetensors").is_file()
    assert re.search(r"Tr\(F\) = [\d.]+ ± [\d.]+", capsys.readouterr().out)  # per_sample: the Fisher trace
    estimate = namespace["estimate"]
    assert estimate.n_contexts == 500 and estimate.mean > 0


def test_every_page_the_readme_links_to_exists():
    readme = (REPO / "README.md").read_text()
    targets = {target.split("#")[0] for target in re.findall(r"\]\(([^)]+)\)", readme) if "://" not in target}
    assert {"docs/guides/training.md", "docs/guides/trl.md", "docs/guides/hub.md"} <= targets
    assert [target for target in sorted(targets) if not (REPO / target).exists()] == []


@pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="needs the trl extra")
def test_the_trl_guide_runs_as_written_on_a_cpu(tmp_path, monkeypatch):
    blocks = python_blocks((REPO / "docs" / "guides" / "trl.md").read_text())
    assert len(blocks) == 1
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__trl_guide__"}
    exec(compile(blocks[0], "docs/guides/trl.md", "exec"), namespace)
    trainer = namespace["trainer"]
    assert trainer.state.global_step == trainer.args.max_steps
    logged = {key for entry in trainer.state.log_history for key in entry}
    assert {"loss", "sam/perturbed_loss", TRACE_METRIC} <= logged  # SAM inside trl, and the trace measured at the end
    assert (tmp_path / "llama-sft-sam" / "README.md").is_file()
    from hf_flatbias import load_flatness_card

    card = load_flatness_card(tmp_path / "llama-sft-sam")  # named as the guide says: SFT on completions, not MLM
    assert (card.objective, card.trace_objective) == ("sft_completion_only", "next_token_trained")


def test_no_guide_signals_processes_by_a_command_line_pattern():
    """``pkill -STOP -f NAME`` stops every process whose command line matches, the user's own included: the docs
    signal the PIDs a run wrote (issue 58)."""
    pattern = re.compile(r"\b(pkill|killall)\b|\bkill\b[^\n]*\$\(pgrep")
    offending = [
        f"{page.relative_to(REPO)}:{number}"
        for page in sorted([REPO / "README.md", *(REPO / "docs").rglob("*.md")])
        for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), start=1)
        if pattern.search(line)
    ]
    assert not offending, offending
