"""Held-out re-reading of campaign v2's C4 (issue 33): the committed H64 starts against the strongest baseline row,
read by a probe written here on fresh sentences.

C4's primary contrast (``claims/C4.json``: each saturated H64 start minus the strongest baseline row per task, the
unmasked lookup on every task) is read again with nothing of the ruler's read-out code: the sentences are a fresh
draw from the same grammar (seed tag `HELDOUT_TAG`, not the ruler's pool `research.ruler.POOL_TAG`), the features
are computed here (every position of ``[CLS] words [SEP]`` of the last layer, padding zeroed; the baseline row from
its definition in the rule), and the probe is scikit-learn's ``LogisticRegression`` called directly (multinomial,
lbfgs, inverse L2 strength ``C`` = the ruler's 0.3 on features standardised here by the fit rows' mean and s.d.:
the same objective as the ruler's, so the same ``C`` means the same thing). What is shared with the project: the
grammar (its sampler, its task labels and, for the baseline row, its exact conditionals: the test module
``tests/test_campaign_v2_heldout.py`` checks those against brute-force sentence probabilities) and the interval's
formula (`verdicts_v2.two_way_interval`).

The read is split-major (every record on split 0, then split 1, ...) and the JSON is rewritten after every read, with
the comparison against the committed C4 recomputed each time; a rerun with the same sizes skips what it holds (more
``--splits`` extends the run: the pool is a prefix-stable draw). Run from the repository root:

    OMP_NUM_THREADS=1 PYTHONPATH=$PWD:$PWD/recipes nice -n 5 python recipes/heldout_v2.py
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from research import rules_v2 as rules
from research.campaign import SHAPES
from research.paper_language import MIN_PROBE_WORDS, TASKS
from research.verdicts_v2 import two_way_interval
from transformers import BertForMaskedLM

from hf_flatbias.results import write_json
from hf_flatbias.synthetic import PCFG
from hf_flatbias.synthetic.tokenizer import CLS_ID, N_SPECIAL, PAD_ID, SEP_ID

V2 = Path(__file__).resolve().parent / "research" / "results" / "campaign_v2"
#: the fresh pool's seed tag: ``SeedSequence([grammar_seed, HELDOUT_TAG])``, another stream than the ruler's (33)
HELDOUT_TAG = 3301
#: raw sentences per drawn chunk: a fixed chunk keeps the pool's first rows the same whatever its total size
CHUNK = 10_000
BASELINE = "unmasked_lookup"


def fresh_pool(grammar: PCFG, n_rows: int, grammar_seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The first ``n_rows`` sentences of >= `MIN_PROBE_WORDS` words of a fresh stream (``word_ids``, ``lengths``)."""
    seeds = np.random.SeedSequence([grammar_seed, HELDOUT_TAG])
    words, lengths, have = [], [], 0
    while have < n_rows:
        sample = grammar.sample(CHUNK, seed=int(seeds.spawn(1)[0].generate_state(1)[0]))
        keep = sample.lengths >= MIN_PROBE_WORDS
        padded = np.full((int(keep.sum()), grammar.max_length), -1, dtype=np.int64)
        padded[:, : sample.word_ids.shape[1]] = sample.word_ids[keep]
        words.append(padded)
        lengths.append(sample.lengths[keep])
        have += int(keep.sum())
    return np.concatenate(words)[:n_rows], np.concatenate(lengths)[:n_rows]


def pool_with_labels(grammar: PCFG, n_rows: int, cache: Path) -> dict[str, np.ndarray]:
    """The pool, its labels per task and the exact masked conditionals (the baseline row's input), cached."""
    if cache.exists():
        return dict(np.load(cache))
    began = time.process_time()
    word_ids, lengths = fresh_pool(grammar, n_rows, 0)
    labels = grammar.task_labels(word_ids, lengths)
    data = {"word_ids": word_ids, "lengths": lengths, **{f"label_{t}": labels[c] for t, c in TASKS.items()}}
    data["conditionals"] = grammar.masked_conditionals(word_ids, lengths).astype(np.float32)
    cache.parent.mkdir(parents=True, exist_ok=True)
    np.savez(cache, **data)
    print(f"[heldout] pool of {n_rows} sentences, labels, conditionals: {time.process_time() - began:.0f} CPU-s")
    return data


def last_layer_features(model: torch.nn.Module, word_ids: np.ndarray, lengths: np.ndarray, width: int) -> np.ndarray:
    """The last layer at every position of ``[CLS] words [SEP]`` padded to ``width + 2`` tokens, padding zeroed,
    flattened per sentence."""
    n = len(lengths)
    ids = np.full((n, width + 2), PAD_ID, dtype=np.int64)
    ids[:, 0] = CLS_ID
    inside = np.arange(width)[None, :] < lengths[:, None]
    ids[:, 1 : width + 1] = np.where(inside, word_ids[:, :width] + N_SPECIAL, PAD_ID)
    ids[np.arange(n), lengths + 1] = SEP_ID
    mask = (ids != PAD_ID).astype(np.int64)
    out = []
    with torch.no_grad():
        for s in range(0, n, 512):
            batch = slice(s, s + 512)
            states = model(
                input_ids=torch.as_tensor(ids[batch]),
                attention_mask=torch.as_tensor(mask[batch]),
                output_hidden_states=True,
            ).hidden_states[-1]
            out.append((states * torch.as_tensor(mask[batch])[..., None]).flatten(1).numpy())
    return np.concatenate(out).astype(np.float64)


def unmasked_lookup_features(
    word_ids: np.ndarray, lengths: np.ndarray, conditionals: np.ndarray, n_words: int
) -> np.ndarray:
    """C4's strongest row by its rule's words: per position the exact conditionals, the word's one-hot, and the
    one-hot scaled by the conditional, concatenated (positions past the end zero)."""
    width = conditionals.shape[1]
    inside = np.arange(width)[None, :] < lengths[:, None]
    onehot = (word_ids[:, :width, None] == np.arange(n_words)[None, None, :]) & inside[..., None]
    onehot = onehot.astype(np.float64)
    lookup = conditionals.astype(np.float64) * inside[..., None]
    return np.concatenate([x.reshape(len(lengths), -1) for x in (lookup, onehot, onehot * lookup)], axis=1)


def probe_accuracy(fit_x: np.ndarray, fit_y: np.ndarray, test_x: np.ndarray, test_y: np.ndarray, c: float) -> float:
    """Test accuracy of a multinomial logistic regression (lbfgs, inverse L2 strength ``c``) on features standardised
    by the fit rows (a constant column is centred, not scaled)."""
    from sklearn.linear_model import LogisticRegression

    mean, sd = fit_x.mean(0), fit_x.std(0)
    sd = np.where(sd > 0, sd, 1.0)
    head = LogisticRegression(C=c, solver="lbfgs", max_iter=rules.RULER_MAX_ITER)
    head.fit((fit_x - mean) / sd, fit_y)
    return float((head.predict((test_x - mean) / sd) == test_y).mean())


def compare(reads: dict[str, dict[str, dict]], c4: dict[str, Any], seeds: list[str], splits: int) -> dict[str, Any]:
    """Per task and over tasks: start minus baseline per seed and finished split, its interval (two-way with >= 2
    splits, seed-level with one), beside the committed C4 primary's mean and interval, and whether they agree."""
    done = [
        r
        for r in range(splits)
        if str(r) in reads.get(f"baseline/{BASELINE}", {})
        and all(str(r) in reads.get(f"start/h64/seed{s}", {}) for s in seeds)
    ]
    if not done:
        return {"splits_done": 0}
    out: dict[str, Any] = {"splits_done": len(done)}
    committed = c4["verdict"]
    for task in [*TASKS, "mean"]:
        d = [
            [reads[f"start/h64/seed{s}"][str(r)][task] - reads[f"baseline/{BASELINE}"][str(r)][task] for r in done]
            for s in seeds
        ]
        held = two_way_interval(d, rules.CONFIDENCE)
        ref = committed["mean_over_tasks"] if task == "mean" else committed["per_task"][task]
        ref_mean, (ref_low, ref_high) = ref["difference"]["mean"], ref["difference"]["ci"]
        low, high = held["ci"]
        out[task] = {
            "heldout": {
                "mean": held["mean"],
                "ci": held["ci"],
                "interval": "two-way" if len(done) > 1 else "seed-level (one split)",
                "seed_level_ci": held["seed_level_ci"],
                "per_seed": {s: float(np.mean(row)) for s, row in zip(seeds, d, strict=True)},
            },
            "committed": {
                "mean": ref_mean,
                "ci": [ref_low, ref_high],
                "per_seed": ref["per_seed_difference"],
                "reading": ref["reading"],
            },
            "largest_per_seed_gap": max(
                abs(float(np.mean(row)) - ref["per_seed_difference"][s]) for s, row in zip(seeds, d, strict=True)
            ),
            "same_sign": bool(np.sign(held["mean"]) == np.sign(ref_mean)),
            "heldout_mean_in_committed_ci": bool(ref_low <= held["mean"] <= ref_high),
            "committed_mean_in_heldout_ci": bool(low <= ref_mean <= high),
            "heldout_reading": "above 0" if low > 0 else ("below 0" if high < 0 else "includes 0"),
        }
    return out


def _ci(row: dict[str, Any]) -> str:
    return f"{row['mean']:+.4f} [{row['ci'][0]:+.4f}, {row['ci'][1]:+.4f}]"


def heldout_markdown(state: dict[str, Any]) -> str:
    """The docs' tables (docs/reproduction/campaign_v2.md, "Held-out check"), from heldout.json alone."""
    comparison, sizes = state["comparison"], state["sizes"]
    if not comparison.get("splits_done"):
        return "(no split read on every record yet)"
    yes = {True: "yes", False: "**no**"}
    splits = comparison["splits_done"]
    lines = [
        f"| task | committed C4 primary (ruler, two-way 95%) | held-out ({splits} fresh split(s) x "
        f"{sizes['n_fit']:,}, test {sizes['n_test']:,}; {comparison['mean']['heldout']['interval']} 95%) "
        "| held-out, seed-level 95% | largest per-seed gap | same sign | held-out mean inside committed interval "
        "| committed mean inside held-out interval |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for task in [*TASKS, "mean"]:
        row = comparison[task]
        lines.append(
            f"| {'mean over tasks' if task == 'mean' else task} | {_ci(row['committed'])} | {_ci(row['heldout'])} "
            f"| {_ci({**row['heldout'], 'ci': row['heldout']['seed_level_ci']})} | {row['largest_per_seed_gap']:.4f} "
            f"| {yes[row['same_sign']]} | {yes[row['heldout_mean_in_committed_ci']]} "
            f"| {yes[row['committed_mean_in_heldout_ci']]} |"
        )
    lines += ["", "| held-out row (mean over splits read) | A | B | C | mean |", "|---|---|---|---|---|"]
    for record, reads in state["reads"].items():
        done = [reads[str(r)] for r in range(splits)]
        name = record.replace("start/h64/seed", "H64 start seed ").replace("baseline/", "baseline ")
        lines.append(
            f"| {name} | " + " | ".join(f"{np.mean([d[k] for d in done]):.4f}" for k in [*TASKS, "mean"]) + " |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n-fit", type=int, default=rules.RULER_N_FIT, help="fit sentences per split")
    parser.add_argument("--n-test", type=int, default=rules.RULER_N_TEST, help="common test sentences")
    parser.add_argument("--splits", type=int, default=2, help="disjoint fit splits (each record on each)")
    parser.add_argument("--seeds", type=int, nargs="+", default=list(rules.SEEDS), help="H64 starts read")
    parser.add_argument("--weights", type=Path, default=V2 / "starts", help="committed starts' weights")
    parser.add_argument("--c4", type=Path, default=V2 / "claims" / "C4.json", help="the committed C4 claim file")
    parser.add_argument("--out", type=Path, default=V2 / "heldout.json", help="results JSON (resumed)")
    parser.add_argument("--cache-dir", type=Path, default=Path("outputs/campaign_v2_heldout"), help="pool cache")
    parser.add_argument("--markdown", action="store_true", help="print the docs' tables from --out and stop")
    args = parser.parse_args(argv)
    if args.markdown:
        print(heldout_markdown(json.loads(args.out.read_text())))
        return {}
    if min(args.n_fit, args.n_test, args.splits) < 1:
        parser.error("--n-fit, --n-test and --splits must be >= 1.")
    seeds = [str(s) for s in args.seeds]
    missing = [s for s in seeds if not (args.weights / "h64" / f"seed{s}" / "start" / "model.safetensors").exists()]
    if missing or not args.c4.exists():
        parser.error(f"need the committed C4 file {args.c4} and the H64 starts' weights (missing seeds {missing}).")
    c4 = json.loads(args.c4.read_text())
    regularization = c4["ruler"]["regularization"]
    sizes = {"n_fit": args.n_fit, "n_test": args.n_test, "seeds": seeds, "C": regularization, "tag": HELDOUT_TAG}
    state: dict[str, Any] = {"reads": {}, "cpu_seconds": {}}
    if args.out.exists():
        state = json.loads(args.out.read_text())
        if state["sizes"] != sizes:
            raise SystemExit(f"{args.out} holds a read of other sizes {state['sizes']}: pass another --out.")

    grammar = PCFG.paper_shaped(0, **SHAPES["three_level"])
    total = args.n_test + args.splits * args.n_fit
    pool = pool_with_labels(grammar, total, args.cache_dir / f"heldout_pool_{HELDOUT_TAG}_{total}.npz")
    parts = {"test": np.arange(args.n_test)}
    for r in range(args.splits):
        parts[str(r)] = np.arange(args.n_test + r * args.n_fit, args.n_test + (r + 1) * args.n_fit)
    width = grammar.max_length

    def features(record: str, rows: np.ndarray) -> np.ndarray:
        if record.startswith("baseline/"):
            return unmasked_lookup_features(
                pool["word_ids"][rows], pool["lengths"][rows], pool["conditionals"][rows], grammar.n_words
            )
        return last_layer_features(models[record], pool["word_ids"][rows], pool["lengths"][rows], width)

    records = [f"start/h64/seed{s}" for s in seeds] + [f"baseline/{BASELINE}"]
    models = {
        f"start/h64/seed{s}": BertForMaskedLM.from_pretrained(args.weights / "h64" / f"seed{s}" / "start").eval()
        for s in seeds
    }
    test_cache: dict[str, np.ndarray] = {}
    for r in range(args.splits):
        for record in records:
            done = state["reads"].setdefault(record, {})
            if str(r) in done:
                continue
            began = time.process_time()
            if record not in test_cache:
                test_cache[record] = features(record, parts["test"])
            fit_x = features(record, parts[str(r)])
            row = {
                task: probe_accuracy(
                    fit_x,
                    pool[f"label_{task}"][parts[str(r)]],
                    test_cache[record],
                    pool[f"label_{task}"][parts["test"]],
                    regularization,
                )
                for task in TASKS
            }
            done[str(r)] = {**row, "mean": float(np.mean(list(row.values())))}
            state["cpu_seconds"][f"{record}/split{r}"] = time.process_time() - began
            state.update(
                sizes=sizes,
                splits_planned=args.splits,
                design=__doc__.split("\n\n")[1],
                comparison=compare(state["reads"], c4, seeds, args.splits),
            )
            tmp = args.out.with_suffix(".json.tmp")
            write_json(tmp, state)
            os.replace(tmp, args.out)
            print(
                f"[heldout] {record} split {r}: "
                + " ".join(f"{k} {v:.4f}" for k, v in done[str(r)].items())
                + f" ({time.process_time() - began:.0f} CPU-s)",
                flush=True,
            )
    state["comparison"] = compare(state["reads"], c4, seeds, args.splits)  # also when every read was already held
    tmp = args.out.with_suffix(".json.tmp")
    write_json(tmp, state)
    os.replace(tmp, args.out)
    mean = state["comparison"].get("mean")
    if mean:
        print(f"[heldout] over tasks: held-out {mean['heldout']} vs committed {mean['committed']}", flush=True)
    return state


if __name__ == "__main__":
    main()
