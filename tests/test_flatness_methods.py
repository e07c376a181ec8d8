"""The table of flatness methods: one class per method name, the trainer as the host every method is written
against, and each method's checkpointed state."""

from __future__ import annotations

import typing

import pytest
import torch

from hf_flatbias import FlatBiasTrainer
from hf_flatbias.sharpness.methods import FLATNESS_METHOD_CLASSES, FlatnessHost, FlatnessMethod
from hf_flatbias.sharpness.methods.table import (
    FLATNESS_METHOD_HYPERPARAMETERS,
    FLATNESS_METHODS,
    PENALTY_METHODS,
    SAM_METHODS,
)
from tests.helpers.tiny_models import classification_rows, tiny_classifier
from tests.helpers.tiny_models import flatbias_config as config


def test_the_method_table_names_the_methods_the_config_and_cards_know():
    assert tuple(FLATNESS_METHOD_CLASSES) == FLATNESS_METHODS == tuple(FLATNESS_METHOD_HYPERPARAMETERS)
    assert set(SAM_METHODS) | set(PENALTY_METHODS) | {"none"} == set(FLATNESS_METHODS)
    assert all(issubclass(method, FlatnessMethod) for method in FLATNESS_METHOD_CLASSES.values())


def test_the_trainer_is_a_host_for_every_method():
    members = [name for name in vars(FlatnessHost) if not name.startswith("_")]
    members += list(typing.get_type_hints(FlatnessHost))
    missing = [name for name in members if not hasattr(FlatBiasTrainer, name) and name not in _INSTANCE_ATTRIBUTES]
    assert not missing, f"FlatBiasTrainer lacks {missing}"


# Set by Trainer.__init__ (or the training loop) rather than defined on the class.
_INSTANCE_ATTRIBUTES = {
    "args",
    "accelerator",
    "model",
    "optimizer",
    "model_accepts_loss_kwargs",
    "current_gradient_accumulation_steps",
}


@pytest.mark.parametrize("method", FLATNESS_METHODS)
def test_the_trainer_runs_the_method_of_its_arguments(tmp_path, method):
    trainer = FlatBiasTrainer(
        model=tiny_classifier(), args=config(tmp_path, flatness_method=method), train_dataset=classification_rows()
    )
    assert type(trainer.flatness_method) is FLATNESS_METHOD_CLASSES[method]
    assert trainer.flatness_method.host is trainer


def test_methods_with_state_give_it_back_as_they_took_it(tmp_path):
    trainer = FlatBiasTrainer(
        model=tiny_classifier(), args=config(tmp_path, flatness_method="looksam"), train_dataset=classification_rows()
    )
    direction = [torch.ones(2), torch.zeros(3)]
    trainer.flatness_method.load_state_dict({"looksam_direction": direction})
    saved = trainer.flatness_method.state_dict()["looksam_direction"]
    assert all(torch.equal(a, b) for a, b in zip(saved, direction, strict=True))
