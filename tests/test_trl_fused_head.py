"""The trl fused-head adapter (hf_flatbias/integrations/trl_fused_head.py) against the installed trl: the forward it
re-implements is trl's own, output for output, and on a trl whose add_fused_lm_head differs from the release it was
read from, the trainers keep trl's head and this file fails naming that trl (issue 58)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl")

import trl  # noqa: E402
from trl.trainer.utils import add_fused_lm_head  # noqa: E402

from hf_flatbias.integrations import trl_fused_head  # noqa: E402
from hf_flatbias.integrations.trl_fused_head import (  # noqa: E402
    TRL_FUSED_HEAD_READ,
    forward_with_head_gradients,
    fused_forward_without_metrics,
    fused_head_differs,
    why_head_gradients_stay_in_backward,
)
from tests.test_logits_sam import tiny_llama  # noqa: E402


def test_the_installed_trls_fused_head_is_the_one_the_adapter_was_read_from():
    assert fused_head_differs() is None, (
        f"trl {trl.__version__} changed add_fused_lm_head (the adapter mirrors trl {TRL_FUSED_HEAD_READ['trl']}'s): "
        "read its fused forward again, bring forward_with_head_gradients in line, and record the new release and "
        "source hash in TRL_FUSED_HEAD_READ. Until then the trainers keep trl's own head for output-layer SAM."
    )


def test_on_another_trl_the_head_is_trls_own(monkeypatch):
    model = tiny_llama(torch.float64, tie_word_embeddings=False)
    assert why_head_gradients_stay_in_backward(model) is None
    monkeypatch.setitem(TRL_FUSED_HEAD_READ, "add_fused_lm_head_sha256", "0" * 64)
    fused_head_differs.cache_clear()
    try:
        reason = why_head_gradients_stay_in_backward(model)
        assert reason is not None and f"trl {trl.__version__}" in reason and "differs" in reason
    finally:
        monkeypatch.undo()
        fused_head_differs.cache_clear()


@pytest.mark.parametrize("pre_shifted", [False, True])
def test_the_mirrored_forward_returns_what_trls_fused_forward_returns(pre_shifted):
    """In float32, the precision trl's kernel computes in (a float64 model's fields come back float32 from trl's,
    float64 from ours: tests/test_logits_sam_trl.py holds ours to float64 autograd)."""
    model = tiny_llama(torch.float32, tie_word_embeddings=False)
    add_fused_lm_head(model, outputs=("log_probs", "entropy", "mean_logits", "is_top1"))
    g = torch.Generator().manual_seed(5)
    input_ids = torch.randint(2, 16, (3, 7), generator=g)
    labels = input_ids.masked_fill(torch.rand(3, 7, generator=g) < 0.3, -100)
    label_args = {"shift_labels": labels} if pre_shifted else {"labels": labels}
    theirs = model(input_ids=input_ids, fused_lm_head=True, num_items_in_batch=17, **label_args)
    ours = forward_with_head_gradients(model, lambda: True)(
        input_ids=input_ids, fused_lm_head=True, num_items_in_batch=17, **label_args
    )
    assert type(ours) is type(theirs)
    assert torch.equal(ours.label_mask, theirs.label_mask) and torch.equal(ours.is_top1, theirs.is_top1)
    for name in ("loss", "log_probs", "entropy", "mean_logits"):
        mine, trls = getattr(ours, name), getattr(theirs, name)
        assert mine.shape == trls.shape and mine.dtype == trls.dtype, name
        assert torch.allclose(mine, trls, rtol=0, atol=2e-6), name


def test_the_fused_head_is_found_where_trl_added_it():
    model = tiny_llama(torch.float64, tie_word_embeddings=False)
    assert fused_forward_without_metrics(model, ()) is None  # no fused head: trl's forward has not been patched
    add_fused_lm_head(model)
    assert callable(fused_forward_without_metrics(model, ("log_sum_sq_probs",)))
    assert trl_fused_head.__doc__ and "trl 1.16" in trl_fused_head.__doc__
