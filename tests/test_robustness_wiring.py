"""The measures beyond the trace wired from one table (`hf_flatbias.measures.MEASURE_TABLE`): weight noise,
quantization and critical sharpness through the callback, the command line, the card and compare, each read back
with its standard error and settings; critical sharpness in training along the trainer's optimizer's next update,
leaving weights, optimizer state, gradients and random streams bit for bit as they were."""

import copy
import json
import math
import warnings

import pytest
import torch
from transformers import BertForMaskedLM

from hf_flatbias.callbacks import HessianTraceCallback
from hf_flatbias.cli import build_parser, main
from hf_flatbias.flatness import estimate_critical_sharpness
from hf_flatbias.flatness.quantization import estimate_quantization_sensitivity
from hf_flatbias.flatness.spectrum import _data_label_loss
from hf_flatbias.flatness.weight_noise import estimate_weight_noise_sensitivity
from hf_flatbias.measures import EXTRA_MEASURES, MEASURE_TABLE, MEASURES, MeasureSettings
from hf_flatbias.modelcard import flatness_card_from_trainer, format_comparison_table, load_flatness_card
from tests.helpers.tiny_models import assert_training_unchanged, trace_command_contexts, train_word_mlm
from tests.test_cli_trace import checkpoint  # noqa: F401 - the fixture
from tests.test_modelcard import front_matter, full_card
from tests.test_trace_callback import tokenizer  # noqa: F401 - the fixture

NEW = ("weight_noise", "quantization", "critical_sharpness")
RECORDS = {
    "weight_noise": {"value": 0.0125, "stderr": 0.0025, "sigma": 0.02, "scale": "rms", "antithetic": True,
                     "n_draws": 8, "seed": 0, "base_loss": 2.5, "n_contexts": 64, "seconds": 1.5, "step": 40,
                     "sigmas": [0.01, 0.02], "means": [0.003, 0.0125], "stderrs": [0.001, 0.0025]},
    "quantization": {"value": 0.25, "stderr": 0.03125, "bits": 4, "granularity": "per_group", "group_size": 8,
                     "include_embeddings": True, "relative_weight_error": 0.125, "base_loss": 2.5, "n_contexts": 64,
                     "seconds": 0.5, "step": 40, "bit_widths": [8, 4], "increases": [0.001, 0.25],
                     "stderrs": [0.0005, 0.03125]},
    "critical_sharpness": {"value": 42.5, "stderr": 3.5, "direction": "AdamW", "learning_rate": 0.001, "rtol": 0.001,
                           "batch_size": 8, "n_batches": 8, "n_converged": 7, "n_forward_passes": 96,
                           "n_contexts": 64, "seconds": 0.75, "step": 40},
}  # fmt: skip


def test_the_table_names_every_measure_and_the_command_line_offers_them_without_torch():
    assert EXTRA_MEASURES == (
        "top_eigenvalue",
        "spectrum_shape",
        "sam_sharpness",
        *NEW,
        "relative_critical_sharpness",
        "gradient_alignment",
        "forgetting",
    )
    assert MEASURES == ("trace", *EXTRA_MEASURES)
    for name, spec in MEASURE_TABLE.items():
        assert callable(spec.function()), name  # "module:function" resolves
        assert set(spec.settings) <= {f for f in MeasureSettings.__dataclass_fields__}, name
        assert spec.metric == f"flatness/{name}"
    arguments = build_parser().parse_args(["trace", "m/x", "--data", "d", "--measures", ",".join(NEW)])
    assert arguments.measures == NEW and arguments.noise_sigmas == (0.01,) and arguments.quantization_bits == (8, 4)
    with pytest.raises(ValueError, match="noise_sigmas"):
        MeasureSettings(noise_sigmas=(0.0,))
    with pytest.raises(ValueError, match="quantization_bits"):
        MeasureSettings(quantization_bits=(16,))


def test_card_records_each_measure_with_its_error_and_settings_and_compare_shows_them(tmp_path, capsys):
    card = full_card(measures=copy.deepcopy(RECORDS))
    path = card.save(tmp_path)
    flatness = front_matter(path)["flatness"]
    for name in NEW:
        assert flatness[name] == RECORDS[name]
    loaded = load_flatness_card(tmp_path)
    assert loaded.measures == RECORDS and loaded == card
    assert isinstance(loaded.measures["quantization"]["bits"], int)
    text = path.read_text()
    assert (
        "| Weight-noise loss increase ± standard error | 0.0125 ± 0.0025 (sigma = 0.02, rms noise, 8 antithetic "
        "draws, seed 0, at sigma 0.01: 0.003 ± 0.001), step 40 |" in text
    )
    assert (
        "| Quantization loss increase ± standard error | 0.25 ± 0.031 (4 bit, groups of 8, at 8 bit: 0.001 ± 0.0005), "
        "step 40 |" in text
    )
    assert "42.5 ± 3.5 (along AdamW's next update, batches of 8, 7/8 searches converged), step 40" in text

    table = format_comparison_table([("a", loaded), ("b", full_card())]).splitlines()
    for name in NEW:
        assert MEASURE_TABLE[name].column in table[0]
    assert "| 0.0125 ± 0.0025 (σ=0.02 rms) | 0.25 ± 0.031 (4 bit, groups of 8) | 42.5 ± 3.5 (AdamW) |" in table[2]
    assert "| per_sample (64×2) | - | - | - |" in table[3]

    assert main(["compare", str(tmp_path)]) == 0
    assert "critical sharpness ± stderr" in capsys.readouterr().out
    assert main(["card", str(tmp_path)]) == 0
    assert "Critical sharpness 2/η_c ± standard error" in capsys.readouterr().out


@pytest.mark.parametrize(
    "record", [{"value": math.inf}, {"value": 1.0, "stderr": -1.0}, {"value": 1.0, "n_batches": math.nan}]
)
def test_bad_records_are_refused(tmp_path, record):
    with pytest.raises(ValueError, match="critical_sharpness"):
        full_card(measures={"critical_sharpness": record}).save(tmp_path)


def test_a_grid_point_without_a_standard_error_is_written_as_unknown_and_read_back(tmp_path):
    # one antithetic pair per sigma has no spread: its error is unknown (null on the card), never a .nan read back
    # with a warning
    from hf_flatbias.flatness.weight_noise import WeightNoisePoint, WeightNoiseSensitivity

    result = WeightNoiseSensitivity(
        points=[WeightNoisePoint(0.01, 0.002, math.nan), WeightNoisePoint(0.02, 0.008, math.nan)], base_loss=2.0,
        scale="rms", antithetic=True, n_draws=1, seed=0, n_contexts=4, n_parameters=10, seconds=0.1,
    )  # fmt: skip
    record = MEASURE_TABLE["weight_noise"].record(result)
    assert record["stderrs"] == [None, None] and "stderr" not in record
    full_card(measures={"weight_noise": record}).save(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_flatness_card(tmp_path).measures["weight_noise"] == record
    with pytest.raises(ValueError, match="stderrs"):
        full_card(measures={"weight_noise": {**record, "stderrs": [math.nan, 0.1]}}).save(tmp_path / "bad")


def test_trace_command_takes_the_robustness_measures(checkpoint, tmp_path, capsys):  # noqa: F811
    folder, data, text_tokenizer, lines = checkpoint
    output = tmp_path / "robust.json"
    assert (
        main(
            [
                "trace",
                str(folder),
                "--data",
                str(data),
                "--n-contexts",
                "6",
                "--seed",
                "2",
                "--output",
                str(output),
                "--measures",
                ",".join(NEW),
                "--noise-sigmas",
                "0.01,0.05",
                "--noise-draws",
                "3",
                "--quantization-bits",
                "8,3",
                "--batch-size",
                "3",
                "--no-progress",
            ]
        )  # fmt: skip
        == 0
    )
    printed = capsys.readouterr().out
    assert "Weight-noise loss increase" in printed and "gradient_descent" in printed
    written = json.loads(output.read_text())
    assert "estimate" not in written and set(written["measures"]) == set(NEW)

    model = BertForMaskedLM.from_pretrained(folder)
    contexts = trace_command_contexts(text_tokenizer, lines, n_contexts=6, seed=2)
    noise = estimate_weight_noise_sensitivity(model, contexts, (0.01, 0.05), n_draws=3, seed=2, batch_size=3)
    assert written["weight_noise"]["points"][1]["mean"] == pytest.approx(noise.points[1].mean, rel=1e-6)
    record = written["measures"]["weight_noise"]
    assert record["value"] == pytest.approx(noise.points[1].mean, rel=1e-6) and record["sigma"] == 0.05
    assert record["stderr"] == pytest.approx(noise.points[1].stderr, rel=1e-6) and record["n_draws"] == 3
    quantized = estimate_quantization_sensitivity(model, contexts, (8, 3), batch_size=3)
    assert written["measures"]["quantization"]["value"] == pytest.approx(quantized.points[1].loss_increase, rel=1e-6)
    assert written["measures"]["quantization"]["bit_widths"] == [8, 3]

    # critical sharpness without an optimizer: along -g of each batch of 3 contexts, plain gradient descent
    critical = written["critical_sharpness"]
    assert critical["direction"] == "gradient_descent" and critical["n_batches"] == 2
    params = [p for p in model.parameters() if p.requires_grad]
    from hf_flatbias.flatness.contexts import TraceContexts

    prepared = TraceContexts.from_rows(contexts, causal=False)
    model.eval()
    for batch, indices in enumerate(([0, 1, 2], [3, 4, 5])):
        grads = torch.autograd.grad(_data_label_loss(model, prepared, indices), params, allow_unused=True)
        update = [-(torch.zeros_like(p) if g is None else g) for p, g in zip(params, grads, strict=True)]
        expected = estimate_critical_sharpness(
            model, lambda m, i=indices: float(_data_label_loss(m, prepared, i)), update, learning_rate=1.0
        )
        assert critical["per_batch"][batch] == pytest.approx(expected.lambda_c, rel=1e-9)
    assert written["measures"]["critical_sharpness"]["stderr"] > 0

    with pytest.raises(SystemExit):
        main(["trace", str(folder), "--data", str(data), "--measures", "trace,noise"])
    assert "choose a comma-separated list" in capsys.readouterr().err
    assert main(["trace", str(folder), "--data", str(data), "--measures", "weight_noise", "--noise-sigmas", "-1"]) == 2
    assert "--noise-sigmas" in capsys.readouterr().err


def _snapshot(trainer):
    inner = trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer
    state = {
        id(p): {k: v.clone() if torch.is_tensor(v) else copy.deepcopy(v) for k, v in inner.state[p].items()}
        for group in inner.param_groups
        for p in group["params"]
    }
    groups = [{k: copy.deepcopy(v) for k, v in group.items() if k != "params"} for group in inner.param_groups]
    return {
        "params": [p.detach().clone() for p in trainer.model.parameters()],
        "grads": [None if p.grad is None else p.grad.clone() for p in trainer.model.parameters()],
        "state": state,
        "groups": groups,
        "rng": torch.random.get_rng_state(),
        "training": [m.training for m in trainer.model.modules()],
    }


def _assert_identical(before, after):
    assert all(torch.equal(a, b) for a, b in zip(before["params"], after["params"], strict=True))
    assert all(
        (a is None and b is None) or torch.equal(a, b) for a, b in zip(before["grads"], after["grads"], strict=True)
    )
    assert before["state"].keys() == after["state"].keys()
    for key, state in before["state"].items():
        assert state.keys() == after["state"][key].keys()
        for name, value in state.items():
            other = after["state"][key][name]
            assert torch.equal(value, other) if torch.is_tensor(value) else value == other
    assert before["groups"] == after["groups"]
    assert torch.equal(before["rng"], after["rng"])
    assert before["training"] == after["training"]


def test_callback_logs_the_robustness_measures_and_training_is_bit_identical(tmp_path, tokenizer):  # noqa: F811
    plain = train_word_mlm(tmp_path / "plain", tokenizer, [])
    callback = HessianTraceCallback(
        n_contexts=6,
        n_draws=1,
        every_n_steps=3,
        batch_size=3,
        max_overhead=None,
        also_measure=NEW,
        measure_settings={"noise_sigmas": (0.05,), "noise_draws": 2, "quantization_bits": (4,)},
    )
    measured = train_word_mlm(tmp_path / "measured", tokenizer, [callback])

    assert_training_unchanged(plain, measured)

    logged = [entry for entry in measured.state.log_history if "flatness/critical_sharpness" in entry]
    assert [entry["step"] for entry in logged] == [3, 6]
    for name in NEW:
        spec = MEASURE_TABLE[name]
        assert spec.metric in logged[-1] and spec.stderr_metric in logged[-1], name
    record = callback.flatness_record
    assert all(record.measure_steps[name] == 6 for name in NEW)
    critical = record.measures["critical_sharpness"]
    assert critical.direction == "AdamW" and critical.n_batches == 2
    assert critical.learning_rate == 0.0  # the end of the linear schedule: measured per unit learning rate

    card = flatness_card_from_trainer(measured)
    assert card.measures["weight_noise"]["sigma"] == 0.05 and card.measures["weight_noise"]["n_draws"] == 2
    assert card.measures["quantization"]["bits"] == 4 and "stderr" in card.measures["quantization"]
    assert card.measures["critical_sharpness"]["direction"] == "AdamW"
    card.save(tmp_path / "card")
    assert load_flatness_card(tmp_path / "card").measures == card.measures


def test_critical_sharpness_through_the_callback_follows_the_optimizer_and_restores_everything(tmp_path, tokenizer):  # noqa: F811
    callback = HessianTraceCallback(
        n_contexts=6, n_draws=1, batch_size=3, also_measure=("critical_sharpness",), on_evaluate=False,
        measure_at_end=False, max_overhead=None,
    )  # fmt: skip
    trainer = train_word_mlm(tmp_path / "run", tokenizer, [callback])
    trainer.args.max_grad_norm = 0.05  # below the gradient's norm: the update measured is of the clipped gradient
    inner = trainer.optimizer.optimizer
    for group in inner.param_groups:
        group["lr"] = 1e-3  # a learning rate mid-schedule, so the optimizer's step is its own
    trainer.model.train()  # as the trainer leaves it between steps
    torch.manual_seed(123)
    before = _snapshot(trainer)
    callback.measure(step=6)
    _assert_identical(before, _snapshot(trainer))
    measured = callback.flatness_record.measures["critical_sharpness"]
    assert measured.direction == "AdamW" and measured.learning_rate == 1e-3

    # the same search by hand: the update a copy of the optimizer applies to the first batch's gradient
    from hf_flatbias.flatness.contexts import TraceContexts

    model = trainer.model
    params = [p for p in model.parameters() if p.requires_grad]
    prepared = TraceContexts.from_rows(callback._contexts, causal=False)
    model.eval()
    grads = torch.autograd.grad(_data_label_loss(model, prepared, [0, 1, 2]), params, allow_unused=True)
    twin = copy.deepcopy(model)
    twin_params = [p for p in twin.parameters() if p.requires_grad]
    index = {id(p): i for i, p in enumerate(params)}
    twin_optimizer = type(inner)(
        [
            {
                **{k: v for k, v in group.items() if k != "params"},
                "params": [twin_params[index[id(p)]] for p in group["params"]],
            }
            for group in inner.param_groups
        ]
    )
    twin_optimizer.load_state_dict(inner.state_dict())
    state = copy.deepcopy(inner.state_dict())

    def update_by_hand(max_norm: float | None) -> list[torch.Tensor]:
        twin_optimizer.load_state_dict(copy.deepcopy(state))
        with torch.no_grad():
            for p, q in zip(params, twin_params, strict=True):
                q.copy_(p)
        for p, g in zip(twin_params, grads, strict=True):
            p.grad = torch.zeros_like(p) if g is None else g.clone()
        if max_norm is not None:  # the Trainer clips before its step, at its max_grad_norm
            norm = torch.nn.utils.clip_grad_norm_(twin_params, max_norm)
            assert norm > max_norm  # clipping binds here, so the check can tell
        twin_optimizer.step()
        return [(q - p).detach() for p, q in zip(params, twin_params, strict=True)]

    def search(update):
        loss = lambda m: float(_data_label_loss(m, prepared, [0, 1, 2]))  # noqa: E731
        return estimate_critical_sharpness(model, loss, update, learning_rate=1e-3).lambda_c

    expected = search(update_by_hand(trainer.args.max_grad_norm))
    assert measured.per_batch[0] == pytest.approx(expected, rel=1e-9)
    assert not measured.per_batch[0] == pytest.approx(search(update_by_hand(None)), rel=1e-3)
    # and it is not plain gradient descent's number
    descent = estimate_critical_sharpness(
        model,
        lambda m: float(_data_label_loss(m, prepared, [0, 1, 2])),
        [-(torch.zeros_like(p) if g is None else g) for p, g in zip(params, grads, strict=True)],
        learning_rate=1.0,
    )
    assert not measured.per_batch[0] == pytest.approx(descent.lambda_c, rel=1e-2)


def test_bad_measure_settings_fail_when_the_callback_is_made():
    with pytest.raises(ValueError, match="noise_draws"):
        HessianTraceCallback(also_measure=("weight_noise",), measure_settings={"noise_draws": 0})
    with pytest.raises(ValueError, match="unknown"):
        HessianTraceCallback(also_measure=("weight_noise",), measure_settings={"sigma": 0.1})
    with pytest.raises(ValueError, match="also_measure"):
        HessianTraceCallback(also_measure=("noise",))


def test_a_measure_without_a_finite_value_is_left_off_the_trainers_card(tmp_path):
    from types import SimpleNamespace

    from hf_flatbias.flatness import FlatnessRecord
    from hf_flatbias.flatness.beyond_trace import CriticalSharpnessEstimate
    from tests.test_modelcard import tiny_args

    never = CriticalSharpnessEstimate(
        mean=math.nan, stderr=math.nan, direction="AdamW", learning_rate=1e-3, rtol=1e-3, batch_size=4, n_contexts=8,
        n_batches=2, n_converged=0, n_forward_passes=64, seconds=0.1, per_batch=[math.nan, math.nan],
    )  # fmt: skip
    record = FlatnessRecord().with_measure("critical_sharpness", never, 5)
    trainer = SimpleNamespace(
        args=tiny_args(tmp_path),
        state=SimpleNamespace(log_history=[], global_step=5, epoch=1.0),
        model=None,
        callback_handler=SimpleNamespace(callbacks=[SimpleNamespace(flatness_record=record)]),
    )
    card = flatness_card_from_trainer(trainer)
    assert card.measures == {}
    card.save(tmp_path / "card")  # the save does not fail over it


# ------------------------------------------------------------------------ issue 58, item 4: bounded, never a bare nan


@pytest.mark.parametrize(
    "flags,expected",
    [
        (["--measures", "weight_noise", "--noise-draws", "1000000000"], "--noise-draws: noise_draws=1000000000 is "),
        (["--measures", "forgetting", "--forgetting-task", "sst2", "--forgetting-steps", "1000000000"],
         "--forgetting-steps: forgetting_steps=1000000000 is "),
        (["--measures", "forgetting", "--forgetting-task", "sst2", "--forgetting-trace-draws", "1000000000"],
         "--forgetting-trace-draws: forgetting_trace_draws=1000000000 is "),
        (["--measures", "weight_noise", "--noise-sigmas", "0.01,1e9"], "--noise-sigmas: noise_sigmas=(0.01, 1e+09)"),
    ],
)  # fmt: skip
def test_a_measurement_past_its_sane_range_is_refused_before_anything_loads(flags, expected, tmp_path, capsys):
    """Before: --noise-draws and --forgetting-steps 10^9 ran without a line of output, --noise-sigmas 1e9 printed
    nan. The model named here does not exist: the refusal has to come before it is looked for."""
    code = main(["trace", str(tmp_path / "no-model"), "--data", str(tmp_path / "no.jsonl"), *flags])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert expected in err and "outside" in err and "no-model" not in err, err
    with pytest.raises(ValueError, match=expected.split(": ", 1)[1].split("=")[0]):
        HessianTraceCallback(also_measure=("weight_noise", "forgetting"),
                             measure_settings={"forgetting_task": "sst2", **_settings_of(flags)})  # fmt: skip


def _settings_of(flags: list[str]) -> dict:
    values = dict(zip(flags[::2], flags[1::2], strict=True))
    values.pop("--measures")
    values.pop("--forgetting-task", None)
    ((flag, text),) = values.items()
    name = flag[2:].replace("-", "_")
    return {name: tuple(float(part) for part in text.split(",")) if name == "noise_sigmas" else int(text)}


def test_a_measure_that_comes_out_non_finite_is_an_error_naming_why(checkpoint, tmp_path, capsys):  # noqa: F811
    """A checkpoint whose own loss is not finite (a weight at 3e38 overflows the logits) gave `nan` with exit 0."""
    folder, data, _, _ = checkpoint
    model = BertForMaskedLM.from_pretrained(folder)
    with torch.no_grad():
        model.cls.predictions.transform.dense.weight[0, 0] = 3e38
    model.save_pretrained(tmp_path / "broken")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
        if (folder / name).is_file():
            (tmp_path / "broken" / name).write_bytes((folder / name).read_bytes())
    output = tmp_path / "out.json"
    flags = ["--n-contexts", "4", "--no-progress", "--output", str(output), "--noise-draws", "1"]
    capsys.readouterr()
    code = main(["trace", str(tmp_path / "broken"), "--data", str(data), "--measures", "weight_noise", *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "weight_noise came out nan" in err[0] and "loss of the checkpoint itself is nan" in err[0], err
    assert not output.exists()
    # the trace of the same checkpoint: its self-check said the estimator missed parameters ("nan vs nan")
    assert main(["trace", str(tmp_path / "broken"), "--data", str(data), *flags[:-2]]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "do not match" not in err[0] and "gradient of the loss is not finite" in err[0], err
    for estimator in ("naive", "hutchinson"):  # no self-check: the trace itself came out nan, with exit 0
        assert main(["trace", str(tmp_path / "broken"), "--data", str(data), *flags[:-2], "--estimator", estimator,
                     "--no-by-group"]) == 2  # fmt: skip
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "the trace came out nan" in err[0], err
    assert not output.exists()


def test_a_noise_level_that_overflows_is_named():
    from hf_flatbias.commands.trace_measures import check_finite_record

    record = {"value": math.inf, "sigma": 5.0, "scale": "absolute", "base_loss": 2.5, "sigmas": [0.01, 5.0],
              "means": [0.01, math.inf]}  # fmt: skip
    with pytest.raises(ValueError, match=r"weight_noise came out inf: the loss under noise of sigma=5 \(absolute\) "):
        check_finite_record("weight_noise", record)
    check_finite_record("weight_noise", {**record, "value": 0.5})


def test_settings_of_a_measure_not_taken_are_refused():
    """Issue 58, item 8: noise_sigmas without weight_noise in also_measure was silently ignored."""
    with pytest.raises(ValueError, match=r"measure_settings: noise_sigmas is a setting of weight_noise, which "
                                         r"also_measure does not name: add weight_noise to also_measure"):  # fmt: skip
        HessianTraceCallback(measure_settings={"noise_sigmas": (0.05,)})
    with pytest.raises(ValueError, match="quantization_bits is a setting of quantization"):
        HessianTraceCallback(also_measure=("weight_noise",), measure_settings={"quantization_bits": (4,)})
    HessianTraceCallback(also_measure=("weight_noise",), measure_settings={"noise_sigmas": (0.05,)})


def test_a_measure_flag_without_its_measure_is_refused(tmp_path, capsys):
    """As the callback's measure_settings: --noise-sigmas without weight_noise in --measures was ignored."""
    argv = ["trace", str(tmp_path / "no-model"), "--data", str(tmp_path / "no.jsonl"), "--noise-sigmas", "0.05"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no-model" not in err, err
    assert "--noise-sigmas is a setting of weight_noise, which --measures does not name: add weight_noise" in err
