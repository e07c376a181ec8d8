"""The robustness study (issue 37): do the flatter arms of continued training lose less under weight noise and
quantization, and forget less after fine-tuning? Rules: `robustness_rules` (constants read at call time, ``rules.X``).

Per model seed, three arms of continued training from the committed saturated H64 start (`train_arm`: AdamW, SAM, and
AdamW with a late SAM window, one `FlatBiasTrainer` run each), and the start itself as a reference; every one is
measured alike (`measure_model`: KL, Fisher trace, weight-noise and quantization sensitivity, forgetting). A unit is
one (seed, arm); `run_study` writes its row to the JSON when it finishes and a rerun skips finished units
(`units.run_units`). `verdicts` turns the rows into the pre-registered pass/fail, `study_markdown` into the
docs' tables, `plot_study` into the figure.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from transformers import BertForMaskedLM

from hf_flatbias.config import FlatBiasConfig
from hf_flatbias.flatness.forgetting import measure_forgetting
from hf_flatbias.flatness.quantization import estimate_quantization_sensitivity
from hf_flatbias.flatness.weight_noise import estimate_weight_noise_sensitivity
from hf_flatbias.stats import paired_difference
from hf_flatbias.synthetic import MaskedWordCollator, sentences_to_dataset
from hf_flatbias.trainer import FlatBiasTrainer

from . import robustness_rules as rules
from .campaign import SHAPES
from .paper_language import PaperLanguage, SentenceSet, setup_paper_language
from .protocol import FISHER_OUTPUT_PROBE, measure_branch
from .runs import RunSpec, trainer_settings
from .units import read_units, rules_constants, run_units

RESULTS = Path(__file__).parent / "results" / "robustness"


@dataclass(frozen=True)
class StudySizes:
    """Material and schedule sizes: the rules' (v1's material) by default; `SMOKE` shrinks them for tests."""

    steps: int = rules.STEPS
    warmup: int = rules.WARMUP
    batch_size: int = rules.BATCH_SIZE
    n_train: int = 200_000  # v1's material (campaign_v2.Sizes): the same sentences, KL set and trace contexts
    n_kl: int = 1000
    n_trace: int = 1000
    n_probe: int = 2000
    trace_draws: int = rules.TRACE_DRAWS
    noise_draws: int = rules.NOISE_DRAWS
    finetune_steps: int = rules.FINETUNE_STEPS
    finetune_batch: int = rules.FINETUNE_BATCH
    n_task_rows: int = rules.N_TASK_ROWS
    n_eval_rows: int = rules.N_EVAL_ROWS


SMOKE = StudySizes(
    steps=8,
    warmup=2,
    batch_size=16,
    n_train=400,
    n_kl=20,
    n_trace=24,
    n_probe=40,
    trace_draws=1,
    noise_draws=2,
    finetune_steps=3,
    finetune_batch=8,
    n_task_rows=40,
    n_eval_rows=40,
)


def load_language(sizes: StudySizes) -> PaperLanguage:
    """v1's language (grammar seed 0, three levels) and its fixed KL sentences, trace contexts and probe splits."""
    return setup_paper_language(
        0,
        n_train=sizes.n_train,
        n_kl=sizes.n_kl,
        n_trace=sizes.n_trace,
        n_probe=sizes.n_probe,
        shape=SHAPES["three_level"],
    )


def task_rows(sentences: SentenceSet, n: int) -> list[dict[str, Any]]:
    """The first ``n`` sentences as classification rows of the downstream task (``rules.FINETUNE_TASK``)."""
    rows = sentences_to_dataset(sentences.word_ids[:n], sentences.lengths[:n])
    labels = sentences.labels[rules.FINETUNE_TASK][:n]
    return [
        {"input_ids": row["input_ids"], "attention_mask": row["attention_mask"], "label": int(label)}
        for row, label in zip(rows, labels, strict=True)
    ]


# ---------------------------------------------------------------- the arms


def window_start(steps: int) -> int:
    """The first update of the late SAM window: the last ``rules.WINDOW_FRACTION`` of ``steps`` take SAM."""
    return steps - round(rules.WINDOW_FRACTION * steps)


def arm_settings(arm: str, seed: int, sizes: StudySizes, output_dir: Path) -> dict[str, Any]:
    """`FlatBiasConfig` fields of ``arm``: the same schedule, data order and masks for every arm of a seed."""
    if arm not in rules.ARMS:
        raise ValueError(f"unknown arm {arm!r}; the study's arms are {list(rules.ARMS)}.")
    spec = RunSpec(
        label=f"seed{seed}/{arm}",
        steps=sizes.steps,
        eval_every=sizes.steps,
        batch_size=sizes.batch_size,
        learning_rate=rules.PEAK_RATE,
        warmup_steps=sizes.warmup,
        lr_scheduler_type="linear",
        adam_beta2=rules.BETA2,
        weight_decay=rules.WEIGHT_DECAY,
        flatness_method="none" if arm == "adamw" else "sam",
        sam_rho=rules.SAM_RHO,
        seed=seed,
    )
    settings = trainer_settings(spec, output_dir)
    if arm == "sam_window":
        settings["sam_start_step"] = window_start(sizes.steps)
    return settings


def start_path(seed: int) -> Path:
    return rules.START_DIR / f"seed{seed}" / "start"


def train_arm(language: PaperLanguage, arm: str, seed: int, sizes: StudySizes, output_dir: Path) -> BertForMaskedLM:
    """``arm`` trained from seed ``seed``'s start; the start itself for the reference arm."""
    model = BertForMaskedLM.from_pretrained(start_path(seed))
    if arm == rules.REFERENCE:
        return model.eval()
    trainer = FlatBiasTrainer(
        model=model,
        args=FlatBiasConfig(**arm_settings(arm, seed, sizes, output_dir)),
        train_dataset=language.train,
        data_collator=MaskedWordCollator(0.0, seed=seed),
    )
    trainer.train()
    return model.eval()


# ---------------------------------------------------------------- the measures


def measure_model(model: BertForMaskedLM, language: PaperLanguage, seed: int, sizes: StudySizes) -> dict[str, Any]:
    """Every measure of the rules on one model; ``seed`` seeds the fine-tuning (head, order, dropout) only."""
    contexts = language.trace_contexts
    row = measure_branch(
        model, language, trace_contexts=sizes.n_trace, trace_draws=sizes.trace_draws, hutchinson_draws=0, probes=False
    )
    row.pop("fisher_trace_by_group", None)
    noise = estimate_weight_noise_sensitivity(
        model, contexts, rules.NOISE_SIGMAS, scale="rms", n_draws=sizes.noise_draws, seed=rules.NOISE_SEED
    )
    row["weight_noise"] = noise.to_dict(per_draw=True)
    row["quantization"] = {
        granularity: estimate_quantization_sensitivity(model, contexts, rules.QUANT_BITS, group_size=group).to_dict()
        for granularity, group in (("per_channel", None), ("per_group", rules.QUANT_GROUP_SIZE))
    }
    forgetting = measure_forgetting(
        model,
        contexts,
        task_rows(language.probes["fit"], sizes.n_task_rows),
        steps=sizes.finetune_steps,
        learning_rate=rules.FINETUNE_RATE,
        batch_size=sizes.finetune_batch,
        weight_decay=rules.FINETUNE_WEIGHT_DECAY,
        num_labels=language.grammar.n_sentence_types,
        eval_rows=task_rows(language.probes["test"], sizes.n_eval_rows),
        seed=seed,
        trace={"n_draws": sizes.trace_draws, "seed": 0, "progress": False, "output_probe": FISHER_OUTPUT_PROBE},
    )
    values = forgetting.to_dict()
    for when in ("before", "after"):  # the trace's mean and stderr; its per-draw detail is not needed here
        estimate = values.pop(f"trace_{when}")
        values[f"trace_{when}"], values[f"trace_{when}_stderr"] = estimate["mean"], estimate["stderr"]
    row["forgetting"] = values
    return row


def primary_values(row: dict[str, Any]) -> dict[str, float]:
    """What the rules compare: the Fisher trace (precondition) and the three hypotheses' measures."""
    noise = {point["sigma"]: point["mean"] for point in row["weight_noise"]["points"]}
    bits = {point["bits"]: point["loss_increase"] for point in row["quantization"]["per_channel"]["points"]}
    return {
        "trace": row["fisher_trace"],
        "noise": noise[rules.PRIMARY_SIGMA],
        "quantization": bits[rules.PRIMARY_BITS],
        "forgetting": row["forgetting"]["forgetting"],
    }


# ---------------------------------------------------------------- the run


def unit_key(seed: int, arm: str) -> str:
    return f"seed{seed}/{arm}"


def study_header() -> dict[str, Any]:
    start_dir = str(rules.START_DIR.relative_to(Path(__file__).parents[2]))
    constants = {**rules_constants(rules), "START_DIR": start_dir}
    return {"study": "robustness (issue 37)", "rules": "recipes/research/robustness_rules.py", "constants": constants}


def run_study(
    path: Path,
    work: Callable[[int, str], dict[str, Any]],
    seeds: Sequence[int] = rules.SEEDS,
    arms: Sequence[str] = (rules.REFERENCE, *rules.ARMS),
) -> dict[str, dict[str, Any]]:
    """Each (seed, arm) in seed-major order unless its row on disk is done; ``work(seed, arm)`` gives the row."""

    def unit(seed: int, arm: str) -> Callable[[Callable], dict[str, Any]]:
        return lambda save: {"seed": seed, "arm": arm, **work(seed, arm)}

    def finish(row: dict[str, Any], seconds: float, cpu_seconds: float) -> tuple[dict[str, Any], str]:
        timed = {**row, "seconds": seconds, "cpu_seconds": cpu_seconds, "status": "done"}
        return timed, f" in {cpu_seconds:.0f} CPU-s {primary_values(row)}"

    units = [(unit_key(seed, arm), unit(seed, arm)) for seed in seeds for arm in arms]
    return run_units(path, units, study_header(), "robustness", finish)


def study_work(language: PaperLanguage, sizes: StudySizes, work_dir: Path) -> Callable[[int, str], dict[str, Any]]:
    """The real unit: train the arm (weights kept under ``work_dir``), then measure it."""

    def work(seed: int, arm: str) -> dict[str, Any]:
        directory = work_dir / f"seed{seed}" / arm
        train_cpu = time.process_time()
        model = train_arm(language, arm, seed, sizes, directory)
        train_cpu = time.process_time() - train_cpu
        model.save_pretrained(directory / "model")
        settings = {"steps": sizes.steps, "batch_size": sizes.batch_size}
        if arm == "sam_window":
            settings["sam_start_step"] = window_start(sizes.steps)
        return {**measure_model(model, language, seed, sizes), "train_cpu_seconds": train_cpu, "training": settings}

    return work


# ---------------------------------------------------------------- the rule (pure, tested)


def verdicts(units: dict[str, dict[str, Any]], seeds: Sequence[int] = rules.SEEDS) -> list[dict[str, Any]]:
    """Per comparison (arm - baseline): the precondition and each hypothesis, paired over the seeds both finished.

    Each entry: ``{"arm", "baseline", "measure", "role", "differences", "estimate", "low", "high", "n", "verdict"}``
    with role ``"precondition"`` (the trace; verdict ``met`` / ``not met``) or ``"hypothesis"`` (``PASS`` / ``FAIL``,
    with ``direction`` ``"opposite"`` when the interval lies above 0); ``pending`` until every seed is in.
    """
    done = {key: row for key, row in units.items() if row.get("status") == "done"}
    out = []
    for arm, baseline in rules.COMPARISONS:
        paired = [s for s in seeds if unit_key(s, arm) in done and unit_key(s, baseline) in done]
        values = {
            s: (primary_values(done[unit_key(s, arm)]), primary_values(done[unit_key(s, baseline)])) for s in paired
        }
        for measure in ("trace", *rules.HYPOTHESES):
            role = "precondition" if measure == "trace" else "hypothesis"
            entry: dict[str, Any] = {"arm": arm, "baseline": baseline, "measure": measure, "role": role}
            differences = [values[s][0][measure] - values[s][1][measure] for s in paired]
            entry.update(seeds=paired, differences=differences, n=len(paired))
            if len(paired) >= 2:
                interval = paired_difference(
                    [values[s][0][measure] for s in paired], [values[s][1][measure] for s in paired], rules.CONFIDENCE
                )
                entry.update(estimate=interval.estimate, low=interval.low, high=interval.high)
            if len(paired) < len(seeds):
                entry["verdict"] = "pending"
            elif role == "precondition":
                entry["verdict"] = "met" if entry["high"] < 0 else "not met"
            else:
                entry["verdict"] = "PASS" if entry["high"] < 0 else "FAIL"
                entry["direction"] = "opposite" if entry["low"] > 0 else "predicted" if entry["high"] < 0 else "none"
            out.append(entry)
    return out


# ---------------------------------------------------------------- the docs' tables and the figure


def _number(value: float | None) -> str:
    """Four significant figures: the measures span 1e-4 (8-bit increases) to 1e3 (traces after fine-tuning)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return f"{value:.4g}"


def study_markdown(units: dict[str, dict[str, Any]]) -> str:
    """The docs' results: the verdicts, then every finished arm's measures, from study.json's units."""
    lines = [
        "| comparison | measure | role | per-seed differences | mean [95% t] | verdict |",
        "|---|---|---|---|---|---|",
    ]
    for entry in verdicts(units):
        per_seed = ", ".join(_number(d) for d in entry["differences"]) or "–"
        interval = (
            f"{_number(entry['estimate'])} [{_number(entry['low'])}, {_number(entry['high'])}]"
            if "estimate" in entry
            else "–"
        )
        verdict = entry["verdict"] + (" (opposite)" if entry.get("direction") == "opposite" else "")
        lines.append(
            f"| {entry['arm']} - {entry['baseline']} | {entry['measure']} | {entry['role']} | {per_seed} | {interval} "
            f"| {verdict} |"
        )
    sigmas = " / ".join(f"{s:g}" for s in rules.NOISE_SIGMAS)
    lines += [
        "",
        f"| seed / arm | KL (upper) | tier | Fisher trace | noise at sigma {sigmas} | 8 / 4 bits per-channel "
        f"| 8 / 4 bits per-group {rules.QUANT_GROUP_SIZE} | forgetting | accuracy before / after | trace after "
        "| train CPU-s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key, row in units.items():
        if row.get("status") != "done":
            lines.append(f"| {key} | {row.get('status')} |" + " |" * 10)
            continue
        noise = " / ".join(_number(p["mean"]) for p in row["weight_noise"]["points"])
        quant = {
            g: " / ".join(_number(p["loss_increase"]) for p in row["quantization"][g]["points"])
            for g in ("per_channel", "per_group")
        }
        forget = row["forgetting"]
        lines.append(
            f"| {key} | {row['kl']:.4f} ({row['saturation']['ci_high']:.4f}) "
            f"| {'saturated' if row['saturated'] else 'out'} | {row['fisher_trace']:.1f} | {noise} "
            f"| {quant['per_channel']} | {quant['per_group']} | {_number(forget['forgetting'])} "
            f"| {forget['accuracy_before']:.3f} / {forget['accuracy_after']:.3f} | {forget['trace_after']:.1f} "
            f"| {row.get('train_cpu_seconds', 0):.0f} |"
        )
    return "\n".join(lines)


def plot_study(units: dict[str, dict[str, Any]], path: Path) -> list[dict[str, Any]]:
    """One panel per measure: each seed's paired difference (dots), the mean with its 95% interval, per comparison."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    entries = verdicts(units)
    measures = ("trace", *rules.HYPOTHESES)
    fig, axes = plt.subplots(1, len(measures), figsize=(3.2 * len(measures), 3.2))
    for ax, measure in zip(axes, measures, strict=True):
        for x, entry in enumerate(e for e in entries if e["measure"] == measure):
            offsets = np.linspace(-0.1, 0.1, entry["n"]) if entry["n"] > 1 else np.zeros(entry["n"])
            ax.scatter(x + offsets, entry["differences"], s=12, color="gray")
            if "estimate" in entry:
                below, above = entry["estimate"] - entry["low"], entry["high"] - entry["estimate"]
                ax.errorbar(x + 0.25, entry["estimate"], yerr=[[below], [above]], fmt="o", color="black", capsize=3)
        ax.axhline(0, color="red", lw=0.8)
        ax.set_xlim(-0.5, len(rules.COMPARISONS) - 0.5)
        ax.set_xticks(range(len(rules.COMPARISONS)), [f"{a}\n- {b}" for a, b in rules.COMPARISONS], fontsize=7)
        ax.set_title(measure, fontsize=9)
    fig.suptitle("robustness study: paired differences over seeds (lower = flatter / more robust)", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return entries


__all__ = [
    "RESULTS",
    "SMOKE",
    "StudySizes",
    "load_language",
    "measure_model",
    "plot_study",
    "primary_values",
    "read_units",
    "run_study",
    "study_markdown",
    "study_work",
    "train_arm",
    "verdicts",
]
