"""Do the explicit flatness regularizers lower the measured trace at matched pre-training loss? (PCFG language)

Small BERT masked LMs are pre-trained on the synthetic PCFG language (`hf_flatbias.synthetic`) with plain AdamW and
with each flatness method. The plain run fixes the target: its validation one-mask loss at the end. Every other
method trains up to ``--extra`` times as many steps and is evaluated every ``--eval-every`` steps; the checkpoint
compared is the first whose validation loss is at or below the target (or the closest one, flagged, when none gets
there). At that checkpoint the recipe measures the paper's flatness, the Fisher trace with labels drawn from the
model at one masked position per validation context, and the accuracy of linear probes for the paper's tasks A
(sentence type) and B (nonterminal over the first 4 words) on mean-pooled frozen features.

    PYTHONPATH=. python recipes/pcfg_regularizers.py [--quick] [--out DIR]

Prints a markdown table and writes ``results.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from transformers import BertConfig, BertForMaskedLM, DataCollatorForLanguageModeling, TrainerCallback  # noqa: E402

from hf_flatbias import FlatBiasConfig, FlatBiasTrainer  # noqa: E402
from hf_flatbias.probe import extract_features, probe_accuracy  # noqa: E402
from hf_flatbias.synthetic import PCFG, build_pcfg_dataset, entropy_bound, make_tokenizer, masked_contexts  # noqa: E402

# name -> FlatBiasConfig overrides; every run shares the rest of the arguments.
METHODS: dict[str, dict] = {
    "adamw": {"flatness_method": "none"},
    "sam": {"flatness_method": "sam", "sam_rho": 0.1},
    "sam_every_4": {"flatness_method": "sam", "sam_rho": 0.1, "sam_every_k": 4},
    "looksam_every_4": {"flatness_method": "looksam", "sam_rho": 0.1, "sam_every_k": 4},
    "fisher_penalty": {"flatness_method": "fisher_penalty", "penalty_lambda": 0.001, "penalty_fd_step": 0.01},
    "grad_norm_penalty": {"flatness_method": "grad_norm_penalty", "penalty_lambda": 0.08, "penalty_fd_step": 0.1},
}


def build_model(vocab_size: int, seed: int) -> BertForMaskedLM:
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=256,
        max_position_embeddings=32,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return BertForMaskedLM(config)


def padded(rows, key: str, pad: int) -> torch.Tensor:
    width = max(len(r) for r in rows[key])
    return torch.tensor([list(r) + [pad] * (width - len(r)) for r in rows[key]])


@torch.no_grad()
def one_mask_loss(model: torch.nn.Module, contexts, batch_size: int = 256) -> float:
    """Mean cross-entropy at the single masked position of each context (nats)."""
    model.eval()
    total, count = 0.0, 0
    for start in range(0, len(contexts), batch_size):
        rows = contexts[start : start + batch_size]
        ids, mask, labels = (
            padded(rows, "input_ids", 0),
            padded(rows, "attention_mask", 0),
            padded(rows, "labels", -100),
        )
        logits = model(input_ids=ids, attention_mask=mask).logits
        total += float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum"))
        count += int((labels != -100).sum())
    model.train()
    return total / count


def fisher_trace(model: torch.nn.Module, contexts, *, n_draws: int, seed: int) -> dict:
    """The paper's flatness measure, through `hf_flatbias.flatness` when it is installed, else a reference loop."""
    try:
        from hf_flatbias.flatness.estimators import estimate_hessian_trace
    except ImportError:
        estimate_hessian_trace = None
    rows = [{k: contexts[i][k] for k in ("input_ids", "attention_mask", "labels")} for i in range(len(contexts))]
    if estimate_hessian_trace is not None:
        estimate = estimate_hessian_trace(model, rows, n_draws=n_draws, seed=seed)
        return {"trace": estimate.mean, "trace_stderr": estimate.stderr, "trace_estimator": estimate.estimator}
    return _naive_fisher_trace(model, rows, n_draws=n_draws, seed=seed)


def _naive_fisher_trace(model: torch.nn.Module, rows, *, n_draws: int, seed: int) -> dict:
    """One backward per draw: ``mean_x mean_y ||grad log p(y | x_-t)||^2`` with ``y`` drawn from the model."""
    model.eval()
    params = [p for p in model.parameters() if p.requires_grad]
    generator = torch.Generator().manual_seed(seed)
    per_context = []
    for row in rows:
        ids = torch.tensor([row["input_ids"]])
        labels = torch.tensor(row["labels"])
        position = int((labels != -100).nonzero()[0])
        log_probs = torch.log_softmax(model(input_ids=ids).logits[0, position].float(), -1)
        values = []
        for draw in range(n_draws):
            y = int(torch.multinomial(log_probs.detach().exp(), 1, generator=generator))
            grads = torch.autograd.grad(log_probs[y], params, retain_graph=draw < n_draws - 1, allow_unused=True)
            values.append(sum(float((g.double() ** 2).sum()) for g in grads if g is not None))
        per_context.append(np.mean(values))
    model.train()
    per_context = np.asarray(per_context)
    return {
        "trace": float(per_context.mean()),
        "trace_stderr": float(per_context.std(ddof=1) / math.sqrt(len(per_context))),
        "trace_estimator": "recipe_naive_loop",
    }


class Checkpoints(TrainerCallback):
    """Validation one-mask loss and a copy of the weights every ``every`` steps; stops once at ``stop_below``."""

    def __init__(self, contexts, every: int, stop_below: float | None = None) -> None:
        self.contexts = contexts
        self.every = every
        self.stop_below = stop_below
        self.history: list[tuple[int, float, dict]] = []
        self.model = None

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step % self.every == 0:
            loss = one_mask_loss(model, self.contexts)
            self.history.append((state.global_step, loss, copy.deepcopy(model.state_dict())))
            print(f"  step {state.global_step}: validation one-mask loss {loss:.4f}", flush=True)
            if self.stop_below is not None and loss <= self.stop_below:
                control.should_training_stop = True  # matched: the later checkpoints would not be compared


def matched_checkpoint(history, target: float) -> tuple[int, float, dict, bool]:
    """The first checkpoint at or below ``target``; else the closest one, marked as not reaching it."""
    for step, loss, state in history:
        if loss <= target:
            return step, loss, state, True
    step, loss, state = min(history, key=lambda item: abs(item[1] - target))
    return step, loss, state, False


def train(method: str, overrides: dict, data, collator, eval_contexts, *, steps: int, every: int, target, args) -> list:
    print(f"{method}: up to {steps} steps", flush=True)
    checkpoints = Checkpoints(eval_contexts, every, stop_below=target)
    config = FlatBiasConfig(
        output_dir=str(Path(args.out) / method),
        max_steps=steps,
        per_device_train_batch_size=args.batch_size,
        learning_rate=args.lr,
        lr_scheduler_type="constant_with_warmup",
        warmup_steps=args.warmup,
        weight_decay=0.01,
        optim="adamw_torch",
        report_to="none",
        save_strategy="no",
        logging_steps=max(1, steps // 10),
        disable_tqdm=True,
        use_cpu=True,
        seed=args.seed,
        data_seed=args.seed,
        **overrides,
    )
    trainer = FlatBiasTrainer(
        model=build_model(len(collator.tokenizer), args.seed),
        args=config,
        train_dataset=data["train"],
        data_collator=collator,
        callbacks=[checkpoints],
    )
    trainer.train()
    return checkpoints.history


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few steps and contexts, a smoke run of a few minutes")
    parser.add_argument("--steps", type=int, default=None, help="steps of the plain AdamW run")
    parser.add_argument("--extra", type=float, default=2.0, help="step budget of the other methods, x --steps")
    parser.add_argument("--eval-every", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--n-train", type=int, default=20000)
    parser.add_argument("--n-contexts", type=int, default=None, help="validation contexts for loss and trace")
    parser.add_argument("--n-draws", type=int, default=2)
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset of " + ",".join(METHODS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--target", type=float, default=None, help="target loss from an earlier AdamW run (then 'adamw' is not rerun)"
    )
    parser.add_argument("--out", default="runs/pcfg_regularizers")
    args = parser.parse_args()
    steps = args.steps or (200 if args.quick else 1500)
    every = args.eval_every or max(10, steps // 15)
    n_contexts = args.n_contexts or (200 if args.quick else 1000)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = sorted(set(methods) - set(METHODS))
    if unknown or ("adamw" not in methods and args.target is None):
        raise ValueError(
            f"--methods must be among {list(METHODS)} (got unknown {unknown}) and include 'adamw' unless --target "
            "gives the AdamW loss to match."
        )
    torch.set_num_threads(1)
    started = time.time()

    pcfg = PCFG.from_seed(args.seed)
    data = build_pcfg_dataset(pcfg, args.n_train, n_validation=max(n_contexts, 2000), seed=args.seed)
    data["train"] = data["train"].select_columns(["input_ids", "attention_mask"])
    tokenizer = make_tokenizer(pcfg.words())
    collator = DataCollatorForLanguageModeling(tokenizer=tokenizer, mlm_probability=0.15)
    eval_contexts = masked_contexts(data["validation"], seed=args.seed + 1, n_contexts=n_contexts)
    floor = entropy_bound(pcfg, eval_contexts)
    probe_rows = data["validation"]

    results = []
    target = args.target
    for method in sorted(methods, key=lambda m: m != "adamw"):
        t0 = time.time()
        budget = steps if method == "adamw" else int(round(steps * args.extra))
        history = train(
            method, METHODS[method], data, collator, eval_contexts, steps=budget, every=every, target=target, args=args
        )
        if method == "adamw":
            target = history[-1][1]
            step, loss, state, reached = history[-1][0], history[-1][1], history[-1][2], True
        else:
            step, loss, state, reached = matched_checkpoint(history, target)
        model = build_model(len(tokenizer), args.seed)
        model.load_state_dict(state)
        trace = fisher_trace(model, eval_contexts, n_draws=args.n_draws, seed=args.seed)
        features = extract_features(model, probe_rows["input_ids"], pooling="mean")
        probes = {
            task: probe_accuracy(features, probe_rows[task], seed=args.seed).accuracy for task in ("task_a", "task_b")
        }
        row = {
            "method": method,
            "step": step,
            "val_loss": loss,
            "reached_target": reached,
            **trace,
            **{f"probe_{k}": v for k, v in probes.items()},
            "overrides": METHODS[method],
            "loss_curve": [(s, round(v, 4)) for s, v, _ in history],
            "seconds": time.time() - t0,
        }
        results.append(row)
        print(json.dumps(row), flush=True)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary = {
        "command": "python recipes/pcfg_regularizers.py "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v not in (None, False)),
        "entropy_floor": floor,
        "target_loss": target,
        "plain_steps": steps,
        "results": results,
        "seconds": time.time() - started,
    }
    (out / "results.json").write_text(json.dumps(summary, indent=2))
    print(
        f"\nentropy floor of the validation contexts: {floor:.4f} nats; target loss (AdamW, {steps} steps): "
        f"{target:.4f}; {time.time() - started:.0f} s"
    )
    print("| method | step | val loss | matched | Tr F (± s.e.) | probe A | probe B |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['method']} | {r['step']} | {r['val_loss']:.4f} | {'yes' if r['reached_target'] else 'NO'} | "
            f"{r['trace']:.2f} ± {r['trace_stderr']:.2f} | {r['probe_task_a']:.3f} | {r['probe_task_b']:.3f} |"
        )


if __name__ == "__main__":
    main()
