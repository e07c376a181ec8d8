"""Campaign v2's committed checkpoints re-measured by independent code (issue 33, "Checked by ... held-out").

The committed starts' KL, with the conditionals from brute-force sentence probabilities (the inside pass alone, no
outside pass: `brute_force_pcfg_conditionals`, the helper v1's check uses) and the masked rows built here, against
the project's `measure_saturation`; and the project's full-set measurement against what starts.json recorded. The
held-out probe reading of C4 (``recipes/heldout_v2.py``) is checked against its JSON and the docs' section.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
from research import campaign_v2 as cv2  # noqa: E402
from research.campaign import SHAPES  # noqa: E402
from research.paper_language import _seeds  # noqa: E402
from research.saturation import measure_saturation  # noqa: E402
from transformers import BertForMaskedLM  # noqa: E402

from hf_flatbias.synthetic import PCFG  # noqa: E402
from hf_flatbias.synthetic.tokenizer import CLS_ID, MASK_ID, N_SPECIAL, PAD_ID, SEP_ID  # noqa: E402
from tests.test_saturated_start import brute_force_pcfg_conditionals  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "recipes" / "research" / "results" / "campaign_v2"
WEIGHTS = RESULTS / "starts"
#: KL sentences re-measured by brute force per start (of the 1,000): ~1.5 s of sentence probabilities each
N_BRUTE = 150
#: H64 (the claims' width) all seeds, and one start of each other width
STARTS = [(64, s) for s in range(5)] + [(128, 0), (48, 0)]


@pytest.fixture(scope="module")
def kl_material():
    """v2's grammar and KL set as `campaign_v2.load_material` builds them (v1's `setup_paper_language`: grammar seed
    0, the three-level shape, the KL draw of `_seeds`), without its 200k training sentences; the brute-force
    conditionals of the first `N_BRUTE` sentences and the grammar's own of all, computed once for every start."""
    grammar = PCFG.paper_shaped(0, **SHAPES["three_level"])
    kl = grammar.sample(cv2.Sizes().n_kl, seed=_seeds(0)[1])
    word_ids, lengths = kl.word_ids[:N_BRUTE], kl.lengths[:N_BRUTE]
    full = grammar.masked_conditionals(kl.word_ids, kl.lengths)
    return {
        "grammar": grammar,
        "kl": kl,
        "full": full,
        "brute": brute_force_pcfg_conditionals(grammar, word_ids, lengths),
        "project": full[:N_BRUTE],
    }


def masked_inputs(word_ids: np.ndarray, lengths: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    """Every position of every sentence masked in turn, written here: ``[CLS] words [SEP]`` as token ids (words
    shifted past the special tokens), padded to the longest, the masked position's word replaced by ``[MASK]``.
    Returns the ids, the attention mask and each row's (sentence, word position)."""
    pairs = np.array([(i, t) for i, n in enumerate(lengths) for t in range(n)])
    ids = np.full((len(pairs), int(lengths.max()) + 2), PAD_ID, dtype=np.int64)
    for row, (i, t) in enumerate(pairs):
        n = lengths[i]
        ids[row, 0], ids[row, n + 1] = CLS_ID, SEP_ID
        ids[row, 1 : n + 1] = word_ids[i, :n] + N_SPECIAL
        ids[row, t + 1] = MASK_ID
    return torch.as_tensor(ids), torch.as_tensor((ids != PAD_ID).astype(np.int64)), pairs


def independent_kl(model: torch.nn.Module, word_ids, lengths, conditionals: np.ndarray, n_words: int) -> float:
    """Mean over masked positions of ``sum_w p log(p / q)``, q the model's softmax over the whole vocabulary read at
    the masked token, in float64."""
    ids, attention, pairs = masked_inputs(word_ids, lengths)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attention).logits
    log_q = torch.log_softmax(logits[torch.arange(len(pairs)), torch.as_tensor(pairs[:, 1] + 1)].double(), -1)
    log_q = log_q.numpy()[:, N_SPECIAL : N_SPECIAL + n_words]
    p = conditionals[pairs[:, 0], pairs[:, 1]]
    terms = np.where(p > 0, p * (np.log(np.where(p > 0, p, 1.0)) - log_q), 0.0)
    return float(terms.sum() / len(pairs))


def test_brute_force_conditionals_equal_the_grammars_on_the_kl_sentences(kl_material):
    """The grammar implementations agree on v2's KL sentences themselves (the exact targets every v2 KL reads)."""
    np.testing.assert_allclose(kl_material["brute"], kl_material["project"], atol=1e-6)
    assert (kl_material["kl"].lengths[:N_BRUTE] < kl_material["kl"].lengths[:N_BRUTE].max()).any()  # padded rows


@pytest.mark.parametrize(("width", "seed"), STARTS, ids=[f"h{w}-seed{s}" for w, s in STARTS])
def test_committed_v2_start_kl_re_measured_by_brute_force_conditionals(kl_material, width, seed):
    """A committed v2 start: KL on the first `N_BRUTE` KL sentences from the brute-force conditionals and the rows
    built here equals the project's `measure_saturation` there (1e-6 nats), and the project's measurement on the
    full KL set equals what starts.json recorded for the start (rel 1e-6: float32 kernels round differently)."""
    directory = WEIGHTS / f"h{width}" / f"seed{seed}" / "start"
    if not (directory / "model.safetensors").exists():
        pytest.skip(f"the weights of h{width} seed {seed} are not committed")
    grammar, kl = kl_material["grammar"], kl_material["kl"]
    model = BertForMaskedLM.from_pretrained(directory).eval()
    assert model.config.hidden_size == width
    word_ids, lengths = kl.word_ids[:N_BRUTE], kl.lengths[:N_BRUTE]
    independent = independent_kl(model, word_ids, lengths, kl_material["brute"], grammar.n_words)
    project = measure_saturation(model, word_ids, kl_material["project"], lengths).kl
    assert independent == pytest.approx(project, abs=1e-6)
    assert 0 < independent < 0.05  # a distilled model, not a constant: the comparison can fail
    recorded = json.loads((RESULTS / "starts.json").read_text())["units"][cv2.start_key(width, seed)]
    assert recorded["status"] == "done"
    full = measure_saturation(model, kl.word_ids, kl_material["full"], kl.lengths)
    assert full.kl == pytest.approx(recorded["measured"]["kl"], rel=1e-6)


# ---------------------------------------------------------------- the held-out probe reading of C4


@pytest.fixture(scope="module")
def heldout(recipes):
    return recipes.load("heldout_v2")


def test_heldout_features_equal_the_rulers_on_the_same_sentences(heldout, kl_material):
    """The features written in the held-out script (model's last layer, the unmasked lookup row) are the ruler's own
    on the same sentences, so the held-out reading differs from the committed one by its sentences and probe code
    only, not by what it reads."""
    from research.paper_language import SentenceSet
    from research.ruler import layer_features
    from research.ruler_reads import baseline_features

    from hf_flatbias.synthetic import build_model

    grammar = kl_material["grammar"]
    word_ids, lengths = heldout.fresh_pool(grammar, 40, 0)
    conditionals = grammar.masked_conditionals(word_ids, lengths)
    model = build_model(N_SPECIAL + grammar.n_words, hidden=16, layers=2, seed=0).eval()
    sentences = SentenceSet(word_ids, lengths, {})
    ours = heldout.last_layer_features(model, word_ids, lengths, grammar.max_length)
    ruler = layer_features(model, sentences, [2], grammar.max_length)[2]
    np.testing.assert_allclose(ours, ruler, atol=1e-5)
    row = heldout.unmasked_lookup_features(word_ids, lengths, conditionals, grammar.n_words)
    np.testing.assert_allclose(row, baseline_features(grammar, sentences, "unmasked_lookup"), atol=1e-6)
    assert (lengths >= 5).all() and (lengths < grammar.max_length).any()  # probe sentences, some padded


def test_heldout_probe_reads_what_fit_probe_reads_at_the_same_c(heldout):
    """sklearn's LogisticRegression on features standardised by hand, against the project's `fit_probe` pipeline at
    the same C: the same objective, so the same accuracy (to a row) on a problem where C matters."""
    from research.ruler import probe_test_accuracy

    rng = np.random.default_rng(0)
    centres = rng.normal(size=(3, 30)) * 0.4
    y = rng.integers(0, 3, size=800)
    x = centres[y] + rng.normal(size=(800, 30)) * rng.uniform(0.5, 5, size=30)  # columns on different scales
    for c in (0.003, 0.3):
        ours = heldout.probe_accuracy(x[:400], y[:400], x[400:], y[400:], c)
        project = probe_test_accuracy(x[:400], y[:400], x[400:], y[400:], regularization=c)
        assert ours == pytest.approx(project, abs=1 / 400)
    assert heldout.probe_accuracy(x[:400], y[:400], x[400:], y[400:], 0.0001) < ours  # C is not ignored


def test_heldout_pool_is_prefix_stable_and_another_stream_than_the_rulers(heldout, kl_material):
    from research.ruler import ruler_pool

    grammar = kl_material["grammar"]
    short, _ = heldout.fresh_pool(grammar, 30, 0)
    long, _ = heldout.fresh_pool(grammar, heldout.CHUNK, 0)  # a second chunk drawn: the first rows unchanged
    np.testing.assert_array_equal(long[:30], short)
    ruler = ruler_pool(grammar, 30, 0).word_ids
    ruler = np.pad(ruler, ((0, 0), (0, grammar.max_length - ruler.shape[1])), constant_values=-1)
    assert (ruler != short).any(1).all()


def test_committed_heldout_reading_recomputes_and_the_docs_tables_equal_it(heldout):
    path = RESULTS / "heldout.json"
    if not path.exists():
        pytest.skip("heldout.json is not committed")
    state = json.loads(path.read_text())
    c4 = json.loads((RESULTS / "claims" / "C4.json").read_text())
    assert state["sizes"]["C"] == c4["ruler"]["regularization"]
    again = heldout.compare(state["reads"], c4, state["sizes"]["seeds"], state["splits_planned"])
    assert json.loads(json.dumps(again)) == state["comparison"]
    docs = (REPO / "docs" / "reproduction" / "campaign_v2.md").read_text()
    begin, end = "<!-- heldout_v2: begin -->", "<!-- heldout_v2: end -->"
    assert docs[docs.index(begin) + len(begin) : docs.index(end)].strip() == heldout.heldout_markdown(state)
    assert docs.index(end) < docs.index("## The claims phase")
