"""docs/tutorial.md shows what `hf-flatbias demo` prints: its blocks are the committed run in docs/tutorial/demo_run/
(written by docs/tutorial/render.py), that run was made with the demo's current settings, its printed lines are its
demo.json, and the decimals the prose quotes are the run's (issue 58: the trace's default draws changed and the
tutorial kept the old run's digits, with nothing failing)."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

from hf_flatbias.cli import build_parser
from hf_flatbias.commands.demo import demo_settings, summary_text

REPO = Path(__file__).resolve().parents[1]
RUN = REPO / "docs" / "tutorial" / "demo_run"
TUTORIAL = REPO / "docs" / "tutorial.md"
RECORD_AGAIN = "record the run again and render the tutorial: see docs/tutorial/render.py's docstring"


def _render_module():
    spec = importlib.util.spec_from_file_location("tutorial_render", REPO / "docs" / "tutorial" / "render.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def render():
    return _render_module()


@pytest.fixture(scope="module")
def report():
    return json.loads((RUN / "demo.json").read_text())


def test_the_committed_run_was_made_with_the_demos_current_settings(report):
    current = demo_settings(build_parser().parse_args(["demo"]))
    assert json.loads(json.dumps(current)) == report["config"], f"the demo's settings changed: {RECORD_AGAIN}"


def test_a_changed_default_is_caught(report, monkeypatch):
    """The check above notices a default that is no flag, such as the trace's draws (what issue 58 found changed)."""
    from hf_flatbias.commands import demo

    monkeypatch.setattr(demo, "RECOMMENDED_N_DRAWS", demo.RECOMMENDED_N_DRAWS + 1)
    changed = demo_settings(build_parser().parse_args(["demo"]))
    assert json.loads(json.dumps(changed)) != report["config"]


def test_a_changed_estimator_default_is_caught(report, monkeypatch):
    """...and a default of the estimator the demo's callback leaves as it is: the output probe's change from sampled
    labels to random signs changed every trace digit of the tutorial (issue 58)."""
    import inspect

    from hf_flatbias.flatness import api

    original = api.estimate_hessian_trace
    signature = inspect.signature(original)
    parameters = [p.replace(default="label") if p.name == "output_probe" else p for p in signature.parameters.values()]

    def with_labels(*args, **kwargs):
        return original(*args, **kwargs)

    with_labels.__signature__ = signature.replace(parameters=parameters)
    monkeypatch.setattr(api, "estimate_hessian_trace", with_labels)
    changed = json.loads(json.dumps(demo_settings(build_parser().parse_args(["demo"]))))
    assert changed["estimator"]["output_probe"] == "label" != report["config"]["estimator"]["output_probe"]


def test_the_tutorials_blocks_are_the_committed_run(render):
    text = TUTORIAL.read_text()
    assert render.stale_blocks(text) == [], RECORD_AGAIN
    assert render.render(text) == text
    assert len(render.MARKER.findall(text)) == len(list(RUN.glob("*.txt"))) == 3


def test_the_committed_printout_is_the_committed_json(report):
    """demo.txt and demo.json are one run: every evaluation line and the closing summary follow from the JSON."""
    printed = (RUN / "demo.txt").read_text()
    for label, rows in report["histories"].items():
        for row in rows:
            line = (
                f"  {label} step {row['step']:>4}: loss {row['eval_loss']:.4f}, "
                f"trace {row['trace']:.1f} +- {row['trace_stderr']:.1f}\n"
            )
            assert printed.count(line) == 1, line
    assert summary_text(report["comparison"], report["config"]["steps"]) + "\n" in printed


def test_the_render_script_rewrites_a_stale_block(render):
    text = TUTORIAL.read_text()
    stale = text.replace(render.block("demo").splitlines()[2], "  adamw step  100: loss 3.2110, trace 134.4 +- 3.3")
    assert render.stale_blocks(stale) == ["demo"]
    assert render.render(stale) == text


# decimals in the prose of sections 1 and 2 that are not the run's, each with where it comes from
NOT_THE_RUN = {
    "0.1": "the models' size, 0.1M parameters",
    "3.3": "benchmarks/RESULTS.md's demo_time run, load average before",
    "4.4": "benchmarks/RESULTS.md's demo_time run, load average after",
}


def _numbers(value):
    if isinstance(value, bool):
        return
    if isinstance(value, int | float):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _numbers(item)
    elif isinstance(value, list):
        for item in value:
            yield from _numbers(item)


def test_every_decimal_the_prose_quotes_is_the_runs(report):
    text = TUTORIAL.read_text()
    prose = re.sub(r"^```.*?^```$", "", text[text.index("## 1.") : text.index("## 3.")], flags=re.M | re.S)
    printed = " ".join((RUN / name).read_text() for name in ("demo.txt", "select.txt", "compare.txt"))
    recorded = list(_numbers(report)) + list(_numbers(json.loads((RUN / "run.json").read_text())))
    quoted = re.findall(r"(?<![\w.])\d+\.\d+(?![\w.])", prose)
    assert quoted, "the prose quotes no decimal: the pattern is wrong"
    for number in quoted:
        digits = len(number.split(".")[1])
        found = re.search(rf"(?<![\d.]){re.escape(number)}(?!\d)", printed) or any(
            round(value, digits) == float(number) for value in recorded
        )
        assert found or number in NOT_THE_RUN, f"docs/tutorial.md quotes {number}, not in the committed run"
