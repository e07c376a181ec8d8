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
