"""Verdicts of the paper's claims, recomputed from result JSON alone (pure functions: no models, no training).

Claim C1, continued training (issue 15), stated before any run:

* Per seed, the *compared branches* are its saturated branches (KL <= 0.010, bootstrap upper end <= 0.015) when it has
  at least 3; otherwise its branches with KL <= 0.020 within 0.003 nats of the seed's lowest such KL ("matched, not
  saturated"), when it has at least 3; otherwise the seed has none and is undecided.
* PASS when (a) Spearman(training step, Fisher trace) < 0 among the compared branches in at least 4 of the 5 seeds,
  and (b) the last-minus-first compared branch's probe accuracy (mean over tasks A/B/C on the fixed test set) has a
  95% seed-level t interval above 0. FAIL when at least 4 seeds have compared branches and (a) or (b) does not hold.
  "undecided (not saturated)" when fewer than 4 seeds have compared branches.
* Reported beside it, never part of it: pooled Spearman(trace, accuracy) and Spearman(KL, accuracy) over every
  compared branch of every seed (the KL ranks as the loss against exact conditionals does: same sentences).

Claims C3-C6 from the saturated start (issue 23) have their rules beside their functions (`C3_RULE` ... `C6_RULE`),
each committed before the comparison it decides was computed; C4 and C6 reuse C1's measurements and say so.

The thresholds are module constants; the verdict is never tuned until it passes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from hf_flatbias.stats import mean_interval

from .analysis import spearman
from .saturation import SATURATED_KL, SATURATED_KL_UPPER

#: fewest compared branches a seed needs for a rank correlation
MIN_COMPARED_BRANCHES = 3
#: "matched, not saturated": branches with KL at most this ...
MATCHED_KL_CEILING = 0.020
#: ... and within this of the seed's lowest such KL
MATCHED_KL_TOLERANCE = 0.003
#: seeds (of 5) whose step-trace correlation must be negative
SEEDS_REQUIRED = 4
CONFIDENCE = 0.95

#: each claim's result file under the results folder
CLAIM_FILES = {
    "C1": "continued_training.json",
    "C2": "model_size.json",
    "C3": "optimizer.json",
    "C4": "lookup_table.json",
    "C5": "adversarial.json",
    "C6": "selection.json",
}

C1_RULE = (
    "PASS if Spearman(training step, Fisher trace) < 0 among compared branches in >= 4 of 5 seeds AND the "
    "last-minus-first compared branch probe accuracy has a 95% seed-level t interval above 0. Compared branches: a "
    "seed's saturated ones (KL <= 0.010, upper <= 0.015) if >= 3, else those with KL <= 0.020 within 0.003 nats of "
    "its lowest such KL ('matched, not saturated') if >= 3, else none. Fewer than 4 seeds with compared branches: "
    "'undecided (not saturated)'."
)


def compared_branches(records: Sequence[dict[str, Any]]) -> tuple[str, list[dict[str, Any]]]:
    """One seed's compared branches and their regime: ``"saturated"``, ``"matched, not saturated"`` or ``"none"``."""
    saturated = [r for r in records if r["kl"] <= SATURATED_KL and r["saturation"]["ci_high"] <= SATURATED_KL_UPPER]
    if len(saturated) >= MIN_COMPARED_BRANCHES:
        return "saturated", sorted(saturated, key=lambda r: r["step"])
    low = [r for r in records if r["kl"] <= MATCHED_KL_CEILING]
    if low:
        best = min(r["kl"] for r in low)
        matched = [r for r in low if r["kl"] <= best + MATCHED_KL_TOLERANCE]
        if len(matched) >= MIN_COMPARED_BRANCHES:
            return "matched, not saturated", sorted(matched, key=lambda r: r["step"])
    return "none", []


def t_interval(values: Sequence[float], confidence: float = CONFIDENCE) -> tuple[float, float, float]:
    """``(mean, low, high)``: `hf_flatbias.stats.mean_interval` as a tuple (all nan for no values)."""
    if len(values) == 0:
        return math.nan, math.nan, math.nan
    result = mean_interval(values, confidence)
    return result.estimate, result.low, result.high


def c1_verdict(seeds: dict[str, Sequence[dict[str, Any]]]) -> dict[str, Any]:
    """The C1 verdict from each seed's branch records (``step``, ``kl``, ``saturation``, ``fisher_trace``,
    ``probe_accuracy``), by the rule of this module's docstring (`C1_RULE`)."""
    per_seed, gains, pooled = {}, [], []
    for seed, records in seeds.items():
        regime, compared = compared_branches(records)
        row: dict[str, Any] = {"regime": regime, "compared_steps": [r["step"] for r in compared]}
        if compared:
            row["spearman_step_trace"] = spearman([r["step"] for r in compared], [r["fisher_trace"] for r in compared])
            row["accuracy_gain"] = compared[-1]["probe_accuracy"] - compared[0]["probe_accuracy"]
            gains.append(row["accuracy_gain"])
            pooled.extend(compared)
        per_seed[seed] = row
    decided = [row for row in per_seed.values() if row["regime"] != "none"]
    negative = sum(1 for row in decided if row["spearman_step_trace"] is not None and row["spearman_step_trace"] < 0)
    mean_gain, low, high = t_interval(gains)
    if len(decided) < SEEDS_REQUIRED:
        verdict = "undecided (not saturated)"
    else:
        verdict = "PASS" if negative >= SEEDS_REQUIRED and low > 0 else "FAIL"
    regimes = {row["regime"] for row in decided}
    accuracy = [r["probe_accuracy"] for r in pooled]
    return {
        "rule": C1_RULE,
        "verdict": verdict,
        "regime": "saturated" if regimes == {"saturated"} else ("matched, not saturated" if decided else "none"),
        "seeds_with_compared_branches": len(decided),
        "seeds_with_negative_step_trace_spearman": negative,
        # None, not NaN, where undefined: the JSON stays standard
        "accuracy_gain_mean": None if math.isnan(mean_gain) else mean_gain,
        "accuracy_gain_ci": None if math.isnan(low) else [low, high],
        "pooled_spearman_trace_accuracy": spearman([r["fisher_trace"] for r in pooled], accuracy),
        "pooled_spearman_kl_accuracy": spearman([r["kl"] for r in pooled], accuracy),
        "per_seed": per_seed,
    }


def in_progress(verdict: dict[str, Any], finished: int, planned: int) -> dict[str, Any]:
    """``verdict`` as it must be reported while runs are missing: "undecided (runs in progress: k of n seeds)".

    The statistics of the finished seeds stay beside it; the stated rule's answer is only given with every seed in.
    """
    if finished >= planned:
        return verdict
    return {**verdict, "verdict": f"undecided (runs in progress: {finished} of {planned} seeds)"}


def saturated_start_c1(seeds: dict[str, Sequence[dict[str, Any]]], planned: int) -> dict[str, Any]:
    """C1 from a saturated start (issue 23): `c1_verdict` of the finished seeds, `in_progress` until all are in,
    with how many branches of each seed stay saturated and the seed-level interval of the trace's change."""
    verdict = in_progress(c1_verdict(seeds), len(seeds), planned)
    change = [records[-1]["fisher_trace"] - records[0]["fisher_trace"] for records in seeds.values() if records]
    mean, low, high = t_interval(change)
    verdict["branches_saturated"] = {
        seed: f"{sum(bool(r['saturated']) for r in records)} of {len(records)}" for seed, records in seeds.items()
    }
    verdict["fisher_trace_change_last_minus_first"] = {
        "mean": None if math.isnan(mean) else mean,
        "ci": None if math.isnan(low) else [low, high],
    }
    return verdict


#: C3's arms from the saturated start: (dropout, weight decay, SAM)
C3_ARMS = {
    "adamw": (0.1, 0.01, False),
    "adamw_plain": (0.0, 0.0, False),
    "adamw_sam": (0.1, 0.01, True),
    "adamw_plain_sam": (0.0, 0.0, True),
}
C3_RULE = (
    "From each seed's saturated start, equal continued training in four arms: adamw (dropout 0.1, weight decay "
    "0.01), adamw_plain (dropout 0, weight decay 0), and each with SAM (rho 0.05, every step). Compared per seed: "
    "each arm's last branch, all saturated (KL <= 0.010, upper <= 0.015) and within 0.003 nats of each other "
    "(matched KL), else the seed is excluded. PASS if, over >= 4 compared seeds, the arm with the largest seed-mean "
    "Fisher trace has the lowest seed-mean primary probe accuracy AND the flattest arm's accuracy minus the "
    "sharpest arm's has a 95% seed-level t interval above 0; FAIL if >= 4 seeds are compared and this does not "
    "hold; else undecided (not saturated). Undecided (runs in progress) until every seed has every arm."
)


def c3_verdict(seeds: dict[str, dict[str, dict[str, Any]]], planned: int) -> dict[str, Any]:
    """C3 by `C3_RULE` from ``{seed: {arm: last branch record}}`` (seeds missing an arm count as not finished)."""
    finished = {s: arms for s, arms in seeds.items() if set(C3_ARMS) <= set(arms)}
    compared = {}
    for seed, arms in finished.items():
        kls = [arms[a]["kl"] for a in C3_ARMS]
        if all(arms[a]["saturated"] for a in C3_ARMS) and max(kls) - min(kls) <= MATCHED_KL_TOLERANCE:
            compared[seed] = arms
    mean_of = {
        key: {a: float(np.mean([arms[a][key] for arms in compared.values()])) for a in C3_ARMS} if compared else None
        for key in ("fisher_trace", "probe_accuracy")
    }
    trace, accuracy = mean_of["fisher_trace"], mean_of["probe_accuracy"]
    row: dict[str, Any] = {"rule": C3_RULE, "seeds_compared": sorted(compared), "seeds_finished": len(finished)}
    if len(compared) < SEEDS_REQUIRED:
        row["verdict"] = "undecided (not saturated)"
    else:
        sharpest, flattest = max(trace, key=trace.get), min(trace, key=trace.get)
        gains = [arms[flattest]["probe_accuracy"] - arms[sharpest]["probe_accuracy"] for arms in compared.values()]
        mean, low, high = t_interval(gains)
        worst = min(accuracy, key=accuracy.get)
        row.update(
            sharpest=sharpest,
            flattest=flattest,
            lowest_accuracy=worst,
            flattest_minus_sharpest_accuracy={"mean": mean, "ci": [low, high]},
            verdict="PASS" if worst == sharpest and low > 0 else "FAIL",
        )
    row.update(seed_mean_fisher_trace=trace, seed_mean_probe_accuracy=accuracy)
    return in_progress(row, len(finished), planned)


def _saturated(record: dict[str, Any]) -> bool:
    return record["kl"] <= SATURATED_KL and record["saturation"]["ci_high"] <= SATURATED_KL_UPPER


def _interval_verdict(differences: dict[str, float], *, above: bool) -> dict[str, Any]:
    """Seed-level t interval of per-seed differences; PASS when it lies wholly above 0 (``above``) or below 0.

    Fewer than `SEEDS_REQUIRED` compared seeds: undecided (not saturated); callers add `in_progress`.
    """
    row: dict[str, Any] = {"seeds_compared": sorted(differences), "per_seed_difference": differences}
    if len(differences) < SEEDS_REQUIRED:
        row.update(verdict="undecided (not saturated)", difference=None)
        return row
    mean, low, high = t_interval(list(differences.values()))
    holds = low > 0 if above else high < 0
    row.update(verdict="PASS" if holds else "FAIL", difference={"mean": mean, "ci": [low, high]})
    return row


def _matched_differences(
    a: dict[str, dict[str, Any]], b: dict[str, dict[str, Any]], keys: Sequence[str]
) -> tuple[list[str], dict[str, dict[str, float]]]:
    """Seeds where ``a``'s and ``b``'s records are both saturated and within `MATCHED_KL_TOLERANCE`, and per key the
    per-seed difference ``a - b`` over those seeds."""
    compared = [
        s for s in a
        if s in b and _saturated(a[s]) and _saturated(b[s]) and abs(a[s]["kl"] - b[s]["kl"]) <= MATCHED_KL_TOLERANCE
    ]  # fmt: skip
    return compared, {key: {s: a[s][key] - b[s][key] for s in compared} for key in keys}


C4_RULE = (
    "Lookup table vs saturated models, on the fixed probe test set (the rule docs/REPRODUCTION.md stated in 774773a: "
    "'the models win on >= 2 of 3 tasks with CI > 0', made precise). Per seed, the saturated start (KL <= 0.010, "
    "upper <= 0.015) against the lookup-table row (a probe of the same width on the exact conditionals "
    "Pr(x_t | x_-t) at every position). PASS if, over >= 4 saturated seeds, model-minus-lookup probe accuracy has a "
    "95% seed-level t interval above 0 on >= 2 of the 3 tasks A/B/C; FAIL if >= 4 seeds are saturated and it does "
    "not; else undecided (not saturated). Beside it, not part of it: the mean over tasks, and the same for each "
    "seed's last C1 branch where saturated. Written after C1's measurements were on disk and before they were "
    "compared with the lookup row; no new run."
)

#: C4: tasks (of 3) on which the saturated models must beat the lookup table
C4_TASKS_REQUIRED = 2


def c4_verdict(
    starts: dict[str, dict[str, Any]], last_branches: dict[str, dict[str, Any]], lookup: dict[str, Any], planned: int
) -> dict[str, Any]:
    """C4 by `C4_RULE` from each seed's start record, last C1 branch record and the lookup row (``probe`` per task
    with its ``accuracy``, and ``probe_accuracy``)."""
    saturated = {s: r for s, r in starts.items() if _saturated(r)}
    tasks = {
        task: _interval_verdict(
            {s: r["probe"][task]["accuracy"] - row["accuracy"] for s, r in saturated.items()}, above=True
        )
        for task, row in lookup["probe"].items()
    }
    row: dict[str, Any] = {"rule": C4_RULE, "seeds_compared": sorted(saturated), "per_task": tasks}
    if len(saturated) < SEEDS_REQUIRED:
        row["verdict"] = "undecided (not saturated)"
    else:
        won = sum(task["verdict"] == "PASS" for task in tasks.values())
        row.update(tasks_won=won, verdict="PASS" if won >= C4_TASKS_REQUIRED else "FAIL")
    base = lookup["probe_accuracy"]
    row["mean_over_tasks"] = _interval_verdict(
        {s: r["probe_accuracy"] - base for s, r in saturated.items()}, above=True
    )
    beside = {s: r["probe_accuracy"] - base for s, r in last_branches.items() if _saturated(r)}
    row["last_branch_minus_lookup"] = {
        "per_seed_difference": beside,
        **(dict(zip(("mean", "low", "high"), t_interval(list(beside.values())), strict=True)) if beside else {}),
    }
    row["lookup_accuracy"] = base
    return in_progress(row, len(starts), planned)


C6_RULE = (
    "Selection among a seed's compared C1 branches (C1's definition: its saturated branches if >= 3, else its "
    "matched ones), as docs/REPRODUCTION.md stated in 774773a ('FlatnessCheckpointSelector among saturated branches "
    "vs the lowest KL: paired accuracy difference over seeds with its CI'), made precise: the branch "
    "`select_flattest_checkpoint` chooses (the selector's defaults: within 0.01 nats of the lowest KL, smallest "
    "Fisher trace, no margin) against the branch with the lowest KL. PASS if chosen-minus-lowest-KL primary probe "
    "accuracy has a 95% seed-level t interval above 0 over >= 4 seeds with compared branches (a seed where both "
    "pick the same branch counts 0); FAIL if >= 4 seeds have compared branches and it does not; else undecided (not "
    "saturated). Written after C1's measurements were on disk and before this selection was computed; no new run."
)


def c6_verdict(seeds: dict[str, Sequence[dict[str, Any]]], planned: int) -> dict[str, Any]:
    """C6 by `C6_RULE` from each seed's C1 branch records."""
    from hf_flatbias.selection import CheckpointRecord, select_flattest_checkpoint

    differences, picks, regimes = {}, {}, set()
    for seed, records in seeds.items():
        regime, compared = compared_branches(records)
        if not compared:
            continue
        regimes.add(regime)
        by_step = {r["step"]: r for r in compared}
        selection = select_flattest_checkpoint(
            CheckpointRecord(step=r["step"], eval_loss=r["kl"], hessian_trace=r["fisher_trace"]) for r in compared
        )
        chosen, lowest_kl = by_step[selection.chosen.step], by_step[selection.lowest_loss.step]
        differences[seed] = chosen["probe_accuracy"] - lowest_kl["probe_accuracy"]
        picks[seed] = {"chosen_step": chosen["step"], "lowest_kl_step": lowest_kl["step"], "regime": regime}
    row = _interval_verdict(differences, above=True)
    row.update(rule=C6_RULE, picks=picks, regime=" and ".join(sorted(regimes)) or "none")
    return in_progress(row, len(seeds), planned)


C5_RULE = (
    "From each seed's saturated start, C1's continued training (same rate, steps, warm-up, batches) with an "
    "adversary on the evaluated read-out: one linear head per task A/B/C on the last layer's states at the fixed "
    "positions concatenated (the primary probe's features), trained on the data's task labels, while the encoder "
    "minimises the paper's masked-LM loss plus 1.0 x the cross-entropy of the frozen heads' predictions to the "
    "uniform distribution; the branch anneals with the same objective. Compared per seed: the adversarial last "
    "branch and C1's last branch, both saturated (KL <= 0.010, upper <= 0.015) and within 0.003 nats (docs/"
    "REPRODUCTION.md, 774773a: 'at matched KL transfer falls (CI)'). PASS if over >= 4 compared seeds "
    "adversarial-minus-C1 primary probe accuracy has a 95% seed-level t interval below 0; FAIL if >= 4 seeds are "
    "compared and it does not; else undecided (not saturated). Beside it, not part of it: adversarial-minus-C1 "
    "Fisher trace with its interval (the paper's adversary also sharpened the model)."
)


def c5_verdict(adversarial: dict[str, dict[str, Any]], plain: dict[str, dict[str, Any]], planned: int) -> dict:
    """C5 by `C5_RULE` from ``{seed: last branch record}`` of the adversarial and the plain (C1) runs."""
    compared, differences = _matched_differences(adversarial, plain, ("probe_accuracy", "fisher_trace"))
    accuracy = _interval_verdict(differences["probe_accuracy"], above=False)
    trace = _interval_verdict(differences["fisher_trace"], above=True)
    row = {"rule": C5_RULE, "verdict": accuracy["verdict"], "seeds_compared": sorted(compared),
           "accuracy_difference": accuracy, "fisher_trace_difference": trace}  # fmt: skip
    return in_progress(row, len(adversarial), planned)


#: C2's widths (same depth as C1's H64-L3); H64's runs are C1's
C2_SIZES = (32, 64, 128)
C2_RULE = (
    "Model size: BERTs of hidden size 32, 64 and 128 (3 layers; H64 is C1's run) are each distilled to saturation "
    "and continued exactly as C1 (same rate, steps, batches); compared per seed: each size's last branch. Sizes "
    "compared: those whose last branch is saturated (KL <= 0.010, upper <= 0.015) in >= 4 seeds; the claim is "
    "decided between the largest and the smallest of them, over the seeds where both are saturated and within "
    "0.003 nats. PASS if larger-minus-smaller primary probe accuracy has a 95% seed-level t interval above 0 AND "
    "larger-minus-smaller Fisher trace measured in H128's parameter space (`hf_flatbias.enlarge`, function-"
    "preserving) has one below 0; FAIL if >= 4 seeds are compared and this does not hold; else undecided (not "
    "saturated). Traces in each model's own parameter space are reported beside."
)


def c2_verdict(sizes: dict[int, dict[str, dict[str, Any]]], planned: int) -> dict[str, Any]:
    """C2 by `C2_RULE` from ``{hidden size: {seed: last branch record}}``; each record carries ``fisher_trace`` in
    its own space and ``fisher_trace_enlarged`` in the largest size's space."""
    usable = sorted(h for h, seeds in sizes.items() if sum(_saturated(r) for r in seeds.values()) >= SEEDS_REQUIRED)
    finished = min((len(seeds) for seeds in sizes.values()), default=0)
    row: dict[str, Any] = {"rule": C2_RULE, "sizes_saturated": usable}
    if len(usable) < 2:
        row.update(verdict="undecided (not saturated)", seeds_compared=[])
        return in_progress(row, finished, planned)
    compared, differences = _matched_differences(
        sizes[usable[-1]], sizes[usable[0]], ("probe_accuracy", "fisher_trace_enlarged")
    )
    accuracy = _interval_verdict(differences["probe_accuracy"], above=True)
    trace = _interval_verdict(differences["fisher_trace_enlarged"], above=False)
    verdict = accuracy["verdict"]
    if verdict != "undecided (not saturated)":
        verdict = "PASS" if accuracy["verdict"] == trace["verdict"] == "PASS" else "FAIL"
    row.update(
        verdict=verdict,
        smaller=usable[0],
        larger=usable[-1],
        seeds_compared=sorted(compared),
        accuracy_difference=accuracy,
        enlarged_fisher_trace_difference=trace,
    )
    return in_progress(row, finished, planned)
