"""Campaign v3's verdicts and tournament statistics (issue 55), pure functions of the reads on disk.

Rules: `research.rules_v3` and ``results/campaign_v3/RULES.md``. `contrasts` computes the gate's row, the
confirmatory contrasts (a) C1 last minus first, (b) C3 SAM minus no SAM, both unadjusted and at equal KL, and (c)
the dose-response regression, for the fine-tuning (verdicts) and the probe (beside). The tournament's statistics
(`partial_rank_correlation`, `seed_bootstrap`, `within_group_permutation_p`, `holm`, `selection_gain`) take plain
arrays. Tests recompute every verdict from the committed JSON with these functions.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from scipy.stats import rankdata

from hf_flatbias.results import write_json
from hf_flatbias.stats import t_half_width

from . import rules_v3 as rules
from .campaign_v3 import Checkpoint, gate_state, read_matrix
from .ruler_reads import PRIMARY, RulerSizes
from .verdicts_v2 import decide, two_way_interval

FINETUNE = "finetune"
MATCHED_NATS = 0.003  # (b)'s pair condition, v2's

Reads = Mapping[str, Sequence[float]]  # checkpoint key -> its read per split


def finetune_reads(raw: Mapping[str, Any], keys: Sequence[str], n_splits: int, gate: Mapping[str, Any]) -> Reads:
    """Each key's fine-tuning read per split at the gate's rung; keys not fully read are left out."""
    found = {}
    for key in keys:
        values = read_matrix(raw, key, n_splits, gate["seeds"], gate["rows"])
        if values is not None:
            found[key] = values
    return found


def probe_reads(stores: Sequence[Mapping[str, Any]], keys: Sequence[str], n_splits: int) -> Reads:
    """Each key's probe read (mean over tasks) per split, from the first store holding all its splits."""
    found = {}
    for key in keys:
        for store in stores:
            splits = store.get(key, {}).get("readouts", {}).get(PRIMARY, {})
            if all(str(r) in splits for r in range(n_splits)):
                found[key] = [splits[str(r)]["mean"] for r in range(n_splits)]
                break
    return found


# ---------------------------------------------------------------- (c) dose-response


def within_seed_fit(y: np.ndarray, covariates: np.ndarray, seeds: np.ndarray) -> np.ndarray:
    """Least-squares coefficients of ``y`` on ``covariates`` (rows x k) with a fixed effect per seed: every column
    centred within its seed, then ordinary least squares without an intercept."""
    y, x = np.asarray(y, dtype=np.float64).copy(), np.asarray(covariates, dtype=np.float64).copy()
    for seed in np.unique(seeds):
        rows = seeds == seed
        y[rows] -= y[rows].mean()
        x[rows] -= x[rows].mean(0)
    return np.linalg.lstsq(x, y, rcond=None)[0]


def dose_response(
    points: Sequence[tuple[int, Sequence[float], float, float]], confidence: float = rules.CONFIDENCE
) -> dict[str, Any]:
    """(c) of RULES.md from ``(seed, read per split, trace, KL)`` per checkpoint: ``b_T`` (mean over splits of the
    per-split fits) with ``mean ± t(q, min(S, R) - 1) sqrt(var_r(b_T^(r))/R + V_seed)``, ``V_seed`` the jackknife over
    seeds of the fit on split-averaged reads; and ``b_KL``, the same for KL's coefficient."""
    seeds = np.array([p[0] for p in points])
    reads = np.array([p[1] for p in points], dtype=np.float64)  # checkpoints x splits
    x = np.array([[p[2], p[3]] for p in points], dtype=np.float64)
    n_splits, unique = reads.shape[1], np.unique(seeds)
    per_split = np.array([within_seed_fit(reads[:, r], x, seeds) for r in range(n_splits)])  # R x 2
    averaged = reads.mean(1)
    jackknife = np.array([within_seed_fit(averaged[seeds != s], x[seeds != s], seeds[seeds != s]) for s in unique])
    n_seeds = len(unique)
    seed_variance = (n_seeds - 1) / n_seeds * ((jackknife - jackknife.mean(0)) ** 2).sum(0)
    variance = per_split.var(0, ddof=1) / n_splits + seed_variance
    df = min(n_seeds, n_splits) - 1
    half = t_half_width(np.sqrt(variance), df, confidence)
    estimate = per_split.mean(0)
    row = {}
    for i, name in enumerate(("trace", "kl")):
        row[name] = {
            "coefficient": float(estimate[i]),
            "ci": [float(estimate[i] - half[i]), float(estimate[i] + half[i])],
            "per_split": per_split[:, i].tolist(),
            "df": df,
        }
    low, high = row["trace"]["ci"]
    row["verdict"] = "PASS" if high < 0 else "FAIL"
    row["reading"] = "predicted direction" if high < 0 else ("opposite direction" if low > 0 else "includes 0")
    row["seeds"] = [int(s) for s in unique]
    row["checkpoints"] = len(points)
    return row


# ---------------------------------------------------------------- (a), (b): paired contrasts at equal KL


def paired_contrast(
    pairs: Mapping[int, tuple[Checkpoint, Checkpoint]], reads: Reads, b_kl: float | None, *, above: bool = True
) -> dict[str, Any]:
    """Per seed ``(a, b)``: ``D[s, r] = read(a) - read(b)``, decided unadjusted and KL-adjusted
    (``D - b_KL (KL_a - KL_b)``); PASS only when both lie on the predicted side (RULES.md)."""
    read = {s: (a, b) for s, (a, b) in pairs.items() if a.key in reads and b.key in reads}
    if len(read) < len(pairs):
        return {"verdict": f"undecided (budget: {len(read)} of {len(pairs)} seeds read)", "seeds_read": sorted(read)}
    differences = {str(s): np.subtract(reads[a.key], reads[b.key]).tolist() for s, (a, b) in read.items()}
    kl_gaps = {str(s): a.kl - b.kl for s, (a, b) in read.items()}
    unadjusted = decide(differences, above=above)
    row: dict[str, Any] = {
        "unadjusted": unadjusted,
        "kl_differences": kl_gaps,
        "kl_difference_mean": float(np.mean(list(kl_gaps.values()))),
        "kl_difference_range": [min(kl_gaps.values()), max(kl_gaps.values())],
    }
    if b_kl is None:
        return {**row, "verdict": "undecided (b_KL pending: (c) not read)", "adjusted": None}
    adjusted_d = {s: (np.asarray(d) - b_kl * kl_gaps[s]).tolist() for s, d in differences.items()}
    adjusted = decide(adjusted_d, above=above)
    row["adjusted"] = {**adjusted, "b_kl": b_kl, "note": "b_KL taken as fixed: its own error is not propagated"}
    if unadjusted["verdict"] == "PASS" and adjusted["verdict"] == "PASS":
        row["verdict"] = "PASS"
    elif unadjusted["verdict"] == "FAIL" or adjusted["verdict"] == "FAIL":
        row["verdict"] = "FAIL"
    else:
        row["verdict"] = unadjusted["verdict"]
    return row


def matched(a: Checkpoint, b: Checkpoint) -> bool:
    """(b)'s pair condition: both saturated and within `MATCHED_NATS` of each other."""
    return a.saturated and b.saturated and abs(a.kl - b.kl) <= MATCHED_NATS


def _family(checkpoints: Mapping[str, Checkpoint], family: str, label: str) -> dict[int, Checkpoint]:
    return {c.seed: c for c in checkpoints.values() if c.family == family and c.label == label}


def readout_contrasts(checkpoints: Mapping[str, Checkpoint], reads: Reads) -> dict[str, Any]:
    """(c), (a) and (b) with their side rows on one read-out."""
    c1 = [c for c in checkpoints.values() if c.family == "c1"]
    seeds_c1 = sorted({c.seed for c in c1})
    complete = [s for s in seeds_c1 if all(c.key in reads for c in c1 if c.seed == s)]
    rows: dict[str, Any] = {}
    if len(complete) == len(seeds_c1):
        points = [(c.seed, reads[c.key], c.fisher_trace, c.kl) for c in c1]
        rows["c_dose_response"] = dose_response(points)
        rows["c_dose_response"]["kl_range_per_seed"] = {
            str(s): [min(c.kl for c in c1 if c.seed == s), max(c.kl for c in c1 if c.seed == s)] for s in seeds_c1
        }
        branches = [p for p, c in zip(points, c1, strict=True) if c.label != "start"]
        rows["c_without_start"] = dose_response(branches)
        b_kl = rows["c_dose_response"]["kl"]["coefficient"]
    else:
        rows["c_dose_response"] = {"verdict": f"undecided (budget: {len(complete)} of {len(seeds_c1)} seeds read)"}
        b_kl = None
    first, last = (_family(checkpoints, "c1", f"step-{step}") for step in (rules.C1_FIRST_STEP, rules.C1_LAST_STEP))
    starts = _family(checkpoints, "c1", "start")
    rows["a_last_minus_first"] = paired_contrast({s: (last[s], first[s]) for s in last}, reads, b_kl)
    rows["a_last_minus_start"] = paired_contrast({s: (last[s], starts[s]) for s in last}, reads, b_kl)
    flat, plain = (_family(checkpoints, "c3", arm) for arm in rules.C3_CONTRAST)
    pairs = {s: (flat[s], plain[s]) for s in flat if matched(flat[s], plain[s])}
    rows["b_sam_minus_plain"] = paired_contrast(pairs, reads, b_kl)
    rows["b_sam_minus_plain"]["seeds_matched"] = sorted(pairs)
    sam, adamw = _family(checkpoints, "c3", "adamw_sam"), _family(checkpoints, "c3", "adamw")
    side = {s: (sam[s], adamw[s]) for s in sam if matched(sam[s], adamw[s])}
    rows["b_side_adamw_sam_minus_adamw"] = (
        paired_contrast(side, reads, b_kl) if len(side) >= 2 else {"verdict": f"undecided ({len(side)} matched seeds)"}
    )
    rows["b_side_adamw_sam_minus_adamw"]["seeds_matched"] = sorted(side)
    return rows


def contrasts(
    checkpoints: Mapping[str, Checkpoint],
    raw_finetune: Mapping[str, Any],
    probe_stores: Sequence[Mapping],
    n_splits: int,
) -> dict[str, Any]:
    """Every v3 verdict: the gate, then each read-out's contrasts (fine-tuning decides; the probe is beside)."""
    gate = gate_state(raw_finetune, n_splits)
    keys = list(checkpoints)
    payload: dict[str, Any] = {"gate": gate}
    if gate["decided"]:
        payload[FINETUNE] = readout_contrasts(checkpoints, finetune_reads(raw_finetune, keys, n_splits, gate))
    payload["probe"] = readout_contrasts(checkpoints, probe_reads(probe_stores, keys, n_splits))
    payload["read"] = {
        FINETUNE: sorted(finetune_reads(raw_finetune, keys, n_splits, gate)) if gate["decided"] else [],
        "probe": sorted(probe_reads(probe_stores, keys, n_splits)),
    }
    return payload


def _probe_stores(results: Path) -> list[Mapping[str, Any]]:
    """v2's probe reads, then v3's own."""
    import json

    paths = (results.parent / "campaign_v2" / "claims" / "reads.json", results / "probe_reads.json")
    return [json.loads(path.read_text())["reads"] for path in paths if path.exists()]


def write_tournament(
    results: Path, checkpoints: Mapping[str, Checkpoint], raw_finetune: Mapping[str, Any], sizes: RulerSizes
) -> dict[str, Any] | None:
    """``tournament.json`` from the reads and ``measures.json`` on disk (None, nothing written, before any measure)."""
    import json

    from .measures_v3 import tournament_values

    if not (results / "measures.json").exists():
        return None
    measured = json.loads((results / "measures.json").read_text())["measures"]
    values = {key: tournament_values(groups) for key, groups in measured.items()}
    gate = gate_state(raw_finetune, sizes.n_splits)
    keys = list(checkpoints)
    readouts = {"probe": probe_reads(_probe_stores(results), keys, sizes.n_splits)}
    if gate["decided"]:
        readouts[FINETUNE] = finetune_reads(raw_finetune, keys, sizes.n_splits, gate)
    payload = {
        "rules": "RULES.md",
        "gate": gate,
        **tournament(checkpoints, readouts, values),
        "sensitivity_saturated": tournament(checkpoints, readouts, values, saturated_only=True)["measures"],
    }
    write_json(results / "tournament.json", payload)
    return payload


def write_contrasts(
    results: Path, checkpoints: Mapping[str, Checkpoint], raw_finetune: Mapping[str, Any], sizes: RulerSizes
) -> dict[str, Any]:
    """``contrasts.json`` from the reads on disk; returns it."""
    payload = contrasts(checkpoints, raw_finetune, _probe_stores(results), sizes.n_splits)
    summary = {FINETUNE: {}, "probe": {}}
    for readout in summary:
        for name, row in payload.get(readout, {}).items():
            summary[readout][name] = row.get("verdict")
    payload["summary"] = {"gate": payload["gate"], **summary}
    write_json(results / "contrasts.json", {"rules": "RULES.md", **payload})
    return payload


# ---------------------------------------------------------------- the tournament's statistics

Group = tuple[np.ndarray, np.ndarray, np.ndarray]  # (transfer, measure, KL) of one within-seed group


def _residual_ranks(values: np.ndarray, kl_ranks: np.ndarray) -> np.ndarray:
    x = np.column_stack([np.ones_like(kl_ranks), kl_ranks])
    ranks = rankdata(values)
    return ranks - x @ np.linalg.lstsq(x, ranks, rcond=None)[0]


def partial_rank_correlation(groups: Sequence[Group]) -> float:
    """Pooled within-group partial rank correlation of transfer with the measure given KL (RULES.md): ranks inside
    each group, both residualised on KL's ranks, residuals pooled, Pearson's correlation. NaN when either pooled
    residual is constant."""
    ry, rm = [], []
    for y, m, kl in groups:
        kl_ranks = rankdata(kl)
        ry.append(_residual_ranks(np.asarray(y), kl_ranks))
        rm.append(_residual_ranks(np.asarray(m), kl_ranks))
    a, b = np.concatenate(ry), np.concatenate(rm)
    if a.std() < 1e-9 or b.std() < 1e-9:  # ranks are O(1): below this the residual is rounding, not signal
        return math.nan
    return float(np.corrcoef(a, b)[0, 1])


def seed_bootstrap(
    groups_by_seed: Mapping[int, Sequence[Group]],
    statistic: Callable[[Sequence[Group]], float],
    n: int = rules.BOOTSTRAPS,
    seed: int = 0,
    confidence: float = rules.CONFIDENCE,
) -> list[float]:
    """Percentile interval of ``statistic`` over seeds resampled with replacement (a seed's groups together)."""
    rng = np.random.default_rng(seed)
    seeds = sorted(groups_by_seed)
    values = []
    for _ in range(n):
        chosen = rng.choice(seeds, size=len(seeds), replace=True)
        value = statistic([g for s in chosen for g in groups_by_seed[s]])
        if not math.isnan(value):
            values.append(value)
    if not values:
        return [math.nan, math.nan]
    tail = (1 - confidence) / 2 * 100
    return [float(np.percentile(values, tail)), float(np.percentile(values, 100 - tail))]


def within_group_permutation_p(groups: Sequence[Group], n: int = rules.PERMUTATIONS, seed: int = 0) -> float:
    """Two-sided p of `partial_rank_correlation` with the measure permuted inside each group ((k + 1) / (n + 1));
    NaN when the correlation is undefined (the measure's ranks are KL's)."""
    rng = np.random.default_rng(seed)
    observed = abs(partial_rank_correlation(groups))
    if math.isnan(observed):
        return math.nan
    exceed = 0
    for _ in range(n):
        shuffled = [(y, rng.permutation(m), kl) for y, m, kl in groups]
        value = partial_rank_correlation(shuffled)
        exceed += bool(math.isnan(value) or abs(value) >= observed - 1e-12)
    return (exceed + 1) / (n + 1)


def holm(pvalues: Mapping[str, float]) -> dict[str, float]:
    """Holm's step-down adjusted p-values (monotone, capped at 1)."""
    order = sorted(pvalues, key=pvalues.get)
    adjusted, running = {}, 0.0
    for i, name in enumerate(order):
        running = max(running, min(1.0, (len(order) - i) * pvalues[name]))
        adjusted[name] = running
    return adjusted


def selection_gain(
    candidates_by_seed: Mapping[int, Sequence[tuple[Sequence[float], float, float]]],
    direction: int,
    window: float = rules.SELECTION_WINDOW_NATS,
) -> dict[str, Any]:
    """Per seed, candidates ``(read per split, measure, KL)``: the measure's pick (flattest by ``direction`` among
    those within ``window`` of the seed's lowest KL) minus the lowest-KL pick, per split; the two-way interval, and
    the pick's shortfall from the seed's best checkpoint (split-averaged)."""
    differences, shortfall = {}, {}
    for seed, rows in candidates_by_seed.items():
        lowest = min(rows, key=lambda row: row[2])
        window_rows = [row for row in rows if row[2] <= lowest[2] + window]
        pick = min(window_rows, key=lambda row: direction * row[1])
        differences[str(seed)] = np.subtract(pick[0], lowest[0]).tolist()
        shortfall[str(seed)] = float(max(np.mean(row[0]) for row in rows) - np.mean(pick[0]))
    gain = two_way_interval([differences[s] for s in sorted(differences)])
    return {"gain": gain, "per_seed": {s: float(np.mean(d)) for s, d in differences.items()}, "shortfall": shortfall}


# ---------------------------------------------------------------- the tournament


def tournament_groups(
    checkpoints: Mapping[str, Checkpoint], reads: Reads, values: Mapping[str, Mapping[str, float]], measure: str
) -> dict[int, list[Group]]:
    """Per model seed, its within-seed groups (C1: start and branches; C3: the arms) in which every checkpoint is
    read and measured: ``(transfer averaged over splits, measure, KL)``."""
    found: dict[int, list[Group]] = {}
    for family in ("c1", "c3"):
        for seed in sorted({c.seed for c in checkpoints.values() if c.family == family}):
            members = [c for c in checkpoints.values() if c.family == family and c.seed == seed]
            if len(members) < rules.MIN_GROUP_SIZE or any(
                c.key not in reads or measure not in values.get(c.key, {}) for c in members
            ):
                continue
            found.setdefault(seed, []).append(
                (
                    np.array([np.mean(reads[c.key]) for c in members]),
                    np.array([values[c.key][measure] for c in members]),
                    np.array([c.kl for c in members]),
                )
            )
    return found


def tournament(
    checkpoints: Mapping[str, Checkpoint],
    readouts: Mapping[str, Reads],
    values: Mapping[str, Mapping[str, float]],
    *,
    saturated_only: bool = False,
    bootstraps: int = rules.BOOTSTRAPS,
    permutations: int = rules.PERMUTATIONS,
) -> dict[str, Any]:
    """RULES.md's tournament: per measure and read-out the pooled within-seed partial rank correlation given KL, its
    seed-bootstrap interval, the within-group permutation p, Holm over the measures, and (directed measures) the
    selection gain over the lowest KL; ``{"measures": {name: {readout: row}}, ...}``."""
    if saturated_only:
        checkpoints = {k: c for k, c in checkpoints.items() if c.saturated}
    table: dict[str, dict[str, Any]] = {name: {} for name in rules.MEASURES}
    for readout, reads in readouts.items():
        pvalues = {}
        for name in rules.MEASURES:
            groups_by_seed = tournament_groups(checkpoints, reads, values, name)
            groups = [g for seed in sorted(groups_by_seed) for g in groups_by_seed[seed]]
            if len(groups_by_seed) < 2:
                table[name][readout] = {"status": "not measured or not read", "seeds": sorted(groups_by_seed)}
                continue
            rho = partial_rank_correlation(groups)
            row: dict[str, Any] = {
                "status": "ranked",
                "seeds": sorted(groups_by_seed),
                "groups": len(groups),
                "checkpoints": int(sum(len(g[0]) for g in groups)),
                "partial_rank_correlation": rho,
                "ci": seed_bootstrap(groups_by_seed, partial_rank_correlation, n=bootstraps),
                "p": within_group_permutation_p(groups, n=permutations),
                "direction": rules.MEASURE_DIRECTION[name],
            }
            direction = rules.MEASURE_DIRECTION[name]
            row["paper_direction"] = bool(direction and not math.isnan(rho) and np.sign(rho) == -direction)
            if not math.isnan(row["p"]):
                pvalues[name] = row["p"]
            row["p_holm"], row["survives"] = math.nan, False  # a measure without a p (no residual) cannot survive
            if direction:
                c1 = {
                    seed: [
                        (reads[c.key], values[c.key][name], c.kl)
                        for c in checkpoints.values()
                        if c.family == "c1" and c.seed == seed
                    ]
                    for seed in groups_by_seed
                    if all(c.key in reads for c in checkpoints.values() if c.family == "c1" and c.seed == seed)
                }
                if len(c1) >= 2:
                    row["selection"] = selection_gain(c1, direction)
            table[name][readout] = row
        for name, adjusted in holm(pvalues).items():
            table[name][readout]["p_holm"] = adjusted
            table[name][readout]["survives"] = adjusted <= rules.SURVIVE_ALPHA
    return {"measures": table, "saturated_only": saturated_only}
