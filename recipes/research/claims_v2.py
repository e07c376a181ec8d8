"""Campaign v2's claims phase (issue 33): C1-C6 from the margin starts, at the pilots' doses, read by the ruler.

The rules are RULES_v2.md's "Claims" section and `rules_v2`'s constants, committed before this code. The phase runs
in three stages, each resumable, in one process or several sharing the results folder (one per core):

1. training units (`training_units`, run by `campaign_v2.run_phase` into ``claims/runs.json``): C1's continued
   training per seed (`rules.C1_BRANCHES` annealed branches over C1's dose, every branch kept), C5's adversarial run,
   C2's run per width, C3's arms, each measured on v1's KL set and trace contexts (KL, Fisher trace; no probe);
2. the primary read-outs: every record a claim's rule compares (`verdicts_v2`'s ``reads_pending``, decided from KL
   and trace alone) read by the ruler's last-layer probe on every split (`ruler_reads.read_record`, into
   ``claims/reads.json``);
3. the secondary read-outs (every other layer, the fine-tuning) of the same records, and the matched tier's.

Stages 1 and 2 alternate claim by claim (C1's units, the primary reads then ready, C5's units, ...), so each claim
is decided before the next one trains; stage 3 comes last.

Each claim's JSON (`claims_v2_report`) is rewritten after every unit and every record read. A claim whose pilot is
not finished is refused before anything is computed (`pilot_decisions`).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers import BertForMaskedLM

from hf_flatbias.enlarge import enlarge
from hf_flatbias.flatness import estimate_hessian_trace
from hf_flatbias.results import write_json
from hf_flatbias.synthetic import bert_config

from . import rules_v2 as rules
from .campaign_v2 import (
    Material,
    Sizes,
    _measure_kwargs,
    adversarial,
    continued_spec,
    load_start,
    run_phase,
)
from .claims_v2_report import claim_payload, claim_records, secondary_readouts, start_record
from .paper_language import task_labelled_train
from .protocol import FISHER_OUTPUT_PROBE, train_with_branches
from .ruler_reads import PRIMARY, ReadStore, RulerRows, RulerSizes, read_record, ruler_rows
from .units import busy_lock, file_lock, read_units, rewrite_lock


def claim_pilots(claim: str, widths: Sequence[int] = rules.WIDTHS) -> tuple[str, ...]:
    """The pilots ``claim``'s runs read (pilots.json unit keys; C2: the rate of each of ``widths``); C4 reads the
    starts only."""
    return {
        "C1": ("c1_dose",),
        "C4": (),
        "C6": ("c1_dose",),
        "C5": ("c1_dose", "c5_weight"),
        "C2": ("c1_dose", *(f"c2_rate/h{w}" for w in widths)),
        "C3": ("c1_dose", "c3_dropout"),
    }[claim]


def parse_claims(text: str) -> list[str]:
    """``"C1,c4"`` -> ``["C1", "C4"]`` in the rules' order (`rules.CLAIMS`); an unknown name is an error."""
    named = [c.strip().upper() for c in text.split(",") if c.strip()]
    unknown = sorted(set(named) - set(rules.CLAIMS))
    if unknown or not named:
        raise SystemExit(f"--claims takes names among {','.join(rules.CLAIMS)}, got {text!r}.")
    return [c for c in rules.CLAIMS if c in named]


def c3_arms(dropout: float | None) -> dict[str, tuple[float, float, bool]]:
    """v1's C3 arms ``{arm: (dropout, weight decay, SAM)}`` with the piloted dropout in place of 0.1; none piloted:
    the two arms without dropout only."""
    plain = {"adamw_plain": (0.0, 0.0, False), "adamw_plain_sam": (0.0, 0.0, True)}
    if dropout is None:
        return plain
    decayed = rules.CONTINUE_WEIGHT_DECAY
    return {"adamw": (dropout, decayed, False), **plain, "adamw_sam": (dropout, decayed, True)}


def pilot_decisions(pilots: Path, claims: Sequence[str], widths: Sequence[int] = rules.WIDTHS) -> dict[str, Any]:
    """What the claims read from pilots.json (dose, rates of ``widths``, dropout, adversary weight); a pilot a
    requested claim needs and pilots.json lacks (or holds unfinished) stops the phase here, before any compute."""
    units = read_units(pilots)
    for claim in claims:
        for key in claim_pilots(claim, widths):
            if units.get(key, {}).get("status") != "done":
                raise SystemExit(
                    f"claim {claim} needs the pilot {key!r}, not finished in {pilots}: run "
                    "`python recipes/pcfg_campaign_v2.py --phase pilots` first."
                )
    decisions: dict[str, Any] = {"source": str(pilots)}
    if (dose := units.get("c1_dose", {})).get("status") == "done":
        choice = dose["choice"]
        rung = next((r for r in choice["rungs"] if r["steps"] == choice["chosen"]), {})
        decisions.update(
            dose=int(choice["chosen"]), dose_status=choice["status"], dose_trace_fall=rung.get("trace_fall")
        )
    finished = {key for key, row in units.items() if row.get("status") == "done"}  # a running ladder has no choice
    rates = {str(w): units[f"c2_rate/h{w}"]["choice"] for w in widths if f"c2_rate/h{w}" in finished}
    decisions["c2_rates"] = {w: c["chosen"] for w, c in rates.items()}
    decisions["c2_rate_status"] = {w: c["status"] for w, c in rates.items()}
    if (dropout := units.get("c3_dropout", {})).get("status") == "done":
        decisions.update(c3_dropout=dropout["choice"]["chosen"], c3_arms=list(c3_arms(dropout["choice"]["chosen"])))
    if (weight := units.get("c5_weight", {})).get("status") == "done":
        decisions["adversary_weight"] = weight["choice"]["chosen"]
    return decisions


@dataclass
class ClaimsRun:
    """Everything the claims phase reads and writes: material and sizes, the starts' and pilots' results, folders."""

    material: Material
    sizes: Sizes
    ruler: RulerSizes
    starts: Path
    pilots: dict[str, Any]
    work_dir: Path
    claims_dir: Path
    _labelled: dict[str, Any] = field(default_factory=dict)

    @property
    def runs_path(self) -> Path:
        return self.claims_dir / "runs.json"

    @property
    def lost_path(self) -> Path:
        return self.claims_dir / "lost.json"

    @property
    def reads_path(self) -> Path:
        return self.claims_dir / "reads.json"

    def labelled_train(self):
        """C5's training rows with their task labels, computed once."""
        if "rows" not in self._labelled:
            self._labelled["rows"] = task_labelled_train(self.material.language, self.sizes.n_train)
        return self._labelled["rows"]


# ---------------------------------------------------------------- stage 1: training units


def branch_record(record: dict[str, Any], prefix: str, directory: Path) -> dict[str, Any]:
    """An annealed branch as a claims record: KL, upper end, Fisher trace, its weights' folder, its read-out key."""
    step = record["step"]
    return {
        "key": f"{prefix}/step-{step}",
        "step": step,
        "kl": record["kl"],
        "ci_high": record["saturation"]["ci_high"],
        "fisher_trace": record["fisher_trace"],
        "fisher_trace_stderr": record["fisher_trace_stderr"],
        "checkpoint": str(directory / "branches" / f"step-{step}"),
    }


def _start(run: ClaimsRun, width: int, seed: int) -> tuple[BertForMaskedLM, dict[str, Any]]:
    start, _ = load_start(run.starts, width, seed)  # refuses an unfinished start
    return start, start_record(read_units(run.starts), width, seed)


def _continue(run: ClaimsRun, spec, prefix: str, start, *, every: int, train_dataset=None) -> list[dict[str, Any]]:
    """`train_with_branches` from ``start``: the pilots' anneal, KL and Fisher trace, every branch kept."""
    directory = run.work_dir / "claims" / prefix
    records = train_with_branches(
        run.material.language,
        spec,
        directory,
        branch_every=every,
        anneal_steps=run.sizes.anneal_steps,
        measure_kwargs=_measure_kwargs(run.sizes, trace=True),
        start_model=start,
        keep_branches=True,
        train_dataset=train_dataset,
    )
    return [branch_record(r, prefix, directory) for r in records]


def c1_unit(run: ClaimsRun, seed: int) -> Callable[[Callable[[dict], None]], dict]:
    """C1 of one seed: the base width's start (H64) continued at `rules.C1_RATE` for C1's dose,
    `rules.C1_BRANCHES` branches."""

    def work(save):
        start, record = _start(run, run.sizes.base_width, seed)
        row = {"seed": seed, "rate": rules.C1_RATE, "steps": run.pilots["dose"], "start": record, "branches": []}
        if record.get("excluded"):
            return row
        every = run.pilots["dose"] // rules.C1_BRANCHES
        spec = continued_spec(seed, start, rules.C1_RATE, run.pilots["dose"], run.sizes)
        return {**row, "branch_every": every, "branches": _continue(run, spec, f"c1/seed{seed}", start, every=every)}

    return work


def c3_unit(run: ClaimsRun, arm: str, seed: int):
    """One C3 arm of one seed: C1's rate and dose with the arm's dropout, weight decay and SAM, one branch."""

    def work(save):
        dropout, weight_decay, sam = c3_arms(run.pilots["c3_dropout"])[arm]
        start, _ = _start(run, run.sizes.base_width, seed)
        spec = continued_spec(seed, start, rules.C1_RATE, run.pilots["dose"], run.sizes, dropout=dropout)
        spec = dataclasses.replace(
            spec, weight_decay=weight_decay, flatness_method="sam" if sam else "none", sam_rho=rules.C3_SAM_RHO
        )
        branches = _continue(run, spec, f"c3/{arm}/seed{seed}", start, every=spec.steps)
        settings = {"dropout": dropout, "weight_decay": weight_decay, "sam": sam, "sam_rho": rules.C3_SAM_RHO}
        return {"seed": seed, "arm": arm, "settings": settings, "branch": branches[-1]}

    return work


def c5_unit(run: ClaimsRun, seed: int):
    """C5 of one seed: C1's run with v1's adversary at the piloted weight, one branch annealed with it."""

    def work(save):
        start, _ = _start(run, run.sizes.base_width, seed)
        weight = run.pilots["adversary_weight"]
        spec = continued_spec(seed, start, rules.C1_RATE, run.pilots["dose"], run.sizes)
        spec = adversarial(spec, run.material.language, weight)
        branches = _continue(run, spec, f"c5/seed{seed}", start, every=spec.steps, train_dataset=run.labelled_train())
        return {"seed": seed, "adversary_weight": weight, "branch": branches[-1]}

    return work


def enlarged_trace(run: ClaimsRun, record: dict[str, Any]) -> dict[str, float]:
    """The branch's Fisher trace in the largest width's parameter space (`enlarge`, function-preserving), on the
    contexts and draws of its own trace (seed = its step, as `measure_branch`)."""
    language = run.material.language
    branch = BertForMaskedLM.from_pretrained(record["checkpoint"]).eval().to(run.sizes.device)
    largest = max(run.sizes.widths)
    if branch.config.hidden_size != largest:
        branch = enlarge(
            branch, bert_config(len(language.tokenizer), hidden=largest, layers=branch.config.num_hidden_layers)
        )
    trace = estimate_hessian_trace(
        branch,
        language.trace_contexts,
        n_contexts=min(run.sizes.n_trace, len(language.trace_contexts)),
        n_draws=run.sizes.trace_draws,
        seed=record["step"],
        progress=False,
        output_probe=FISHER_OUTPUT_PROBE,
    )
    return {"fisher_trace_enlarged": trace.mean, "fisher_trace_enlarged_stderr": trace.stderr}


def reuses_c1(pilots: dict[str, Any], base_width: int = rules.V1_WIDTH) -> bool:
    """C2's run at the base width (H64) is C1's run when that width's piloted rate is C1's."""
    return pilots.get("c2_rates", {}).get(str(base_width)) == rules.C1_RATE


def c2_unit(run: ClaimsRun, width: int, seed: int):
    """C2 of one width and seed: its start at its piloted rate for C1's dose, one branch (H64: C1's last branch when
    the rates agree), plus that branch's trace in the largest width's space."""

    def work(save):
        rate = run.pilots["c2_rates"][str(width)]
        start, record = _start(run, width, seed)
        row = {"width": width, "seed": seed, "rate": rate}
        if record.get("excluded"):
            return {**row, "branch": {**record, "key": f"c2/h{width}/seed{seed}/excluded"}}
        if width == run.sizes.base_width and reuses_c1(run.pilots, width):
            c1 = read_units(run.runs_path)[f"c1/seed{seed}"]
            branch, row["reuses"] = dict(c1["branches"][-1]), f"c1/seed{seed}"
        else:
            spec = continued_spec(seed, start, rate, run.pilots["dose"], run.sizes)
            branch = _continue(run, spec, f"c2/h{width}/seed{seed}", start, every=spec.steps)[-1]
        return {**row, "branch": {**branch, **enlarged_trace(run, branch)}}

    return work


def training_units(run: ClaimsRun, claims: Sequence[str], seeds: Sequence[int]) -> list:
    """The requested claims' runs in the rules' order (C1's first: C5, C6 and C2's H64 read it)."""
    units: list = []
    if {"C1", "C6", "C5"} & set(claims) or ("C2" in claims and reuses_c1(run.pilots, run.sizes.base_width)):
        units += [(f"c1/seed{s}", c1_unit(run, s)) for s in seeds]
    if "C5" in claims and run.pilots.get("adversary_weight") is not None:
        units += [(f"c5/seed{s}", c5_unit(run, s)) for s in seeds]
    if "C2" in claims:
        units += [(f"c2/h{w}/seed{s}", c2_unit(run, w, s)) for w in run.sizes.widths for s in seeds]
    if "C3" in claims:
        units += [
            (f"c3/{arm}/seed{s}", c3_unit(run, arm, s)) for arm in c3_arms(run.pilots["c3_dropout"]) for s in seeds
        ]
    return units


# ---------------------------------------------------------------- stages 2-3: read-outs, claim files


def write_claims(run: ClaimsRun, claims: Sequence[str], store: ReadStore) -> dict[str, dict[str, Any]]:
    """Every requested claim's JSON from the runs, the starts and the read-outs on disk."""
    runs, starts = read_units(run.runs_path), read_units(run.starts)
    payloads = {}
    for claim in claims:
        records = claim_records(
            claim, runs, starts, store, run.ruler, widths=run.sizes.widths, base_width=run.sizes.base_width
        )
        payloads[claim] = claim_payload(claim, records, run.pilots, run.ruler, run.sizes.layers)
        write_json(run.claims_dir / f"{claim}.json", payloads[claim])
    return payloads


def pending_reads(payloads: dict[str, dict[str, Any]], stage: str) -> dict[str, list[str]]:
    """``{record key: read-outs}`` the verdicts of a stage still wait for: ``"primary"`` (the saturated tier's
    probe) or ``"secondary"`` (the other read-outs, and the matched tier's probe). Baseline rows: the probe only."""
    wanted: dict[str, list[str]] = {}
    for payload in payloads.values():
        rows = [(payload["verdict"], PRIMARY)]
        if stage == "secondary":
            rows = [
                (payload["sensitivity_matched"], PRIMARY),
                *((payload["secondary"][r], r) for r in secondary_readouts(payload["layers"])),
            ]
        for row, readout in rows:
            for key in row.get("reads_pending", []):
                readouts = wanted.setdefault(key, [])
                chosen = PRIMARY if key.startswith("baseline/") else readout
                if chosen not in readouts:
                    readouts.append(chosen)
    return wanted


def checkpoints(run: ClaimsRun) -> dict[str, str]:
    """Every record key of the finished runs and starts -> its weights' folder."""
    found = {}
    for row in read_units(run.runs_path).values():
        for record in [row.get("start"), *row.get("branches", []), row.get("branch")]:
            if record and "checkpoint" in record:
                found[record["key"]] = record["checkpoint"]
    starts = read_units(run.starts)
    for key in starts:
        width, seed = key.split("/")  # start_key's "h64/seed0"
        if record := start_record(starts, int(width.removeprefix("h")), int(seed.removeprefix("seed"))):
            found[record["key"]] = record["checkpoint"]
    return found


def read_stage(run: ClaimsRun, claims: Sequence[str], store: ReadStore, rows: RulerRows, stage: str) -> bool:
    """Read every record the stage's verdicts wait for, the claim files rewritten after each; a record another
    process is reading is left to it. Returns whether any was."""
    store.save()  # take up what other processes have read
    wanted = pending_reads(write_claims(run, claims, store), stage)
    paths = checkpoints(run)
    elsewhere = False
    for key, readouts in wanted.items():
        with file_lock(busy_lock(run.reads_path, key), wait=False) as mine:
            if not mine:
                print(f"[claims] {key}: another process is reading it, skipped", flush=True)
                elsewhere = True
                continue
            store.save()
            if key.startswith("baseline/"):
                read_record(store, key, rows, run.ruler, readouts, baseline=key.split("/", 1)[1])
            else:
                model = BertForMaskedLM.from_pretrained(paths[key]).eval().to(run.sizes.device)
                read_record(store, key, rows, run.ruler, readouts, model=model, source=paths[key])
        write_claims(run, claims, store)
    return elsewhere


def set_aside_lost_units(run: ClaimsRun) -> list[str]:
    """Move every finished training unit whose weights are on disk nowhere (a work folder lost with its session before
    `research.carry` kept it) from runs.json to ``lost.json``, with any read-outs of its records, so it runs and is
    read again; its numbers stay there for a side by side with the rerun. Returns the keys moved. Read and rewritten
    under both files' locks, so another claims process's rows written meanwhile are not lost."""
    with file_lock(rewrite_lock(run.runs_path)), file_lock(rewrite_lock(run.reads_path)):
        units = read_units(run.runs_path)
        records = {
            key: [r for r in [row.get("start"), *row.get("branches", []), row.get("branch")] if r and "checkpoint" in r]
            for key, row in units.items()
            if row.get("status") == "done"
        }
        moved = [key for key, kept in records.items() if any(not Path(r["checkpoint"]).exists() for r in kept)]
        if moved:
            _move_to_lost(run, units, records, moved)
    return moved


def _move_to_lost(run: ClaimsRun, units: dict[str, Any], records: dict[str, list], moved: list[str]) -> None:
    lost = {"units": {}, "reads": {}, **(json.loads(run.lost_path.read_text()) if run.lost_path.exists() else {})}
    reads = json.loads(run.reads_path.read_text()) if run.reads_path.exists() else None
    for key in moved:
        lost["units"][key] = {**units.pop(key), "status": "lost: its weights went with a session's work folder"}
        for record in records[key]:
            if reads is not None and record["key"] in reads["reads"] and not record["key"].startswith("start/"):
                lost["reads"][record["key"]] = reads["reads"].pop(record["key"])
    header = {k: v for k, v in json.loads(run.runs_path.read_text()).items() if k != "units"}
    write_json(run.lost_path, {**header, **lost})
    write_json(run.runs_path, {**header, "units": units})
    if reads is not None:
        write_json(run.reads_path, reads)


def run_claims(
    run: ClaimsRun, claims: Sequence[str], seeds: Sequence[int], *, poll_seconds: float = 60.0
) -> dict[str, dict[str, Any]]:
    """The phase: each claim's training units (C1's, C5's, C2's, C3's in turn), each followed by the primary
    read-outs then ready, so a claim is decided before the next one trains; the secondary read-outs last. Returns
    the claim files. Several processes may run it on one results folder at once (one per core): each takes the
    units and records the others do not hold, and waits, polling, until what they hold is done and read."""
    run.claims_dir.mkdir(parents=True, exist_ok=True)
    for key in set_aside_lost_units(run):
        print(f"[claims] {key}: its weights are lost; moved to {run.lost_path.name}, run again", flush=True)
    groups: dict[str, list] = {}
    for key, work in training_units(run, claims, seeds):
        groups.setdefault(key.split("/")[0], []).append((key, work))
    store = ReadStore(run.reads_path, run.ruler)
    language = run.material.language
    rows = ruler_rows(language.grammar, language.grammar_seed, run.ruler, run.work_dir / "cache")
    while True:
        elsewhere = False
        for units in list(groups.values()) or [[]]:  # C4 alone trains nothing and is read all the same
            finished = run_phase(run.runs_path, units, "claims") if units else {}
            elsewhere |= any(finished.get(key, {}).get("status") != "done" for key, _ in units)
            elsewhere |= read_stage(run, claims, store, rows, "primary")
        _print_verdicts(run, claims, store, "primary")
        elsewhere |= read_stage(run, claims, store, rows, "secondary")
        _print_verdicts(run, claims, store, "secondary")
        if not elsewhere:
            return write_claims(run, claims, store)
        print(f"[claims] waiting {poll_seconds:.0f} s for another process's units and reads", flush=True)
        time.sleep(poll_seconds)


def _print_verdicts(run: ClaimsRun, claims: Sequence[str], store: ReadStore, stage: str) -> None:
    for claim, payload in write_claims(run, claims, store).items():
        print(f"[claims] after the {stage} read-outs: {claim} {payload['verdict']['verdict']}", flush=True)
