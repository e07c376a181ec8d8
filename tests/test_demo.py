"""`hf-flatbias demo`, the README's first command: two runs side by side, compared at matched loss."""

import contextlib
import importlib.util
import io
import json
import math
import random

import numpy as np
import pytest
import torch
import yaml
from transformers.utils import logging as transformers_logging

from hf_flatbias.cli import main
from hf_flatbias.commands.demo import compare_at_matched_loss

SMALL = ["--steps", "20", "--eval-every", "10", "--n-train", "400", "--n-contexts", "32", "--n-probe", "60"]


@contextlib.contextmanager
def numpy_and_python_random_state():
    numpy_state, python_state = np.random.get_state(), random.getstate()
    try:
        yield
    finally:
        np.random.set_state(numpy_state)
        random.setstate(python_state)


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo") / "out"
    printed = io.StringIO()
    # training seeds the global random streams: later tests must not depend on whether the demo ran before them
    with contextlib.redirect_stdout(printed), torch.random.fork_rng(), numpy_and_python_random_state():
        assert main(["demo", "--output-dir", str(out), *SMALL]) == 0
    return out, printed.getvalue()


def test_both_runs_leave_checkpoints_cards_and_the_comparison(demo):
    out, printed = demo
    report = json.loads((out / "demo.json").read_text())
    histories, comparison = report["histories"], report["comparison"]
    assert set(histories) == {"adamw", "sam"}
    for label, method in (("adamw", "none"), ("sam", "sam")):
        steps = [row["step"] for row in histories[label]]
        assert steps == [10, 20]
        for step in steps:
            assert (out / label / f"checkpoint-{step}" / "trainer_state.json").is_file()
        flatness = yaml.safe_load((out / label / "README.md").read_text().split("---")[1])["flatness"]
        assert flatness["method"] == method and math.isfinite(flatness["hessian_trace"])
        assert flatness["hessian_trace"] == pytest.approx(histories[label][-1]["trace"])
        row = comparison["checkpoints"][label]
        assert row in [{**h, **{k: row[k] for k in ("probe_accuracy", "probe_stderr")}} for h in histories[label]]
        assert 0 < row["probe_accuracy"] <= 1 and row["probe_stderr"] > 0
    assert (out / "demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "At matched validation loss" in printed and "What it does not show" in printed
    assert "{'loss'" not in printed  # the Trainer's raw log dictionaries are replaced by one line per evaluation
    for label, rows in histories.items():  # one line per evaluation, with that step's own loss and trace
        for row in rows:
            line = f"{label} step {row['step']:>4}: loss {row['eval_loss']:.4f}, trace {row['trace']:.1f}"
            assert printed.count(line) == 1, line


def test_demo_leaves_transformers_progress_bars_as_they_were(demo):
    assert transformers_logging.is_progress_bar_enabled()


def test_tensorboard_logs_are_written_when_tensorboard_is_installed_and_the_demo_says_which(demo):
    out, printed = demo
    events = [list((out / label).rglob("events.out.tfevents.*")) for label in ("adamw", "sam")]
    if importlib.util.find_spec("tensorboard") is None:  # the README's plain install
        assert events == [[], []] and "TensorBoard logs: none written (tensorboard is not installed" in printed
    else:
        assert all(events) and f"TensorBoard logs: tensorboard --logdir {out}" in printed


def test_select_works_on_each_run(demo, capsys):
    out, _ = demo
    assert main(["select", str(out / "sam"), "--json"]) == 0
    selection = json.loads(capsys.readouterr().out)
    assert selection["chosen"]["step"] in (10, 20)


def test_matched_loss_is_the_lowest_loss_both_runs_reached():
    histories = {
        "fast": [{"step": 10, "eval_loss": 3.0}, {"step": 20, "eval_loss": 2.5}, {"step": 30, "eval_loss": 2.0}],
        "slow": [{"step": 10, "eval_loss": 3.2}, {"step": 20, "eval_loss": 2.9}, {"step": 30, "eval_loss": 2.6}],
    }
    comparison = compare_at_matched_loss(histories)
    assert comparison["target_loss"] == 2.6
    assert comparison["checkpoints"]["fast"]["step"] == 20 and comparison["checkpoints"]["slow"]["step"] == 30


@pytest.mark.parametrize("flag", ["--steps", "--eval-every", "--n-probe"])
def test_demo_rejects_a_non_positive_size(tmp_path, flag, capsys):
    assert main(["demo", "--output-dir", str(tmp_path), flag, "0"]) == 2
    assert capsys.readouterr().err == f"hf-flatbias demo: error: {flag} must be >= 1 (got 0).\n"


def test_demo_refuses_to_mix_with_an_earlier_run(demo, capsys):
    out, _ = demo
    before = sorted(path.name for path in (out / "sam").iterdir())
    assert main(["demo", "--output-dir", str(out), *SMALL]) == 2
    assert "already holds a demo run" in capsys.readouterr().err
    assert sorted(path.name for path in (out / "sam").iterdir()) == before
