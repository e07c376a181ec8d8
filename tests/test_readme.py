"""The README's Quick start runs as written: its python blocks, executed in order in an empty folder."""

import re

from hf_flatbias.constants import TRACE_METRIC
from tests.conftest import REPO


def quick_start_blocks() -> list[str]:
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## Quick start") :]
    section = section[: section.index("\n## ", 1)]
    return re.findall(r"```python\n(.*?)```", section, flags=re.DOTALL)


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
