"""Output-layer SAM (logits-SAM) with one trunk forward per step, against a plain-PyTorch SAM written here that runs
two whole forwards: ``FlatBiasTrainer`` (causal Llama, masked-LM BERT), ``FlatBiasSFTTrainer`` and
``FlatBiasDPOTrainer``, accumulation 1 and 2, float32 and float64; the trunk replay on its own; the fallbacks."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from torch import nn
from transformers import BertForMaskedLM, LlamaConfig, LlamaForCausalLM

from hf_flatbias import FlatBiasTrainer
from hf_flatbias.sharpness.trunk_replay import TrunkReplay, trunk_modules, why_trunk_cannot_be_replayed
from tests.helpers.tiny_models import (
    SEQ_LEN,
    TINY_DECODER,
    VOCAB,
    flatbias_config,
    randomize_norms,
    tiny_bert_config,
)

RHO = 0.05
LR = 0.1
STEPS = 3


def tiny_llama(dtype=torch.float32, **overrides) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return randomize_norms(LlamaForCausalLM(LlamaConfig(**{**TINY_DECODER, **overrides}))).to(dtype)


def tiny_untied_mlm(dtype=torch.float32, **overrides) -> BertForMaskedLM:
    """BERT's masked LM with its own decoder weight (tied, the decoder is the input embedding and moves the trunk)."""
    torch.manual_seed(0)
    return BertForMaskedLM(tiny_bert_config(tie_word_embeddings=False, **overrides)).to(dtype)


def causal_rows(n: int = 24, seed: int = 5) -> list[dict[str, torch.Tensor]]:
    """Random tokens with a random unlabelled tail: micro-batches hold unequal label counts."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, TINY_DECODER["vocab_size"], (n, SEQ_LEN), generator=g)
    keep = torch.randint(2, SEQ_LEN + 1, (n,), generator=g)
    labels = torch.where(torch.arange(SEQ_LEN)[None, :] < keep[:, None], ids, torch.full_like(ids, -100))
    return [{"input_ids": ids[i], "labels": labels[i]} for i in range(n)]


def masked_rows(n: int = 24, seed: int = 7) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (n, SEQ_LEN), generator=g)
    labelled = torch.rand(n, SEQ_LEN, generator=g) < 0.3
    labelled[:, 0] = True
    return [{"input_ids": ids[i], "labels": torch.where(labelled[i], ids[i], -100)} for i in range(n)]


def updates_of(trainer) -> list[list[dict[str, torch.Tensor]]]:
    """The micro-batches of each update, as the trainer's (sequential) dataloader yields them."""
    batches = [dict(b) for b in trainer.get_train_dataloader()]
    k = trainer.args.gradient_accumulation_steps
    return [batches[s * k : (s + 1) * k] for s in range(trainer.args.max_steps)]


def max_param_diff(a: nn.Module, b: nn.Module) -> float:
    return max(float((p - q).detach().abs().max()) for p, q in zip(a.parameters(), b.parameters(), strict=True))


# ---------------------------------------------------------------- the plain-PyTorch reference: two whole forwards


def reference_head_sam_sgd(model, updates, loss_of, *, lr=LR, rho=RHO):
    """SGD with SAM perturbing the output layer only: per micro-batch, g = d loss / d head at w, the head moved by
    rho g / ||g||, the whole model run again there and differentiated for every parameter, the head moved back."""
    params = list(model.parameters())
    head = list(model.get_output_embeddings().parameters())
    for update in updates:
        total = [torch.zeros_like(p) for p in params]
        for batch in update:
            grads = torch.autograd.grad(loss_of(model, batch, update), head)
            norm = math.sqrt(sum(float((g * g).sum()) for g in grads))
            saved = [p.detach().clone() for p in head]
            with torch.no_grad():
                for p, g in zip(head, grads, strict=True):
                    p.add_(g, alpha=rho / norm)
            grads = torch.autograd.grad(loss_of(model, batch, update), params, allow_unused=True)
            total = [t if g is None else t + g for t, g in zip(total, grads, strict=True)]
            with torch.no_grad():
                for p, s in zip(head, saved, strict=True):
                    p.copy_(s)
        with torch.no_grad():
            for p, t in zip(params, total, strict=True):
                p.sub_(lr * t)
    return model


def causal_loss(model, batch, update):
    """Summed next-token cross-entropy over the update's labelled tokens (Llama's loss with num_items_in_batch)."""
    logits = model(input_ids=batch["input_ids"]).logits[:, :-1]
    count = sum(int((b["labels"][:, 1:] != -100).sum()) for b in update)
    summed = nn.functional.cross_entropy(
        logits.flatten(0, 1).float(), batch["labels"][:, 1:].flatten(), ignore_index=-100, reduction="sum"
    )
    return summed / count


def masked_loss(model, batch, update):
    """Summed cross-entropy over the update's labelled tokens (the package weighs BERT's loss by tokens)."""
    logits = model(input_ids=batch["input_ids"]).logits
    count = sum(int((b["labels"] != -100).sum()) for b in update)
    summed = nn.functional.cross_entropy(
        logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100, reduction="sum"
    )
    return summed / count


class CallCounter:
    """Counts the forwards of one module (a trunk layer: replayed calls never reach it)."""

    def __init__(self, module: nn.Module):
        self.calls = 0
        module.register_forward_pre_hook(self._count)

    def _count(self, module, args):
        self.calls += 1


def first_layer(model: nn.Module) -> nn.Module:
    return model.model.layers[0] if hasattr(model, "model") else model.bert.encoder.layer[0]


# ---------------------------------------------------------------- FlatBiasTrainer

TRAINER_CASES = {"llama": (tiny_llama, causal_rows, causal_loss), "bert": (tiny_untied_mlm, masked_rows, masked_loss)}


@pytest.mark.parametrize("kind", ["llama", "bert"])
@pytest.mark.parametrize("accumulation", [1, 2])
@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-6), (torch.float64, 1e-13)])
def test_trainer_runs_the_trunk_once_and_matches_two_forward_sam(tmp_path, kind, accumulation, dtype, tolerance):
    build, rows, loss_of = TRAINER_CASES[kind]
    args = flatbias_config(
        tmp_path,
        flatness_method="sam",
        sam_rho=RHO,
        sam_parameters="output_layer",
        per_device_train_batch_size=4 // accumulation,
        gradient_accumulation_steps=accumulation,
    )
    trainer = FlatBiasTrainer(model=build(dtype), args=args, train_dataset=rows())
    counter = CallCounter(first_layer(trainer.model))
    reference = reference_head_sam_sgd(build(dtype), updates_of(trainer), loss_of)
    trainer.train()
    assert counter.calls == STEPS * accumulation, "one trunk forward per micro-batch"
    difference = max_param_diff(trainer.model, reference)
    assert difference < tolerance, difference
    assert max_param_diff(build(dtype), reference) > 1e-3  # the steps moved the weights
    plain = reference_head_sam_sgd(build(dtype), updates_of(trainer), loss_of, rho=1e-30)
    assert max_param_diff(plain, reference) > 100 * tolerance, "the check tells SAM from a plain step"


def test_functional_sam_on_the_output_layer_reuses_the_trunk_too(tmp_path):
    def run(parameters, path):
        args = flatbias_config(path, flatness_method="functional_sam", sam_rho=RHO, sam_parameters=parameters)
        trainer = FlatBiasTrainer(model=tiny_llama(torch.float64), args=args, train_dataset=causal_rows())
        counter = CallCounter(first_layer(trainer.model))
        trainer.train()
        return trainer.model, counter.calls

    # 'lm_head.*' selects the same parameters as 'output_layer', but written as a pattern
    replayed, calls = run("output_layer", tmp_path / "a")
    assert calls == STEPS
    # 'lm_head.*,model.norm.*' moves the final norm too: two whole forwards per step, the reference here
    both, calls_both = run("lm_head.*,model.norm.weight", tmp_path / "b")
    assert calls_both == 2 * STEPS
    assert max_param_diff(replayed, both) > 1e-8  # different selections, different steps
    pattern, calls_pattern = run("lm_head.*", tmp_path / "c")
    assert calls_pattern == STEPS and max_param_diff(replayed, pattern) == 0.0


def train_with_replay(tmp_path, model, rows, *, replay: bool, **overrides):
    """A SAM run on the output layer; ``replay=False`` forces the two-forward step (the code before the replay)."""
    from hf_flatbias.sharpness.methods import sam

    args = flatbias_config(tmp_path, flatness_method="sam", sam_rho=RHO, sam_parameters="output_layer", **overrides)
    trainer = FlatBiasTrainer(model=model, args=args, train_dataset=rows)
    counter = CallCounter(first_layer(trainer.model))
    if not replay:
        trainer.flatness_method.trunk_replay = lambda module: (None, 1.0)
    assert isinstance(trainer.flatness_method, sam.SamFamily)
    trainer.train()
    return trainer, counter.calls


def test_a_trunk_with_dropout_runs_twice_and_steps_as_before(tmp_path, caplog):
    """Dropout draws new masks in a second forward: reusing the first pass's would change the step, so both forwards
    run, bit for bit the two-forward step, and the log says why once."""
    build = lambda: tiny_untied_mlm(hidden_dropout_prob=0.1)  # noqa: E731
    with caplog.at_level(logging.WARNING):
        fallback, calls = train_with_replay(tmp_path / "a", build(), masked_rows(), replay=True)
    assert calls == 2 * STEPS
    assert sum("draws random numbers" in r.getMessage() for r in caplog.records) == 1
    before, _ = train_with_replay(tmp_path / "b", build(), masked_rows(), replay=False)
    assert max_param_diff(fallback.model, before.model) == 0.0


def test_tied_output_layer_runs_twice_and_matches_the_reference(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        trainer, calls = train_with_replay(tmp_path, tiny_llama(tie_word_embeddings=True), causal_rows(), replay=True)
    assert calls == 2 * STEPS
    assert sum("tied input embeddings" in r.getMessage() for r in caplog.records) == 1
    reference = reference_head_sam_sgd(tiny_llama(tie_word_embeddings=True), updates_of(trainer), causal_loss)
    assert max_param_diff(trainer.model, reference) < 1e-6


def test_total_flos_count_the_head_only(tmp_path):
    from hf_flatbias.sharpness.trunk_replay import extra_pass_share

    replayed, _ = train_with_replay(tmp_path / "a", tiny_llama(), causal_rows(), replay=True)
    two_pass, _ = train_with_replay(tmp_path / "b", tiny_llama(), causal_rows(), replay=False)
    share = extra_pass_share(tiny_llama(), tiny_llama().lm_head)
    assert 0 < share < 1
    assert replayed.state.total_flos == pytest.approx(two_pass.state.total_flos * (1 + share) / 2)


# ---------------------------------------------------------------- the replay on its own


class GlueFeedsTheHead(nn.Module):
    """A model whose glue passes the logits through a trunk module (``post``) after the head: the replay must run
    ``post`` again at w + e, since its input depends on the head."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(3, 4), nn.Tanh())
        self.head = nn.Linear(4, 5)
        self.post = nn.Linear(5, 2)

    def forward(self, x):
        return self.post(self.head(self.body(x))).pow(2).sum()


def test_replay_runs_again_what_depends_on_the_head_and_gives_the_two_forward_gradient():
    x = torch.randn(6, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    model = GlueFeedsTheHead().double()
    params = list(model.parameters())
    assert why_trunk_cannot_be_replayed(model, model.head, list(model.head.parameters())) is None
    replay = TrunkReplay(trunk_modules(model, model.head))
    assert replay.modules == [model.body, model.post]

    def step(use_replay: bool) -> list[torch.Tensor]:
        with replay.recording() if use_replay else torch.enable_grad():
            loss = model(x)
        grads = torch.autograd.grad(loss, list(model.head.parameters()))
        with torch.no_grad():
            for p, g in zip(model.head.parameters(), grads, strict=True):
                p.add_(0.1 * g)
        with replay.replaying() if use_replay else torch.enable_grad():
            result = torch.autograd.grad(model(x), params)
        with torch.no_grad():
            for p, g in zip(model.head.parameters(), grads, strict=True):
                p.sub_(0.1 * g)
        replay.clear()
        return list(result)

    expected = step(False)
    got = step(True)
    assert (replay.replayed, replay.computed) == (1, 1)  # body replayed, post run again
    assert max(float((a - b).abs().max()) for a, b in zip(got, expected, strict=True)) < 1e-14


def test_replay_refuses_a_trunk_that_draws_random_numbers():
    model = GlueFeedsTheHead()
    model.body.append(nn.Dropout(0.5))
    replay = TrunkReplay(trunk_modules(model, model.head))
    with replay.recording():
        model(torch.randn(2, 3))
    assert replay.drew_random_numbers
    with replay.replaying() as replayed:
        assert not replayed


def test_tied_and_compiled_models_are_named_as_not_replayable():
    tied = tiny_llama(tie_word_embeddings=True)
    assert "tied" in why_trunk_cannot_be_replayed(tied, tied.lm_head, [tied.lm_head.weight])
    model = tiny_llama()
    assert "not all in the output layer" in why_trunk_cannot_be_replayed(
        model, model.lm_head, [model.lm_head.weight, model.model.norm.weight]
    )
    compiled = torch.compile(model)
    assert "compiled" in why_trunk_cannot_be_replayed(compiled, model.lm_head, [model.lm_head.weight])
