"""Campaign v2's verdicts of C1-C6 (issue 33), recomputed from a claim's JSON alone (pure functions: no models).

The rules are `rules_v2`'s docstring and RULES_v2.md ("Claims"), read here at call time (``rules.X``). What each
claim compares is v1's (`verdicts.C1_RULE` .. ``C6_RULE``); what differs is the read-out and the interval: every
compared checkpoint is read by the ruler on the same ``R`` fit splits, a contrast gives a paired difference per seed
and split ``D[s, r]``, and `two_way_interval` lets both the seed-to-seed and the split-to-split noise into its
interval. A record (a start or an annealed branch) is ``{"key", "kl", "ci_high", "fisher_trace", "reads"}`` (C1's
branches add ``"step"``): ``key`` names its read-out in reads.json and ``reads[readout]`` is ``{"mean": [one float
per split], "tasks": {"A": [...], ...}}`` or absent while unread. ``readout`` is ``"probe"`` (the primary: the last
layer), ``"layer0"`` .. (the other layers) or ``"finetune"`` (both secondary: fewer splits). A verdict whose rule
needs an unread record says so and lists its ``key`` in ``reads_pending``: the claims phase reads exactly those.

``tier`` is ``"saturated"`` (primary: KL <= `rules.SATURATED_KL`, upper end <= `rules.SATURATED_KL_UPPER`) or
``"matched"`` (the sensitivity row: v1's matched tier, KL <= `rules.MATCHED_KL_CEILING` within
`rules.MATCHED_KL_TOLERANCE`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from hf_flatbias.stats import t_half_width

from . import rules_v2 as rules
from .analysis import spearman

TIERS = ("saturated", "matched")
IN_PROGRESS = "undecided (runs in progress: {done} of {planned} seeds)"
READS_PENDING = "undecided (read-outs in progress)"
NOT_SATURATED = "undecided (not saturated)"


def two_way_interval(differences: Sequence[Sequence[float]], confidence: float | None = None) -> dict[str, Any]:
    """The mean of ``D[s, r]`` (seeds x splits) with the two-way interval of RULES_v2.md:
    ``mean +- t(1/2 + confidence/2, min(S, R) - 1) * sqrt(var_s(mean_r D) / S + var_r(mean_s D) / R)`` (ddof 1; a
    single split drops the split term and uses ``S - 1`` degrees of freedom), and beside it the seed-level t interval
    of the per-seed means. Needs >= 2 seeds."""
    confidence = rules.CONFIDENCE if confidence is None else confidence
    d = np.asarray(differences, dtype=np.float64)
    if d.ndim != 2 or d.shape[0] < 2 or d.shape[1] < 1:
        raise ValueError(f"the two-way interval needs a (seeds >= 2, splits >= 1) array, got shape {d.shape}.")
    seeds, splits = d.shape
    seed_means, split_means = d.mean(1), d.mean(0)
    variance = seed_means.var(ddof=1) / seeds + (split_means.var(ddof=1) / splits if splits > 1 else 0.0)
    df = (min(seeds, splits) if splits > 1 else seeds) - 1
    half = t_half_width(math.sqrt(variance), df, confidence)
    # t * s before / sqrt(S): the order the committed claim files were computed in, so they recompute exactly
    seed_half = t_half_width(seed_means.std(ddof=1), seeds - 1, confidence) / math.sqrt(seeds)
    mean = float(d.mean())
    return {
        "mean": mean,
        "ci": [mean - half, mean + half],
        "df": df,
        "confidence": confidence,
        "seed_level_ci": [float(seed_means.mean()) - seed_half, float(seed_means.mean()) + seed_half],
        "split_means": split_means.tolist(),
    }


def decide(differences: Mapping[str, Sequence[float]], *, above: bool) -> dict[str, Any]:
    """A contrast's row from per-seed, per-split differences: PASS when the two-way interval lies wholly above 0
    (``above``) or below it, FAIL ("not shown") with >= `rules.SEEDS_REQUIRED` seeds otherwise, undecided (not
    saturated) with fewer; ``reading`` says where the interval lies relative to the predicted side."""
    row: dict[str, Any] = {
        "seeds_compared": sorted(differences),
        "per_seed_difference": {s: float(np.mean(v)) for s, v in differences.items()},
        "predicted": "above 0" if above else "below 0",
    }
    if len(differences) < max(rules.SEEDS_REQUIRED, 2):  # an interval needs two seeds whatever the rule asks
        return {**row, "verdict": NOT_SATURATED, "difference": None, "reading": None}
    interval = two_way_interval([differences[s] for s in sorted(differences)])
    low, high = interval["ci"]
    predicted, opposite = (low > 0, high < 0) if above else (high < 0, low > 0)
    reading = "predicted direction" if predicted else ("opposite direction" if opposite else "includes 0")
    return {**row, "verdict": "PASS" if predicted else "FAIL", "difference": interval, "reading": reading}


def seed_level(values: Sequence[float]) -> dict[str, Any] | None:
    """Mean and seed-level t interval of one number per seed (None for fewer than 2)."""
    if len(values) < 2:
        return None
    interval = two_way_interval(np.asarray(values, dtype=np.float64)[:, None])
    return {"mean": interval["mean"], "ci": interval["ci"]}


def in_tier(row: Mapping[str, Any], tier: str) -> bool:
    """One record's tier: saturated (KL and upper end) or matched (KL under the ceiling); an ``excluded`` record
    (its start missed the margin) is in neither."""
    if row.get("excluded"):
        return False
    if tier == "saturated":
        return row["kl"] <= rules.SATURATED_KL and row["ci_high"] <= rules.SATURATED_KL_UPPER
    if tier == "matched":
        return row["kl"] <= rules.MATCHED_KL_CEILING
    raise ValueError(f"tier must be one of {TIERS}, got {tier!r}.")


def matched_pair(a: Mapping[str, Any], b: Mapping[str, Any], tier: str) -> bool:
    """Two records compared by a claim: both in the tier and within `rules.MATCHED_KL_TOLERANCE` of each other."""
    return in_tier(a, tier) and in_tier(b, tier) and abs(a["kl"] - b["kl"]) <= rules.MATCHED_KL_TOLERANCE


def compared_branches(branches: Sequence[Mapping[str, Any]], tier: str) -> list[Mapping[str, Any]]:
    """A seed's compared C1 branches, by step: its saturated ones if >= `rules.MIN_COMPARED_BRANCHES`; in the
    matched tier, v1's fallback (those within the tolerance of the seed's lowest KL under the ceiling) when the
    saturated ones are too few; else none."""
    saturated = [b for b in branches if in_tier(b, "saturated")]
    if len(saturated) >= rules.MIN_COMPARED_BRANCHES:
        return sorted(saturated, key=lambda b: b["step"])
    if tier == "saturated":
        return []
    low = [b for b in branches if in_tier(b, "matched")]
    if not low:
        return []
    best = min(b["kl"] for b in low)
    matched = [b for b in low if b["kl"] <= best + rules.MATCHED_KL_TOLERANCE]
    return sorted(matched, key=lambda b: b["step"]) if len(matched) >= rules.MIN_COMPARED_BRANCHES else []


def difference(a: Mapping[str, Any], b: Mapping[str, Any], readout: str, task: str | None = None) -> list | None:
    """``a - b`` per split of two records' read-outs (the mean over tasks, or one task), over the splits both have;
    None while either is unread."""
    read_a, read_b = a.get("reads", {}).get(readout), b.get("reads", {}).get(readout)
    if read_a is None or read_b is None:
        return None
    x, y = (read_a["mean"], read_b["mean"]) if task is None else (read_a["tasks"][task], read_b["tasks"][task])
    n = min(len(x), len(y))
    return (np.asarray(x[:n]) - np.asarray(y[:n])).tolist()


def paired(pairs: Mapping[str, tuple[Mapping, Mapping]], readout: str) -> tuple[dict[str, list], list[str]]:
    """``{seed: a - b per split}`` of ``{seed: (a, b)}`` records, and the keys of those still unread."""
    differences, pending = {}, []
    for seed, (a, b) in pairs.items():
        d = difference(a, b, readout)
        if d is None:
            pending += [r["key"] for r in (a, b) if readout not in r.get("reads", {})]
        else:
            differences[seed] = d
    return differences, pending


def finish(row: dict[str, Any], finished: int, planned: int, pending: Sequence[str]) -> dict[str, Any]:
    """The verdict as reported while work is missing: runs first, then read-outs; else the rule's own answer.
    ``reads_pending`` (sorted, unique) is always there: the claims phase reads those keys next."""
    row = {**row, "reads_pending": sorted(set(pending))}
    if finished < planned:
        return {**row, "verdict": IN_PROGRESS.format(done=finished, planned=planned)}
    if pending:
        return {**row, "verdict": READS_PENDING}
    return row


def c1_verdict(
    seeds: Mapping[str, Mapping[str, Any]], planned: int, tier: str = "saturated", readout: str = "probe"
) -> dict[str, Any]:
    """C1 from ``{seed: {"start": record, "branches": [records with "step"]}}``."""
    per_seed, gains, beside = {}, {}, {}
    pending: list[str] = []
    for seed, record in seeds.items():
        compared = compared_branches(record["branches"], tier)
        row: dict[str, Any] = {"compared_steps": [b["step"] for b in compared]}
        if compared:
            row["spearman_step_trace"] = spearman(row["compared_steps"], [b["fisher_trace"] for b in compared])
            first, last = compared[0], compared[-1]
            found, missing = paired({seed: (last, first)}, readout)
            gains.update(found)
            pending += missing
            found, missing = paired({seed: (last, record["start"])}, readout)  # beside the rule: read as well
            beside.update(found)
            pending += missing
        per_seed[seed] = row
    decided = [r for r in per_seed.values() if r["compared_steps"]]
    negative = sum(1 for r in decided if r["spearman_step_trace"] is not None and r["spearman_step_trace"] < 0)
    row = decide(gains, above=True)
    if len(decided) < rules.SEEDS_REQUIRED:
        row["verdict"] = NOT_SATURATED
    elif row["verdict"] != NOT_SATURATED:
        row["verdict"] = "PASS" if negative >= rules.SEEDS_REQUIRED and row["verdict"] == "PASS" else "FAIL"
    falls = [
        1 - r["branches"][-1]["fisher_trace"] / r["start"]["fisher_trace"] for r in seeds.values() if r["branches"]
    ]
    row.update(
        tier=tier,
        readout=readout,
        seeds_with_compared_branches=len(decided),
        seeds_with_negative_step_trace_spearman=negative,
        per_seed=per_seed,
        last_minus_start=decide(beside, above=True),
        trace_fall_start_to_last=seed_level(falls),
    )
    return finish(row, len(seeds), planned, pending)


def c6_verdict(
    seeds: Mapping[str, Mapping[str, Any]], planned: int, tier: str = "saturated", readout: str = "probe"
) -> dict[str, Any]:
    """C6 from C1's seed records: `select_flattest_checkpoint` (its defaults) against the lowest-KL compared branch."""
    from hf_flatbias.selection import CheckpointRecord, select_flattest_checkpoint

    pairs, picks = {}, {}
    for seed, record in seeds.items():
        compared = compared_branches(record["branches"], tier)
        if not compared:
            continue
        selection = select_flattest_checkpoint(
            CheckpointRecord(step=b["step"], eval_loss=b["kl"], hessian_trace=b["fisher_trace"]) for b in compared
        )
        by_step = {b["step"]: b for b in compared}
        chosen, lowest = by_step[selection.chosen.step], by_step[selection.lowest_loss.step]
        picks[seed] = {"chosen_step": chosen["step"], "lowest_kl_step": lowest["step"]}
        pairs[seed] = (chosen, lowest)
    differences, pending = paired(pairs, readout)
    row = {**decide(differences, above=True), "tier": tier, "readout": readout, "picks": picks}
    return finish(row, len(seeds), planned, pending)


def strongest_baselines(baselines: Mapping[str, Mapping[str, Any]], readout: str = "probe") -> dict[str, str]:
    """Per task (and ``"mean"``, the primary) the name of the baseline row with the highest mean over the splits."""
    reads = {name: row["reads"][readout] for name, row in baselines.items()}
    tasks = next(iter(reads.values()))["tasks"]
    best = {task: max(reads, key=lambda b: float(np.mean(reads[b]["tasks"][task]))) for task in tasks}
    best["mean"] = max(reads, key=lambda b: float(np.mean(reads[b]["mean"])))
    return best


def c4_verdict(
    starts: Mapping[str, Mapping[str, Any]],
    baselines: Mapping[str, Mapping[str, Any]],
    planned: int,
    tier: str = "saturated",
    readout: str = "probe",
) -> dict[str, Any]:
    """C4 from ``{seed: start record}`` (H64) and ``{name: baseline record}`` (read by the primary probe only: a
    secondary read-out of the models is set against the baselines' primary read on the same splits): per task the
    model minus the strongest row there; PASS on >= `rules.C4_TASKS_REQUIRED` of the tasks."""
    usable = {s: r for s, r in starts.items() if in_tier(r, tier)}
    pending = [r["key"] for r in usable.values() if readout not in r.get("reads", {})]
    pending += [r["key"] for r in baselines.values() if "probe" not in r.get("reads", {})]
    row: dict[str, Any] = {"tier": tier, "readout": readout, "seeds_compared": sorted(usable)}
    if not baselines or any("probe" not in r.get("reads", {}) for r in baselines.values()):
        return finish({**row, "verdict": READS_PENDING}, len(starts), planned, pending or ["baselines"])
    strongest = strongest_baselines(baselines)

    def against(name: str, task: str) -> dict[str, Any]:
        baseline = {"reads": {readout: baselines[name]["reads"]["probe"]}}
        one = None if task == "mean" else task
        found = {s: difference(r, baseline, readout, one) for s, r in usable.items()}
        return decide({s: d for s, d in found.items() if d is not None}, above=True)

    per_task = {task: against(strongest[task], task) for task in strongest if task != "mean"}
    row.update(strongest=strongest, per_task=per_task)
    if len(usable) < rules.SEEDS_REQUIRED:
        row["verdict"] = NOT_SATURATED
    else:
        won = sum(task["verdict"] == "PASS" for task in per_task.values())
        row.update(tasks_won=won, verdict="PASS" if won >= rules.C4_TASKS_REQUIRED else "FAIL")
    row["mean_over_tasks"] = against(strongest["mean"], "mean")
    row["each_baseline"] = {
        name: {task: against(name, task)["difference"] for task in [*per_task, "mean"]} for name in baselines
    }
    return finish(row, len(starts), planned, pending)


def _matched_seeds(a: Mapping[str, Mapping], b: Mapping[str, Mapping], tier: str) -> list[str]:
    return sorted(s for s in a if s in b and matched_pair(a[s], b[s], tier))


def c5_verdict(
    adversarial: Mapping[str, Mapping[str, Any]],
    plain: Mapping[str, Mapping[str, Any]],
    planned: int,
    tier: str = "saturated",
    readout: str = "probe",
) -> dict[str, Any]:
    """C5 from ``{seed: last branch record}`` of the adversarial and the C1 runs: adversarial minus C1, below 0."""
    seeds = _matched_seeds(adversarial, plain, tier)
    differences, pending = paired({s: (adversarial[s], plain[s]) for s in seeds}, readout)
    row = {**decide(differences, above=False), "tier": tier, "readout": readout}
    traces = [adversarial[s]["fisher_trace"] - plain[s]["fisher_trace"] for s in seeds]
    row["fisher_trace_difference"] = seed_level(traces)
    return finish(row, len(adversarial), planned, pending)


def c2_verdict(
    sizes: Mapping[str, Mapping[str, Mapping[str, Any]]], planned: int, tier: str = "saturated", readout: str = "probe"
) -> dict[str, Any]:
    """C2 from ``{width: {seed: last branch record + "fisher_trace_enlarged"}}`` (widths as strings)."""
    usable = sorted(
        (w for w, seeds in sizes.items() if sum(in_tier(r, tier) for r in seeds.values()) >= rules.SEEDS_REQUIRED),
        key=int,
    )
    finished = min((len(seeds) for seeds in sizes.values()), default=0)
    row: dict[str, Any] = {"tier": tier, "readout": readout, "sizes_in_tier": usable}
    if len(usable) < 2:
        return finish({**row, "verdict": NOT_SATURATED, "seeds_compared": []}, finished, planned, [])
    larger, smaller = sizes[usable[-1]], sizes[usable[0]]
    seeds = _matched_seeds(larger, smaller, tier)
    differences, pending = paired({s: (larger[s], smaller[s]) for s in seeds}, readout)
    accuracy = decide(differences, above=True)
    trace = seed_level([larger[s]["fisher_trace_enlarged"] - smaller[s]["fisher_trace_enlarged"] for s in seeds])
    verdict = accuracy["verdict"]
    if verdict != NOT_SATURATED:
        verdict = "PASS" if verdict == "PASS" and trace is not None and trace["ci"][1] < 0 else "FAIL"
    row.update(
        verdict=verdict,
        larger=usable[-1],
        smaller=usable[0],
        seeds_compared=seeds,
        accuracy_difference=accuracy,
        enlarged_fisher_trace_difference=trace,
    )
    return finish(row, finished, planned, pending)


def c3_verdict(
    seeds: Mapping[str, Mapping[str, Mapping[str, Any]]],
    arms: Sequence[str],
    planned: int,
    tier: str = "saturated",
    readout: str = "probe",
) -> dict[str, Any]:
    """C3 from ``{seed: {arm: last branch record}}`` over the ``arms`` that were run."""
    finished = {s: a for s, a in seeds.items() if set(arms) <= set(a)}
    compared = {
        s: a
        for s, a in finished.items()
        if all(in_tier(a[arm], tier) for arm in arms)
        and max(a[arm]["kl"] for arm in arms) - min(a[arm]["kl"] for arm in arms) <= rules.MATCHED_KL_TOLERANCE
    }
    pending = [a[arm]["key"] for a in compared.values() for arm in arms if readout not in a[arm].get("reads", {})]
    row: dict[str, Any] = {"tier": tier, "readout": readout, "arms": list(arms), "seeds_compared": sorted(compared)}
    if len(compared) < rules.SEEDS_REQUIRED or pending:
        return finish({**row, "verdict": NOT_SATURATED}, len(finished), planned, pending)
    trace = {arm: float(np.mean([a[arm]["fisher_trace"] for a in compared.values()])) for arm in arms}
    read_out = {
        arm: float(np.mean([np.mean(a[arm]["reads"][readout]["mean"]) for a in compared.values()])) for arm in arms
    }
    sharpest, flattest = max(trace, key=trace.get), min(trace, key=trace.get)
    differences, _ = paired({s: (a[flattest], a[sharpest]) for s, a in compared.items()}, readout)
    contrast = decide(differences, above=True)
    lowest = min(read_out, key=read_out.get)
    row.update(
        sharpest=sharpest,
        flattest=flattest,
        lowest_read_out=lowest,
        seed_mean_fisher_trace=trace,
        seed_mean_read_out=read_out,
        flattest_minus_sharpest=contrast,
        verdict="PASS" if lowest == sharpest and contrast["verdict"] == "PASS" else "FAIL",
    )
    return finish(row, len(finished), planned, [])
