"""The saturated-start campaign's phases (issue 23), each resumable from what it left on disk.

Per model seed: a start distilled on the exact conditionals until saturated (`distilled_start`), the rate pilot
(`choose_rate`, once), then the claims' continued trainings from that start (`run_c1_seed`, `run_c3_arm`,
`run_c5_seed`, `run_c2_size`). A phase whose ``result.json`` (or ``start.json``) exists is read back, never
recomputed; each writes that file last. ``args`` is the namespace of ``recipes/pcfg_saturated_start.py``'s parser.
The result files and verdicts are `claims`' job.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
from transformers import BertForMaskedLM

from hf_flatbias.adversarial import AdversarialPretrainingModel
from hf_flatbias.enlarge import enlarge
from hf_flatbias.flatness import estimate_hessian_trace
from hf_flatbias.results import write_json
from hf_flatbias.synthetic import bert_config, build_model
from hf_flatbias.synthetic.conditionals import cached_conditionals

from .distillation import ConditionalPool, distil_to_saturation
from .paper_language import PaperLanguage, setup_paper_language, task_classes
from .protocol import FISHER_OUTPUT_PROBE, measure_branch, train_with_branches
from .runs import RunSpec
from .verdicts import C2_SIZES, C3_ARMS

SHAPES = {
    "three_level": {"n_levels": 3, "symbols_per_level": 5, "n_words": 50, "binary_rules_per_symbol": 10},
    "paper": {},
}
ROUTE = (
    "Saturated start reached by distilling the exact conditionals (soft targets; our route, not the paper's "
    "training), then continued training with the paper's objective (sampled data token, one [MASK] per row); every "
    "compared point is a branch annealed to lr 0, measured on exact conditionals."
)
RATE_RULE = (
    "The constant continued-training rate is the largest of the candidates whose one pilot branch (seed 0, one "
    "branch interval at that rate, annealed) is saturated (KL <= 0.010, upper <= 0.015); the smallest if none is. "
    "Chosen on the KL alone, before any trace or probe of the campaign is seen."
)


def _seeds(grammar_seed: int) -> tuple[int, int]:
    # the pool and the stop set: draws of their own, disjoint from the protocol's train/KL/trace/probe streams
    pool, stop = np.random.SeedSequence([grammar_seed, 23]).spawn(2)
    return int(pool.generate_state(1)[0]), int(stop.generate_state(1)[0])


def material(args: argparse.Namespace):
    """The language's fixed material (`setup_paper_language`), the distillation pool and the stop set."""
    language = setup_paper_language(
        args.grammar_seed,
        n_train=args.n_train,
        n_kl=args.n_kl,
        n_trace=args.n_trace,
        n_probe=args.n_probe,
        shape=SHAPES[args.shape],
    )
    pools = []
    for n, seed in zip((args.n_pool, args.n_stop), _seeds(args.grammar_seed), strict=True):
        sample = language.grammar.sample(n, seed=seed)
        start = time.perf_counter()
        conditionals = cached_conditionals(
            language.grammar, sample.word_ids, sample.lengths, cache_dir=args.work_dir / "cache"
        )
        print(f"exact conditionals of {n} sentences: {time.perf_counter() - start:.1f} s", flush=True)
        pools.append(ConditionalPool(sample.word_ids, sample.lengths, conditionals))
    return language, pools[0], pools[1]


def measure_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return dict(
        trace_contexts=args.n_trace,
        trace_draws=args.trace_draws,
        hutchinson_draws=args.hutchinson_draws,
        probe_layers=tuple(range(args.layers)),  # hidden_states 0 (embeddings) .. L-1; L is the primary
    )


def distil_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The distillation schedule of `distil_to_saturation` as the recipe's flags set it."""
    return dict(
        steps=args.distil_steps,
        learning_rate=args.distil_lr,
        warmup_steps=args.distil_warmup,
        batch_size=args.batch_size,
        extensions=args.extensions,
        extend_below=args.extend_below,
    )


def distilled_start(
    args, language, pool, stop_set, seed: int, hidden: int | None = None
) -> tuple[BertForMaskedLM, dict[str, Any]]:
    """Seed ``seed``'s saturated start (distilled once, then read from disk) and its record; ``hidden``: another
    width than the campaign's (C2), kept under ``seedS/hH/start``."""
    hidden = args.hidden if hidden is None else hidden
    seed_dir = args.work_dir / f"seed{seed}"
    start_dir = (seed_dir if hidden == args.hidden else seed_dir / f"h{hidden}") / "start"
    record_path = start_dir / "start.json"
    if record_path.exists():
        model = BertForMaskedLM.from_pretrained(start_dir).to("cpu" if args.use_cpu else "cuda")
        return model.eval(), json.loads(record_path.read_text())
    checkpoint = start_dir.with_name("start_distillation.pt")  # a stopped distillation resumes from here
    model = build_model(len(language.tokenizer), hidden=hidden, layers=args.layers, seed=seed)
    model.to("cpu" if args.use_cpu else "cuda")
    print(f"[seed {seed}] distilling ({sum(p.numel() for p in model.parameters()):,} parameters)", flush=True)
    distillation = distil_to_saturation(model, pool, stop_set, seed=seed, checkpoint=checkpoint, **distil_kwargs(args))
    start = time.perf_counter()
    measured = measure_branch(model, language, seed=0, **measure_kwargs(args))
    record = {"distillation": distillation, "measured": measured, "measure_seconds": time.perf_counter() - start}
    print(
        f"[seed {seed}] start: {distillation['steps']} steps in {distillation['seconds']:.0f} s, KL "
        f"{measured['kl']:.4f} [{measured['saturation']['ci_low']:.4f}, {measured['saturation']['ci_high']:.4f}] "
        f"saturated={measured['saturated']} Fisher {measured['fisher_trace']:.1f} "
        f"probe {measured['probe_accuracy']:.3f}",
        flush=True,
    )
    model.save_pretrained(start_dir)
    write_json(record_path, record)  # written last: its presence means the start is complete
    checkpoint.unlink(missing_ok=True)
    return model, record


def continue_spec(
    args,
    seed: int,
    learning_rate: float,
    steps: int,
    *,
    dropout: float = 0.0,
    weight_decay: float = 0.01,
    sam: bool = False,
    hidden: int | None = None,
) -> RunSpec:
    """The continued training: AdamW (beta2 0.98, weight decay 0.01), constant rate after a short warm-up; C3's arms
    change dropout, weight decay and SAM (rho 0.05 every step; the branches anneal with plain AdamW steps)."""
    return RunSpec(
        label=f"seed{seed}",
        steps=steps,
        eval_every=args.branch_every,
        batch_size=args.batch_size,
        learning_rate=learning_rate,
        warmup_steps=args.continue_warmup,
        lr_scheduler_type="constant_with_warmup",
        adam_beta2=0.98,
        weight_decay=weight_decay,
        dropout=dropout,
        flatness_method="sam" if sam else "none",
        sam_rho=0.05,
        hidden=args.hidden if hidden is None else hidden,
        layers=args.layers,
        seed=seed,
        use_cpu=args.use_cpu,
    )


def campaign_rate(args, language, pool, stop_set) -> float:
    """The continued-training rate every claim uses: `choose_rate` on the first seed's start (read from disk once
    chosen)."""
    start, _ = distilled_start(args, language, pool, stop_set, args.seeds[0])
    return choose_rate(args, language, start)["chosen"]


def choose_rate(args, language, start: BertForMaskedLM) -> dict[str, Any]:
    """`RATE_RULE` on seed 0's start: pilots from the largest candidate down, stopping at the first saturated."""
    path = args.work_dir / "rate_pilot.json"
    if path.exists():
        return json.loads(path.read_text())
    pilots = []
    candidates = sorted(args.continue_lrs, reverse=True)
    chosen = candidates[-1]
    for rate in candidates:
        records = train_with_branches(
            language,
            continue_spec(args, args.seeds[0], rate, args.branch_every),
            args.work_dir / "rate_pilot" / f"lr{rate:g}",
            branch_every=args.branch_every,
            anneal_steps=args.anneal_steps,
            start_model=start,
            measure_kwargs=dict(trace_contexts=0, trace_draws=1, hutchinson_draws=1),
        )
        pilots.append({"learning_rate": rate, "kl": records[0]["kl"], "saturation": records[0]["saturation"]})
        if records[0]["saturated"]:
            chosen = rate
            break
    payload = {"rule": RATE_RULE, "candidates": candidates, "pilots": pilots, "chosen": chosen}
    write_json(path, payload)
    print(f"continued-training rate: {chosen:g} (pilots {[(p['learning_rate'], round(p['kl'], 4)) for p in pilots]})")
    return payload


def _finished(directory: Path) -> dict[str, Any] | None:
    """A phase's ``result.json`` (written last, so its presence means the phase is complete), or None."""
    done = directory / "result.json"
    return json.loads(done.read_text()) if done.exists() else None


def _continue(args, language, spec: RunSpec, directory: Path, start, *, every: int | None = None, **options) -> list:
    """`train_with_branches` from ``start`` with the campaign's anneal and measurements; one branch, at the end of
    the run, unless ``every`` says otherwise."""
    return train_with_branches(
        language,
        spec,
        directory,
        branch_every=every or spec.steps,
        anneal_steps=args.anneal_steps,
        measure_kwargs=measure_kwargs(args),
        start_model=start,
        **options,
    )


def run_c1_seed(args, language, start: BertForMaskedLM, seed: int, rate: float) -> dict[str, Any]:
    """Continued training of one seed from its saturated start; finished seeds are read back."""
    seed_dir = args.work_dir / f"seed{seed}" / "c1"
    if done := _finished(seed_dir):
        return done
    began = time.perf_counter()
    spec = continue_spec(args, seed, rate, args.continue_steps)
    records = _continue(args, language, spec, seed_dir, start, every=args.branch_every, keep_branches=True)
    payload = {"seed": seed, "records": records, "seconds_this_run": time.perf_counter() - began}
    write_json(seed_dir / "result.json", payload)
    return payload


def run_c3_arm(args, language, start: BertForMaskedLM, seed: int, rate: float, arm: str) -> dict[str, Any]:
    """One C3 arm of one seed from its saturated start: the C1 length, one branch at the end; read back if done."""
    arm_dir = args.work_dir / f"seed{seed}" / "c3" / arm
    if done := _finished(arm_dir):
        return done
    dropout, weight_decay, sam = C3_ARMS[arm]
    spec = continue_spec(args, seed, rate, args.continue_steps, dropout=dropout, weight_decay=weight_decay, sam=sam)
    began = time.perf_counter()
    records = _continue(args, language, spec, arm_dir, start)
    payload = {"seed": seed, "arm": arm, "record": records[-1], "seconds_this_run": time.perf_counter() - began}
    write_json(arm_dir / "result.json", payload)
    return payload


def adversarial_spec(args, language: PaperLanguage, seed: int, rate: float) -> RunSpec:
    """C5's continued training: C1's (`continue_spec`) with `AdversarialPretrainingModel` around the encoder, one
    head per task on the primary probe's features (last layer, the fixed width concatenated, the sentence unmasked),
    fed the rows' ``task_labels``."""

    def wrap(model):
        return AdversarialPretrainingModel(
            model,
            task_classes(language),
            adversary_weight=args.adversary_weight,
            pooling="concat",
            width=language.width + 2,  # [CLS] words [SEP]: the width encoder_features reads
            read_unmasked=True,
        )

    spec = continue_spec(args, seed, rate, args.continue_steps)
    return dataclasses.replace(spec, wrap_model=wrap, task_column="task_labels")


def run_c5_seed(
    args, language: PaperLanguage, labelled_train, start: BertForMaskedLM, seed: int, rate: float
) -> dict[str, Any]:
    """C5 of one seed: the adversarial continued training from its start, one branch at C1's length (annealed with
    the same objective); read back if done. A stopped run starts this seed again (no trunk checkpoint: see
    `train_with_branches`)."""
    seed_dir = args.work_dir / f"seed{seed}" / "c5"
    if done := _finished(seed_dir):
        return done
    began = time.perf_counter()
    spec = adversarial_spec(args, language, seed, rate)
    records = _continue(args, language, spec, seed_dir, start, train_dataset=labelled_train)
    payload = {"seed": seed, "record": records[-1], "seconds_this_run": time.perf_counter() - began}
    write_json(seed_dir / "result.json", payload)
    return payload


def run_c2_size(args, language, pool, stop_set, seed: int, rate: float, hidden: int) -> dict[str, Any]:
    """C2 of one seed and width: a start distilled at that width, C1's continued training with one branch at its
    length, and that branch's Fisher trace also in the largest width's parameter space (`enlarge`, function-
    preserving; the same contexts and draws as its own trace, so the largest width's two traces are equal)."""
    size_dir = args.work_dir / f"seed{seed}" / "c2" / f"h{hidden}"
    if done := _finished(size_dir):
        return done
    began = time.perf_counter()
    start, start_record = distilled_start(args, language, pool, stop_set, seed, hidden=hidden)
    spec = continue_spec(args, seed, rate, args.continue_steps, hidden=hidden)
    records = _continue(args, language, spec, size_dir, start, keep_branches=True)
    record = records[-1]
    branch = BertForMaskedLM.from_pretrained(size_dir / "branches" / f"step-{record['step']}").eval()
    largest = bert_config(len(language.tokenizer), hidden=max(C2_SIZES), layers=args.layers)
    trace = estimate_hessian_trace(
        enlarge(branch, largest) if hidden != max(C2_SIZES) else branch,
        language.trace_contexts,
        n_contexts=record["trace_contexts"],
        n_draws=args.trace_draws,
        seed=record["step"],  # measure_branch's seed for this branch
        progress=False,
        output_probe=FISHER_OUTPUT_PROBE,
    )
    record.update(fisher_trace_enlarged=trace.mean, fisher_trace_enlarged_stderr=trace.stderr)
    payload = {
        "seed": seed,
        "hidden": hidden,
        "parameters": sum(p.numel() for p in branch.parameters()),
        "start": {**start_record["distillation"], "measured": start_record["measured"]},
        "record": record,
        "seconds_this_run": time.perf_counter() - began,
    }
    write_json(size_dir / "result.json", payload)
    return payload


def commit_checkpoints(args, language, seed: int, result: dict[str, Any]) -> None:
    """The saturated start and the last branch of ``seed`` (weights, config, tokenizer) under RESULTS/checkpoints."""
    last = result["records"][-1]["step"]
    for name, source in {
        "start": args.work_dir / f"seed{seed}" / "start",
        "last_branch": args.work_dir / f"seed{seed}" / "c1" / "branches" / f"step-{last}",
    }.items():
        target = args.results_dir / "checkpoints" / f"seed{seed}_{name}"
        if not source.exists() and (target / "model.safetensors").exists():
            continue  # a resumed campaign: the committed state keeps this copy, not the branch folder it came from
        target.mkdir(parents=True, exist_ok=True)
        for file in ("config.json", "model.safetensors"):
            shutil.copy2(source / file, target / file)
        language.tokenizer.save_pretrained(target)


def finished_from_disk(args) -> tuple[dict[int, dict], dict[int, dict], float | None]:
    """Every planned seed whose start and continued training are on disk (also those of other processes)."""
    results, starts = {}, {}
    for seed in args.seeds:
        done = args.work_dir / f"seed{seed}" / "c1" / "result.json"
        start = args.work_dir / f"seed{seed}" / "start" / "start.json"
        if done.exists() and start.exists():
            results[seed], starts[seed] = json.loads(done.read_text()), json.loads(start.read_text())
    pilot = args.work_dir / "rate_pilot.json"
    return results, starts, json.loads(pilot.read_text())["chosen"] if pilot.exists() else None
