"""Campaign v3's tournament measures (issue 55): every flatness measure the product ships, on every v3 checkpoint.

Rules: `research.rules_v3` (``MEASURES``, ``MEASURE_SETTINGS``) and RULES.md's tournament section. Each measure is
taken through the product's own implementation (the measures table, `estimate_hessian_trace`, the spectrum and
diagonal estimators) on v1's trace contexts, seed 0, the same for every checkpoint; a setting the rules do not fix
is the product's default at the commit that measured (recorded with the value). One value per (checkpoint, measure)
in ``measures.json`` (`MeasureStore`, rewritten after each), so a rerun measures only what is missing; a measure
the installed product does not ship is skipped and reported "not measured" by the tournament.
"""

from __future__ import annotations

import json
import math
import subprocess
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from hf_flatbias.results import write_json

from . import rules_v3 as rules
from .units import file_lock, rewrite_lock

Contexts = Mapping[str, Any]  # "plain": the trace contexts; "typed": with sentence_type; "task": the downstream task
Measure = Callable[[torch.nn.Module, Contexts, Mapping[str, Any]], dict[str, Any]]


def _table(name: str, **settings: Any) -> Measure:
    """A measure of the product's table (`hf_flatbias.measures.MEASURE_TABLE`), its card record's value/stderr."""

    def measure(model, contexts: Contexts, fixed):
        from hf_flatbias.measure_settings import MeasureSettings
        from hf_flatbias.measures import MEASURE_TABLE

        spec = MEASURE_TABLE[name]
        result = spec.function()(
            model,
            contexts["plain"],
            n_contexts=fixed["n_contexts"],
            settings=MeasureSettings(**settings),
            seed=0,
            batch_size=64,
            causal=False,
            task=contexts["task"],
        )
        record = spec.record(result)
        return {"value": record["value"], "stderr": record.get("stderr"), "settings": settings}

    return measure


def _fisher(model, contexts: Contexts, fixed):
    contexts = contexts["plain"]
    from hf_flatbias import estimate_hessian_trace

    estimate = estimate_hessian_trace(
        model, contexts, n_contexts=fixed["n_contexts"], n_draws=fixed["fisher_draws"], seed=0, progress=False
    )
    return {
        "value": estimate.mean,
        "stderr": estimate.stderr,
        "median_of_means": estimate.median_of_means,
        "median_of_means_groups": estimate.median_of_means_groups,
        "top_share": estimate.top_share,
    }


def _hessian(model, contexts: Contexts, fixed):
    contexts = contexts["plain"]
    from hf_flatbias import estimate_hessian_trace

    estimate = estimate_hessian_trace(
        model,
        contexts,
        n_contexts=fixed["n_contexts"],
        n_draws=fixed["hessian_trace_draws"],
        estimator="hutchinson",
        seed=0,
        progress=False,
    )
    return {"value": estimate.mean, "stderr": estimate.stderr}


def _spectrum(model, contexts: Contexts, fixed):
    """The top eigenvalues (Lanczos), their power law, and the density's share of the trace above a fraction of the
    largest eigenvalue."""
    from hf_flatbias.flatness.spectrum import estimate_spectral_density, estimate_top_eigenvalues
    from hf_flatbias.flatness.spectrum_shape import fit_power_law

    contexts = contexts["plain"]
    n_contexts = min(fixed["n_contexts"], rules.SPECTRUM_CONTEXTS)  # Amendment 1
    top = estimate_top_eigenvalues(model, contexts, k=fixed["top_k"], matrix="fisher", n_contexts=n_contexts)
    eigenvalues = sorted(top.eigenvalues, reverse=True)
    density = estimate_spectral_density(model, contexts, matrix="fisher", n_contexts=n_contexts)
    power_law = fit_power_law(eigenvalues)
    cut = fixed["density_tail_fraction"] * eigenvalues[0]
    mass = [
        (x * w, x > cut)
        for nodes, weights in zip(density.nodes, density.weights, strict=True)
        for x, w in zip(nodes, weights, strict=True)
    ]
    total = sum(m for m, _ in mass)
    return {
        "value": eigenvalues[0],
        "eigenvalues": eigenvalues,
        "density_tail": sum(m for m, above in mass if above) / total if total > 0 else math.nan,
        "density_runs": len(density.nodes),
        "density_steps": len(density.nodes[0]),
        "n_contexts": n_contexts,
        "power_law_alpha": power_law.alpha,
        "power_law_alpha_stderr": power_law.alpha_stderr,
        "power_law_r_squared": power_law.r_squared,
    }


def _fisher_diagonal(model, contexts: Contexts, fixed):
    contexts = contexts["plain"]
    from hf_flatbias.flatness.diagonal import estimate_fisher_diagonal

    found = estimate_fisher_diagonal(model, contexts, n_contexts=fixed["n_contexts"], n_draws=fixed["fisher_draws"])
    return {"value": math.sqrt(sum(float(d.square().sum()) for d in found.diagonal.values()))}


def with_sentence_types(contexts, grammar) -> list[dict[str, Any]]:
    """The one-mask contexts as rows with a ``sentence_type`` column: task A's label (the type maximising
    ``Pr(sentence | type)``) of the whole sentence, the masked word put back from ``labels``."""
    import numpy as np

    from hf_flatbias.constants import IGNORE_INDEX
    from hf_flatbias.synthetic.data import N_SPECIAL

    rows = [dict(row) for row in contexts]
    sentences = []
    for row in rows:
        ids = [
            label if label != IGNORE_INDEX else token
            for token, label in zip(row["input_ids"], row["labels"], strict=True)
        ]
        sentences.append([token - N_SPECIAL for token in ids if token >= N_SPECIAL])
    word_ids = np.full((len(rows), max(map(len, sentences))), -1)
    for i, words in enumerate(sentences):
        word_ids[i, : len(words)] = words
    types = grammar.task_labels(word_ids, np.array([len(w) for w in sentences]))["task_a"]
    for row, kind in zip(rows, types, strict=True):
        row["sentence_type"] = int(kind)
    return rows


def downstream_task(rows, task: str = rules.MEASURE_SETTINGS["relative_critical_task"]):
    """The ruler's first fit split as ``task``'s rows (`ForgettingTask`): what relative critical sharpness's
    downstream optimizer takes its first update on."""
    from hf_flatbias.flatness.forgetting_task import ForgettingTask

    from .ruler import padded_tokens, task_class_counts

    fit = rows.part("fit0")
    ids, mask = padded_tokens(fit, rows.width)
    labelled = [
        {"input_ids": i.tolist(), "attention_mask": m.tolist(), "label": int(y)}
        for i, m, y in zip(ids, mask, fit.labels[task], strict=True)
    ]
    classes = task_class_counts(rows.grammar)[task]
    return ForgettingTask(f"task {task}, ruler fit split 0", "label", classes, labelled, None)


def _alignment(model, contexts, fixed):
    typed = {**contexts, "plain": contexts["typed"]}
    result = _table("gradient_alignment", alignment_column="sentence_type")(model, typed, fixed)
    return {**result, "sources": "sentence type (task A's label)"}


# measure group -> how it is taken; a group may give several tournament measures (see `tournament_values`)
MEASURE_GROUPS: dict[str, Measure] = {
    "fisher_trace": _fisher,
    "hessian_trace": _hessian,
    "spectrum": _spectrum,
    "sam_sharpness": _table("sam_sharpness", sam_rho=rules.MEASURE_SETTINGS["sam_rho"]),
    "critical_sharpness": _table("critical_sharpness", critical_rtol=rules.MEASURE_SETTINGS["critical_rtol"]),
    "weight_noise": _table(
        "weight_noise",
        noise_sigmas=(rules.MEASURE_SETTINGS["noise_sigma"],),
        noise_draws=rules.MEASURE_SETTINGS["noise_draws"],
    ),
    "quantization_8bit": _table("quantization", quantization_bits=(8,)),
    "quantization_4bit": _table("quantization", quantization_bits=(4,)),
    "fisher_diagonal_norm": _fisher_diagonal,
    "gradient_alignment": _alignment,
    "relative_critical_sharpness": _table(
        "relative_critical_sharpness", critical_rtol=rules.MEASURE_SETTINGS["critical_rtol"]
    ),
}


def tournament_values(measured: Mapping[str, Mapping[str, Any]]) -> dict[str, float]:
    """A checkpoint's measured groups -> the tournament's measures (`rules_v3.MEASURES`) that they give."""
    values: dict[str, float] = {}
    for name in rules.MEASURES:
        if name in measured:
            values[name] = measured[name]["value"]
    if "fisher_trace" in measured:
        values["fisher_trace_median_of_means"] = measured["fisher_trace"]["median_of_means"]
    if "spectrum" in measured:
        values["top_eigenvalue"] = measured["spectrum"]["value"]
        values["spectral_density_tail"] = measured["spectrum"]["density_tail"]
        values["spectrum_power_law"] = measured["spectrum"]["power_law_alpha"]
    return {name: float(value) for name, value in values.items() if value is not None}


class MeasureStore:
    """``measures.json``: per checkpoint key, per measure group, its result, seconds and the commit that measured."""

    def __init__(self, path: Path):
        self.path = path

    def read(self) -> dict[str, dict[str, Any]]:
        return json.loads(self.path.read_text())["measures"] if self.path.exists() else {}

    def add(self, key: str, group: str, result: dict[str, Any]) -> None:
        with file_lock(rewrite_lock(self.path)):
            held = self.read()
            held.setdefault(key, {}).setdefault(group, result)
            payload = {"rules": "RULES.md", "settings": rules.MEASURE_SETTINGS, "measures": held}
            write_json(self.path, payload)


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "unknown"


def measure_checkpoints(
    store: MeasureStore, models: Mapping[str, Callable[[], torch.nn.Module]], contexts, groups=None
) -> None:
    """Take every group (default all) missing from ``store`` on every checkpoint (``key -> loader``)."""
    fixed = rules.MEASURE_SETTINGS
    commit = _commit()
    for key, load in models.items():
        missing = [g for g in (groups or MEASURE_GROUPS) if g not in store.read().get(key, {})]
        if not missing:
            continue
        model = load()
        for group in missing:
            began, cpu = time.perf_counter(), time.process_time()
            result = MEASURE_GROUPS[group](model, contexts, fixed)
            result.update(seconds=time.perf_counter() - began, cpu_seconds=time.process_time() - cpu, commit=commit)
            store.add(key, group, result)
            print(f"[v3 measures] {key} {group}: {result['value']:.4g} ({result['cpu_seconds']:.0f} CPU-s)", flush=True)
