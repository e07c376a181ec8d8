"""Anneal-to-evaluate branches: the anneal's arithmetic, and a trunk left bit-identical by branching off it."""

import copy

import numpy as np
import pytest
import torch
from research.branches import BranchEvaluator, anneal_branch, linear_anneal_rates

from hf_flatbias import FlatBiasConfig, FlatBiasTrainer
from hf_flatbias.synthetic import PCFG, MaskedWordCollator, build_model, make_tokenizer, sentences_to_dataset


class Quadratic(torch.nn.Module):
    """loss = ||w - target||^2 / 2, so a plain SGD step scales w - target by (1 - lr)."""

    def __init__(self, start: torch.Tensor, target: torch.Tensor):
        super().__init__()
        self.w = torch.nn.Parameter(start.clone())
        self.target = target

    def forward(self, **_):
        return type("Out", (), {"loss": 0.5 * ((self.w - self.target) ** 2).sum()})()


def test_anneal_follows_the_linear_schedule_from_the_trunk_and_leaves_it_alone():
    rates = linear_anneal_rates(0.3, 4)
    assert rates == pytest.approx([0.3, 0.225, 0.15, 0.075])
    start, target = torch.tensor([2.0, -1.0]), torch.tensor([0.5, 0.5])
    trunk = Quadratic(start, target)
    optimizer = torch.optim.SGD(trunk.parameters(), lr=0.3)
    rng = torch.get_rng_state()
    branch = anneal_branch(trunk, optimizer, iter(lambda: {}, None), steps=4, learning_rate=0.3)
    expected = target + (start - target) * float(np.prod([1 - r for r in rates]))
    torch.testing.assert_close(branch.w.detach(), expected)
    torch.testing.assert_close(trunk.w.detach(), start)
    assert optimizer.param_groups[0]["lr"] == 0.3 and torch.equal(torch.get_rng_state(), rng)


def test_branch_starts_from_the_trunks_adam_moments():
    trunk = Quadratic(torch.tensor([2.0, -1.0]), torch.zeros(2))
    optimizer = torch.optim.AdamW(trunk.parameters(), lr=0.1, betas=(0.9, 0.98))
    for _ in range(3):
        trunk().loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    after_trunk = trunk.w.detach().clone()
    # reference: continue the trunk itself one step at the same rate
    reference = Quadratic(after_trunk, torch.zeros(2))
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=0.1, betas=(0.9, 0.98))
    # a deep copy: load_state_dict shares the step counters, and stepping the reference would advance the trunk's
    reference_optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    reference().loss.backward()
    reference_optimizer.step()
    branch = anneal_branch(trunk, optimizer, iter(lambda: {}, None), steps=1, learning_rate=0.1)
    torch.testing.assert_close(branch.w.detach(), reference.w.detach())
    torch.testing.assert_close(trunk.w.detach(), after_trunk)
    assert int(optimizer.state_dict()["state"][0]["step"]) == 3  # the trunk's own counters did not move


def train_trunk(tmp_path, *, branching: bool):
    grammar = PCFG.from_seed(0)
    sample = grammar.sample(256, seed=0)
    train = sentences_to_dataset(sample.word_ids, sample.lengths)
    model = build_model(len(make_tokenizer(grammar.words())), hidden=16, layers=1, dropout=0.1, seed=0)
    args = FlatBiasConfig(
        output_dir=str(tmp_path / f"run_{branching}"),
        max_steps=6,
        per_device_train_batch_size=8,
        learning_rate=1e-2,
        adam_beta2=0.98,
        lr_scheduler_type="constant_with_warmup",
        warmup_steps=2,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        use_cpu=True,
        seed=0,
    )
    measured = []
    callbacks = []
    if branching:

        def measure(branch, step):
            measured.append((step, {n: p.detach().clone() for n, p in branch.named_parameters()}))
            return {"step_seen": step}

        callbacks.append(BranchEvaluator(train, every=2, anneal_steps=3, batch_size=8, measure=measure))
    trainer = FlatBiasTrainer(
        model=model, args=args, train_dataset=train, data_collator=MaskedWordCollator(seed=0), callbacks=callbacks
    )
    trainer.train()
    return trainer, measured, callbacks


def test_branching_leaves_trunk_weights_and_optimizer_state_identical(tmp_path):
    plain, _, _ = train_trunk(tmp_path, branching=False)
    branched, measured, (evaluator,) = train_trunk(tmp_path, branching=True)
    for (name, a), (_, b) in zip(plain.model.named_parameters(), branched.model.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    state_a, state_b = plain.optimizer.state_dict()["state"], branched.optimizer.state_dict()["state"]
    assert state_a.keys() == state_b.keys()
    for key in state_a:
        for field, value in state_a[key].items():
            assert torch.equal(value, state_b[key][field]), (key, field)
    assert [r["step"] for r in evaluator.records] == [2, 4, 6] and [s for s, _ in measured] == [2, 4, 6]
    # the branches moved away from the trunk they were copied from
    last_branch = measured[-1][1]
    assert any(not torch.equal(p, last_branch[n]) for n, p in branched.model.named_parameters())
