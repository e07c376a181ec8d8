"""The adversarial pretraining objective of `hf_flatbias.adversarial`: its loss, each player's gradient, its checks."""

import math

import pytest
import torch
import torch.nn.functional as F
from transformers import BertConfig, BertForMaskedLM

from hf_flatbias.adversarial import AdversarialPretrainingModel, confusion_loss


def tiny_bert(seed=0):
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=23,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return BertForMaskedLM(config)


def batch(seed=0):
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(5, 23, (6, 7), generator=generator)
    labels = torch.full_like(input_ids, -100)
    labels[:, 3] = input_ids[:, 3]
    input_ids[:, 3] = 4
    task_labels = torch.tensor([0, 1, 2, 1, -1, 0])
    return dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), labels=labels, task_labels=task_labels)


def test_confusion_loss_is_cross_entropy_to_uniform():
    uniform = torch.zeros(4, 3)
    assert confusion_loss(uniform).item() == pytest.approx(math.log(3))
    logits = torch.tensor([[2.0, 0.0, -1.0], [0.5, 0.5, 3.0]])
    log_probs = torch.log(torch.softmax(logits, dim=-1))
    reference = -(log_probs.sum(dim=-1) / 3).mean()
    assert confusion_loss(logits).item() == pytest.approx(reference.item(), rel=1e-6)
    assert confusion_loss(logits).item() > math.log(3)


def test_each_player_gets_only_its_own_gradient():
    """Head: gradient of CE on detached features only. Encoder: gradient of MLM + lambda * confusion only."""
    weight = 0.7
    wrapper = AdversarialPretrainingModel(tiny_bert(), n_classes=3, adversary_weight=weight)
    inputs = batch()
    wrapper(**inputs).loss.backward()
    head_grad = wrapper.adversary.weight.grad.clone()
    encoder_grads = {n: p.grad.clone() for n, p in wrapper.model.named_parameters() if p.grad is not None}

    # Independent reference: the two objectives written out separately on fresh copies.
    reference = tiny_bert()
    reference.load_state_dict(wrapper.model.state_dict())
    head = torch.nn.Linear(16, 3)
    head.load_state_dict(wrapper.adversary.state_dict())
    keep = inputs["task_labels"] >= 0
    out = reference(
        input_ids=inputs["input_ids"],
        attention_mask=inputs["attention_mask"],
        labels=inputs["labels"],
        output_hidden_states=True,
    )
    cls = out.hidden_states[-1][:, 0][keep]
    F.cross_entropy(head(cls.detach()), inputs["task_labels"][keep]).backward(retain_graph=True)
    torch.testing.assert_close(head_grad, head.weight.grad)
    with torch.no_grad():
        frozen = head.weight.clone(), head.bias.clone()
    probs_log = F.log_softmax(cls @ frozen[0].T + frozen[1], dim=-1)
    encoder_objective = out.loss + weight * (-probs_log.mean())
    reference.zero_grad()
    encoder_objective.backward()
    for name, parameter in reference.named_parameters():
        if parameter.grad is not None:
            torch.testing.assert_close(encoder_grads[name], parameter.grad, msg=name)


def test_zero_weight_trains_the_encoder_like_plain_mlm():
    wrapper = AdversarialPretrainingModel(tiny_bert(), n_classes=3, adversary_weight=0.0)
    plain = tiny_bert()
    inputs = batch(seed=3)
    wrapper(**inputs).loss.backward()
    plain(**{k: v for k, v in inputs.items() if k != "task_labels"}).loss.backward()
    for (name, got), (_, expected) in zip(wrapper.model.named_parameters(), plain.named_parameters(), strict=True):
        torch.testing.assert_close(got.grad, expected.grad, msg=name)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"n_classes": 1}, "n_classes must be at least 2"),
        ({"n_classes": 3, "adversary_weight": -1}, ">= 0"),
        ({"n_classes": 3, "pooling": "max"}, "pooling='max'"),
    ],
)
def test_bad_settings_are_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        AdversarialPretrainingModel(tiny_bert(), **kwargs)

