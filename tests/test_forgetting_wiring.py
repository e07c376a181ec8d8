"""Forgetting as a measure of the table (`hf_flatbias.measures.MEASURE_TABLE`): equal to a hand-written
fine-tune-then-evaluate loop on a tiny model, through the callback (training bit for bit as without it), the command
line, the card and compare, each number with its standard error and settings; its downstream task loaded once and
bad inputs refused before anything is measured."""

import copy
import json
import math

import pytest
import torch
from datasets import Dataset, DatasetDict
from transformers import BertForSequenceClassification

from hf_flatbias.callbacks import HessianTraceCallback
from hf_flatbias.cli import main
from hf_flatbias.flatness import build_masked_contexts, load_forgetting_task, measure_forgetting
from hf_flatbias.measures import MEASURE_TABLE, MeasureSettings
from hf_flatbias.modelcard import flatness_card_from_trainer, format_comparison_table, load_flatness_card
from tests.helpers.tiny_models import MLM_WORDS as WORDS
from tests.helpers.tiny_models import (
    VOCAB,
    assert_training_unchanged,
    tiny_bert_config,
    tiny_mlm,
    trace_command_contexts,
    train_word_mlm,
)
from tests.test_cli_trace import WORDS as CLI_WORDS
from tests.test_cli_trace import checkpoint  # noqa: F401 - the fixture
from tests.test_modelcard import front_matter, full_card
from tests.test_trace_callback import tokenizer  # noqa: F401 - the fixture

RECORD = {
    "value": 0.125, "stderr": 0.03125, "task": "sst2", "label_column": "label", "steps": 50, "learning_rate": 2e-05,
    "batch_size": 8, "optimizer": "adamw", "weight_decay": 0.0, "seed": 0, "num_labels": 2, "lm_loss_before": 2.5,
    "lm_loss_after": 2.625, "accuracy_before": 0.5, "accuracy_before_stderr": 0.0625, "accuracy_after": 0.75,
    "accuracy_after_stderr": 0.046875, "accuracy_on": "eval_rows", "n_task_rows": 1000, "n_eval_rows": 500,
    "trace_before": 12.5, "trace_before_stderr": 0.5, "trace_after": 14.0, "trace_after_stderr": 0.75,
    "trace_n_draws": 2, "n_contexts": 64, "seconds": 3.5, "step": 40,
}  # fmt: skip


def _contexts(n=12, seed=0, length=6):
    generator = torch.Generator().manual_seed(seed)
    rows = [{"input_ids": torch.randint(2, VOCAB, (length,), generator=generator).tolist()} for _ in range(n)]
    return build_masked_contexts(rows, mask_token_id=1, seed=seed)


def _task_file(path, n=20, seed=1, length=5, column="label"):
    generator = torch.Generator().manual_seed(seed)
    rows = [
        {"input_ids": torch.randint(2, VOCAB, (length,), generator=generator).tolist(), column: i % 2} for i in range(n)
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _masked_lm_losses(model, contexts):
    """``-log p(target)`` of each context from the stock forward (logits at every position)."""
    losses = []
    with torch.no_grad():
        for row in contexts:
            ids = torch.tensor([row["input_ids"]])
            labels = torch.tensor(row["labels"])
            position = int((labels != -100).nonzero()[0, 0])
            logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0, position].double()
            losses.append(float(torch.nn.functional.cross_entropy(logits[None], labels[position][None])))
    return torch.tensor(losses, dtype=torch.float64)


def _reference_forgetting(model, contexts, train, evaluation, *, steps, lr, batch_size, seed, num_labels):
    """Fine-tune a fresh classifier holding the LM's encoder with plain AdamW in the seeded order, put the tuned
    encoder back into a copy of the LM and evaluate: written from BERT's classes, not the package's helpers."""
    before = _masked_lm_losses(model, contexts)
    torch.manual_seed(seed)
    classifier = BertForSequenceClassification(tiny_bert_config(num_labels=num_labels))
    missing = classifier.bert.load_state_dict(model.bert.state_dict(), strict=False).missing_keys
    assert all(key.startswith("pooler.") for key in missing)  # a masked LM has no pooler: it stays as initialised
    optimizer = torch.optim.AdamW(classifier.parameters(), lr=lr, weight_decay=0.0)
    order, queue = torch.Generator().manual_seed(seed), []
    classifier.train()
    for _ in range(steps):
        if len(queue) < batch_size:
            queue += torch.randperm(len(train), generator=order).tolist()
        chosen, queue = queue[:batch_size], queue[batch_size:]
        ids = torch.tensor([train[i]["input_ids"] for i in chosen])
        labels = torch.tensor([train[i]["label"] for i in chosen])
        loss = torch.nn.functional.cross_entropy(classifier(input_ids=ids).logits, labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    classifier.eval()
    with torch.no_grad():
        ids = torch.tensor([row["input_ids"] for row in evaluation])
        correct = (
            classifier(input_ids=ids).logits.argmax(-1) == torch.tensor([r["label"] for r in evaluation])
        ).double()
    tuned = copy.deepcopy(model)
    keys = set(tuned.bert.state_dict())
    tuned.bert.load_state_dict({k: v for k, v in classifier.bert.state_dict().items() if k in keys})
    difference = _masked_lm_losses(tuned, contexts) - before
    return difference, correct


def test_the_measure_equals_a_hand_written_fine_tune_then_evaluate(tmp_path):
    model = tiny_mlm(0).eval()
    contexts = _contexts()
    task = load_forgetting_task(str(_task_file(tmp_path / "task.jsonl")), n_train=16, seed=3, vocab_size=VOCAB)
    assert task.eval_rows is None and len(task.train_rows) == 16 and task.num_labels == 2
    settings = MeasureSettings(
        forgetting_task=str(tmp_path / "task.jsonl"), forgetting_steps=5, forgetting_learning_rate=1e-2,
        forgetting_batch_size=6,
    )  # fmt: skip
    spec = MEASURE_TABLE["forgetting"]
    result = spec.function()(model, contexts, n_contexts=None, settings=settings, seed=3, batch_size=4, task=task)
    difference, correct = _reference_forgetting(
        model, contexts, task.train_rows, task.train_rows, steps=5, lr=1e-2, batch_size=6, seed=3, num_labels=2
    )
    assert result.forgetting == pytest.approx(float(difference.mean()), rel=1e-6, abs=1e-9)
    assert result.stderr == pytest.approx(float(difference.std() / math.sqrt(len(difference))), rel=1e-6)
    assert result.accuracy_after == pytest.approx(float(correct.mean()))
    assert result.accuracy_after_stderr == pytest.approx(float(correct.std() / math.sqrt(len(correct))))
    assert float(difference.abs().max()) > 1e-3  # the steps moved the encoder: the agreement is not of zeros

    record = spec.record(result)
    assert record["value"] == result.forgetting and record["stderr"] == result.stderr
    assert record["task"] == str(tmp_path / "task.jsonl") and record["steps"] == 5 and record["batch_size"] == 6
    assert record["accuracy_on"] == "task_rows" and record["accuracy_after_stderr"] == result.accuracy_after_stderr


def test_the_task_is_drawn_once_by_the_seed_and_the_same_for_every_checkpoint(tmp_path, tokenizer):  # noqa: F811
    generator = torch.Generator().manual_seed(0)

    def split(n):
        texts = [" ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (5,), generator=generator)) for _ in range(n)]
        return Dataset.from_dict({"text": texts, "task_a": [i % 3 - (i % 7 == 0) for i in range(n)]})

    DatasetDict(train=split(40), validation=split(20)).save_to_disk(str(tmp_path / "synthetic"))
    kwargs = dict(tokenizer=tokenizer, label_column="task_a", n_train=12, n_eval=8)
    first = load_forgetting_task(str(tmp_path / "synthetic"), seed=0, **kwargs)
    again = load_forgetting_task(str(tmp_path / "synthetic"), seed=0, **kwargs)
    other = load_forgetting_task(str(tmp_path / "synthetic"), seed=1, **kwargs)
    assert first.train_rows == again.train_rows and first.eval_rows == again.eval_rows
    assert first.train_rows != other.train_rows
    assert len(first.train_rows) == 12 and len(first.eval_rows) == 8 and first.num_labels == 3
    assert all(row["label"] >= 0 for row in first.train_rows + first.eval_rows)  # -1 rows are left out, counted
    assert first.n_unlabelled == sum(i % 7 == 0 and i % 3 == 0 for i in range(40)) + sum(
        i % 7 == 0 and i % 3 == 0 for i in range(20)
    )
    assert first.train_rows[0]["input_ids"][0] == tokenizer.cls_token_id


def test_card_carrying_forgetting_reads_back_and_compare_shows_it(tmp_path, capsys):
    card = full_card(measures={"forgetting": dict(RECORD)})
    path = card.save(tmp_path)
    assert front_matter(path)["flatness"]["forgetting"] == RECORD
    loaded = load_flatness_card(tmp_path)
    assert loaded.measures == {"forgetting": RECORD} and loaded == card
    assert isinstance(loaded.measures["forgetting"]["steps"], int)
    text = path.read_text()
    assert (
        "| Forgetting: pre-training loss increase after fine-tuning ± standard error | 0.125 ± 0.031 (sst2, 50 adamw "
        "steps at lr 2e-05 in batches of 8, loss 2.5 -> 2.625, accuracy 0.500 ± 0.062 -> 0.750 ± 0.047 on 500 "
        "validation rows, Fisher trace 12.5 ± 0.5 -> 14 ± 0.75), step 40 |" in text
    )
    table = format_comparison_table([("a", loaded), ("b", full_card())]).splitlines()
    assert table[0].endswith("| forgetting ΔL ± stderr | sst2/accuracy | stsb/pearson | stsb/spearmanr |")
    assert "| 0.125 ± 0.031 (sst2, 50 steps, acc 0.750 ± 0.047) |" in table[2]
    assert main(["compare", str(tmp_path)]) == 0
    assert "forgetting ΔL ± stderr" in capsys.readouterr().out
    assert main(["card", str(tmp_path)]) == 0
    assert "accuracy 0.500 ± 0.062 -> 0.750 ± 0.047 on 500 validation rows" in capsys.readouterr().out
    with pytest.raises(ValueError, match="forgetting"):
        full_card(measures={"forgetting": {**RECORD, "accuracy_after_stderr": math.nan}}).save(tmp_path / "bad")


def test_callback_measures_forgetting_on_a_copy_and_training_is_bit_identical(tmp_path, tokenizer):  # noqa: F811
    generator = torch.Generator().manual_seed(5)
    texts = [" ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (6,), generator=generator)) for _ in range(24)]
    task = tmp_path / "task.jsonl"
    task.write_text("".join(json.dumps({"text": t, "label": i % 2}) + "\n" for i, t in enumerate(texts)))
    plain = train_word_mlm(tmp_path / "plain", tokenizer, [])
    callback = HessianTraceCallback(
        n_contexts=6, n_draws=1, every_n_steps=3, batch_size=3, max_overhead=None, also_measure=("forgetting",),
        measure_settings={"forgetting_task": str(task), "forgetting_steps": 3, "forgetting_learning_rate": 1e-2,
                          "forgetting_batch_size": 4, "forgetting_train_rows": 16},
    )  # fmt: skip
    measured = train_word_mlm(tmp_path / "measured", tokenizer, [callback])

    assert_training_unchanged(plain, measured)
    logged = [entry for entry in measured.state.log_history if "flatness/forgetting" in entry]
    assert [entry["step"] for entry in logged] == [3, 6] and "flatness/forgetting_stderr" in logged[-1]
    result = callback.flatness_record.measures["forgetting"]
    assert result.steps == 3 and result.n_task_rows == 16 and result.task == str(task)

    # the same numbers by a direct call on the trained weights, the callback's contexts and the same rows
    direct = measure_forgetting(
        measured.model, callback._contexts, callback._forgetting_task.train_rows, num_labels=2, steps=3,
        learning_rate=1e-2, batch_size=4, seed=0, lm_batch_size=3,
    )  # fmt: skip
    assert result.forgetting == pytest.approx(direct.forgetting, rel=1e-9)

    card = flatness_card_from_trainer(measured)
    record = card.measures["forgetting"]
    assert record["steps"] == 3 and record["learning_rate"] == 1e-2 and "stderr" in record
    assert "accuracy_after_stderr" in record and record["step"] == 6
    card.save(tmp_path / "card")
    assert load_flatness_card(tmp_path / "card").measures == card.measures


def test_trace_command_measures_forgetting_as_the_api_does(checkpoint, tmp_path):  # noqa: F811
    folder, data, text_tokenizer, lines = checkpoint
    generator = torch.Generator().manual_seed(2)
    task = tmp_path / "task.jsonl"
    task.write_text(
        "".join(
            json.dumps({"text": " ".join(CLI_WORDS[i] for i in torch.randint(0, 10, (5,), generator=generator)),
                        "label": i % 2}) + "\n"
            for i in range(16)
        )
    )  # fmt: skip
    output = tmp_path / "out.json"
    arguments = ["trace", str(folder), "--data", str(data), "--n-contexts", "6", "--seed", "1", "--batch-size", "3"]
    arguments += ["--measures", "forgetting", "--forgetting-task", str(task), "--forgetting-steps", "2"]
    arguments += ["--forgetting-learning-rate", "0.05", "--forgetting-trace-draws", "1", "--output", str(output)]
    assert main([*arguments, "--no-progress"]) == 0
    record = json.loads(output.read_text())["measures"]["forgetting"]

    from transformers import BertForMaskedLM

    model = BertForMaskedLM.from_pretrained(folder)
    contexts = trace_command_contexts(text_tokenizer, lines, n_contexts=6, seed=1)
    rows = load_forgetting_task(str(task), tokenizer=text_tokenizer, seed=1, max_length=32).train_rows
    direct = measure_forgetting(
        model, contexts, rows, steps=2, learning_rate=0.05, seed=1, lm_batch_size=3,
        trace={"n_draws": 1, "seed": 1, "batch_size": 3},
    )  # fmt: skip
    assert record["value"] == pytest.approx(direct.forgetting, rel=1e-9)
    assert record["stderr"] == pytest.approx(direct.stderr, rel=1e-9)
    assert record["trace_after"] == pytest.approx(direct.trace_after.mean, rel=1e-9)
    assert record["trace_n_draws"] == 1 and record["n_task_rows"] == 16 and record["steps"] == 2


@pytest.mark.parametrize(
    "flags, fragment",
    [
        ([], "--forgetting-task: forgetting_task is needed by forgetting"),
        (["--forgetting-task", "no/such/file.jsonl"], "neither a GLUE task"),
        (["--forgetting-task", "stsb"], "regression task"),
        (["--forgetting-task", "rte"], "needs the Hugging Face Hub"),
        (["--forgetting-task", "sst2", "--forgetting-steps", "0"], "--forgetting-steps"),
        (["--forgetting-task", "sst2", "--forgetting-learning-rate", "-1"], "--forgetting-learning-rate"),
    ],
)
def test_the_command_line_refuses_bad_forgetting_settings_before_loading(
    flags, fragment, tmp_path, capsys, monkeypatch
):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = tmp_path / "never-read"  # refused before the model is looked at
    assert main(["trace", str(model), "--data", str(tmp_path), "--measures", "forgetting", *flags]) == 2
    error = capsys.readouterr().err.strip()
    assert fragment in error and "\n" not in error


@pytest.mark.parametrize(
    "rows, kwargs, fragment",
    [
        ([{"input_ids": [2, 3], "class": 1}], {}, "no column 'label'"),
        ([{"input_ids": [2, 3], "label": 0.5}], {}, "not a whole-number class"),
        ([{"input_ids": [2, 3], "label": 1}, {"input_ids": [3, 4], "label": 1}], {}, "one class only"),
        ([{"input_ids": [2, 3], "label": -1}], {}, "No row"),
        ([{"text": "w1 w2", "label": 0}, {"text": "w2", "label": 1}], {}, "needs the model's tokenizer"),
        ([{"input_ids": [2, 99], "label": 0}, {"input_ids": [3], "label": 1}], {"vocab_size": 30}, "vocabulary of 30"),
    ],
)
def test_the_task_loader_refuses_bad_rows(rows, kwargs, fragment, tmp_path):
    path = tmp_path / "task.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(ValueError, match=fragment) as error:
        load_forgetting_task(str(path), **kwargs)
    assert "\n" not in str(error.value)


def test_the_callback_refuses_forgetting_without_its_task():
    with pytest.raises(ValueError, match="forgetting_task is needed by forgetting"):
        HessianTraceCallback(also_measure=("forgetting",))
    with pytest.raises(ValueError, match="forgetting_optimizer"):
        HessianTraceCallback(
            also_measure=("forgetting",), measure_settings={"forgetting_task": "sst2", "forgetting_optimizer": "adam"}
        )


def test_a_decoder_without_a_padding_id_fine_tunes_in_batches():
    # Pythia's and OLMo's configs have no pad_token_id: transformers' decoder classifiers refuse batches without one
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.helpers.tiny_models import TINY_DECODER

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{**TINY_DECODER, "pad_token_id": None, "eos_token_id": 1})).eval()
    generator = torch.Generator().manual_seed(0)
    texts = [{"input_ids": torch.randint(2, 16, (4 + i % 3,), generator=generator).tolist()} for i in range(8)]
    contexts = build_masked_contexts(texts, mask_token_id=None, causal=True)
    task = [{"input_ids": t["input_ids"], "label": i % 2} for i, t in enumerate(texts)]
    result = measure_forgetting(model, contexts, task, steps=2, learning_rate=1e-2, batch_size=4)
    assert math.isfinite(result.forgetting) and result.forgetting != 0
    assert model.config.pad_token_id is None  # the LM's own config is left as it was
