"""The faithful protocol at the released code's shape on one GPU, in one command of at most ~10 minutes (issue 15).

Runs `pcfg_grammar_gate.py` on 1-2 candidate grammars, then `pcfg_c1_continued_training.py` on the gated grammar
(or, when none passes, on the candidate with the lowest pilot KL, labelled "not gated") for as many model seeds as
the budget allows, each recipe's JSON in one output folder, and prints the gate table and the C1 verdict. Shape:
`PCFG.paper_shaped` grammars, BERT H256-L4 (3.3M parameters), batch 1024, AdamW beta2 0.98, weight decay 0.01,
warm-up, fp32 (the protocol's annealed branches are a plain PyTorch loop without autocast, so bf16 would train trunk
and branches differently). Candidates and seeds run as concurrent processes on the one GPU: the models are far too
small to fill it, so a step is bound by kernel launches and data, and processes overlap on its idle time; each gets
an equal share of the CPU threads (the probes fit on the CPU).

BUDGET (assumed, not measured on a GPU): ~15 ms per step of H256-L4 at batch 1024 including the batch's assembly
(launch-bound: ~3 ms of kernels per step, ~7 ms of reading and collating 1024 rows measured on one CPU core), ~30 s
per branch measurement (KL, traces, three probes on 2,000 x 4,608 features), ~25 s of language setup per process.
Gate: 2,000-step pilots (2M sentences, twice the CPU pilots'), about 80 s. C1: 4,000 trunk steps, a branch every
1,000 annealed over 500 steps (4 branches, 6,000 steps in all), about 3 minutes per seed alone, seeds concurrent.
The script stops starting work once ``--budget-minutes`` are spent, kills what still runs at the deadline (a
finished candidate or seed is already on disk), and merges whatever finished; each phase's wall time is printed and
written to ``protocol_gpu.json`` so the next session can resize.

    python recipes/pcfg_protocol_gpu.py                   # on the GPU machine: <= 9 minutes, outputs/pcfg_protocol_gpu
    python recipes/pcfg_protocol_gpu.py --dry-run         # tiny sizes on whatever device is here (tests)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from hf_flatbias.cli import run_recipe

RECIPES = Path(__file__).resolve().parent
#: most CPU threads one process gets: the models' tiny CPU ops (features, probes) slow down with more, badly so on a
#: shared machine (a smoke merge took 15 s on one thread and 248 s on two here)
MAX_THREADS = 4
#: seconds kept back from the budget for the final merge (reference rows: three probes and the exact conditionals)
MERGE_RESERVE_SECONDS = 60


def parse_arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--candidates",
        nargs="+",
        default=["1:1", "2:1"],
        help="gate grammars GRAMMAR_SEED:CONC (default: the CPU gate's lowest lexical baseline and lowest pilot KL)",
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4], help="C1 model seeds (concurrent)")
    parser.add_argument("--budget-minutes", type=float, default=9.0, help="no new work starts after this; all stops")
    parser.add_argument("--gate-share", type=float, default=0.3, help="largest fraction of the budget for the gate")
    parser.add_argument("--hidden", type=int, default=256, help="BERT hidden size (256 x 4 layers: 3.3M parameters)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--learning-rate", type=float, default=1e-3, help="peak (gate) and constant (C1 trunk) rate")
    parser.add_argument("--gate-steps", type=int, default=2000)
    parser.add_argument("--gate-warmup-steps", type=int, default=200)
    parser.add_argument("--c1-steps", type=int, default=4000, help="trunk steps")
    parser.add_argument("--branch-every", type=int, default=1000)
    parser.add_argument("--anneal-steps", type=int, default=500)
    parser.add_argument("--c1-warmup-steps", type=int, default=300)
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    parser.add_argument("--output-dir", type=Path, default=Path("outputs") / "pcfg_protocol_gpu")
    parser.add_argument("--dry-run", action="store_true", help="the recipes' --smoke sizes, 2 seeds, seconds")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible here; pass --device auto.")
    if args.budget_minutes <= 0 or not 0 < args.gate_share < 1:
        parser.error("--budget-minutes must be > 0 and --gate-share in (0, 1).")
    if args.dry_run and "--seeds" not in (argv or sys.argv[1:]):
        args.seeds = [0, 1]
    return args


def recipe_command(name: str, args: argparse.Namespace, *extra: str) -> list[str]:
    """``python recipes/<name>.py`` with the shared shape flags (or ``--smoke``) and ``extra``."""
    device = "cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()) else "cpu"
    command = [sys.executable, str(RECIPES / f"{name}.py"), "--device", device]
    if args.dry_run:
        return [*command, "--smoke", *extra]
    shape = ["--hidden", args.hidden, "--layers", args.layers, "--batch-size", args.batch_size]
    return [*command, *map(str, shape), "--learning-rate", str(args.learning_rate), *extra]


def run_concurrently(commands: dict[str, list[str]], deadline: float, log_dir: Path) -> dict[str, dict]:
    """Start every command at once (an equal share of the CPU threads each); kill those still running at ``deadline``.

    Returns ``{name: {"returncode", "seconds", "killed"}}``; each command's output goes to ``log_dir/NAME.log``.
    """
    threads = threads_each(len(commands))
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    env["PYTHONPATH"] = merge_environment()["PYTHONPATH"]
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    log_dir.mkdir(parents=True, exist_ok=True)
    started, processes, logs = time.monotonic(), {}, {}
    for name, command in commands.items():
        logs[name] = open(log_dir / f"{name}.log", "w")  # noqa: SIM115 (closed below, after the process ends)
        processes[name] = subprocess.Popen(
            command, stdout=logs[name], stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    outcome = {}
    for name, process in processes.items():
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
            killed = False
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)  # its own session: this process and its children only
            process.wait()
            killed = True
        logs[name].close()
        outcome[name] = {"returncode": process.returncode, "seconds": time.monotonic() - started, "killed": killed}
        print(
            f"  {name}: {'killed at the deadline' if killed else f'exit {process.returncode}'} "
            f"after {outcome[name]['seconds']:.0f} s (log {log_dir / f'{name}.log'})",
            flush=True,
        )
    return outcome


def merge_environment() -> dict[str, str]:
    """A merge's environment: this checkout first on the path, the threads of a process running alone."""
    path = os.pathsep.join(filter(None, [str(RECIPES.parent), os.environ.get("PYTHONPATH")]))
    threads = str(threads_each(1))
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}


def threads_each(processes: int) -> int:
    """CPU threads for each of ``processes`` concurrent processes: an equal share of half the cores, 1 to 4."""
    return max(1, min(MAX_THREADS, (os.cpu_count() or 1) // (2 * max(1, processes))))


def gate_table(gate: dict) -> str:
    rows = ["grammar   lexical A/B/C (mean)        pilot KL   passes"]
    for row in gate["table"]:
        rows.append(
            f"{row['grammar_seed']}:{row['concentration']:<6g} "
            f"{row['lexical_A']:.3f}/{row['lexical_B']:.3f}/{row['lexical_C']:.3f} ({row['lexical_baseline']:.3f})"
            f"   {row['pilot_kl']:.4f}     {'yes' if row['passes'] else 'no'}"
        )
    return "\n".join(rows)


def main(argv=None) -> dict:
    args = parse_arguments(argv)
    start = time.monotonic()
    deadline = start + 60 * args.budget_minutes
    out = args.output_dir
    out.mkdir(parents=True, exist_ok=True)
    summary: dict = {"recipe": "pcfg_protocol_gpu", "config": {k: str(v) for k, v in vars(args).items()}}
    summary["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"

    def save():
        (out / "protocol_gpu.json").write_text(json.dumps(summary, indent=2) + "\n")

    gate_dir = out / "gate"
    gate_flags = (
        [] if args.dry_run else ["--steps", str(args.gate_steps), "--warmup-steps", str(args.gate_warmup_steps)]
    )
    print(f"gate: {len(args.candidates)} candidates at once on {summary['device']}", flush=True)
    summary["gate_runs"] = run_concurrently(
        {
            f"gate_{c.replace(':', '_c')}": recipe_command(
                "pcfg_grammar_gate", args, "--candidates", c, "--output-dir", str(gate_dir), *gate_flags
            )
            for c in args.candidates
        },
        min(deadline, start + 60 * args.budget_minutes * args.gate_share),
        out / "logs",
    )
    subprocess.run(
        recipe_command("pcfg_grammar_gate", args, "--merge", "--output-dir", str(gate_dir)),
        check=True,
        env=merge_environment(),
        stdout=subprocess.DEVNULL,
    )
    gate = json.loads((gate_dir / "gate.json").read_text())
    summary["gate"] = gate
    summary["gate_seconds"] = time.monotonic() - start
    save()
    print(gate_table(gate), flush=True)
    if not gate["table"]:
        print("gate: no candidate finished within the budget; C1 not started", flush=True)
        return summary
    grammar = gate["chosen"] or min(gate["table"], key=lambda row: row["pilot_kl"])
    summary["c1_grammar"] = {**grammar, "gated": gate["chosen"] is not None}
    grammar_flags = ["--grammar-seed", str(grammar["grammar_seed"]), "--concentration", f"{grammar['concentration']:g}"]
    print(
        f"C1 on grammar {grammar['grammar_seed']}:{grammar['concentration']:g}"
        f"{'' if gate['chosen'] else ' (not gated: no candidate passed, lowest pilot KL)'}",
        flush=True,
    )
    c1_dir = out / "c1"
    c1_flags = [] if args.dry_run else [
        "--steps", str(args.c1_steps),
        "--branch-every", str(args.branch_every),
        "--anneal-steps", str(args.anneal_steps),
        "--warmup-steps", str(args.c1_warmup_steps),
    ]  # fmt: skip
    c1_start = time.monotonic()
    summary["c1_runs"] = run_concurrently(
        {
            f"c1_seed{seed}": recipe_command(
                "pcfg_c1_continued_training",
                args,
                *grammar_flags,
                "--seeds",
                str(seed),
                "--output-dir",
                str(c1_dir),
                *c1_flags,
            )
            for seed in args.seeds
        },
        deadline - MERGE_RESERVE_SECONDS * (not args.dry_run),
        out / "logs",
    )
    finished = [s for s in args.seeds if (c1_dir / f"seed{s}" / "result.json").exists()]
    summary["c1_seconds"] = time.monotonic() - c1_start
    summary["c1_finished_seeds"] = finished
    save()
    if not finished:
        print("C1: no seed finished within the budget (partial branches are in c1/seed*/branches.json)", flush=True)
        return summary
    merge = recipe_command(
        "pcfg_c1_continued_training",
        args,
        *grammar_flags,
        "--merge",
        "--seeds",
        *map(str, finished),
        "--output-dir",
        str(c1_dir),
        *c1_flags,
    )
    subprocess.run(merge, check=True, env=merge_environment(), stdout=subprocess.DEVNULL)
    results = json.loads((c1_dir / "c1_results.json").read_text())
    summary["c1_verdict"] = results["verdict"]
    summary["seconds"] = time.monotonic() - start
    save()
    verdict = results["verdict"]
    print(f"C1 ({len(finished)} seeds: {finished}): {verdict['verdict']} ({verdict['regime']})", flush=True)
    for seed, records in results["seeds"].items():
        line = ", ".join(f"{r['step']}: KL {r['kl']:.4f} tr {r.get('fisher_trace', float('nan')):.1f} "
                         f"acc {r['probe_accuracy']:.3f}" for r in records)  # fmt: skip
        print(f"  seed {seed}: {line}", flush=True)
    print(f"total {summary['seconds']:.0f} s; JSON in {out}", flush=True)
    return summary


if __name__ == "__main__":
    run_recipe(main)
