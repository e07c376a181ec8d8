"""Gradient alignment across data sources (issue 55, deliverable 3b): the mean pairwise cosine of per-source mean
gradients and its stratified jackknife error, against numpy on random block vectors and against plain autograd (one
backward per context through the stock forward) on a tiny BERT; wired through the table (the callback, the trace
command, the card and compare)."""

import copy
import itertools
import json
import math

import numpy as np
import pytest
import torch

from hf_flatbias.cli import main
from hf_flatbias.flatness import build_masked_contexts
from hf_flatbias.flatness.gradient_alignment import alignment_from_gram, estimate_gradient_alignment
from hf_flatbias.measures import MEASURE_TABLE, MeasureSettings, check_required_settings
from hf_flatbias.modelcard import format_comparison_table, load_flatness_card
from tests.helpers.tiny_models import VOCAB, tiny_mlm
from tests.test_modelcard import full_card


def _cosine(a, b):
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def _alignment(vectors, owners, sizes):
    """A from block sums by their definition: each source's mean gradient, then the mean cosine over pairs."""
    n_sources = max(owners) + 1
    means = [
        sum(v for v, o in zip(vectors, owners, strict=True) if o == s)
        / sum(n for n, o in zip(sizes, owners, strict=True) if o == s)
        for s in range(n_sources)
    ]
    return float(np.mean([_cosine(means[s], means[t]) for s, t in itertools.combinations(range(n_sources), 2)]))


def _jackknife(vectors, owners, sizes):
    """The stratified delete-one-block jackknife, by dropping each block and recomputing from the vectors."""
    variance = 0.0
    for s in set(owners):
        blocks = [j for j, o in enumerate(owners) if o == s]
        replicates = [
            _alignment(
                [v for i, v in enumerate(vectors) if i != j],
                [o for i, o in enumerate(owners) if i != j],
                [n for i, n in enumerate(sizes) if i != j],
            )
            for j in blocks
        ]
        m = len(blocks)
        variance += (m - 1) / m * float(np.sum((np.array(replicates) - np.mean(replicates)) ** 2))
    return math.sqrt(variance)


def test_the_gram_arithmetic_equals_the_definition_and_a_brute_force_jackknife():
    rng = np.random.default_rng(0)
    owners = [0, 0, 0, 1, 1, 1, 1, 2, 2, 2]
    sizes = [3, 4, 3, 2, 2, 3, 2, 5, 4, 4]
    shared = rng.standard_normal(50)
    vectors = [n * (shared + 1.5 * rng.standard_normal(50)) for n in sizes]
    gram = torch.tensor(np.array([[a @ b for b in vectors] for a in vectors]))
    value, stderr, pairs = alignment_from_gram(gram, owners, sizes)
    assert value == pytest.approx(_alignment(vectors, owners, sizes), rel=1e-12)
    assert stderr == pytest.approx(_jackknife(vectors, owners, sizes), rel=1e-10)
    assert len(pairs) == 3 and np.mean(pairs) == pytest.approx(value, rel=1e-12)


def test_identical_sources_align_fully_and_a_single_block_has_no_error():
    vector = np.arange(1.0, 6.0)
    gram = torch.tensor(np.outer([1.0, 2.0, 3.0], [1.0, 2.0, 3.0]) * (vector @ vector))
    value, stderr, _ = alignment_from_gram(gram, [0, 1, 1], [1, 1, 1])
    assert value == pytest.approx(1.0) and math.isnan(stderr)
    with pytest.raises(ValueError, match="two sources"):
        alignment_from_gram(gram, [0, 0, 0], [1, 1, 1])


def _contexts_with_sources(n=18, seed=0):
    generator = torch.Generator().manual_seed(seed)
    rows = [
        {"input_ids": torch.randint(2, VOCAB, (6,), generator=generator).tolist(), "kind": ["a", "b", "c"][i % 3]}
        for i in range(n)
    ]
    return build_masked_contexts(rows, mask_token_id=1, seed=seed, keep_columns=("kind",))


def _per_context_gradients(model, contexts):
    """One backward per context of ``-log p(target)`` from the stock forward (logits at every position)."""
    params = [p for p in model.parameters() if p.requires_grad]
    gradients = []
    for row in contexts:
        ids = torch.tensor([row["input_ids"]])
        labels = torch.tensor(row["labels"])
        position = int((labels != -100).nonzero()[0, 0])
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0, position]
        loss = torch.nn.functional.cross_entropy(logits[None], labels[position][None])
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        gradients.append(
            torch.cat(
                [(torch.zeros_like(p) if g is None else g).reshape(-1) for p, g in zip(params, grads, strict=True)]
            )
            .double()
            .numpy()
        )
    return gradients


def test_tiny_bert_equals_plain_autograd_per_context_gradients():
    model, contexts = tiny_mlm(seed=3).eval(), _contexts_with_sources()
    settings = MeasureSettings(alignment_column="kind", alignment_blocks=3)
    result = MEASURE_TABLE["gradient_alignment"].function()(
        model, contexts, n_contexts=None, settings=settings, seed=0, batch_size=4
    )
    gradients = _per_context_gradients(model, contexts)
    kinds = [row["kind"] for row in contexts]
    # blocks as the measure splits them: each source's contexts in order, in 3 near-equal contiguous parts
    vectors, owners, sizes = [], [], []
    for s, kind in enumerate(sorted(set(kinds))):
        members = [i for i, k in enumerate(kinds) if k == kind]
        for part in np.array_split(members, 3):
            vectors.append(sum(gradients[i] for i in part))
            owners.append(s)
            sizes.append(len(part))
    assert result.mean == pytest.approx(_alignment(vectors, owners, sizes), rel=1e-5)
    assert result.stderr == pytest.approx(_jackknife(vectors, owners, sizes), rel=1e-4)
    means = {kind: np.mean([gradients[i] for i, k in enumerate(kinds) if k == kind], axis=0) for kind in "abc"}
    direct = np.mean([_cosine(means[a], means[b]) for a, b in itertools.combinations("abc", 2)])
    assert result.mean == pytest.approx(direct, rel=1e-5)
    assert result.sources == ["a", "b", "c"] and result.contexts_per_source == [6, 6, 6]
    record = MEASURE_TABLE["gradient_alignment"].record(result)
    assert record["value"] == result.mean and record["n_sources"] == 3 and record["column"] == "kind"


def test_bad_inputs_name_the_fix():
    model = tiny_mlm(seed=3)
    contexts = _contexts_with_sources()
    with pytest.raises(ValueError, match="one source"):
        estimate_gradient_alignment(model, contexts, ["a"] * len(contexts))
    with pytest.raises(ValueError, match="has no 'other' column"):
        MEASURE_TABLE["gradient_alignment"].function()(
            model, contexts, n_contexts=None, settings=MeasureSettings(alignment_column="other"), batch_size=4
        )
    with pytest.raises(ValueError, match="alignment_blocks must be at least 2"):
        MeasureSettings(alignment_blocks=1)
    with pytest.raises(ValueError, match="--alignment-column"):
        check_required_settings(["gradient_alignment"], MeasureSettings())


RECORD = {
    "value": 0.375, "stderr": 0.0625, "column": "task_a", "n_sources": 3, "sources": ["0", "1", "2"],
    "contexts_per_source": [80, 90, 86], "pair_cosines": [0.25, 0.5, 0.375], "n_blocks": 8, "n_contexts": 256,
    "batch_size": 32, "seconds": 4.5, "step": 40,
}  # fmt: skip


def test_card_reads_it_back_and_compare_shows_it(tmp_path, capsys):
    card = full_card(measures={"gradient_alignment": copy.deepcopy(RECORD)})
    card.save(tmp_path)
    loaded = load_flatness_card(tmp_path)
    assert loaded.measures == {"gradient_alignment": RECORD}
    text = (tmp_path / "README.md").read_text()
    assert "| Gradient alignment across sources (mean pairwise cosine) ± standard error | 0.375 ± 0.062 (" in text
    assert "sources from 'task_a', 3 sources (0, 1, 2), jackknife over 8 blocks a source), step 40 |" in text
    table = format_comparison_table([("a", loaded), ("b", full_card())]).splitlines()
    assert "gradient alignment ± stderr" in table[0] and "| 0.375 ± 0.062 (task_a, 3 sources) |" in table[2]
    assert main(["compare", str(tmp_path)]) == 0
    assert "gradient alignment ± stderr" in capsys.readouterr().out


from tests.test_trace_callback import tokenizer  # noqa: E402, F401 - the fixture


def test_trace_command_and_callback_take_it_as_the_api_does(tokenizer, tmp_path):  # noqa: F811
    from hf_flatbias import HessianTraceCallback
    from tests.helpers.tiny_models import train_word_mlm, word_mlm, word_rows

    rows = [{**row, "kind": i % 2} for i, row in enumerate(word_rows(tokenizer, 12, 1))]
    callback = HessianTraceCallback(
        eval_dataset=rows, n_contexts=12, n_draws=1, every_n_steps=3, batch_size=3, max_overhead=None,
        also_measure=("gradient_alignment",), measure_settings={"alignment_column": "kind", "alignment_blocks": 2},
    )  # fmt: skip
    trained = train_word_mlm(tmp_path / "measured", tokenizer, [callback])
    logged = [entry for entry in trained.state.log_history if "flatness/gradient_alignment" in entry]
    assert [entry["step"] for entry in logged] == [3, 6] and "flatness/gradient_alignment_stderr" in logged[-1]
    result = callback.flatness_record.measures["gradient_alignment"]
    assert result.sources == ["0", "1"] and result.contexts_per_source == [6, 6]
    assert [c["kind"] for c in callback._contexts] == [i % 2 for i in range(12)]

    folder = tmp_path / "model"
    model = word_mlm(tokenizer)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    data = tmp_path / "rows.jsonl"
    lines = [json.dumps({"input_ids": list(map(int, r["input_ids"])), "kind": r["kind"]}) for r in rows]
    data.write_text("".join(line + "\n" for line in lines))
    output = tmp_path / "out.json"
    arguments = ["trace", str(folder), "--data", str(data), "--n-contexts", "12", "--seed", "1", "--batch-size", "3"]
    arguments += ["--measures", "gradient_alignment", "--alignment-column", "kind", "--alignment-blocks", "2"]
    assert main([*arguments, "--output", str(output), "--no-progress"]) == 0
    record = json.loads(output.read_text())["measures"]["gradient_alignment"]
    contexts = build_masked_contexts(
        rows, mask_token_id=tokenizer.mask_token_id, seed=1, special_token_ids=tokenizer.all_special_ids,
        keep_columns=("kind",),
    )  # fmt: skip
    direct = estimate_gradient_alignment(model, contexts, [c["kind"] for c in contexts], n_blocks=2, batch_size=3)
    assert record["value"] == pytest.approx(direct.mean, rel=1e-9) and record["n_sources"] == 2
