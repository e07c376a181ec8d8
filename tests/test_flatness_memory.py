"""batch_size="auto": the bytes one context adds to a per_sample batch, and the batch size a budget allows."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hf_flatbias.flatness import TraceContexts, estimate_hessian_trace
from hf_flatbias.flatness.contexts import build_masked_contexts
from hf_flatbias.flatness.memory import auto_batch_size, per_sample_bytes_per_context

VOCAB = 32


def _llama():
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
    )
    return LlamaForCausalLM(config).eval()


def _rows(n, length, seed=0):
    generator = torch.Generator().manual_seed(seed)
    rows = [{"input_ids": torch.randint(2, VOCAB, (length,), generator=generator).tolist()} for _ in range(n)]
    return build_masked_contexts(rows, mask_token_id=None, causal=True, seed=seed)


def _longest_context_bytes(model, rows):
    contexts = TraceContexts.from_rows(rows, causal=True)
    longest = max(range(len(contexts)), key=lambda i: len(contexts.input_ids[i]))
    return contexts, per_sample_bytes_per_context(model, contexts, longest)


def test_bytes_per_context_grow_with_the_context_and_set_the_batch_size():
    model = _llama()
    short_contexts, short = _longest_context_bytes(model, [{**r} for r in _rows(6, 8)])
    _, long = _longest_context_bytes(model, _rows(6, 32))
    # activations grow linearly with the length, Gram matrices quadratically
    assert 2.0 < long / short < 16.0
    # at least the hidden states of every layer: 2 layers x 32 tokens x 16 features x 4 bytes, many times over
    assert long > 10 * 2 * 32 * 16 * 4
    indices = list(range(len(short_contexts)))
    # the one-context check's gradient: the largest tensor's, thrice (a tied matrix's two uses and their sum)
    gradient = 3 * 4 * max(p.numel() for p in model.parameters())
    assert auto_batch_size(model, short_contexts, indices, memory_budget=gradient + 3 * short + short // 2) == 3
    assert auto_batch_size(model, short_contexts, indices, memory_budget=gradient + 100 * short) == len(indices)
    with pytest.raises(ValueError, match="memory budget"):
        auto_batch_size(model, short_contexts, indices, memory_budget=gradient + short // 2)


def test_auto_batch_size_gives_the_same_estimate():
    model, rows = _llama(), _rows(10, 12)
    fixed = estimate_hessian_trace(model, rows, n_draws=2, batch_size=3)
    auto = estimate_hessian_trace(model, rows, n_draws=2, batch_size="auto")
    assert auto.mean == pytest.approx(fixed.mean, rel=1e-6)
    with pytest.raises(ValueError, match="'auto'"):
        estimate_hessian_trace(model, rows, batch_size="big")


def test_the_recorder_holds_only_what_the_graph_saves_and_no_graph_after_it():
    """The recorded outputs the graph does not save (the query and output projections of a Llama layer) are freed
    as the forward goes, their gradients still reach the recorder, and nothing of a measurement outlives it."""
    import gc
    import weakref

    from hf_flatbias.flatness.ghost import GhostNormRecorder
    from hf_flatbias.flatness.lm import logits_at_positions

    model = _llama()
    contexts = TraceContexts.from_rows(_rows(3, 8), causal=True)
    batch = contexts.model_inputs([0, 1, 2], model)
    decoder = model.get_output_embeddings()
    recorder = GhostNormRecorder(model, list(model.parameters()), keep_outputs_of=(decoder,))
    recorder.batch_size = 3
    with recorder:
        logits = logits_at_positions(model, batch, torch.tensor(contexts.positions))
    names = {module: name for name, module in model.named_modules()}
    freed = {names[call.module].split(".")[-1] for call in recorder.calls if call.output is None}
    assert {"q_proj", "o_proj", "down_proj"} <= freed
    assert next(call for call in recorder.calls if call.module is decoder).output is logits
    grad = torch.ones_like(logits)
    recorder.gradients_at_outputs(logits, grad, retain_graph=True)
    assert all(call.grad_output is not None for call in recorder.calls)
    # the same gradients as autograd's at the outputs the graph keeps
    kept = [call for call in recorder.calls if call.output is not None]
    expected = torch.autograd.grad(logits, [call.output for call in kept], grad, retain_graph=True)
    for call, reference in zip(kept, expected, strict=True):
        torch.testing.assert_close(call.grad_output, reference, rtol=0, atol=0)
    # no reference cycle: the graph and the recorder go with the last references to them, without the collector
    gc.disable()
    try:
        recorder_ref, logits_ref = weakref.ref(recorder), weakref.ref(logits)
        del recorder, logits, kept, expected, call, reference
        assert recorder_ref() is None and logits_ref() is None
    finally:
        gc.enable()
