"""Linear probes: chance on random features, near-perfect on separable ones, Wilson interval, feature extraction."""

import math

import numpy as np
import pytest
import torch
from transformers import BertConfig, BertForMaskedLM

from hf_flatbias.probe import extract_features, labelled_rows, probe_accuracy, wilson_interval


def test_random_features_are_at_chance():
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 4, 3000)
    result = probe_accuracy(rng.normal(size=(3000, 16)), labels, seed=1)
    assert result.n_classes == 4 and result.n_test == 900
    assert result.ci_low <= 0.25 + 0.02 and result.ci_high >= 0.25 - 0.02
    assert abs(result.accuracy - result.chance) < 0.06


def test_linearly_separable_features_are_found():
    rng = np.random.default_rng(1)
    labels = rng.integers(0, 3, 1500)
    centres = rng.normal(size=(3, 8)) * 4
    features = centres[labels] + rng.normal(size=(1500, 8))
    train = probe_accuracy(features[:1000], labels[:1000], test_features=features[1000:], test_labels=labels[1000:])
    assert train.accuracy > 0.95 and train.n_test == 500


def test_wilson_interval_solves_its_defining_equation():
    # the Wilson bounds are the p where |phat - p| = z * sqrt(p (1 - p) / n)
    successes, trials, z = 37, 50, 1.959963984540054
    phat = successes / trials
    for p in wilson_interval(successes, trials, 0.95):
        assert abs(phat - p) == pytest.approx(z * math.sqrt(p * (1 - p) / trials), rel=1e-9)
    assert wilson_interval(0, 10)[0] == pytest.approx(0.0, abs=1e-12)
    assert wilson_interval(10, 10)[1] == pytest.approx(1.0, abs=1e-12)


def test_undefined_labels_are_dropped_and_bad_input_rejected():
    rng = np.random.default_rng(2)
    labels = rng.integers(-1, 2, 400)
    result = probe_accuracy(rng.normal(size=(400, 4)), labels)
    assert result.n_train + result.n_test == int((labels >= 0).sum())
    with pytest.raises(ValueError, match="one entry per row"):
        probe_accuracy(np.zeros((10, 2)), np.zeros(9, dtype=int))
    with pytest.raises(ValueError, match="two distinct labels"):
        probe_accuracy(np.zeros((10, 2)), np.zeros(10, dtype=int))
    with pytest.raises(ValueError, match="integers"):
        probe_accuracy(np.zeros((10, 2)), np.zeros(10))


def test_labelled_rows_keep_the_defined_labels_as_float64_and_name_the_bad_split():
    features = torch.arange(12, dtype=torch.float32).reshape(6, 2)
    x, y = labelled_rows(features, [0, -1, 1, 2, -1, 0], "fit features")
    assert x.dtype == np.float64 and x.tolist() == [[0, 1], [4, 5], [6, 7], [10, 11]] and y.tolist() == [0, 1, 2, 0]
    with pytest.raises(ValueError, match="fit features contain NaN"):
        labelled_rows(np.full((6, 2), np.nan), np.zeros(6, dtype=int), "fit features")
    with pytest.raises(ValueError, match="fewer than 4 rows"):
        labelled_rows(np.zeros((6, 2)), np.array([0, 1, 0, -1, -1, -1]))


def test_extract_features_ignores_padding():
    torch.manual_seed(0)
    config = BertConfig(vocab_size=20, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
    model = BertForMaskedLM(config).train()
    rows = [[2, 7, 8, 3], [2, 9, 3], [2, 5, 6, 7, 8, 3]]
    for pooling in ("cls", "mean"):
        features = extract_features(model, rows, pooling=pooling, batch_size=2)
        assert model.training  # mode restored
        model.eval()
        with torch.no_grad():
            for row, feature in zip(rows, features, strict=True):
                hidden = model(input_ids=torch.tensor([row]), output_hidden_states=True).hidden_states[-1][0]
                reference = hidden[0] if pooling == "cls" else hidden.mean(0)
                np.testing.assert_allclose(feature, reference.numpy(), atol=1e-5)
        model.train()
    assert extract_features(model, rows, pooling="concat").shape == (3, 16 * 6)
    with pytest.raises(ValueError, match="pooling"):
        extract_features(model, rows, pooling="max")
