"""Campaign v3's reads (issue 55): campaign v2's committed checkpoints fine-tuned again, gate first, stage by stage.

Rules: `research.rules_v3` (prose: recipes/research/results/campaign_v3/RULES.md), committed before any read.
Each (checkpoint, split, fine-tuning seed) is one read: a copy of the encoder fine-tuned per task A/B/C on a fit split
(`ruler.finetune_classifier`, v2's settings) and scored on the test rows and on the CV rows. Reads are cached in
``finetune_reads.json`` (`FinetuneStore`, rewritten after every read under its lock), so a stopped run loses at most
the read in progress and two processes can share the work (a read being done is held by its busy lock). The gate
(`gate_state`) decides how many seeds per split and which rows every later read uses; the probe reads a stage lacks
(v2's are reused) follow its fine-tuning, through v2's `ruler_reads.read_record`, into ``probe_reads.json``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hf_flatbias.results import write_json

from . import rules_v3 as rules
from .claims_v2_report import start_record
from .paper_language import TASKS
from .ruler import classifier_accuracy, finetune_classifier, task_class_counts
from .ruler_reads import PRIMARY, ReadStore, RulerRows, RulerSizes, read_record
from .units import busy_lock, file_lock, read_units, rewrite_lock

V2 = Path(__file__).parent / "results" / "campaign_v2"
RESULTS = Path(__file__).parent / "results" / "campaign_v3"
ROW_SETS = {"test": ("test",), "test+cv": ("test", "cv")}


@dataclass(frozen=True)
class Checkpoint:
    """One committed checkpoint v3 reads, with what v2 recorded of it."""

    key: str  # v2's record key, e.g. "c1/seed0/step-8000", "start/h64/seed0"
    family: str  # "c1" (starts and branches), "c3", "c2"
    seed: int
    label: str  # its place in its family: "start", "step-8000", an arm's name, "h128 start", "h128 branch"
    stage: str
    path: Path
    kl: float
    ci_high: float
    fisher_trace: float

    @property
    def saturated(self) -> bool:
        return self.kl <= 0.010 and self.ci_high <= 0.015  # v1's saturated tier (v2's rules, unchanged)


def _committed(record_path: str, v2_dir: Path) -> Path:
    """v2's work-folder path (``outputs/campaign_v2/...``) -> its committed copy (starts as is, the rest carried)."""
    relative = record_path.split("campaign_v2/", 1)[1]
    return v2_dir / relative if relative.startswith("starts/") else v2_dir / "carry" / relative


def checkpoint_table(v2_dir: Path = V2) -> dict[str, Checkpoint]:
    """The 58 checkpoints of RULES.md by key, in the rules' stage order (within a stage: by seed)."""
    units = read_units(v2_dir / "claims" / "runs.json")
    starts = read_units(v2_dir / "starts.json")
    found: list[Checkpoint] = []

    def add(record: Mapping[str, Any], family: str, seed: int, label: str, stage: str) -> None:
        found.append(
            Checkpoint(
                key=record["key"],
                family=family,
                seed=seed,
                label=label,
                stage=stage,
                path=_committed(record["checkpoint"], v2_dir),
                kl=float(record["kl"]),
                ci_high=float(record["ci_high"]),
                fisher_trace=float(record["fisher_trace"]),
            )
        )

    for seed in rules.SEEDS:
        for branch in units[f"c1/seed{seed}"]["branches"]:
            label = f"step-{branch['step']}"
            ends = branch["step"] in (rules.C1_FIRST_STEP, rules.C1_LAST_STEP)
            add(branch, "c1", seed, label, ("gate" if seed == 0 else "c1_pair") if ends else "c1_rest")
        add(start_record(starts, 64, seed), "c1", seed, "start", "c1_rest")
        for arm in rules.C3_ARMS:
            stage = "c3_pair" if arm in rules.C3_CONTRAST else "c3_rest"
            add(units[f"c3/{arm}/seed{seed}"]["branch"], "c3", seed, arm, stage)
    for seed in rules.C2_SEEDS:
        add(units[f"c2/h128/seed{seed}"]["branch"], "c2", seed, "h128 branch", "c2")
        add(start_record(starts, 128, seed), "c2", seed, "h128 start", "c2")
    order = [name for name, _ in rules.STAGES]
    found.sort(key=lambda c: (order.index(c.stage), c.seed))
    return {c.key: c for c in found}


# ---------------------------------------------------------------- the fine-tuning reads


def finetune_seed(split: int, index: int) -> int:
    """Fine-tuning seed ``index`` of ``split`` (RULES.md): none equals v2's seed ``split``."""
    return rules.FINETUNE_SEED_BASE * (index + 1) + split


class FinetuneStore:
    """Every fine-tuning read by checkpoint key and ``"split/seed index"``: per task its test and CV accuracy, and
    the read's CPU seconds. One JSON rewritten whole after every read, merging under the file's lock what other
    processes wrote; a read already on disk is never replaced."""

    def __init__(self, path: Path, sizes: RulerSizes):
        self.path = path
        self.settings = {
            "epochs": sizes.finetune_epochs,
            "learning_rate": sizes.finetune_lr,
            "batch_size": sizes.finetune_batch,
            "n_fit": sizes.n_fit,
            "n_test": sizes.n_test,
            "n_cv": sizes.n_cv,
            "seed_base": rules.FINETUNE_SEED_BASE,
        }
        self.reads: dict[str, dict[str, Any]] = self._on_disk()

    def _on_disk(self) -> dict[str, dict[str, Any]]:
        if not self.path.exists():
            return {}
        state = json.loads(self.path.read_text())
        if state["settings"] != self.settings:
            raise SystemExit(f"{self.path} holds reads of other settings {state['settings']}: pass another --results.")
        return state["reads"]

    def has(self, key: str, split: int, index: int) -> bool:
        return f"{split}/{index}" in self.reads.get(key, {})

    def add(self, key: str, split: int, index: int, read: dict[str, Any]) -> None:
        with file_lock(rewrite_lock(self.path)):
            disk = self._on_disk()
            disk.setdefault(key, {}).setdefault(f"{split}/{index}", read)
            write_json(self.path, {"rules": "RULES.md", "settings": self.settings, "reads": disk})
        self.reads = disk

    def refresh(self) -> None:
        self.reads = self._on_disk()

    def cpu_seconds(self) -> float:
        return sum(read["cpu_seconds"] for entry in self.reads.values() for read in entry.values())


def split_read(
    reads: Mapping[str, Any], key: str, split: int, n_seeds: int, rows: str, tasks: Sequence[str] = tuple(TASKS)
) -> float | None:
    """A checkpoint's read on ``split``: accuracy over ``tasks`` and the split's first ``n_seeds`` fine-tuning seeds,
    scored on ``rows`` ("test", or "test+cv": both row sets pooled, each of the same size); None while one is
    missing."""
    entry = reads.get(key, {})
    values = []
    for index in range(n_seeds):
        read = entry.get(f"{split}/{index}")
        if read is None:
            return None
        for task in tasks:
            values.extend(read["tasks"][task][part] for part in ROW_SETS[rows])
    return float(np.mean(values))


def read_matrix(
    reads: Mapping[str, Any], key: str, n_splits: int, n_seeds: int, rows: str, tasks: Sequence[str] = tuple(TASKS)
) -> list[float] | None:
    """`split_read` on every split, or None while any is missing."""
    values = [split_read(reads, key, r, n_seeds, rows, tasks) for r in range(n_splits)]
    return None if any(v is None for v in values) else values


def gate_state(reads: Mapping[str, Any], n_splits: int) -> dict[str, Any]:
    """The gate (RULES.md) from the reads so far: ``{"rung", "seeds", "rows", "decided", "passed", "rungs"}``. While
    undecided, ``seeds`` is what the gate's pair must be read with next; decided, the rung every read uses."""
    first, last = rules.GATE_PAIR
    rungs = []
    for rung, (seeds, rows) in enumerate(rules.GATE_LADDER):
        a, b = (read_matrix(reads, key, n_splits, seeds, rows) for key in (first, last))
        if a is None or b is None:
            return {"rung": rung, "seeds": seeds, "rows": rows, "decided": False, "passed": False, "rungs": rungs}
        differences = np.subtract(b, a)
        sd = float(differences.std(ddof=1))
        rungs.append({"seeds": seeds, "rows": rows, "sd": sd, "passed": sd <= rules.GATE_MAX_SD})
        if sd <= rules.GATE_MAX_SD:
            return {"rung": rung, "seeds": seeds, "rows": rows, "decided": True, "passed": True, "rungs": rungs}
    seeds, rows = rules.GATE_LADDER[-1]
    return {
        "rung": len(rules.GATE_LADDER) - 1,
        "seeds": seeds,
        "rows": rows,
        "decided": True,
        "passed": False,
        "rungs": rungs,
    }


def finetune_read(model: torch.nn.Module, rows: RulerRows, sizes: RulerSizes, split: int, seed: int) -> dict[str, Any]:
    """One read: per task, fine-tuned on fit split ``split`` with ``seed``, scored on the test and the CV rows."""
    began = time.process_time()
    fit, scored = rows.part(f"fit{split}"), {part: rows.part(part) for part in ("test", "cv")}
    classes = task_class_counts(rows.grammar)
    tasks = {}
    for task in TASKS:
        classifier = finetune_classifier(
            model,
            fit,
            task,
            n_classes=classes[task],
            width=rows.width,
            epochs=sizes.finetune_epochs,
            learning_rate=sizes.finetune_lr,
            batch_size=sizes.finetune_batch,
            seed=seed,
        )
        tasks[task] = {part: classifier_accuracy(classifier, s, task, rows.width) for part, s in scored.items()}
    return {"seed": seed, "tasks": tasks, "cpu_seconds": time.process_time() - began}


# ---------------------------------------------------------------- the loop


@dataclass
class ReadsRun:
    """What the reading loop reads and writes."""

    checkpoints: dict[str, Checkpoint]
    rows: RulerRows
    sizes: RulerSizes
    finetune: FinetuneStore
    probe: ReadStore
    v2_probe: ReadStore
    budget_seconds: float = rules.READS_BUDGET_CPU_HOURS * 3600

    def spent(self) -> float:
        self.finetune.refresh()
        probe = sum(entry["cpu_seconds"] for entry in self.probe._on_disk().values())
        return self.finetune.cpu_seconds() + probe


def wanted_reads(run: ReadsRun, stage: str, seeds: int) -> Iterator[tuple[str, int, int]]:
    """The (key, split, seed index) a stage still lacks at ``seeds`` per split."""
    for checkpoint in run.checkpoints.values():
        if checkpoint.stage != stage:
            continue
        for split in range(run.sizes.n_splits):
            for index in range(seeds):
                if not run.finetune.has(checkpoint.key, split, index):
                    yield checkpoint.key, split, index


def has_probe(run: ReadsRun, key: str) -> bool:
    return any(
        len(store.reads.get(key, {}).get("readouts", {}).get(PRIMARY, {})) >= run.sizes.n_splits
        for store in (run.v2_probe, run.probe)
    )


def _load(checkpoint: Checkpoint):
    from transformers import BertForMaskedLM

    return BertForMaskedLM.from_pretrained(checkpoint.path).eval()


def _read_one(run: ReadsRun, key: str, split: int, index: int) -> bool:
    """Fine-tune ``key`` on ``split`` with seed ``index`` unless another process holds it; whether this one did."""
    with file_lock(busy_lock(run.finetune.path, f"{key}/{split}/{index}"), wait=False) as mine:
        if not mine:
            return False
        run.finetune.refresh()
        if run.finetune.has(key, split, index):
            return True
        read = finetune_read(_load(run.checkpoints[key]), run.rows, run.sizes, split, finetune_seed(split, index))
        run.finetune.add(key, split, index, read)
        # no accuracy in the log: whoever watches the run stays blind to the contrasts until --phase analyse
        print(f"[v3] {key} split {split} seed {read['seed']}: read ({read['cpu_seconds']:.0f} CPU-s)", flush=True)
        return True


def _read_probes(run: ReadsRun, stage: str) -> None:
    for checkpoint in run.checkpoints.values():
        if checkpoint.stage != stage or has_probe(run, checkpoint.key):
            continue
        with file_lock(busy_lock(run.probe.path, checkpoint.key), wait=False) as mine:
            if mine:
                run.probe.save()
                read_record(run.probe, checkpoint.key, run.rows, run.sizes, [PRIMARY], model=_load(checkpoint))


def run_reads(run: ReadsRun, *, poll_seconds: float = 30.0, stop_after: float | None = None) -> dict[str, Any]:
    """The gate, then every stage in order at the gate's rung, until everything is read or the budget is spent.
    ``stop_after`` (wall seconds) ends the loop early, between reads. Returns the final gate state."""
    began = time.time()
    stages = [name for name, _ in rules.STAGES]

    def out_of_time() -> bool:
        return stop_after is not None and time.time() - began > stop_after

    while True:
        if run.spent() >= run.budget_seconds:
            print(f"[v3] the reads' budget ({run.budget_seconds / 3600:.1f} CPU-h) is spent: stopping", flush=True)
            return gate_state(run.finetune.reads, run.sizes.n_splits)
        gate = gate_state(run.finetune.reads, run.sizes.n_splits)
        todo = stages if gate["decided"] else ["gate"]
        did_any, waiting = False, False
        for stage in todo:
            pending = list(wanted_reads(run, stage, gate["seeds"]))
            for key, split, index in pending:
                if out_of_time() or run.spent() >= run.budget_seconds:
                    return gate
                if _read_one(run, key, split, index):
                    did_any = True
                else:
                    waiting = True
            if not pending:
                _read_probes(run, stage)
            if pending:
                break  # a stage is finished before the next starts (its last reads may be another process's)
        if not did_any:
            if not waiting and gate["decided"] and all(not list(wanted_reads(run, s, gate["seeds"])) for s in stages):
                for stage in stages:
                    _read_probes(run, stage)
                return gate
            if out_of_time():
                return gate
            time.sleep(poll_seconds)
