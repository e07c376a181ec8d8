"""The flatness steps inside trl's SFTTrainer and DPOTrainer, against plain-PyTorch steps written here.

Each reference takes the very micro-batches the trainer's dataloader yields (trl's tokenization and collation are
data, not what is tested) and writes the loss from its definition: SFT's summed next-token NLL over the update's
trained tokens; DPO's -log sigmoid(beta * margin of the policy/reference log-ratios), reference log-probabilities
from a frozen copy of the initial model, computed once per micro-batch.
"""

from __future__ import annotations

import copy
import random
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("trl")

from datasets import Dataset  # noqa: E402

from hf_flatbias import FlatBiasDPOConfig, FlatBiasDPOTrainer, FlatBiasSFTConfig, FlatBiasSFTTrainer  # noqa: E402
from tests.helpers.tiny_models import flatbias_config, logged_losses, tiny_llama, word_tokenizer  # noqa: E402
from tests.test_regularizers import grad_list, max_param_diff, norm_of  # noqa: E402

N_WORDS = 20
TRL_DEFAULTS_OFF = dict(bf16=False, gradient_checkpointing=False)


@pytest.fixture(scope="module")
def tokenizer():
    return word_tokenizer(N_WORDS)


def words(rng: random.Random, low: int, high: int) -> str:
    return " ".join(f"w{rng.randrange(N_WORDS)}" for _ in range(rng.randint(low, high)))


def prompt_completion_rows(n: int = 16, seed: int = 0) -> Dataset:
    rng = random.Random(seed)
    return Dataset.from_list([{"prompt": words(rng, 2, 4), "completion": " " + words(rng, 2, 5)} for _ in range(n)])


def text_rows(n: int = 16, seed: int = 1) -> Dataset:
    rng = random.Random(seed)
    return Dataset.from_list([{"text": words(rng, 3, 7)} for _ in range(n)])


def preference_rows(n: int = 12, seed: int = 2) -> Dataset:
    rng = random.Random(seed)
    return Dataset.from_list(
        [
            {"prompt": words(rng, 2, 3), "chosen": " " + words(rng, 1, 4), "rejected": " " + words(rng, 1, 4)}
            for _ in range(n)
        ]
    )


def sft_config(tmp_path, **overrides) -> FlatBiasSFTConfig:
    return flatbias_config(tmp_path, FlatBiasSFTConfig, **{**TRL_DEFAULTS_OFF, "shuffle_dataset": False, **overrides})


def dpo_config(tmp_path, **overrides) -> FlatBiasDPOConfig:
    return flatbias_config(tmp_path, FlatBiasDPOConfig, **{**TRL_DEFAULTS_OFF, "beta": 0.5, **overrides})


def fresh_model(trainer):
    """The trainer's initial model built again: a deep copy of a trl model would keep calling the original (trl's
    fused LM head closes over the forward of the model it patched)."""
    return tiny_llama(trainer.model.config.vocab_size).to(trainer.model.dtype)


def with_lora(model, seed: int = 3):
    """LoRA adapters on the attention's q and v projections (B starts at zero, so the policy starts as the base)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    return get_peft_model(model, LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))


def updates_of(trainer) -> list[list[dict[str, torch.Tensor]]]:
    """The micro-batches of each update, as the trainer's (sequential) dataloader yields them."""
    batches = list(trainer.get_train_dataloader())
    k, steps = trainer.args.gradient_accumulation_steps, trainer.args.max_steps
    assert len(batches) >= k * steps, "the test data is too short for the steps asked"
    return [[dict(b) for b in batches[s * k : (s + 1) * k]] for s in range(steps)]


# ---------------------------------------------------------------- losses from their definitions


def next_token_logits(model, batch):
    inputs = {key: value for key, value in batch.items() if key not in ("labels", "completion_mask")}
    # without a cache, transformers reads packed documents' boundaries from position_ids (a cache would hide them)
    return model(**inputs, use_cache=False).logits[:, :-1]


def trained_token_count(update) -> int:
    return sum(int((batch["labels"][:, 1:] != -100).sum()) for batch in update)


def sft_loss(model, batch, update):
    """Summed next-token NLL of the micro-batch over the trained tokens of the whole update."""
    logits, labels = next_token_logits(model, batch), batch["labels"][:, 1:]
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum") / (
        trained_token_count(update)
    )


def completion_log_probs(model, batch):
    """log p(completion | prompt) of every row (chosen rows first, then rejected)."""
    log_probs = torch.log_softmax(next_token_logits(model, batch).float(), -1)
    targets = batch["input_ids"][:, 1:]
    per_token = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return (per_token * batch["completion_mask"][:, 1:]).sum(1)


def dpo_loss_function(reference_model, beta):
    # keyed by id, the batch kept alive beside its values so that a freed batch's id cannot be reused by another
    references: dict[int, tuple[dict, torch.Tensor]] = {}

    def loss(model, batch, update):
        key = id(batch)
        if key not in references:  # once per micro-batch, at the weights before its first pass
            with torch.no_grad():
                references[key] = (batch, completion_log_probs(reference_model, batch))
        chosen, rejected = (completion_log_probs(model, batch) - references[key][1]).chunk(2)
        return -F.logsigmoid(beta * (chosen - rejected)).mean() / len(update)

    return loss


def reference_sam_sgd(model, updates, loss_of, *, lr, rho, scope):
    """SAM with SGD: e = rho g / ||g|| from each micro-batch's gradient ('micro_batch') or the update's ('batch'),
    the gradient at w + e summed over the update's micro-batches."""
    params = [p for p in model.parameters() if p.requires_grad]

    def perturbation(grads):
        norm = norm_of(grads)
        return [rho * g / norm for g in grads]

    for update in updates:
        if scope == "batch":
            per_batch = [grad_list(loss_of(model, b, update), params) for b in update]
            first = [sum(parts) for parts in zip(*per_batch, strict=True)]
            eps = perturbation(first)
        total = [torch.zeros_like(p) for p in params]
        for batch in update:
            if scope == "micro_batch":
                eps = perturbation(grad_list(loss_of(model, batch, update), params))
            saved = [p.detach().clone() for p in params]
            with torch.no_grad():
                torch._foreach_add_(params, eps)
            total = [t + g for t, g in zip(total, grad_list(loss_of(model, batch, update), params), strict=True)]
            with torch.no_grad():
                for p, s in zip(params, saved, strict=True):
                    p.copy_(s)
        with torch.no_grad():
            for p, t in zip(params, total, strict=True):
                p.sub_(lr * t)
    return model


def reference_penalty_sgd(model, updates, *, method, lr, lam, h, seed=0):
    """The penalties from their formulas (as in test_regularizers), on SFT's loss: grad_norm: (1 - lam/h) g(w) +
    lam/h g(w + h u); fisher: g_data(w + h u) + 2 lam N ||g_y|| / h (g_y(w + h u) - g_y(w)) / k with y drawn from
    the model at the trained positions, u = g / ||g|| (g_y for fisher)."""
    params = [p for p in model.parameters() if p.requires_grad]
    generator = torch.Generator().manual_seed(seed)

    def labelled_logits(batch):
        return next_token_logits(model, batch)[batch["labels"][:, 1:] != -100]

    for update in updates:
        total = [torch.zeros_like(p) for p in params]
        for batch in update:
            if method == "fisher_penalty":
                logits = labelled_logits(batch)
                # drawn from float32 probabilities, as the package draws them (the same draws in any dtype)
                probabilities = torch.softmax(logits.detach().float(), -1)
                y = torch.multinomial(probabilities, 1, generator=generator).squeeze(-1)
                g = grad_list(F.cross_entropy(logits, y), params)
            else:
                g = grad_list(sft_loss(model, batch, update), params)
            g_norm = norm_of(g)
            saved = [p.detach().clone() for p in params]
            with torch.no_grad():
                torch._foreach_add_(params, [gi * (h / g_norm) for gi in g])
            if method == "fisher_penalty":
                data = grad_list(sft_loss(model, batch, update), params)
                shifted_y = grad_list(F.cross_entropy(labelled_logits(batch), y), params)
                c = 2 * lam * len(y) * g_norm / h / len(update)
                step = [d + c * (s - gi) for d, s, gi in zip(data, shifted_y, g, strict=True)]
            else:
                r = lam / h
                shifted = grad_list(sft_loss(model, batch, update), params)
                step = [(1 - r) * gi + r * s for gi, s in zip(g, shifted, strict=True)]
            with torch.no_grad():
                for p, s in zip(params, saved, strict=True):
                    p.copy_(s)
            total = [t + s for t, s in zip(total, step, strict=True)]
        with torch.no_grad():
            for p, t in zip(params, total, strict=True):
                p.sub_(lr * t)
    return model


# ---------------------------------------------------------------- SFT


SFT_CASES = {
    # name: (dataset, config overrides)
    "completion_only": (prompt_completion_rows, {}),
    "language_modeling": (text_rows, {}),
    "packing": (text_rows, {"packing": True, "max_length": 16, "per_device_train_batch_size": 2}),
}


def sft_trainer(
    tmp_path,
    tokenizer,
    case,
    dtype=torch.float32,
    *,
    model=None,
    n_eval=0,
    peft_config=None,
    callbacks=None,
    **overrides,
):
    """SFT of ``model`` (a fresh `tiny_llama` in ``dtype`` unless given) on ``case``'s rows (`SFT_CASES`), with
    ``n_eval`` held-out rows of the same kind (seed 5) if any; ``overrides`` are config fields."""
    rows, case_overrides = SFT_CASES[case]
    args = sft_config(tmp_path, **{**case_overrides, **overrides})
    model = tiny_llama(len(tokenizer)).to(dtype) if model is None else model
    return FlatBiasSFTTrainer(
        model=model,
        args=args,
        train_dataset=rows(),
        eval_dataset=rows(n=n_eval, seed=5) if n_eval else None,
        processing_class=tokenizer,
        peft_config=peft_config,
        callbacks=callbacks,
    )


@pytest.mark.parametrize(
    "case,scope,accumulation",
    [
        ("completion_only", "micro_batch", 1),
        ("completion_only", "micro_batch", 2),
        ("completion_only", "batch", 2),
        ("language_modeling", "batch", 2),
        ("packing", "micro_batch", 2),
        ("packing", "batch", 2),
    ],
)
def test_sft_sam_matches_plain_pytorch_sam(tmp_path, tokenizer, case, scope, accumulation):
    batch_size = SFT_CASES[case][1].get("per_device_train_batch_size", 4) // accumulation
    trainer = sft_trainer(
        tmp_path,
        tokenizer,
        case,
        flatness_method="sam",
        sam_scope=scope,
        per_device_train_batch_size=batch_size,
        gradient_accumulation_steps=accumulation,
    )
    if case == "completion_only":
        assert all(int(b["labels"][0, 1]) == -100 for update in updates_of(trainer) for b in update)  # prompt masked
    if case == "packing":
        assert all("position_ids" in b for update in updates_of(trainer) for b in update)
    reference = reference_sam_sgd(fresh_model(trainer), updates_of(trainer), sft_loss, lr=0.1, rho=0.05, scope=scope)
    initial = fresh_model(trainer)
    trainer.train()
    difference = max_param_diff(trainer.model, reference)
    assert difference < 1e-6, difference
    assert max_param_diff(initial, reference) > 1e-3  # the steps moved the weights


def test_sft_sam_with_lora_perturbs_and_trains_the_adapters_only(tmp_path, tokenizer):
    trainer = sft_trainer(
        tmp_path,
        tokenizer,
        "completion_only",
        model=with_lora(tiny_llama(len(tokenizer))),
        flatness_method="sam",
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
    )
    reference = reference_sam_sgd(
        with_lora(tiny_llama(len(tokenizer))), updates_of(trainer), sft_loss, lr=0.1, rho=0.05, scope="micro_batch"
    )
    trainer.train()
    assert max_param_diff(trainer.model, reference) < 1e-6
    base = tiny_llama(len(tokenizer))
    for name, p in trainer.model.get_base_model().named_parameters():
        if "lora_" not in name:
            assert torch.equal(p, base.get_parameter(name.replace(".base_layer", ""))), name


@pytest.mark.parametrize("method", ["fisher_penalty", "grad_norm_penalty"])
def test_sft_penalties_match_their_definitions(tmp_path, tokenizer, method):
    # float64 weights: the finite difference divides by h = 0.01 and amplifies rounding (float32 weights: 8e-7 apart;
    # float64: 3e-7, trl's fused LM head still returning float32-accurate log-probabilities)
    trainer = sft_trainer(
        tmp_path,
        tokenizer,
        "completion_only",
        dtype=torch.float64,
        flatness_method=method,
        penalty_lambda=0.02,
        penalty_fd_step=0.01,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
    )
    updates = updates_of(trainer)
    reference = reference_penalty_sgd(fresh_model(trainer), updates, method=method, lr=0.1, lam=0.02, h=0.01)
    plain = reference_sam_sgd(fresh_model(trainer), updates, sft_loss, lr=0.1, rho=1e-12, scope="micro_batch")
    trainer.train()
    assert max_param_diff(trainer.model, reference) < 1e-6
    assert max_param_diff(plain, reference) > 1e-5  # the penalty changed the steps


def logged_steps(trainer) -> list[dict[str, float]]:
    return [entry for entry in trainer.state.log_history if "loss" in entry]


@pytest.mark.parametrize(
    "method,scope", [("sam", "micro_batch"), ("sam", "batch"), ("looksam", "micro_batch"), ("fisher_penalty", None)]
)
def test_sft_second_pass_logs_nothing_twice(tmp_path, tokenizer, method, scope):
    overrides = dict(per_device_train_batch_size=2, gradient_accumulation_steps=2)
    plain = sft_trainer(tmp_path / "plain", tokenizer, "completion_only", **overrides)
    plain.train()
    flat = sft_trainer(
        tmp_path / "flat",
        tokenizer,
        "completion_only",
        flatness_method=method,
        sam_scope=scope or "micro_batch",
        **overrides,
    )
    flat.train()
    first_plain, first_flat = logged_steps(plain)[0], logged_steps(flat)[0]
    # the first update's clean pass sees the same weights as the plain step
    for key in ("loss", "entropy", "mean_token_accuracy"):
        assert first_flat[key] == pytest.approx(first_plain[key], abs=1e-6), key
    assert [e["num_tokens"] for e in logged_steps(flat)] == [e["num_tokens"] for e in logged_steps(plain)]
    if method != "fisher_penalty":
        assert first_flat["sam/perturbed_loss"] > first_flat["loss"]


def test_sft_config_keeps_trl_defaults_and_validates_flatness_fields(tmp_path):
    from trl import SFTConfig

    ours, trl_own = FlatBiasSFTConfig(str(tmp_path), use_cpu=True), SFTConfig(str(tmp_path), use_cpu=True)
    for name in ("learning_rate", "logging_steps", "gradient_checkpointing", "bf16", "max_length"):
        assert getattr(ours, name) == getattr(trl_own, name), name
    with pytest.raises(ValueError, match="sam_rho"):
        FlatBiasSFTConfig(str(tmp_path), use_cpu=True, flatness_method="sam", sam_rho=-1.0)


def test_activation_offloading_is_refused_with_a_flatness_method(tmp_path, tokenizer):
    with pytest.raises(ValueError, match="activation_offloading=False"):
        sft_trainer(tmp_path, tokenizer, "completion_only", flatness_method="sam", activation_offloading=True)


def test_trainers_keep_trl_tags_and_add_ours():
    assert FlatBiasSFTTrainer._tag_names == ["trl", "sft", "hf_flatbias"]
    assert FlatBiasDPOTrainer._tag_names == ["trl", "dpo", "hf_flatbias"]


def test_without_trl_the_names_ask_for_the_extra(tmp_path):
    code = (
        "import sys; sys.modules['trl'] = None\n"
        "import hf_flatbias\n"
        "try:\n    hf_flatbias.FlatBiasSFTTrainer\nexcept ImportError as e:\n    print(e)\n"
        "print(hf_flatbias.FlatBiasConfig.__name__)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert 'pip install "hf_flatbias[trl]"' in result.stdout, result.stderr
    assert "FlatBiasConfig" in result.stdout


# ---------------------------------------------------------------- DPO


def dpo_trainer(tmp_path, tokenizer, *, live_reference, n_eval=0, callbacks=None, **overrides):
    """DPO of a fresh `tiny_llama` on `preference_rows`, the reference a live copy of it or precomputed, with
    ``n_eval`` held-out pairs (seed 5) if any; ``overrides`` are config fields."""
    model = tiny_llama(len(tokenizer))
    reference = copy.deepcopy(model) if live_reference else None
    args = dpo_config(tmp_path, precompute_ref_log_probs=not live_reference, **overrides)
    return FlatBiasDPOTrainer(
        model=model,
        ref_model=reference,
        args=args,
        train_dataset=preference_rows(),
        eval_dataset=preference_rows(n=n_eval, seed=5) if n_eval else None,
        processing_class=tokenizer,
        callbacks=callbacks,
    )


class ForwardCounter:
    def __init__(self, module):
        self.calls = 0
        module.register_forward_pre_hook(self._count)

    def _count(self, module, args):
        self.calls += 1


@pytest.mark.parametrize("live_reference", [False, True])
@pytest.mark.parametrize("scope,accumulation", [("micro_batch", 1), ("micro_batch", 2), ("batch", 2)])
def test_dpo_sam_matches_plain_pytorch_sam(tmp_path, tokenizer, live_reference, scope, accumulation):
    trainer = dpo_trainer(
        tmp_path,
        tokenizer,
        live_reference=live_reference,
        flatness_method="sam",
        sam_scope=scope,
        per_device_train_batch_size=4 // accumulation,
        gradient_accumulation_steps=accumulation,
    )
    updates = updates_of(trainer)
    loss = dpo_loss_function(fresh_model(trainer).eval(), beta=0.5)
    reference = reference_sam_sgd(fresh_model(trainer), updates, loss, lr=0.1, rho=0.05, scope=scope)
    if live_reference:
        counter = ForwardCounter(trainer.ref_model)
    initial = fresh_model(trainer)
    trainer.train()
    difference = max_param_diff(trainer.model, reference)
    assert difference < 1e-6, difference
    assert max_param_diff(initial, reference) > 1e-3
    if live_reference:  # once per micro-batch, not again at w + e
        assert counter.calls == trainer.args.max_steps * accumulation


def test_dpo_sam_with_lora_uses_the_adapter_free_model_as_reference(tmp_path, tokenizer):
    trainer = FlatBiasDPOTrainer(
        model=with_lora(tiny_llama(len(tokenizer))),
        args=dpo_config(tmp_path, flatness_method="sam", per_device_train_batch_size=2, gradient_accumulation_steps=2),
        train_dataset=preference_rows(),
        processing_class=tokenizer,
    )
    assert trainer.ref_model is None and not trainer.precompute_ref_logps
    loss = dpo_loss_function(tiny_llama(len(tokenizer)).eval(), beta=0.5)
    reference = reference_sam_sgd(
        with_lora(tiny_llama(len(tokenizer))), updates_of(trainer), loss, lr=0.1, rho=0.05, scope="micro_batch"
    )
    trainer.train()
    # trl keeps a frozen copy of the adapters as the "ref" adapter: compare what trains
    trained = [p for p in trainer.model.parameters() if p.requires_grad]
    expected = [p for p in reference.parameters() if p.requires_grad]
    assert len(trained) == len(expected)
    assert max(float((p - q).abs().max()) for p, q in zip(trained, expected, strict=True)) < 1e-6


def test_dpo_second_pass_logs_nothing_twice(tmp_path, tokenizer):
    overrides = dict(per_device_train_batch_size=2, gradient_accumulation_steps=2)
    plain = dpo_trainer(tmp_path / "plain", tokenizer, live_reference=True, **overrides)
    plain.train()
    flat = dpo_trainer(tmp_path / "flat", tokenizer, live_reference=True, flatness_method="sam", **overrides)
    flat.train()
    first_plain, first_flat = logged_steps(plain)[0], logged_steps(flat)[0]
    keys = [
        "loss",
        "rewards/chosen",
        "rewards/rejected",
        "rewards/margins",
        "rewards/accuracies",
        "logps/chosen",
        "entropy",
        "mean_token_accuracy",
    ]
    for key in keys:
        assert first_flat[key] == pytest.approx(first_plain[key], abs=1e-6), key
    assert [e["num_tokens"] for e in logged_steps(flat)] == [e["num_tokens"] for e in logged_steps(plain)]
    assert first_flat["sam/perturbed_loss"] > first_flat["loss"]


def test_dpo_refuses_the_fisher_penalty(tmp_path, tokenizer):
    with pytest.raises(ValueError, match="grad_norm_penalty"):
        dpo_trainer(tmp_path, tokenizer, live_reference=True, flatness_method="fisher_penalty")


def test_dpo_config_refuses_the_fisher_penalty_before_a_trainer_is_built(tmp_path):
    """Issue 58, item 8: the config passed, and only the trainer (after the model and data were loaded) refused it."""
    from hf_flatbias.sharpness.methods.table import METHOD_TABLE

    with pytest.raises(ValueError, match="DPO's preference loss") as refused:
        FlatBiasDPOConfig(str(tmp_path), use_cpu=True, flatness_method="fisher_penalty")
    assert str(refused.value) == METHOD_TABLE["fisher_penalty"].refusals["dpo"]
    FlatBiasSFTConfig(str(tmp_path), use_cpu=True, flatness_method="fisher_penalty")  # SFT runs it


# ---------------------------------------------------------------- the trace callback


def exact_next_token_fisher_trace(model, contexts) -> float:
    """Mean over contexts of sum_y p(y) ||grad log p(y)||^2 over the trainable parameters, every y enumerated."""
    params = [p for p in model.parameters() if p.requires_grad]
    traces = []
    for context in contexts:
        position = next(t for t, label in enumerate(context["labels"]) if label != -100)
        ids = torch.tensor([context["input_ids"][:position]])
        log_p = torch.log_softmax(model(input_ids=ids, use_cache=False).logits[0, -1].double(), -1)
        trace = 0.0
        for y in range(len(log_p)):
            trace += float(log_p[y].exp()) * norm_of(grad_list(log_p[y], params, retain_graph=True)) ** 2
        traces.append(trace)
    return sum(traces) / len(traces)


def measured_positions(callback) -> list[tuple[list[int], int]]:
    return [
        (context["input_ids"], next(t for t, label in enumerate(context["labels"]) if label != -100))
        for context in callback._contexts
    ]


@pytest.mark.parametrize("lora", [False, True])
def test_trace_callback_on_sft_measures_the_trained_parameters_on_held_out_completions(tmp_path, tokenizer, lora):
    from hf_flatbias import HessianTraceCallback

    peft_config = None
    if lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    callback = HessianTraceCallback(n_contexts=6, n_draws=24, on_evaluate=False)
    trainer = sft_trainer(
        tmp_path,
        tokenizer,
        "completion_only",
        n_eval=6,
        peft_config=peft_config,
        callbacks=[callback],
        flatness_method="sam",
        max_steps=2,
    )
    trainer.train()
    held_out = trainer.eval_dataset
    for index, (ids, position) in enumerate(measured_positions(callback)):
        row = held_out[index]
        assert ids == row["input_ids"] and row["labels"][position] != -100  # a completion token
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    assert (trainable < 500) == lora  # LoRA: the adapters only
    logged = [entry for entry in trainer.state.log_history if "flatness/hessian_trace" in entry][-1]
    exact = exact_next_token_fisher_trace(trainer.model, callback._contexts)
    assert abs(logged["flatness/hessian_trace"] - exact) < 4 * logged["flatness/hessian_trace_stderr"] + 1e-9


def test_trace_callback_on_dpo_measures_the_policy_on_the_chosen_responses(tmp_path, tokenizer):
    from hf_flatbias import HessianTraceCallback

    callback = HessianTraceCallback(n_contexts=6, n_draws=24, on_evaluate=False)
    trainer = dpo_trainer(
        tmp_path, tokenizer, live_reference=True, n_eval=6, callbacks=[callback], flatness_method="sam", max_steps=2
    )
    trainer.train()
    for index, (ids, position) in enumerate(measured_positions(callback)):
        row = trainer.eval_dataset[index]
        assert ids == row["prompt_ids"] + row["chosen_ids"] and position >= len(row["prompt_ids"])
    logged = [entry for entry in trainer.state.log_history if "flatness/hessian_trace" in entry][-1]
    exact = exact_next_token_fisher_trace(trainer.model, callback._contexts)
    assert abs(logged["flatness/hessian_trace"] - exact) < 4 * logged["flatness/hessian_trace_stderr"] + 1e-9


def test_trace_logs_leave_trl_metrics_to_the_training_loss(tmp_path, tokenizer):
    from hf_flatbias import HessianTraceCallback

    trainer = sft_trainer(
        tmp_path,
        tokenizer,
        "completion_only",
        n_eval=4,
        callbacks=[HessianTraceCallback(n_contexts=4, every_n_steps=1, on_evaluate=False)],
        flatness_method="sam",
        max_steps=2,
    )
    trainer.train()
    for entry in trainer.state.log_history:
        if "flatness/hessian_trace" in entry:
            assert "mean_token_accuracy" not in entry
        if "loss" in entry:
            assert {"mean_token_accuracy", "entropy", "num_tokens"} <= set(entry)


def test_trace_rows_of_a_packed_row_are_its_documents(tmp_path, tokenizer):
    trainer = sft_trainer(tmp_path, tokenizer, "packing")
    packed = trainer.train_dataset[0]
    documents = trainer.trace_context_rows(packed)
    assert [len(d["input_ids"]) for d in documents] == list(packed["seq_lengths"]) and len(documents) > 1
    assert sum((d["input_ids"] for d in documents), []) == list(packed["input_ids"])
    assert all(len(d["completion_mask"]) == len(d["input_ids"]) for d in documents)


def sft_loss_of_logits(logits, batch, update):
    labels = batch["labels"][:, 1:]
    summed = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
    return summed / trained_token_count(update)


def dpo_loss_of_logits(reference_model, beta):
    """DPO's sigmoid loss from the policy's next-token logits, the reference's log-probabilities taken once per
    micro-batch."""
    references: dict[int, tuple[dict, torch.Tensor]] = {}  # the batch kept alive: no other may reuse its id

    def loss(logits, batch, update):
        if id(batch) not in references:
            with torch.no_grad():
                references[id(batch)] = (batch, completion_log_probs(reference_model, batch))
        targets = batch["input_ids"][:, 1:].unsqueeze(-1)
        per_token = torch.log_softmax(logits.float(), -1).gather(-1, targets).squeeze(-1)
        masked = per_token * batch["completion_mask"][:, 1:]
        chosen, rejected = (masked.sum(1) - references[id(batch)][1]).chunk(2)
        return -F.logsigmoid(beta * (chosen - rejected)).mean() / len(update)

    return loss


def reference_functional_sam_sgd(model, updates, loss_of_logits, *, lr, rho, scope):
    """Functional-SAM with SGD from the materialised logits: e = rho g / ||g|| (per micro-batch or per update, as
    `reference_sam_sgd`), the update direction d/dw <F(w + e), dL/dF(w)> summed over micro-batches."""
    params = [p for p in model.parameters() if p.requires_grad]

    def gradient_and_cotangent(batch, update):
        logits = next_token_logits(model, batch)
        *grads, cotangent = torch.autograd.grad(loss_of_logits(logits, batch, update), [*params, logits])
        return list(grads), cotangent.detach()

    for update in updates:
        if scope == "batch":
            pairs = [gradient_and_cotangent(b, update) for b in update]
            first = [sum(parts) for parts in zip(*(g for g, _ in pairs), strict=True)]
        total = [torch.zeros_like(p) for p in params]
        for i, batch in enumerate(update):
            if scope == "micro_batch":
                first, cotangent = gradient_and_cotangent(batch, update)
            else:
                cotangent = pairs[i][1]
            norm = norm_of(first)
            saved = [p.detach().clone() for p in params]
            with torch.no_grad():
                torch._foreach_add_(params, [rho * g / norm for g in first])
            surrogate = (next_token_logits(model, batch) * cotangent).sum()
            total = [t + g for t, g in zip(total, grad_list(surrogate, params), strict=True)]
            with torch.no_grad():
                for p, s in zip(params, saved, strict=True):
                    p.copy_(s)
        with torch.no_grad():
            for p, t in zip(params, total, strict=True):
                p.sub_(lr * t)
    return model


@pytest.mark.parametrize(
    "case,scope,accumulation",
    [("completion_only", "micro_batch", 2), ("completion_only", "batch", 2), ("packing", "micro_batch", 1)],
)
def test_sft_functional_sam_through_the_fused_head_matches_the_logits_reference(
    tmp_path, tokenizer, case, scope, accumulation
):
    """trl's SFT loss never builds the logits; Functional-SAM's cotangent and surrogate, computed in row chunks from the
    hidden states, give the update of the reference that materialises them."""
    batch_size = SFT_CASES[case][1].get("per_device_train_batch_size", 4) // accumulation
    trainer = sft_trainer(
        tmp_path,
        tokenizer,
        case,
        flatness_method="functional_sam",
        sam_scope=scope,
        per_device_train_batch_size=batch_size,
        gradient_accumulation_steps=accumulation,
    )
    updates = updates_of(trainer)
    reference = reference_functional_sam_sgd(
        fresh_model(trainer), updates, sft_loss_of_logits, lr=0.1, rho=0.05, scope=scope
    )
    sam = reference_sam_sgd(fresh_model(trainer), updates, sft_loss, lr=0.1, rho=0.05, scope=scope)
    trainer.train()
    difference = max_param_diff(trainer.model, reference)
    assert difference < 1e-6, difference
    assert max_param_diff(sam, reference) > 1e-4  # the tolerance tells Functional-SAM from SAM
    logged = next(entry for entry in trainer.state.log_history if "loss" in entry)
    assert logged["sam/perturbed_loss"] > logged["loss"]


def test_sft_functional_sam_with_lora_matches_the_logits_reference(tmp_path, tokenizer):
    """With LoRA the head is frozen: its term drops out, and the adapters take J^T c through the hidden states."""
    trainer = sft_trainer(
        tmp_path,
        tokenizer,
        "completion_only",
        model=with_lora(tiny_llama(len(tokenizer))),
        flatness_method="functional_sam",
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
    )
    updates = updates_of(trainer)
    model = with_lora(tiny_llama(len(tokenizer)))
    reference = reference_functional_sam_sgd(model, updates, sft_loss_of_logits, lr=0.1, rho=0.05, scope="micro_batch")
    trainer.train()
    assert max_param_diff(trainer.model, reference) < 1e-6
    sam = reference_sam_sgd(
        with_lora(tiny_llama(len(tokenizer))), updates, sft_loss, lr=0.1, rho=0.05, scope="micro_batch"
    )
    assert max_param_diff(sam, reference) > 1e-6


def test_sft_functional_sam_holds_no_more_than_a_chunk_of_logits(tmp_path, tokenizer, monkeypatch):
    """Chunks of 3 rows give the same update as one chunk: the cotangent is recomputed per chunk, not stored."""
    from hf_flatbias.sharpness import fused_head

    def train(chunk_rows, folder):
        monkeypatch.setattr(fused_head, "CHUNK_ROWS", chunk_rows)
        trainer = sft_trainer(tmp_path / folder, tokenizer, "completion_only", flatness_method="functional_sam")
        original = fused_head.fused_head_surrogate
        widths = []

        def surrogate(hidden, head, cotangent, *, chunk_rows=chunk_rows):
            widths.append(hidden.shape[0])
            return original(hidden, head, cotangent, chunk_rows=chunk_rows)

        monkeypatch.setattr(fused_head, "fused_head_surrogate", surrogate)
        trainer.train()
        monkeypatch.setattr(fused_head, "fused_head_surrogate", original)
        return trainer.model, widths

    chunked, widths = train(3, "chunked")
    whole, _ = train(10_000, "whole")
    assert min(widths) > 3  # several chunks per micro-batch
    assert max_param_diff(chunked, whole) < 1e-6


def test_sft_functional_sam_refuses_losses_that_bypass_the_fused_head(tmp_path, tokenizer):
    args = sft_config(tmp_path, flatness_method="functional_sam", label_smoothing_factor=0.1)
    with pytest.raises(ValueError, match="^flatness_method='functional_sam' in FlatBiasSFTTrainer reads dL/dF"):
        FlatBiasSFTTrainer(
            model=tiny_llama(len(tokenizer)), args=args, train_dataset=text_rows(), processing_class=tokenizer
        )


@pytest.mark.parametrize("scope,accumulation", [("micro_batch", 2), ("batch", 2)])
def test_dpo_functional_sam_through_the_fused_head_matches_the_logits_reference(
    tmp_path, tokenizer, scope, accumulation
):
    trainer = dpo_trainer(
        tmp_path,
        tokenizer,
        live_reference=True,
        flatness_method="functional_sam",
        sam_scope=scope,
        per_device_train_batch_size=4 // accumulation,
        gradient_accumulation_steps=accumulation,
    )
    updates = updates_of(trainer)
    loss = dpo_loss_of_logits(fresh_model(trainer).eval(), beta=0.5)
    reference = reference_functional_sam_sgd(fresh_model(trainer), updates, loss, lr=0.1, rho=0.05, scope=scope)
    sam_loss = dpo_loss_function(fresh_model(trainer).eval(), beta=0.5)
    sam = reference_sam_sgd(fresh_model(trainer), updates, sam_loss, lr=0.1, rho=0.05, scope=scope)
    trainer.train()
    difference = max_param_diff(trainer.model, reference)
    assert difference < 1e-6, difference
    assert max_param_diff(sam, reference) > 1e-4  # the tolerance tells Functional-SAM from SAM


# ---------------------------------------------------------------- the flatness card of a trl run (issue 38)


@pytest.mark.filterwarnings("ignore:Could not find a config file")  # the base model's name is not a folder here
def test_the_card_of_a_lora_sft_run_names_sft_its_completion_loss_and_the_adapters(tmp_path, tokenizer):
    from peft import LoraConfig

    from hf_flatbias import HessianTraceCallback, load_flatness_card

    model = tiny_llama(len(tokenizer))
    model.name_or_path = "tests/tiny-llama"  # what from_pretrained sets; PEFT records it as the base model
    trainer = sft_trainer(
        tmp_path,
        tokenizer,
        "completion_only",
        model=model,
        n_eval=4,
        peft_config=LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0),
        callbacks=[HessianTraceCallback(n_contexts=4, n_draws=1, on_evaluate=False)],
        flatness_method="sam",
        max_steps=1,
    )
    trainer.train()
    trainer.evaluate()
    trainer.save_model()
    card = load_flatness_card(tmp_path)
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in trainer.model.parameters())
    assert (card.objective, card.pretraining_loss_source) == ("sft_completion_only", "eval")
    assert card.pretraining_loss == pytest.approx(trainer.state.log_history[-1]["eval_loss"])
    assert card.loss_label == "SFT loss on completions (held-out evaluation)"
    assert card.trace_objective == "next_token_trained" and card.hessian_trace is not None
    assert (card.trainable_parameters, card.num_parameters) == (trainable, total) and trainable < total / 10
    assert (card.adapter, card.base_model) == ("LORA", "tests/tiny-llama")
    text = (tmp_path / "README.md").read_text(encoding="utf-8")
    assert "fill-mask" not in text and "| Pre-training loss" not in text
    assert "| SFT loss on completions (held-out evaluation) |" in text
    assert "where the fine-tuning loss trains (completions)" in text and "masked position" not in text
    assert f"| Parameters the trace covers | {trainable:,} trained of {total:,} (the LORA adapters) |" in text


def test_the_card_of_a_dpo_run_names_the_preference_loss_and_its_source(tmp_path, tokenizer):
    from hf_flatbias import HessianTraceCallback, load_flatness_card

    trainer = dpo_trainer(
        tmp_path,
        tokenizer,
        live_reference=True,
        n_eval=4,
        callbacks=[HessianTraceCallback(n_contexts=4, n_draws=1, on_evaluate=False)],
        flatness_method="sam",
        max_steps=1,
    )
    trainer.train()
    trainer.save_model()
    card = load_flatness_card(tmp_path)
    train_loss = logged_losses(trainer)[-1]
    assert (card.objective, card.pretraining_loss_source, card.pretraining_loss) == ("dpo", "train", train_loss)
    assert card.loss_label == "DPO preference loss (training, last logged)"
    assert card.trace_objective == "next_token_chosen"
    total = sum(p.numel() for p in trainer.model.parameters())
    assert card.trainable_parameters == card.num_parameters == total and card.adapter is None
    text = (tmp_path / "README.md").read_text(encoding="utf-8")
    [entry] = front_matter_of(text)["model-index"]
    assert {result["task"]["name"] for result in entry["results"]} == {"Direct preference optimization"}
    flatness = front_matter_of(text)["flatness"]  # the key names the loss (issue 58): it is no pre-training loss
    assert flatness["dpo_loss"] == train_loss and flatness["dpo_loss_source"] == "train"
    assert "pretraining_loss" not in flatness
    assert "| DPO preference loss (training, last logged) |" in text and "| Pre-training loss" not in text
    assert "chosen response per preference pair" in text and "reference model is not measured" in text


@pytest.mark.parametrize("method", ["sam", "asam"])
def test_only_a_dpo_config_carries_the_kept_softmax_budget_and_only_its_card_records_it(tmp_path, method):
    """sam_kept_softmax_mib is read by FlatBiasDPOTrainer alone: the plain and SFT configs have no such field (a
    value given to them would have been ignored in silence) and their SAM cards do not mention it; a DPO card
    records the value the run used."""
    from types import SimpleNamespace

    from hf_flatbias import FlatBiasConfig, load_flatness_card
    from hf_flatbias.modelcard import flatness_card_from_trainer

    configs = {
        "plain": FlatBiasConfig(str(tmp_path / "plain"), flatness_method=method, report_to="none", use_cpu=True),
        "sft": sft_config(tmp_path / "sft", flatness_method=method),
        "dpo": dpo_config(tmp_path / "dpo", flatness_method=method, sam_kept_softmax_mib=64),
    }
    for name, args in configs.items():
        carried = "sam_kept_softmax_mib" in args.__dataclass_fields__
        assert carried == hasattr(args, "sam_kept_softmax_mib") == (name == "dpo"), name
        assert ("sam_kept_softmax_mib" in args.to_dict()) == carried, name
        trainer = SimpleNamespace(args=args, state=SimpleNamespace(log_history=[], global_step=1, epoch=1.0))
        flatness_card_from_trainer(trainer).save(args.output_dir)
        training = load_flatness_card(args.output_dir).training_hyperparameters
        assert "sam_parameters" in training, f"{name}: the shared SAM step options are recorded"
        text = (tmp_path / name / "README.md").read_text(encoding="utf-8")
        assert ("sam_kept_softmax_mib" in text) == carried, name
        assert training.get("sam_kept_softmax_mib") == (64.0 if carried else None), name


def front_matter_of(text: str) -> dict:
    import yaml

    return yaml.safe_load(text.split("---\n")[1])
