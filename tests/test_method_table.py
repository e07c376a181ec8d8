"""The one table of flatness methods (`hf_flatbias.sharpness.methods.table.METHOD_TABLE`): importable without torch,
every entry's class and options real, every refusal a one-line reason, and the config, engine checks, card and trl
trainers answering from it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

from hf_flatbias import FlatBiasConfig
from hf_flatbias.modelcard import METHOD_TITLES
from hf_flatbias.sharpness.methods import FlatnessMethod
from hf_flatbias.sharpness.methods.table import (
    DEEPSPEED_ENGINES,
    ENGINES,
    FAMILIES,
    FLATNESS_METHODS,
    METHOD_TABLE,
    SAM_STEP_OPTION_NAMES,
    TRL_TRAINERS,
    method_spec,
)
from hf_flatbias.sharpness.support import check_deepspeed_supports_method, check_fsdp_supports

REPO_ROOT = Path(__file__).resolve().parents[1]
SUPPORT_QUESTIONS = (*ENGINES, "torch_compile", *TRL_TRAINERS, "activation_offloading", "adapters")

# A fresh interpreter in which importing torch or transformers fails: the table and the modules that read it
# without torch (constants, the methods package) must still import.
_WITHOUT_TORCH = """
import importlib.abc, json, sys

class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "transformers", "accelerate"):
            raise ImportError(f"{name} is blocked in this test")
        return None

sys.meta_path.insert(0, Refuse())
from hf_flatbias.sharpness.methods.table import METHOD_TABLE
import hf_flatbias.constants, hf_flatbias.sharpness.methods
print(json.dumps({"methods": list(METHOD_TABLE), "titles": [spec.title for spec in METHOD_TABLE.values()]}))
"""


def test_the_table_imports_without_torch():
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    completed = subprocess.run(
        [sys.executable, "-c", _WITHOUT_TORCH], env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )
    assert completed.returncode == 0, completed.stderr
    listed = json.loads(completed.stdout)
    assert listed["methods"] == list(FLATNESS_METHODS)
    assert listed["titles"] == [METHOD_TITLES[name] for name in FLATNESS_METHODS]


def test_every_entry_names_a_method_class_and_config_fields_that_exist():
    config_fields = {f.name for f in fields(FlatBiasConfig)}
    for name, spec in METHOD_TABLE.items():
        assert spec.name == name and spec.family in FAMILIES, name
        method_class = spec.load_class()
        assert isinstance(method_class, type) and issubclass(method_class, FlatnessMethod), name
        assert set(spec.options) <= config_fields, (name, set(spec.options) - config_fields)
        assert set(spec.step_options) <= set(SAM_STEP_OPTION_NAMES), name
        # sam_kept_softmax_mib is FlatBiasDPOConfig's own option; every other step option is FlatBiasConfig's
        assert set(spec.step_options) - {"sam_kept_softmax_mib"} <= config_fields, name
        assert set(spec.engines) <= set(ENGINES) and set(spec.trl_trainers) <= set(TRL_TRAINERS), name
        assert "single_process" in spec.engines, f"{name}: every method runs on one process"


def test_the_classes_are_distinct_per_method_but_none():
    classes = [spec.load_class() for spec in METHOD_TABLE.values()]
    assert len(set(classes)) == len(classes), "one class per method: a class that asks its name back is a second table"


@pytest.mark.parametrize("name", FLATNESS_METHODS)
def test_every_refusal_is_one_line_with_a_fix(name):
    spec = METHOD_TABLE[name]
    for question in SUPPORT_QUESTIONS:
        reason = spec.refusal(question)  # an unsupported answer without a reason would raise KeyError here
        if reason is not None:
            assert "\n" not in reason and repr(name) in reason, (name, question)
            assert any(word in reason for word in ("Use", "use", "Set", "set")), (name, question, reason)
    assert set(spec.refusals) <= {*SUPPORT_QUESTIONS, "deepspeed", "optim"}, name
    assert bool(spec.optimizers) == ("optim" in spec.refusals), f"{name}: a method that limits optim says why"


def test_an_unknown_method_is_refused_with_the_choices(tmp_path):
    with pytest.raises(ValueError, match=r"^flatness_method='adam_sam' is not supported; choose one of \['none'"):
        method_spec("adam_sam")
    with pytest.raises(ValueError, match="choose one of"):
        FlatBiasConfig(str(tmp_path), flatness_method="adam_sam", report_to="none")


@pytest.mark.parametrize("name", FLATNESS_METHODS)
def test_the_engine_checks_answer_what_the_table_says(tmp_path, name):
    args = FlatBiasConfig(str(tmp_path), flatness_method=name, report_to="none", use_cpu=True)
    spec = METHOD_TABLE[name]
    for engine in DEEPSPEED_ENGINES:
        config = {"zero_optimization": {"stage": int(engine[-1])}}
        if engine in spec.engines:
            check_deepspeed_supports_method(config, args)
        else:
            with pytest.raises(ValueError) as refused:
                check_deepspeed_supports_method(config, args)
            assert str(refused.value) == spec.refusal(engine)
    if "fsdp2" in spec.engines:
        check_fsdp_supports(name, "global", fsdp_version=2)
    else:
        with pytest.raises(ValueError) as refused:
            check_fsdp_supports(name, "global", fsdp_version=2)
        assert str(refused.value) == spec.refusal("fsdp2")


def test_the_config_help_and_choices_list_every_method():
    flatness_method = FlatBiasConfig.__dataclass_fields__["flatness_method"]
    assert flatness_method.metadata["choices"] == list(FLATNESS_METHODS)
    for name, spec in METHOD_TABLE.items():
        assert f"'{name}': {spec.help}" in flatness_method.metadata["help"]
