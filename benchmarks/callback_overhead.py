"""What `HessianTraceCallback` at its defaults adds to a training run, measured in one run.

A BERT masked LM (hidden 256, 8 layers, vocabulary 30,522: 14.2M parameters, "15M") trains ``--steps`` steps of 16
sequences of 128 tokens with an evaluation every ``--eval-every`` steps, once without and once with the callback,
the two runs interleaved ``--repeats`` times so that load on a shared machine hits both alike. Times are the
process's CPU seconds of ``trainer.train()`` (one torch thread; wall time on a shared machine mostly measures the
neighbours); the ratio of each repeat is (with callback) / (without), and the median is reported. On a machine
whose load changes between runs that ratio is noisy (two threads of one core slow each other's CPU time), so the
script also prints the in-run ratio: the run with the callback over the same run less the CPU seconds of the
callback's own measurements, both taken under the same load.

``--model bert-base`` runs the same at 110M (BERT-base); ``--seq-len`` and ``--batch`` shorten its sequences and
batches (training and evaluation rows alike) to what the machine affords, and ``--skip-plain`` runs only the run with
the callback (its in-run ratio, no cross-run ratio). Where a full run is too slow for the machine, ``--project`` times
two training steps and the callback's first measurement instead and replays the run's budget on those costs: a
projected ratio, printed as such.

``--arms`` names the runs of each repeat, taken in a rotated order from one repeat to the next so that a change of
load hits every arm alike: ``plain`` (no callback), ``callback`` (the callback with ``--callback``'s settings, its
defaults by default) and ``budgeted-final`` (the same with ``full_final_measurement=False``: the final measurement
sized by the budget like the others, the default before it was made whole). For each run with a callback it prints
the final measurement's CPU seconds as a multiple of one training step (the median CPU seconds between a step's
start and end in the same run) and as a share of the run's training (its CPU seconds less the callback's own), and
apart from it the interim measurements' share (every measurement before the final one: those ``max_overhead``
budgets).

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/callback_overhead.py [--repeats 2]
        [--callback '{"max_overhead": null}'] [--model bert-base --project]
    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/callback_overhead.py --model bert-base --seq-len 32 --repeats 1
    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/callback_overhead.py --arms plain,budgeted-final,callback

Last lines: ``callback_wall_ratio=X`` and ``callback_overhead_ratio=X`` (with the run without the callback: wall and
CPU seconds) and ``callback_in_run_ratio=X``; with ``--arms``, ``<arm>_ratio=X`` (CPU seconds over the same
repeat's ``plain``), ``<arm>_in_run_ratio=X``, ``<arm>_final_steps=X`` and ``<arm>_interim_share=X`` for each arm
with a callback.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import (  # noqa: E402
    BertConfig,
    BertForMaskedLM,
    DataCollatorForLanguageModeling,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from hf_flatbias.callbacks import HessianTraceCallback  # noqa: E402
from hf_flatbias.synthetic import make_tokenizer  # noqa: E402

SEQ_LEN, BATCH = 128, 16


class TimedTraceCallback(HessianTraceCallback):
    """The callback, with the CPU seconds of its own measurements counted in the run: a share measured under the
    same load as the training it is compared with."""

    def __init__(self, **options) -> None:
        super().__init__(**options)
        self.cpu_seconds = 0.0
        self.cpu_per_measurement: list[float] = []

    def measure(self, *args, **kwargs):
        start = time.process_time()
        try:
            return super().measure(*args, **kwargs)
        finally:
            self.cpu_per_measurement.append(time.process_time() - start)
            self.cpu_seconds += self.cpu_per_measurement[-1]


class StepClock(TrainerCallback):
    """CPU seconds of each optimizer step, from its start to its end; placed before the trace callback, so a
    measurement taken at a step's end is not counted in the step."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self._start = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        self._start = time.process_time()

    def on_step_end(self, args, state, control, **kwargs):
        self.seconds.append(time.process_time() - self._start)

    def step(self) -> float:
        """The median step, the first left out (it pays for lazy initialisation)."""
        return statistics.median(self.seconds[1:] or self.seconds)


MODELS = {
    "bert-15m": dict(hidden_size=256, num_hidden_layers=8, num_attention_heads=4, intermediate_size=1024),
    "bert-base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072),
}


def build_tokenizer(seq_len: int = SEQ_LEN):
    # 30,522 ids like BERT's vocabulary: 5 special tokens and 30,517 words
    return make_tokenizer([f"w{i}" for i in range(30_517)], model_max_length=seq_len)


def rows(tokenizer, n: int, seed: int) -> Dataset:
    """Zipf-distributed words, so that frequent and rare embedding rows both occur."""
    seq_len = tokenizer.model_max_length
    generator = torch.Generator().manual_seed(seed)
    weights = 1.0 / torch.arange(1, len(tokenizer) - 4, dtype=torch.float64)
    ids = torch.multinomial(weights, n * (seq_len - 2), replacement=True, generator=generator).reshape(n, -1) + 5
    cls, sep = tokenizer.cls_token_id, tokenizer.sep_token_id
    input_ids = [[cls, *row.tolist(), sep] for row in ids]
    return Dataset.from_dict({"input_ids": input_ids, "attention_mask": [[1] * seq_len for _ in input_ids]})


def build_model(name: str, tokenizer) -> BertForMaskedLM:
    torch.manual_seed(0)
    return BertForMaskedLM(
        BertConfig(vocab_size=len(tokenizer), max_position_embeddings=tokenizer.model_max_length, **MODELS[name])
    )


def train(
    name: str, tokenizer, train_rows, eval_rows, steps: int, eval_every: int, callback, batch: int, clock=None
) -> tuple[float, float]:
    """CPU and wall seconds of one ``trainer.train()``; ``clock`` (a `StepClock`) times its steps."""
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            out,
            max_steps=steps,
            per_device_train_batch_size=batch,
            per_device_eval_batch_size=batch,
            eval_strategy="steps",
            eval_steps=eval_every,
            logging_steps=eval_every,
            save_strategy="no",
            report_to=[],
            disable_tqdm=True,
            use_cpu=True,
            dataloader_num_workers=0,
            seed=0,
        )
        trainer = Trainer(
            model=build_model(name, tokenizer),
            args=args,
            train_dataset=train_rows,
            eval_dataset=eval_rows,
            data_collator=DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.15),
            processing_class=tokenizer,
            callbacks=[c for c in (clock, callback) if c is not None],
        )
        if callback is not None:
            callback.bind_trainer(trainer)
        start, wall = time.process_time(), time.perf_counter()
        trainer.train()
        return time.process_time() - start, time.perf_counter() - wall


def project(name: str, tokenizer, steps: int, eval_every: int, options: dict, batch: int) -> None:
    """One estimate's cost against one training step, and the ratios of a ``steps``-step run they predict: the
    final measurement sized by the budget (``projected_budgeted_final_ratio``) and, unless ``--callback`` turns it
    off, on all ``n_contexts`` contexts as the callback takes it by default (``projected_callback_overhead_ratio``).

    Times three AdamW steps of ``batch`` sequences (the median of the last two counts) and a first measurement as the
    callback takes it (one batch of contexts), in CPU seconds; the run is then replayed with the callback's own
    sizing rule (`contexts_within_budget`) on those costs. Evaluations are left out of the training time (they would
    only lower the ratio), and every measurement is costed at the first one's seconds per context."""
    from transformers import DataCollatorForLanguageModeling

    from hf_flatbias.callbacks import contexts_within_budget
    from hf_flatbias.constants import DEFAULT_BATCH_SIZE
    from hf_flatbias.flatness import build_masked_contexts, estimate_hessian_trace

    model = build_model(name, tokenizer)
    collate = DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.15)
    train_rows = rows(tokenizer, 3 * batch, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    step_seconds = []
    for i in range(3):
        inputs = collate([train_rows[j] for j in range(i * batch, (i + 1) * batch)])
        start = time.process_time()
        model(**inputs).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        step_seconds.append(time.process_time() - start)
    step = statistics.median(step_seconds[1:])  # the first pays for lazy initialisation
    eval_rows = rows(tokenizer, 4 * batch, seed=1)
    n_contexts = options.get("n_contexts", 256)
    contexts = build_masked_contexts(
        [{"input_ids": r["input_ids"]} for r in eval_rows],
        mask_token_id=tokenizer.mask_token_id,
        n_contexts=n_contexts,
        seed=0,
        special_token_ids=tokenizer.all_special_ids,
    )
    first = options.get("batch_size", DEFAULT_BATCH_SIZE)
    start = time.process_time()
    estimate = estimate_hessian_trace(model, contexts, n_contexts=first, n_draws=options.get("n_draws", 2))
    per_context = (time.process_time() - start) / first
    print(
        f"{name}: {model.num_parameters() / 1e6:.0f}M parameters, training step {step:.1f} CPU s "
        f"(steps {[round(t, 1) for t in step_seconds]}), "
        f"first measurement ({first} contexts) {per_context * first:.1f} CPU s = {per_context * first / step:.2f} "
        f"steps, trace {estimate.mean:.1f} +- {estimate.stderr:.1f}",
        flush=True,
    )
    spent, previous, sizes = 0.0, None, []
    for at in range(eval_every, steps + 1, eval_every):
        n = contexts_within_budget(
            max_overhead=options.get("max_overhead", 0.05),
            train_seconds=at * step,
            measuring_seconds=spent,
            seconds_per_context=previous,
            n_contexts=n_contexts,
            min_contexts=first,
            required=at == steps,
        )
        spent += n * per_context
        previous = per_context
        sizes.append((at, n))
    print(f"projected measurements (step, contexts): {sizes}; {spent:.0f} CPU s over {steps * step:.0f} s of training")
    budgeted_final = 1 + spent / (steps * step)
    # the callback's default takes the final measurement on every context instead of what the budget leaves
    whole = spent + (n_contexts - sizes[-1][1]) * per_context
    print(
        f"projected final measurement on all {n_contexts} contexts: {n_contexts * per_context:.0f} CPU s = "
        f"{n_contexts * per_context / step:.1f} steps"
    )
    print(f"projected_budgeted_final_ratio={budgeted_final:.3f}")
    full_final = options.get("full_final_measurement", True) and options.get("max_overhead", 0.05) is not None
    print(f"projected_callback_overhead_ratio={1 + whole / (steps * step) if full_final else budgeted_final:.3f}")


ARMS = ("plain", "budgeted-final", "callback")


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def compare_arms(args, options: dict, tokenizer, train_rows, eval_rows) -> None:
    """``--arms``: each repeat runs every arm once, the order rotated by one from a repeat to the next."""
    arms = [arm.strip() for arm in args.arms.split(",") if arm.strip()]
    unknown = sorted(set(arms) - set(ARMS))
    if unknown or not arms:
        raise SystemExit(f"--arms {args.arms!r}: {unknown or 'none'} unknown; choose from {', '.join(ARMS)}.")
    settings = {"plain": None, "budgeted-final": {**options, "full_final_measurement": False}, "callback": options}
    cpu = {arm: [] for arm in arms}
    ratio, in_run, final_steps, final_share, interim_share, step_seconds = ({arm: [] for arm in arms} for _ in range(6))
    for repeat in range(args.repeats):
        order = arms[repeat % len(arms) :] + arms[: repeat % len(arms)]
        seconds = {}
        for arm in order:
            callback = None if settings[arm] is None else TimedTraceCallback(**settings[arm])
            clock = StepClock()
            load = os.getloadavg()[0]
            seconds[arm], wall = train(
                args.model, tokenizer, train_rows, eval_rows, args.steps, args.eval_every, callback, args.batch, clock
            )
            cpu[arm].append(seconds[arm])
            step_seconds[arm].append(clock.step())
            line = (
                f"repeat {repeat} {arm}: {seconds[arm]:.1f} CPU s ({wall:.0f} wall s), step {clock.step():.2f} CPU s, "
                f"load average {load:.1f} -> {os.getloadavg()[0]:.1f}"
            )
            if callback is not None:
                training = seconds[arm] - callback.cpu_seconds
                # the last measurement is the final one (taken at the last step); those before it are the interim
                # ones the budget sizes
                final = callback.cpu_per_measurement[-1]
                interim = sum(callback.cpu_per_measurement[:-1])
                in_run[arm].append(seconds[arm] / training)
                final_steps[arm].append(final / clock.step())
                final_share[arm].append(final / training)
                interim_share[arm].append(interim / training)
                measurements = ", ".join(
                    f"step {e['step']}: {e['n_contexts']} contexts in {cpu_s:.1f} CPU s, {e['trace']:.1f} +- "
                    f"{e['stderr']:.1f}"
                    for e, cpu_s in zip(callback.measurement_history, callback.cpu_per_measurement, strict=True)
                )
                line += (
                    f"; callback {callback.cpu_seconds:.1f} CPU s (in-run ratio {in_run[arm][-1]:.3f}); final "
                    f"measurement {final:.1f} CPU s = {final_steps[arm][-1]:.2f} steps = {final_share[arm][-1]:.3f} "
                    f"of the run's training; interim measurements {interim:.1f} CPU s = {interim_share[arm][-1]:.3f} "
                    f"of it; measurements: {measurements}"
                )
            print(line, flush=True)
        if "plain" in seconds:
            for arm in arms:
                ratio[arm].append(seconds[arm] / seconds["plain"])
    for arm in arms:
        print(f"{arm}: {spread(cpu[arm])} CPU s, step {spread(step_seconds[arm])} CPU s (median, min-max)")
    for arm in arms:
        if arm != "plain" and ratio[arm]:
            print(f"{arm}_ratio={spread(ratio[arm])}")
        if in_run[arm]:
            print(f"{arm}_in_run_ratio={spread(in_run[arm])}")
            print(f"{arm}_final_steps={spread(final_steps[arm])} (final share of training {spread(final_share[arm])})")
            print(f"{arm}_interim_share={spread(interim_share[arm])} (interim measurements' CPU s / training's)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="bert-15m")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--callback", default="{}", help="HessianTraceCallback keyword arguments, as JSON")
    parser.add_argument("--project", action="store_true", help="time one step and one estimate, project the ratio")
    parser.add_argument("--seq-len", type=int, default=SEQ_LEN, help="tokens per training and evaluation sequence")
    parser.add_argument("--batch", type=int, default=BATCH, help="sequences per training (and evaluation) batch")
    parser.add_argument("--skip-plain", action="store_true", help="only the run with the callback (in-run ratio)")
    parser.add_argument("--arms", help=f"runs per repeat, interleaved, from {', '.join(ARMS)} (comma-separated)")
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    options = json.loads(args.callback)
    tokenizer = build_tokenizer(args.seq_len)
    if args.project:
        project(args.model, tokenizer, args.steps, args.eval_every, options, args.batch)
        return
    train_rows = rows(tokenizer, args.steps * args.batch, seed=0)
    eval_rows = rows(tokenizer, 4 * args.batch, seed=1)
    n_params = build_model(args.model, tokenizer).num_parameters()
    print(
        f"BERT MLM {n_params / 1e6:.1f}M parameters, {args.steps} steps of {args.batch} x {args.seq_len} tokens, "
        f"evaluation every {args.eval_every} steps on {len(eval_rows)} rows, {torch.get_num_threads()} thread(s), "
        f"callback {options or 'at its defaults'}, load average {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    if args.arms:
        compare_arms(args, options, tokenizer, train_rows, eval_rows)
        return
    ratios, wall_ratios, in_run = [], [], []
    for repeat in range(args.repeats):
        plain = plain_wall = None
        if not args.skip_plain:
            plain, plain_wall = train(
                args.model, tokenizer, train_rows, eval_rows, args.steps, args.eval_every, None, args.batch
            )
        callback = TimedTraceCallback(**options)
        measured, measured_wall = train(
            args.model, tokenizer, train_rows, eval_rows, args.steps, args.eval_every, callback, args.batch
        )
        if plain is not None:
            ratios.append(measured / plain)
            wall_ratios.append(measured_wall / plain_wall)
        history = callback.measurement_history
        measuring = sum(entry["seconds"] for entry in history)
        # the same run's training without the callback's measurements
        in_run.append(measured / (measured - callback.cpu_seconds))
        steps = ", ".join(
            f"step {e['step']}: {e['n_contexts']} contexts in {e['seconds']:.1f} s, "
            f"{e['trace']:.1f} +- {e['stderr']:.1f}"
            for e in history
        )
        without = (
            "without not run"
            if plain is None
            else f"without {plain:.1f} CPU s ({plain_wall:.0f} wall s), ratio {ratios[-1]:.3f} "
            f"(wall {wall_ratios[-1]:.3f})"
        )
        print(
            f"repeat {repeat}: with {measured:.1f} CPU s ({measured_wall:.0f} wall s), {without}; "
            f"load average {os.getloadavg()[0]:.1f}; callback CPU s {callback.cpu_seconds:.1f} "
            f"(in-run ratio {in_run[-1]:.3f}), wall s {measuring:.1f}; "
            f"measurements: {steps}",
            flush=True,
        )
    if ratios:
        low, high = min(wall_ratios), max(wall_ratios)
        print(f"callback_wall_ratio={statistics.median(wall_ratios):.3f} (range {low:.3f}-{high:.3f})")
        print(f"callback_overhead_ratio={statistics.median(ratios):.3f} (range {min(ratios):.3f}-{max(ratios):.3f})")
    print(f"callback_in_run_ratio={statistics.median(in_run):.3f} (range {min(in_run):.3f}-{max(in_run):.3f})")


if __name__ == "__main__":
    main()
