"""Relative critical sharpness (issue 55, deliverable 3c): the pre-training loss's critical step along a downstream
optimizer's first update, against the closed form on quadratics (SGD, AdamW with weight decay, an uphill direction)
and against a brute-force grid search along a hand-built AdamW direction on a tiny BERT."""

import json
import math

import pytest
import torch
from torch import nn
from transformers import BertForSequenceClassification

from hf_flatbias.flatness import build_masked_contexts, load_forgetting_task
from hf_flatbias.flatness.relative_critical_sharpness import (
    downstream_update,
    estimate_relative_critical_sharpness,
    summarize,
)
from hf_flatbias.measures import MEASURE_TABLE, MeasureSettings
from tests.helpers.tiny_models import VOCAB, tiny_bert_config, tiny_mlm


class TwoQuadratics(nn.Module):
    """``L_k(w) = 1/2 w^T H_k w - b_k^T w`` for a pre-training (k=1) and a nearby downstream (k=2) loss, float64."""

    def __init__(self, n: int = 10, seed: int = 0, flip: bool = False):
        super().__init__()
        g = torch.Generator().manual_seed(seed)

        def spd(low, high):
            q, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
            return q @ torch.diag(torch.linspace(low, high, n, dtype=torch.float64)) @ q.T

        self.register_buffer("H1", spd(0.5, 20.0))
        self.register_buffer("H2", self.H1 + spd(0.1, 5.0))
        self.register_buffer("b1", torch.randn(n, generator=g, dtype=torch.float64))
        self.register_buffer("b2", self.b1 + 0.5 * torch.randn(n, generator=g, dtype=torch.float64))
        self.w = nn.Parameter(torch.randn(n, generator=g, dtype=torch.float64))
        self.flip = flip  # a downstream loss that is the pre-training loss's negative: every step goes uphill

    def pretraining(self, module=None) -> torch.Tensor:
        return 0.5 * self.w @ self.H1 @ self.w - self.b1 @ self.w

    def downstream(self) -> torch.Tensor:
        if self.flip:
            return -self.pretraining()
        return 0.5 * self.w @ self.H2 @ self.w - self.b2 @ self.w

    def gradients(self):
        w = self.w.detach()
        return self.H1 @ w - self.b1, self.H2 @ w - self.b2


def _search(model, **kwargs):
    values, statuses, passes = estimate_relative_critical_sharpness(
        model,
        lambda batch: lambda m: float(m.pretraining()),
        model,
        lambda batch: model.downstream(),
        1,
        **kwargs,
    )
    return values[0], statuses[0], passes


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sgd_direction_gives_the_closed_form_on_a_quadratic(seed):
    model = TwoQuadratics(seed=seed)
    g1, g2 = model.gradients()
    d = -g2
    assert float(g1 @ d) < 0  # the downstream step goes downhill on the pre-training loss too
    expected = float(d @ model.H1 @ d / -(g1 @ d))
    before = model.w.detach().clone()
    value, status, _ = _search(model, optimizer="sgd", learning_rate=0.01, rtol=1e-6)
    assert status == "converged" and value == pytest.approx(expected, rel=2e-6)
    assert torch.equal(model.w.detach(), before)
    plain = float(g1 @ model.H1 @ g1 / (g1 @ g1))  # its own critical sharpness: a different number
    assert abs(value / plain - 1) > 1e-3


def test_adamw_first_step_direction_gives_the_closed_form():
    model = TwoQuadratics(seed=4)
    g1, g2 = model.gradients()
    lr, decay = 0.01, 0.1
    # a fresh AdamW's first step, from its definition: bias-corrected moments of one gradient, decoupled decay
    d = -g2 / (g2.abs() + 1e-8) - decay * model.w.detach()
    assert float(g1 @ d) < 0
    expected = float(d @ model.H1 @ d / -(g1 @ d))
    value, status, _ = _search(model, optimizer="adamw", learning_rate=lr, weight_decay=decay, rtol=1e-6)
    assert status == "converged" and value == pytest.approx(expected, rel=2e-6)
    update = downstream_update([model.w], model.downstream(), optimizer="adamw", learning_rate=lr, weight_decay=decay)
    assert torch.allclose(update.updates[0] / lr, d, rtol=1e-6, atol=1e-12)
    assert model.w.grad is None  # left as it was


def test_an_uphill_downstream_update_rises_at_once_and_is_counted_not_averaged():
    model = TwoQuadratics(seed=0, flip=True)
    value, status, _ = _search(model, optimizer="sgd", learning_rate=0.01)
    assert math.isnan(value) and status == "rose_at_every_step"
    summary = summarize([2.0, 4.0, value], ["converged", "converged", status])
    assert summary["mean"] == 3.0 and summary["n_rose_at_once"] == 1 and summary["n_batches"] == 3
    assert summary["stderr"] == pytest.approx(1.0)


def test_bad_settings_name_the_fix():
    model = TwoQuadratics()
    with pytest.raises(ValueError, match="optimizer="):
        downstream_update([model.w], model.downstream(), optimizer="adam", learning_rate=0.1)
    with pytest.raises(ValueError, match="learning_rate"):
        downstream_update([model.w], model.downstream(), learning_rate=0.0)
    with pytest.raises(ValueError, match="shared="):
        _search(model, shared={"w": "v"})


# ---------------------------------------------------------------------------------------------------------------------
# a tiny BERT: the table's measure against a direction built by hand and a brute-force search along it


def _task_file(path, n=12, seed=1, length=5):
    generator = torch.Generator().manual_seed(seed)
    rows = [
        {"input_ids": torch.randint(2, VOCAB, (length,), generator=generator).tolist(), "label": i % 2}
        for i in range(n)
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _pretraining_loss(model, contexts):
    """Mean ``-log p(target)`` over the contexts from the stock forward."""
    losses = []
    with torch.no_grad():
        for row in contexts:
            ids = torch.tensor([row["input_ids"]])
            labels = torch.tensor(row["labels"])
            position = int((labels != -100).nonzero()[0, 0])
            logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0, position].double()
            losses.append(float(torch.nn.functional.cross_entropy(logits[None], labels[position][None])))
    return sum(losses) / len(losses)


def test_tiny_bert_matches_a_brute_force_search_along_a_hand_built_adamw_step(tmp_path):
    model = tiny_mlm(seed=2)
    generator = torch.Generator().manual_seed(0)
    rows = [{"input_ids": torch.randint(2, VOCAB, (6,), generator=generator).tolist()} for _ in range(8)]
    contexts = build_masked_contexts(rows, mask_token_id=1, seed=0)
    task = load_forgetting_task(str(_task_file(tmp_path / "task.jsonl")), n_train=12, seed=3, vocab_size=VOCAB)
    settings = MeasureSettings(
        forgetting_task=str(tmp_path / "task.jsonl"), forgetting_batch_size=6, forgetting_learning_rate=1e-3
    )
    spec = MEASURE_TABLE["relative_critical_sharpness"]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result = spec.function()(model, contexts, n_contexts=None, settings=settings, seed=5, batch_size=8, task=task)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert result.n_batches == 1 and result.statuses == ["converged"]

    # the direction by hand: BERT's own classifier, seeded as the measure seeds it, the LM's encoder loaded
    torch.manual_seed(5)
    classifier = BertForSequenceClassification(tiny_bert_config(num_labels=2)).eval()
    classifier.bert.load_state_dict(model.bert.state_dict(), strict=False)
    ids = torch.tensor([row["input_ids"] for row in task.train_rows[:6]])
    labels = torch.tensor([row["label"] for row in task.train_rows[:6]])
    loss = torch.nn.functional.cross_entropy(classifier(input_ids=ids).logits, labels)
    names = [n for n, _ in model.bert.named_parameters()]
    grads = torch.autograd.grad(loss, [dict(classifier.bert.named_parameters())[n] for n in names])
    direction = {n: -g / (g.abs() + 1e-8) for n, g in zip(names, grads, strict=True)}

    base = _pretraining_loss(model, contexts)
    params = dict(model.bert.named_parameters())
    saved = {n: p.detach().clone() for n, p in params.items()}

    def rises(eta):
        with torch.no_grad():
            for n in names:
                params[n].copy_(saved[n] + eta * direction[n])
        return _pretraining_loss(model, contexts) > base

    low = 1e-7
    while not rises(2 * low) and low < 10:  # a coarse bracket by doubling, then a 0.2% grid inside it
        low *= 2
    crossing = low
    while not rises(crossing) and crossing < 2 * low:
        crossing *= 1.002
    rises(0.0)  # the weights back
    assert all(torch.equal(params[n], saved[n]) for n in names)
    # the grid brackets eta_c within 0.5%; float32 forwards add a little
    assert result.mean == pytest.approx(2 / crossing, rel=0.01)
    record = spec.record(result)
    assert record["value"] == result.mean and record["n_rose_at_once"] == 0


# ---------------------------------------------------------------------------------------------------------------------
# wiring: the callback's also_measure, the trace command, the card and compare

from hf_flatbias import HessianTraceCallback  # noqa: E402
from hf_flatbias.cli import main  # noqa: E402
from hf_flatbias.flatness.relative_critical_sharpness import relative_critical_sharpness  # noqa: E402
from hf_flatbias.modelcard import flatness_card_from_trainer, format_comparison_table, load_flatness_card  # noqa: E402
from tests.helpers.tiny_models import MLM_WORDS as WORDS  # noqa: E402
from tests.helpers.tiny_models import assert_training_unchanged, train_word_mlm  # noqa: E402
from tests.test_cli_trace import WORDS as CLI_WORDS  # noqa: E402
from tests.test_cli_trace import checkpoint  # noqa: E402, F401 - the fixture
from tests.test_modelcard import full_card  # noqa: E402
from tests.test_trace_callback import tokenizer  # noqa: E402, F401 - the fixture

RECORD = {
    "value": 41.5, "stderr": 3.25, "task": "sst2", "optimizer": "adamw", "learning_rate": 2e-05, "rtol": 0.001,
    "batch_size": 8, "downstream_batch_size": 8, "n_batches": 4, "n_converged": 3, "n_rose_at_once": 1,
    "n_forward_passes": 60, "seed": 0, "n_contexts": 32, "seconds": 2.5, "step": 40,
}  # fmt: skip


def test_card_carrying_it_reads_back_and_compare_shows_it(tmp_path, capsys):
    card = full_card(measures={"relative_critical_sharpness": dict(RECORD)})
    card.save(tmp_path)
    loaded = load_flatness_card(tmp_path)
    assert loaded.measures == {"relative_critical_sharpness": RECORD}
    assert isinstance(loaded.measures["relative_critical_sharpness"]["n_rose_at_once"], int)
    text = (tmp_path / "README.md").read_text()
    assert (
        "| Relative critical sharpness 2/η_c (pre-training loss along a fine-tuning step) ± standard error | " in text
    )
    assert "41.5 ± 3.2 (along a fresh adamw's first step on sst2, downstream batches of 8, 1/4 steps raised" in text
    table = format_comparison_table([("a", loaded), ("b", full_card())]).splitlines()
    assert "relative critical sharpness ± stderr" in table[0] and "| 41.5 ± 3.2 (sst2, adamw) |" in table[2]
    assert main(["compare", str(tmp_path)]) == 0
    assert "relative critical sharpness ± stderr" in capsys.readouterr().out


def _word_task(path, words, n=16, seed=5):
    generator = torch.Generator().manual_seed(seed)
    texts = [" ".join(words[i] for i in torch.randint(0, len(words), (5,), generator=generator)) for _ in range(n)]
    path.write_text("".join(json.dumps({"text": t, "label": i % 2}) + "\n" for i, t in enumerate(texts)))
    return path


def test_callback_measures_it_and_training_is_bit_identical(tmp_path, tokenizer):  # noqa: F811
    task = _word_task(tmp_path / "task.jsonl", WORDS)
    plain = train_word_mlm(tmp_path / "plain", tokenizer, [])
    callback = HessianTraceCallback(
        n_contexts=6, n_draws=1, every_n_steps=3, batch_size=3, max_overhead=None,
        also_measure=("relative_critical_sharpness",),
        measure_settings={"forgetting_task": str(task), "forgetting_batch_size": 4, "forgetting_train_rows": 16,
                          "forgetting_learning_rate": 1e-3},
    )  # fmt: skip
    measured = train_word_mlm(tmp_path / "measured", tokenizer, [callback])
    assert_training_unchanged(plain, measured)
    logged = [entry for entry in measured.state.log_history if "flatness/relative_critical_sharpness" in entry]
    assert [entry["step"] for entry in logged] == [3, 6]
    result = callback.flatness_record.measures["relative_critical_sharpness"]
    assert result.n_batches == 2 and result.task == str(task)
    settings = callback.config.settings()
    direct = relative_critical_sharpness(
        measured.model, callback._contexts, n_contexts=6, settings=settings, seed=0, batch_size=3,
        task=callback._forgetting_task,
    )  # fmt: skip
    assert direct.per_batch == pytest.approx(result.per_batch, rel=1e-9, nan_ok=True)
    card = flatness_card_from_trainer(measured)
    if math.isfinite(result.mean):
        assert card.measures["relative_critical_sharpness"]["step"] == 6


def test_trace_command_measures_it_as_the_api_does(checkpoint, tmp_path):  # noqa: F811
    folder, data, text_tokenizer, lines = checkpoint
    task = _word_task(tmp_path / "task.jsonl", CLI_WORDS[:10], seed=2)
    output = tmp_path / "out.json"
    arguments = ["trace", str(folder), "--data", str(data), "--n-contexts", "6", "--seed", "1", "--batch-size", "3"]
    arguments += ["--measures", "relative_critical_sharpness", "--forgetting-task", str(task)]
    arguments += ["--forgetting-batch-size", "4", "--forgetting-learning-rate", "1e-3", "--output", str(output)]
    assert main([*arguments, "--no-progress"]) == 0
    written = json.loads(output.read_text())
    record = written["measures"]["relative_critical_sharpness"]

    from transformers import BertForMaskedLM

    from tests.helpers.tiny_models import trace_command_contexts

    model = BertForMaskedLM.from_pretrained(folder)
    contexts = trace_command_contexts(text_tokenizer, lines, n_contexts=6, seed=1)
    loaded = load_forgetting_task(str(task), tokenizer=text_tokenizer, seed=1, max_length=32)
    settings = MeasureSettings(forgetting_task=str(task), forgetting_batch_size=4, forgetting_learning_rate=1e-3)
    direct = relative_critical_sharpness(
        model, contexts, n_contexts=None, settings=settings, seed=1, batch_size=3, task=loaded
    )
    assert record["value"] == pytest.approx(direct.mean, rel=1e-9)
    assert record["n_batches"] == 2 and record["downstream_batch_size"] == 4
    assert written["relative_critical_sharpness"]["per_batch"] == pytest.approx(direct.per_batch, rel=1e-9, nan_ok=True)
