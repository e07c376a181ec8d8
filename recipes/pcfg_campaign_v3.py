"""Campaign v3 (issue 55): campaign v2's committed checkpoints read again, fine-tuning first, with a gated ruler.

Rules: `research.rules_v3` (prose: recipes/research/results/campaign_v3/RULES.md), committed before any read. v3
trains nothing. ``--phase reads`` fine-tunes the gate's pair until the gate decides its rung, then every stage's
checkpoints in the rules' order at that rung (the probe reads a stage lacks follow it), until everything is read or
13 CPU-hours of reading are spent. ``--phase measures`` takes the tournament's measures (`research.measures_v3`) on
every checkpoint, the cheap groups first, the spectrum last. ``--phase analyse`` writes ``contrasts.json`` and
``tournament.json`` from what is on disk, and the docs' tables. Resumable read by read; two processes may share the
work (at most two, by the rules):

    mkdir -p outputs/campaign_v3; for i in 1 2; do OMP_NUM_THREADS=1 PYTHONPATH=$PWD:$PWD/recipes nohup nice -n 10 \\
      python recipes/pcfg_campaign_v3.py --phase reads >> outputs/campaign_v3/reads-$i.log 2>&1 & echo $! \\
      >> outputs/campaign_v3/pids; done

Pause and resume by the recorded process ids (`kill -STOP $(cat outputs/campaign_v3/pids)`, then `-CONT`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from research.campaign_v2 import Sizes, load_material
from research.campaign_v3 import RESULTS, V2, FinetuneStore, ReadsRun, checkpoint_table, gate_state, run_reads
from research.docs_blocks import replace_generated
from research.ruler_reads import ReadStore, RulerSizes, ruler_rows

WORK = Path("outputs/campaign_v3")
DOCS = Path(__file__).resolve().parents[1] / "docs" / "reproduction" / "campaign_v3.md"


def parse_arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--phase", choices=["reads", "measures", "analyse"], required=True, help="what to run")
    parser.add_argument("--results", type=Path, default=RESULTS, help="the folder of v3's JSON (default: committed)")
    parser.add_argument("--work-dir", type=Path, default=WORK, help="where the ruler's row cache lives")
    parser.add_argument(
        "--stop-after-hours", type=float, default=None, help="end the reads loop after this much wall time"
    )
    args = parser.parse_args(argv)
    if args.stop_after_hours is not None and args.stop_after_hours <= 0:
        parser.error(f"--stop-after-hours must be > 0, got {args.stop_after_hours}")
    return args


def main(argv=None) -> None:
    args = parse_arguments(argv)
    torch.set_num_threads(1)
    sizes = RulerSizes()
    finetune = FinetuneStore(args.results / "finetune_reads.json", sizes)
    if args.phase == "measures":
        from research.measures_v3 import (
            MEASURE_GROUPS,
            MeasureStore,
            downstream_task,
            measure_checkpoints,
            with_sentence_types,
        )
        from transformers import BertForMaskedLM

        language = load_material(args.work_dir, Sizes()).language
        rows = ruler_rows(language.grammar, language.grammar_seed, sizes, args.work_dir / "cache")
        contexts = {
            "plain": language.trace_contexts,
            "typed": with_sentence_types(language.trace_contexts, language.grammar),
            "task": downstream_task(rows),
        }
        loaders = {
            key: (lambda path=checkpoint.path: BertForMaskedLM.from_pretrained(path).eval())
            for key, checkpoint in checkpoint_table().items()
        }
        store = MeasureStore(args.results / "measures.json")
        cheap = [group for group in MEASURE_GROUPS if group != "spectrum"]
        for groups in (cheap, ["spectrum"]):  # Amendment 1: the spectrum last
            measure_checkpoints(store, loaders, contexts, groups)
    elif args.phase == "reads":
        language = load_material(args.work_dir, Sizes()).language  # v1's grammar seed 0, as v2 read it
        run = ReadsRun(
            checkpoints=checkpoint_table(),
            rows=ruler_rows(language.grammar, language.grammar_seed, sizes, args.work_dir / "cache"),
            sizes=sizes,
            finetune=finetune,
            probe=ReadStore(args.results / "probe_reads.json", sizes),
            v2_probe=ReadStore(V2 / "claims" / "reads.json", sizes),
        )
        stop = None if args.stop_after_hours is None else args.stop_after_hours * 3600
        gate = run_reads(run, stop_after=stop)
        print(f"[v3] reads loop ended; gate: {json.dumps(gate)}", flush=True)
    else:
        from research.campaign_v3_report import contrasts_table, gate_table, progress_table
        from research.verdicts_v3 import write_contrasts, write_tournament

        checkpoints = checkpoint_table()
        payload = write_contrasts(args.results, checkpoints, finetune.reads, sizes)
        write_tournament(args.results, checkpoints, finetune.reads, sizes)
        gate = gate_state(finetune.reads, sizes.n_splits)
        text = DOCS.read_text()
        for name, body in (
            ("gate", gate_table(gate)),
            ("progress", progress_table(checkpoints, finetune.reads, gate)),
            ("contrasts", contrasts_table(payload)),
        ):
            text = replace_generated(text, f"v3 {name}", body, DOCS)
        DOCS.write_text(text)
        print(json.dumps(payload["summary"], indent=1))


if __name__ == "__main__":
    main()
