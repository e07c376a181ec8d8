"""Campaign v2's first phases (issue 33): starts distilled to a margin, then KL/trace-only pilots.

The rules are `rules_v2`'s constants, read here at call time (``rules.X``), never copied as literals. Two phases,
each a list of units run cheapest first; a unit's JSON row is written when it finishes (and its sub-steps as they
finish, ``status: "running"``), and a rerun skips units whose row says ``"done"``:

- starts (`run_starts`): per width and seed, v1's committed start reused if it meets the margin, else further
  decays (`extend_start`), then measured on v1's KL set (KL, Fisher trace; no probe).
- pilots (`run_pilots`): C1's dose (`choose_dose`), C2's rate per width, C3's dropout and C5's adversary weight
  (`choose_largest_saturated`), each from the pilot seed's start, KL (and for C1 the Fisher trace) only.

The numerical work is v1's: `distil_to_saturation`, `train_with_branches`, `measure_branch` (with ``probes=False``),
the language and pools of `campaign.material`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import BertForMaskedLM

from hf_flatbias.adversarial import AdversarialPretrainingModel
from hf_flatbias.results import write_json
from hf_flatbias.synthetic import build_model

from . import rules_v2 as rules
from .campaign import material
from .distillation import ConditionalPool, distil_to_saturation
from .paper_language import PaperLanguage, task_classes, task_labelled_train
from .protocol import measure_branch, train_with_branches
from .runs import RunSpec
from .units import read_units, rules_constants, run_units

V1_STATE = Path(__file__).parent / "results" / "saturated_start" / "campaign_state"
RESULTS = Path(__file__).parent / "results" / "campaign_v2"


@dataclass(frozen=True)
class Sizes:
    """Material, shape and schedule sizes: v1's by default (the rules' values, v1's grammar and widths, on the CPU);
    `SMOKE` shrinks them for tests; ``recipes/pcfg_protocol_gpu.py`` defines the GPU's shape."""

    n_train: int = 200_000
    n_kl: int = 1000
    n_trace: int = 1000
    n_probe: int = 2000
    n_pool: int = 30_000
    n_stop: int = 1000
    trace_draws: int = 2
    layers: int = rules.LAYERS
    batch_size: int = rules.BATCH_SIZE
    extension_steps: int = rules.EXTENSION_STEPS
    extension_warmup: int = rules.EXTENSION_WARMUP
    first_decay: tuple[int, float, int] = rules.FIRST_DECAY
    dose_ladder: tuple[int, ...] = rules.DOSE_LADDER
    dose_branch_every: int = rules.DOSE_BRANCH_EVERY
    anneal_steps: int = rules.ANNEAL_STEPS
    continue_warmup: int = rules.CONTINUE_WARMUP
    #: the grammar's shape (`campaign.SHAPES`), grammar seed 0 either way
    shape: str = "three_level"
    #: the starts' widths in the order they run (C2 compares them all) ...
    widths: tuple[int, ...] = rules.WIDTHS
    #: ... and the one of C1, C3, C5 and the pilots but C2's rates
    base_width: int = rules.V1_WIDTH
    #: where v1's committed starts live (`v1_start_dir`); None: no v1 start, every width starts fresh
    v1_starts: Path | None = V1_STATE
    #: where the models train and are measured ("cpu", "cuda")
    device: str = "cpu"


SMOKE = Sizes(
    n_train=400,
    n_kl=30,
    n_trace=8,
    n_probe=60,
    n_pool=300,
    n_stop=40,
    trace_draws=1,
    layers=1,
    batch_size=16,
    extension_steps=12,
    extension_warmup=2,
    first_decay=(16, 2e-3, 2),
    dose_ladder=(10, 20),
    dose_branch_every=10,
    anneal_steps=4,
    continue_warmup=2,
)


@dataclass
class Material:
    """v1's fixed material for grammar seed 0 (`campaign.material`) at ``Sizes.shape``: language, distillation pool,
    stop set."""

    language: PaperLanguage
    pool: ConditionalPool
    stop_set: ConditionalPool


def load_material(work_dir: Path, sizes: Sizes) -> Material:
    """v1's language, pool and stop set (the same draws as v1's campaign), exact conditionals cached in ``work_dir``."""
    v1_flags = argparse.Namespace(  # v1's `material` reads its recipe's flags; built here once, not passed around
        grammar_seed=0,
        shape=sizes.shape,
        n_train=sizes.n_train,
        n_kl=sizes.n_kl,
        n_trace=sizes.n_trace,
        n_probe=sizes.n_probe,
        n_pool=sizes.n_pool,
        n_stop=sizes.n_stop,
        work_dir=work_dir,
    )
    return Material(*material(v1_flags))


# ---------------------------------------------------------------- rules as functions of rows (pure, tested)


def meets_margin(kl: float, ci_high: float) -> bool:
    """The starts' margin: KL <= `rules.MARGIN_KL` and bootstrap upper end <= `rules.MARGIN_KL_UPPER`."""
    return kl <= rules.MARGIN_KL and ci_high <= rules.MARGIN_KL_UPPER


def stays_saturated(kl: float, ci_high: float) -> bool:
    """v1's saturated tier (`rules.SATURATED_KL`, `rules.SATURATED_KL_UPPER`): what a pilot branch must keep."""
    return kl <= rules.SATURATED_KL and ci_high <= rules.SATURATED_KL_UPPER


def choose_dose(
    start_trace: float,
    rows: Sequence[dict[str, float]],
    ladder: Sequence[int] | None = None,
    min_fall: float | None = None,
) -> dict[str, Any]:
    """C1's dose by `rules_v2`: ``rows`` are pilot branches ``{"steps", "kl", "ci_high", "fisher_trace"}``.

    Returns ``{"status", "chosen", "rungs"}``: status ``"met"`` (the shortest rung whose trace fell by >= ``min_fall``
    relative to ``start_trace`` while saturated), ``"pending"`` (rungs still to measure, none met yet), else, every
    rung measured: ``"under-dosed"`` (the longest saturated rung) or ``"no rung saturated"`` (the shortest).
    ``ladder`` and ``min_fall`` default to `rules.DOSE_LADDER` and `rules.DOSE_MIN_TRACE_FALL`.
    """
    ladder = rules.DOSE_LADDER if ladder is None else ladder
    min_fall = rules.DOSE_MIN_TRACE_FALL if min_fall is None else min_fall
    by_steps = {int(row["steps"]): row for row in rows}
    rungs = []
    for steps in sorted(ladder):
        if steps not in by_steps:
            continue
        row = by_steps[steps]
        fall = 1.0 - row["fisher_trace"] / start_trace
        saturated = stays_saturated(row["kl"], row["ci_high"])
        rungs.append({"steps": steps, "trace_fall": fall, "saturated": saturated, "kl": row["kl"]})
    met = [r["steps"] for r in rungs if r["saturated"] and r["trace_fall"] >= min_fall]
    if met:
        return {"status": "met", "chosen": min(met), "rungs": rungs}
    if len(rungs) < len(ladder):
        return {"status": "pending", "chosen": None, "rungs": rungs}
    saturated = [r["steps"] for r in rungs if r["saturated"]]
    if saturated:
        return {"status": "under-dosed", "chosen": max(saturated), "rungs": rungs}
    return {"status": "no rung saturated", "chosen": min(ladder), "rungs": rungs}


def choose_largest_saturated(
    ladder: Sequence[float], rows: Sequence[dict[str, float]], *, fallback_smallest: bool
) -> dict[str, Any]:
    """The largest ladder value whose pilot row ``{"value", "kl", "ci_high"}`` stays saturated, tried from the largest
    down. Returns ``{"status", "chosen", "next"}``: ``"chosen"``; ``"pending"`` with ``next`` the value to pilot;
    or, none saturated, ``"none saturated"`` with ``chosen`` the smallest (``fallback_smallest``: C2's rate) or None
    (C3's dropout, C5's weight)."""
    by_value = {float(row["value"]): row for row in rows}
    for value in sorted(ladder, reverse=True):
        if value not in by_value:
            return {"status": "pending", "chosen": None, "next": value}
        if stays_saturated(by_value[value]["kl"], by_value[value]["ci_high"]):
            return {"status": "chosen", "chosen": value, "next": None}
    return {"status": "none saturated", "chosen": min(ladder) if fallback_smallest else None, "next": None}


# ---------------------------------------------------------------- resumable JSON of units


def rules_header(phase: str) -> dict[str, Any]:
    """What every phase JSON carries: the rules module's constants, and where the prose is."""
    return {
        "phase": phase,
        "rules": "recipes/research/results/campaign_v2/RULES_v2.md",
        "constants": rules_constants(rules),
    }


def run_phase(
    path: Path, units: Sequence[tuple[str, Callable[[Callable[[dict], None]], dict]]], phase: str
) -> dict[str, dict]:
    """`units.run_units` under ``phase``'s header: each ``(key, work)`` in order unless its row on disk is done."""
    return run_units(path, units, rules_header(phase), phase)


# ---------------------------------------------------------------- starts


def start_key(width: int, seed: int) -> str:
    return f"h{width}/seed{seed}"


def v1_start_dir(width: int, seed: int, state: Path = V1_STATE) -> Path:
    """Where v1 committed the start of ``width`` and ``seed`` (it may not exist: H48)."""
    return state / f"seed{seed}" / ("start" if width == rules.V1_WIDTH else f"h{width}/start")


def _stop_row(distillation: dict[str, Any], index: int, steps: int, peak: float) -> dict[str, Any]:
    stop = distillation["stop_kl"]
    return {
        "decay": index,
        "steps": steps,
        "peak": peak,
        "stop_kl": stop["kl"],
        "stop_ci_high": stop["ci_high"],
        "margin_met": meets_margin(stop["kl"], stop["ci_high"]),
        "seconds": distillation["seconds"],
        "cpu_seconds": distillation["cpu_seconds"],
    }


def _decay(
    model: torch.nn.Module,
    material: Material,
    directory: Path,
    *,
    steps: int,
    peak: float,
    warmup: int,
    batch_size: int,
    seed: int,
) -> dict[str, Any]:
    """One decay to lr 0 from ``model`` (fresh AdamW), stop set measured at its end only; resumes mid-decay."""
    return distil_to_saturation(
        model,
        material.pool,
        material.stop_set,
        steps=steps,
        learning_rate=peak,
        warmup_steps=warmup,
        batch_size=batch_size,
        check_every=steps,  # only at the decay's end: no early stop mid-decay
        extensions=(),
        seed=seed,
        checkpoint=directory.with_suffix(".pt"),
    )


def extend_start(
    material: Material, width: int, seed: int, unit_dir: Path, sizes: Sizes, save: Callable[[dict], None]
) -> tuple[BertForMaskedLM, dict[str, Any]]:
    """The margin's rule for one width and seed: v1's start reused if it meets the margin, else (from v1's start,
    or from a fresh model after v1's first decay) up to `rules.MAX_EXTENSIONS` decays, stopping at the first that
    meets it. Every finished decay is saved (weights and ``decay.json``) and read back by a rerun. Returns the start
    (the first decay meeting the margin, else the one with the lowest stop-set KL) and its row."""
    row: dict[str, Any] = {"width": width, "seed": seed, "decays": []}
    v1_dir = None if sizes.v1_starts is None else v1_start_dir(width, seed, sizes.v1_starts)
    from_v1 = v1_dir is not None and v1_dir.exists()
    if from_v1:
        model = BertForMaskedLM.from_pretrained(v1_dir).to(sizes.device)
        stop = json.loads((v1_dir / "start.json").read_text())["distillation"]["stop_kl"]
        row.update(base="v1 committed start", v1_stop_kl=stop["kl"], v1_stop_ci_high=stop["ci_high"])
        if meets_margin(stop["kl"], stop["ci_high"]):
            return model.eval(), {**row, "source": "v1 reused", "margin_met": True, "chosen_decay": None}
    else:
        row.update(base="fresh model, v1's first decay to its end")
        model = build_model(len(material.language.tokenizer), hidden=width, layers=sizes.layers, seed=seed)
        model.to(sizes.device)
    plan = [] if from_v1 else [(0, *sizes.first_decay)]
    plan += [
        (k, sizes.extension_steps, rules.EXTENSION_PEAK, sizes.extension_warmup)
        for k in range(1, 1 + rules.MAX_EXTENSIONS)
    ]
    for index, steps, peak, warmup in plan:
        decay_dir = unit_dir / f"decay{index}"
        if (decay_dir / "decay.json").exists():
            model = BertForMaskedLM.from_pretrained(decay_dir).to(sizes.device)
            decay = json.loads((decay_dir / "decay.json").read_text())
        else:
            print(f"[h{width} seed {seed}] decay {index}: {steps} steps from peak {peak:g}", flush=True)
            distillation = _decay(
                model,
                material,
                decay_dir,
                steps=steps,
                peak=peak,
                warmup=warmup,
                batch_size=sizes.batch_size,
                seed=1000 * index + seed,
            )
            decay = _stop_row(distillation, index, steps, peak)
            model.save_pretrained(decay_dir)
            write_json(decay_dir / "decay.json", decay)  # written last: its presence means the decay is complete
            decay_dir.with_suffix(".pt").unlink(missing_ok=True)
        row["decays"].append(decay)
        print(
            f"[h{width} seed {seed}] decay {index}: stop-set KL {decay['stop_kl']:.4f} "
            f"(upper {decay['stop_ci_high']:.4f}) margin={decay['margin_met']}",
            flush=True,
        )
        save(row)
        if decay["margin_met"]:
            break
    extensions = [d for d in row["decays"] if d["decay"] > 0]
    met = [d for d in row["decays"] if d["margin_met"]]
    best = met[0] if met else min(row["decays"], key=lambda d: d["stop_kl"])
    model = BertForMaskedLM.from_pretrained(unit_dir / f"decay{best['decay']}").to(sizes.device)
    source = f"{row['base']} + {len(extensions)} extension(s)"
    return model.eval(), {**row, "source": source, "margin_met": bool(met), "chosen_decay": best["decay"]}


def measure_start(model: torch.nn.Module, language: PaperLanguage, sizes: Sizes) -> dict[str, Any]:
    """A start on v1's KL set and trace contexts: KL with its interval, Fisher trace (seed 0 draws); no probe."""
    record = measure_branch(
        model, language, trace_contexts=sizes.n_trace, trace_draws=sizes.trace_draws, hutchinson_draws=0, probes=False
    )
    record["kl_margin_met"] = meets_margin(record["kl"], record["saturation"]["ci_high"])
    return record


def start_unit(material: Material, width: int, seed: int, work_dir: Path, sizes: Sizes):
    """The unit of work of one start: margin, then the measurement; the chosen weights under ``.../start``."""

    def work(save: Callable[[dict], None]) -> dict[str, Any]:
        unit_dir = work_dir / "starts" / f"h{width}" / f"seed{seed}"
        model, row = extend_start(material, width, seed, unit_dir, sizes, save)
        model.save_pretrained(unit_dir / "start")
        measured = measure_start(model, material.language, sizes)
        print(
            f"[h{width} seed {seed}] start ({row['source']}): KL {measured['kl']:.4f} "
            f"(upper {measured['saturation']['ci_high']:.4f}) Fisher {measured['fisher_trace']:.1f} "
            f"margin={row['margin_met']}",
            flush=True,
        )
        return {**row, "measured": measured, "checkpoint": str(unit_dir / "start")}

    return work


def run_starts(material: Material, work_dir: Path, results: Path, sizes: Sizes) -> dict[str, dict]:
    """Every start, ``sizes.widths`` in order, seeds `rules.SEEDS` each; ``results`` rewritten after each."""
    units = [
        (start_key(width, seed), start_unit(material, width, seed, work_dir, sizes))
        for width in sizes.widths
        for seed in rules.SEEDS
    ]
    return run_phase(results, units, "starts")


# ---------------------------------------------------------------- pilots


def continued_spec(
    seed: int, start: BertForMaskedLM, rate: float, steps: int, sizes: Sizes, *, dropout: float = 0.0
) -> RunSpec:
    """v1's continued training (`campaign.continue_spec`'s settings) from ``start`` (its width and depth): AdamW
    (`rules.CONTINUE_BETA2`, `rules.CONTINUE_WEIGHT_DECAY`), constant ``rate`` after a short warm-up, one branch at
    the end unless the caller branches more often; on ``sizes.device``."""
    return RunSpec(
        label=f"seed{seed}",
        steps=steps,
        eval_every=steps,
        batch_size=sizes.batch_size,
        learning_rate=rate,
        warmup_steps=sizes.continue_warmup,
        lr_scheduler_type="constant_with_warmup",
        adam_beta2=rules.CONTINUE_BETA2,
        weight_decay=rules.CONTINUE_WEIGHT_DECAY,
        dropout=dropout,
        hidden=start.config.hidden_size,
        layers=start.config.num_hidden_layers,
        heads=start.config.num_attention_heads,
        seed=seed,
        use_cpu=sizes.device == "cpu",
    )


def adversarial(spec: RunSpec, language: PaperLanguage, weight: float) -> RunSpec:
    """``spec`` with v1's adversary on the evaluated read-out (`campaign.adversarial_spec`'s) at ``weight``: one head
    per task on the last layer's positions concatenated, the sentence unmasked, fed the rows' ``task_labels``."""

    def wrap(model):
        return AdversarialPretrainingModel(
            model,
            task_classes(language),
            adversary_weight=weight,
            pooling="concat",
            width=language.width + 2,  # [CLS] words [SEP]: the width encoder_features reads
            read_unmasked=True,
        )

    return dataclasses.replace(spec, wrap_model=wrap, task_column="task_labels")


def _flat(record: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """A pilot branch's row: what the rules read, and the record's KL/trace fields."""
    row = {"steps": record["step"], "kl": record["kl"], "ci_high": record["saturation"]["ci_high"], **extra}
    if "fisher_trace" in record:
        row.update(fisher_trace=record["fisher_trace"], fisher_trace_stderr=record["fisher_trace_stderr"])
    return row


def _measure_kwargs(sizes: Sizes, *, trace: bool) -> dict[str, Any]:
    return dict(
        trace_contexts=sizes.n_trace if trace else 0,
        trace_draws=sizes.trace_draws,
        hutchinson_draws=0,
        probes=False,
    )


def load_start(starts: Path, width: int, seed: int) -> tuple[BertForMaskedLM, dict[str, Any]]:
    """A finished start of the starts phase (its row must be done)."""
    row = read_units(starts).get(start_key(width, seed))
    if row is None or row.get("status") != "done":
        raise SystemExit(f"the start h{width} seed {seed} is not finished: run --phase starts first.")
    return BertForMaskedLM.from_pretrained(row["checkpoint"]).eval(), row


def dose_unit(material: Material, starts: Path, work_dir: Path, sizes: Sizes):
    """C1's dose pilot: one trunk at `rules.C1_RATE`, a branch every ``dose_branch_every`` steps, stopped as soon as
    `choose_dose` says ``met``."""

    def work(save: Callable[[dict], None]) -> dict[str, Any]:
        start, start_row = load_start(starts, sizes.base_width, rules.PILOT_SEED)
        start_trace = start_row["measured"]["fisher_trace"]

        def decided(records: list[dict[str, Any]]) -> bool:
            rows = [_flat(r) for r in records]
            save(
                {"start_trace": start_trace, "rows": rows, "choice": choose_dose(start_trace, rows, sizes.dose_ladder)}
            )
            return choose_dose(start_trace, rows, sizes.dose_ladder)["status"] == "met"

        records = train_with_branches(
            material.language,
            continued_spec(rules.PILOT_SEED, start, rules.C1_RATE, max(sizes.dose_ladder), sizes),
            work_dir / "pilots" / "c1_dose",
            branch_every=sizes.dose_branch_every,
            anneal_steps=sizes.anneal_steps,
            measure_kwargs=_measure_kwargs(sizes, trace=True),
            start_model=start,
            stop_when=decided,
        )
        rows = [_flat(r) for r in records]
        choice = choose_dose(start_trace, rows, sizes.dose_ladder)
        print(f"[pilots] C1 dose: {choice['status']}, {choice['chosen']} steps", flush=True)
        return {
            "width": sizes.base_width,
            "rate": rules.C1_RATE,
            "start_trace": start_trace,
            "rows": rows,
            "choice": choice,
        }

    return work


def ladder_unit(
    ladder: Sequence[float],
    pilot: Callable[[float], dict[str, Any]],
    *,
    fallback_smallest: bool,
    describe: dict[str, Any],
    saved_rows: Callable[[], list[dict[str, Any]]] = list,
):
    """A ladder pilot: `choose_largest_saturated` asks for the next value, ``pilot(value)`` gives its branch record.
    ``saved_rows()``: the rungs a stopped run finished (its partial row), not run again."""

    def work(save: Callable[[dict], None]) -> dict[str, Any]:
        rows = [row for row in saved_rows() if row["value"] in ladder]
        while (choice := choose_largest_saturated(ladder, rows, fallback_smallest=fallback_smallest))[
            "status"
        ] == "pending":
            rows.append(_flat(pilot(choice["next"]), value=choice["next"]))
            save({**describe, "rows": rows})
        return {**describe, "rows": rows, "choice": choice}

    return work


def pilot_units(material: Material, starts: Path, pilots: Path, work_dir: Path, sizes: Sizes) -> list:
    """The pilots in order: C1's dose, then (at its length) C2's rate per width, C3's dropout, C5's weight."""
    language = material.language
    pilot_dir = work_dir / "pilots"

    def dose() -> int:
        row = read_units(pilots)["c1_dose"]
        return int(row["choice"]["chosen"])

    def branch(directory: Path, spec: RunSpec, start, **options) -> dict[str, Any]:
        records = train_with_branches(
            language,
            spec,
            directory,
            branch_every=spec.steps,
            anneal_steps=sizes.anneal_steps,
            measure_kwargs=_measure_kwargs(sizes, trace=False),
            start_model=start,
            **options,
        )
        return records[-1]

    def rate_pilot(width: int) -> Callable[[float], dict[str, Any]]:
        def run(rate: float) -> dict[str, Any]:
            start, _ = load_start(starts, width, rules.PILOT_SEED)
            spec = continued_spec(rules.PILOT_SEED, start, rate, dose(), sizes)
            return branch(pilot_dir / "c2_rate" / f"h{width}" / f"lr{rate:g}", spec, start)

        return run

    def dropout_pilot(dropout: float) -> dict[str, Any]:
        start, _ = load_start(starts, sizes.base_width, rules.PILOT_SEED)
        spec = continued_spec(rules.PILOT_SEED, start, rules.C1_RATE, dose(), sizes, dropout=dropout)
        return branch(pilot_dir / "c3_dropout" / f"d{dropout:g}", spec, start)

    labelled: dict[str, Any] = {}

    def adversary_pilot(weight: float) -> dict[str, Any]:
        start, _ = load_start(starts, sizes.base_width, rules.PILOT_SEED)
        spec = adversarial(continued_spec(rules.PILOT_SEED, start, rules.C1_RATE, dose(), sizes), language, weight)
        if "rows" not in labelled:  # the task labels of 200k sentences: computed once for every weight
            labelled["rows"] = task_labelled_train(language, sizes.n_train)
        return branch(pilot_dir / "c5_weight" / f"w{weight:g}", spec, start, train_dataset=labelled["rows"])

    def saved(key: str) -> Callable[[], list[dict[str, Any]]]:
        return lambda: read_units(pilots).get(key, {}).get("rows", [])

    units = [("c1_dose", dose_unit(material, starts, work_dir, sizes))]
    for width in sizes.widths:
        describe = {"width": width, "seed": rules.PILOT_SEED, "ladder": list(rules.RATE_LADDER)}
        key = f"c2_rate/h{width}"
        units.append(
            (
                key,
                ladder_unit(
                    rules.RATE_LADDER,
                    rate_pilot(width),
                    fallback_smallest=True,
                    describe=describe,
                    saved_rows=saved(key),
                ),
            )
        )
    units.append(
        (
            "c3_dropout",
            ladder_unit(
                rules.DROPOUT_LADDER,
                dropout_pilot,
                fallback_smallest=False,
                describe={"rate": rules.C1_RATE, "ladder": list(rules.DROPOUT_LADDER)},
                saved_rows=saved("c3_dropout"),
            ),
        )
    )
    units.append(
        (
            "c5_weight",
            ladder_unit(
                rules.ADVERSARY_LADDER,
                adversary_pilot,
                fallback_smallest=False,
                describe={"rate": rules.C1_RATE, "ladder": list(rules.ADVERSARY_LADDER)},
                saved_rows=saved("c5_weight"),
            ),
        )
    )
    return units


def run_pilots(material: Material, starts: Path, pilots: Path, work_dir: Path, sizes: Sizes) -> dict[str, dict]:
    """Every pilot in order; ``pilots`` rewritten after each branch."""
    return run_phase(pilots, pilot_units(material, starts, pilots, work_dir, sizes), "pilots")


# ---------------------------------------------------------------- the docs' rows


def _kl(value: float | None, upper: float | None) -> str:
    return "–" if value is None else f"{value:.4f} (≤ {upper:.4f})"


def starts_markdown(units: dict[str, dict[str, Any]], widths: Sequence[int] = rules.WIDTHS) -> str:
    """The starts' table of docs/reproduction/campaign_v2.md, from starts.json's units (``widths`` in order)."""
    lines = [
        "| start | status | v1 stop-set KL | decays: stop-set KL | margin | KL-set KL | Fisher trace |",
        "|---|---|---|---|---|---|---|",
    ]
    for width in widths:
        for seed in rules.SEEDS:
            row = units.get(start_key(width, seed))
            if row is None:
                lines.append(f"| H{width} seed {seed} | not started | | | | | |")
                continue
            decays = ", ".join(f"{d['decay']}: {d['stop_kl']:.4f}" for d in row["decays"]) or "none"
            measured = row.get("measured")
            trace = f"{measured['fisher_trace']:.1f}" if measured else "–"
            margin = {True: "met", False: "missed"}.get(row.get("margin_met"), "–") if row["status"] == "done" else "–"
            lines.append(
                f"| H{width} seed {seed} | {row['status']} | {_kl(row.get('v1_stop_kl'), row.get('v1_stop_ci_high'))} "
                f"| {decays} | {margin} "
                f"| {_kl(measured['kl'], measured['saturation']['ci_high']) if measured else '–'} "
                f"| {trace} |"
            )
    return "\n".join(lines)


def pilots_markdown(units: dict[str, dict[str, Any]]) -> str:
    """The pilots' table of docs/reproduction/campaign_v2.md, from pilots.json's units."""
    lines = ["| pilot | status | rows (value or steps: KL) | choice |", "|---|---|---|---|"]
    for key, row in units.items():
        rows = ", ".join(
            f"{r.get('value', r['steps']):g}: {r['kl']:.4f}"
            + (f" (trace {r['fisher_trace']:.1f})" if "fisher_trace" in r else "")
            for r in row.get("rows", [])
        )
        choice = row.get("choice") or {}
        lines.append(f"| {key} | {row['status']} | {rows} | {choice.get('status', '–')}: {choice.get('chosen')} |")
    return "\n".join(lines)
