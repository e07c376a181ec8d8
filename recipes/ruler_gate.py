"""The ruler gate of campaign v2 (issue 33): is the probe read-out fine enough to see C1's effect?

On the committed seed-0 pair of campaign v1 (``checkpoints/seed0_start`` and ``checkpoints/seed0_last_branch``) the
ruler (`research.ruler`) reads both checkpoints on R disjoint fit splits of ``--n-fit`` fresh probe sentences and one
fixed common test set, with the probes' ``C`` fixed first by ``--cv-folds``-fold cross-validation on v1's seed-1
start (not a gate model). Gate: the s.d. over the splits of (last - start) primary accuracy (last layer, mean of tasks
A/B/C) must be <= ``--threshold`` (0.002). Every layer's probe is reported beside the primary, and full fine-tuning of
the encoder per task on the first ``--finetune-splits`` splits as a secondary read-out.

Resumable: the JSON is rewritten after the cross-validation and after every split; a rerun with the same settings
skips what it holds (other settings: another ``--out``). The rule and its history are in
``recipes/research/results/campaign_v2/RULES.md``, committed before the run.

    OMP_NUM_THREADS=1 nohup nice -n 5 python recipes/ruler_gate.py --n-fit 20000 \
        --out recipes/research/results/campaign_v2/ruler_gate.json > outputs/ruler_gate.log 2>&1 &
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from research.campaign import SHAPES
from research.paper_language import TASKS
from research.ruler import (
    CV_GRID,
    GATE_SD,
    POOL_TAG,
    RowLayout,
    cross_validated_regularization,
    finetune_accuracy,
    gate_summary,
    layer_features,
    primary_accuracy,
    probe_test_accuracy,
    ruler_pool,
    split_rows,
    subset,
    task_class_counts,
)
from transformers import BertForMaskedLM

from hf_flatbias.argparsing import OneLineErrorParser, number, whole_number
from hf_flatbias.cli import run_recipe
from hf_flatbias.results import write_json
from hf_flatbias.synthetic import PCFG

RESULTS = Path(__file__).resolve().parent / "research" / "results"
V1 = RESULTS / "saturated_start"
GATE_PAIR = {"start": V1 / "checkpoints" / "seed0_start", "last": V1 / "checkpoints" / "seed0_last_branch"}
CV_MODEL = V1 / "campaign_state" / "seed1" / "start"
RULE = (
    "PASS if the s.d. (ddof 1) over the R disjoint fit splits of (last branch - start) primary probe accuracy "
    "(last layer, mean of tasks A/B/C, fixed common test set) on v1's committed seed-0 pair is <= the threshold; "
    "C fixed beforehand by cross-validation on v1's seed-1 start. If N_fit=20,000 fails, N_fit=40,000 is the last "
    "try; if both fail the ruler is declared unable to resolve C1's effect at this probe design. Nothing else is "
    "tuned to pass (RULES.md)."
)


@dataclass(frozen=True)
class GateSettings:
    """Everything that fixes the gate's numbers (a rerun must match them to resume)."""

    grammar_seed: int = 0
    shape: str = "three_level"
    n_fit: int = 20_000
    n_splits: int = 5
    n_test: int = 10_000
    n_cv: int = 10_000
    cv_folds: int = 3
    cv_grid: tuple[float, ...] = CV_GRID
    max_iter: int = 1000
    threshold: float = GATE_SD
    finetune_splits: int = 2
    finetune_epochs: int = 3
    finetune_lr: float = 5e-4
    finetune_batch: int = 64
    finetune_seed: int = 0


def parse_settings(argv: list[str] | None = None) -> tuple[GateSettings, Path]:
    """The command line as `GateSettings` and the output path."""
    defaults = GateSettings()
    parser = OneLineErrorParser(description=__doc__.splitlines()[0])
    for field in dataclasses.fields(GateSettings):
        flag = "--" + field.name.replace("_", "-")
        if field.name == "cv_grid":
            parser.add_argument(flag, type=number, nargs="+", default=list(defaults.cv_grid))
        else:
            form = {"int": whole_number, "float": number, "str": str}[field.type]  # a named form in the error line
            parser.add_argument(flag, type=form, default=getattr(defaults, field.name))
    parser.add_argument("--out", type=Path, default=RESULTS / "campaign_v2" / "ruler_gate.json")
    args = vars(parser.parse_args(argv))
    out = args.pop("out")
    args["cv_grid"] = tuple(args["cv_grid"])
    settings = GateSettings(**args)
    check_settings(settings)
    return settings, out


def check_settings(settings: GateSettings) -> None:
    """A `ValueError` of one line naming the flag, before the pool is drawn: a negative count failed deep in the
    split arithmetic."""

    def flag(name: str) -> str:
        return "--" + name.replace("_", "-")

    minimum = {"cv_folds": 2, "grammar_seed": 0, "finetune_seed": 0, "finetune_splits": 0}
    for field in dataclasses.fields(GateSettings):
        value = getattr(settings, field.name)
        if field.type == "int" and value < minimum.get(field.name, 1):
            raise ValueError(
                f"{flag(field.name)} must be a whole number >= {minimum.get(field.name, 1)} (got {value})."
            )
        if field.type == "float" and not (math.isfinite(value) and value > 0):
            raise ValueError(f"{flag(field.name)} must be a finite number > 0 (got {value}).")
    if settings.finetune_splits > settings.n_splits:
        raise ValueError(
            f"--finetune-splits must be from 0 to --n-splits {settings.n_splits} (got {settings.finetune_splits})."
        )
    if not settings.cv_grid or not all(math.isfinite(c) and c > 0 for c in settings.cv_grid):
        raise ValueError(f"--cv-grid must be finite numbers > 0 (got {' '.join(map(str, settings.cv_grid))}).")
    if settings.shape not in SHAPES:
        raise ValueError(f"--shape {settings.shape}: choose one of {', '.join(SHAPES)}.")


def load_state(path: Path, settings: GateSettings) -> dict[str, Any]:
    """The JSON of a stopped run with the same settings, or a fresh state; other settings raise."""
    fresh = {"settings": dataclasses.asdict(settings), "cv": None, "splits": {}, "finetune": {}}
    if not path.exists():
        return fresh
    state = json.loads(path.read_text())
    theirs = {**state["settings"], "cv_grid": tuple(state["settings"]["cv_grid"])}
    if theirs != dataclasses.asdict(settings):
        raise SystemExit(f"{path} was written with other settings {state['settings']}; pass another --out.")
    return state


def save(path: Path, state: dict[str, Any]) -> None:
    """`write_json` to a temporary file, then renamed: a run stopped mid-write leaves the previous JSON."""
    tmp = path.with_suffix(".json.tmp")
    write_json(tmp, state)
    os.replace(tmp, path)


def finished_splits(state: dict[str, Any], n_splits: int) -> list[int]:
    """Splits whose primary probes are in the state (a rerun skips them)."""
    return [r for r in range(n_splits) if str(r) in state["splits"]]


def read_layers(models, fit, test, test_features, layers, settings, regularization) -> dict[str, dict[str, Any]]:
    """Both checkpoints' probes on one fit split: per checkpoint, per layer, the accuracy of each task and their
    mean."""
    record: dict[str, dict[str, Any]] = {}
    for name, model in models.items():
        fit_features = layer_features(model, fit, layers, test["width"])
        record[name] = {}
        for layer in layers:
            per_task = {
                task: probe_test_accuracy(
                    fit_features[layer],
                    fit.labels[task],
                    test_features[name][layer],
                    test["rows"].labels[task],
                    regularization=regularization,
                    max_iter=settings.max_iter,
                )
                for task in TASKS
            }
            record[name][str(layer)] = {**per_task, "mean": primary_accuracy(per_task)}
    return record


def summarise(state: dict[str, Any], settings: GateSettings, layers: list[int]) -> dict[str, Any]:
    """The gate over the finished splits (verdict only when all R are in), layer means, fine-tuning means, cost."""
    done = finished_splits(state, settings.n_splits)
    splits = [state["splits"][str(r)] for r in done]
    summary: dict[str, Any] = {"splits_finished": len(done), "splits_planned": settings.n_splits}
    if len(splits) >= 2:
        gate = gate_summary(
            [s["start"]["primary"] for s in splits],
            [s["last"]["primary"] for s in splits],
            threshold=settings.threshold,
        )
        if len(done) < settings.n_splits:
            gate["verdict"] = f"incomplete ({len(done)} of {settings.n_splits} splits)"
        summary["gate"] = gate
    if splits:
        summary["by_layer_mean"] = {
            name: {
                str(layer): float(np.mean(values))
                for layer in layers
                if (
                    values := [
                        s[name]["by_layer"][str(layer)]["mean"] for s in splits if str(layer) in s[name]["by_layer"]
                    ]
                )
            }
            for name in ("start", "last")
        }
        summary["by_layer_splits"] = {
            str(layer): sum(str(layer) in s["start"]["by_layer"] for s in splits) for layer in layers
        }
    if state["finetune"]:
        summary["finetune_mean"] = {
            name: float(np.mean([primary_accuracy(f[name]) for f in state["finetune"].values()]))
            for name in ("start", "last")
        }
        summary["finetune_differences"] = [
            primary_accuracy(f["last"]) - primary_accuracy(f["start"]) for f in state["finetune"].values()
        ]
    cpu = (state["cv"] or {}).get("cpu_seconds", 0.0)
    cpu += sum(s["cpu_seconds"] + s.get("layers_cpu_seconds", 0.0) for s in state["splits"].values())
    cpu += sum(f["cpu_seconds"] for f in state["finetune"].values())
    summary["cpu_minutes"] = cpu / 60
    return summary


def main(argv: list[str] | None = None) -> dict[str, Any]:
    settings, out = parse_settings(argv)
    state = load_state(out, settings)
    state.update(
        rule=RULE,
        gate_pair={k: str(v.relative_to(RESULTS.parent.parent.parent)) for k, v in GATE_PAIR.items()},
        cv_model=str(CV_MODEL.relative_to(RESULTS.parent.parent.parent)),
        pool=(
            f"fresh sentences of PCFG.paper_shaped({settings.grammar_seed}, **SHAPES[{settings.shape!r}]) with >= 5 "
            f"words, drawn by SeedSequence([{settings.grammar_seed}, {POOL_TAG}]) (v1's probe pool holds 5,000): "
            "test rows first, then the R fit splits, then the CV rows, all disjoint"
        ),
    )
    began = time.perf_counter()
    grammar = PCFG.paper_shaped(settings.grammar_seed, **SHAPES[settings.shape])
    layout = RowLayout(settings.n_test, settings.n_fit, settings.n_splits, settings.n_cv)
    parts = split_rows(layout)
    sentences = ruler_pool(grammar, layout.total, settings.grammar_seed)
    width = grammar.max_length
    print(f"pool of {layout.total} sentences in {time.perf_counter() - began:.0f} s", flush=True)

    if state["cv"] is None:
        cpu = time.process_time()
        cv_model = BertForMaskedLM.from_pretrained(CV_MODEL).eval()
        last = cv_model.config.num_hidden_layers
        cv_rows = subset(sentences, parts["cv"])
        features = layer_features(cv_model, cv_rows, [last], width)[last]
        cv = cross_validated_regularization(
            features, cv_rows.labels, grid=settings.cv_grid, folds=settings.cv_folds, max_iter=settings.max_iter
        )
        state["cv"] = {**cv, "layer": last, "cpu_seconds": time.process_time() - cpu}
        save(out, state)
        print(f"C by {settings.cv_folds}-fold CV on {CV_MODEL.name}: {cv['chosen']:g} {cv['scores']}", flush=True)
    regularization = state["cv"]["chosen"]

    models = {name: BertForMaskedLM.from_pretrained(path).eval() for name, path in GATE_PAIR.items()}
    layers = list(range(models["start"].config.num_hidden_layers + 1))
    test = subset(sentences, parts["test"])
    test_features = {name: layer_features(model, test, layers, width) for name, model in models.items()}
    primary, others = layers[-1], layers[:-1]
    test_set = {"rows": test, "width": width}
    for r in range(settings.n_splits):  # the gate first: the primary probe on every split
        if str(r) in state["splits"]:
            continue
        cpu = time.process_time()
        fit = subset(sentences, parts[f"fit{r}"])
        read = read_layers(models, fit, test_set, test_features, [primary], settings, regularization)
        record = {name: {"primary": read[name][str(primary)]["mean"], "by_layer": read[name]} for name in models}
        record["difference"] = record["last"]["primary"] - record["start"]["primary"]
        record["cpu_seconds"] = time.process_time() - cpu
        state["splits"][str(r)] = record
        state["summary"] = summarise(state, settings, layers)
        save(out, state)
        print(
            f"split {r}: start {record['start']['primary']:.4f} last {record['last']['primary']:.4f} "
            f"diff {record['difference']:+.4f} ({record['cpu_seconds'] / 60:.1f} CPU-min)",
            flush=True,
        )
    for r in range(settings.n_splits):  # then every other layer, beside the primary
        record = state["splits"][str(r)]
        if record.get("layers_cpu_seconds") is not None:
            continue
        cpu = time.process_time()
        fit = subset(sentences, parts[f"fit{r}"])
        read = read_layers(models, fit, test_set, test_features, others, settings, regularization)
        for name in models:
            record[name]["by_layer"].update(read[name])
        record["layers_cpu_seconds"] = time.process_time() - cpu
        state["summary"] = summarise(state, settings, layers)
        save(out, state)
        print(f"split {r}, layers {others}: {[record['last']['by_layer'][str(x)]['mean'] for x in others]}", flush=True)

    classes = task_class_counts(grammar)
    for r in range(settings.finetune_splits):
        if str(r) in state["finetune"]:
            continue
        cpu = time.process_time()
        fit = subset(sentences, parts[f"fit{r}"])
        record = {
            name: {
                task: finetune_accuracy(
                    model,
                    fit,
                    test,
                    task,
                    n_classes=classes[task],
                    width=width,
                    epochs=settings.finetune_epochs,
                    learning_rate=settings.finetune_lr,
                    batch_size=settings.finetune_batch,
                    seed=settings.finetune_seed + r,
                )
                for task in TASKS
            }
            for name, model in models.items()
        }
        record["cpu_seconds"] = time.process_time() - cpu
        state["finetune"][str(r)] = record
        state["summary"] = summarise(state, settings, layers)
        save(out, state)
        print(f"fine-tune split {r}: {record}", flush=True)

    state["summary"] = summarise(state, settings, layers)
    save(out, state)
    print(json.dumps(state["summary"], indent=2), flush=True)
    return state


if __name__ == "__main__":
    run_recipe(main)
