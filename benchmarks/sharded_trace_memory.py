"""Per-rank peak memory of the ``per_sample`` trace of a model FSDP2 or ZeRO-3 shards, with 1, 2 and 4 CPU processes.

The bound the sharded trace should keep on each rank: its own shard of the parameters, the largest block the engine
gathers at once (one FSDP unit; one module under ZeRO-3) and one batch's activations; the parameter part should fall
about as 1/N. Each arm is one ``torch.distributed.run`` launch (gloo) of this script in worker mode: every rank builds
the same seeded model, shards it (``fully_shard`` on each decoder layer and the root; ``deepspeed.initialize`` at
stage 3 with nothing kept whole), hands back freed memory, and measures ``estimate_hessian_trace(...,
across_processes=True)``. It reports

- ``peak``: the rank's peak resident memory during the measurement above what it held just before (malloc_trim, then
  the peak reset through /proc/self/clear_refs: `large_model_trace.PeakMemory`);
- ``held``: the rank's resident memory just before, which holds its shard (and the Python/torch runtime);
- ``shard``: the bytes of the parameters the rank owns (its local shards);
- ``gathered_max``: the most parameter bytes the rank held whole at any moment of the measurement, sampled every
  few milliseconds from the engine's own state (unsharded FSDP2 parameters with storage, ZeRO-3 parameters not
  ``NOT_AVAILABLE``): the whole model would read ``model``;
- the estimate, and its relative difference from one plain (unsharded, no engine) process on the same contexts,
  measured in the driver.

The arms run one after another (1, 2, 4 processes for each engine); the machine's other load changes the times, not
the memory. ``--model llama100m`` is `_common.llama_100m` (100M, tied head); ``llama50m`` halves its layers and
MLP (about 51M).

    OMP_NUM_THREADS=1 PYTHONPATH=. MALLOC_MMAP_THRESHOLD_=1048576 MALLOC_ARENA_MAX=2 \
        python benchmarks/sharded_trace_memory.py --engines fsdp2,zero3 --processes 1,2,4

The two glibc settings make freed blocks go back to the system: with glibc's defaults (a mmap threshold that rises
to 32 MiB as large blocks are freed, an arena per thread) the multi-process arms kept 0.4-0.8 GiB more resident at
their peak than live, which reads as memory growing with N (`benchmarks/RESULTS.md` has both runs).

Last lines: ``gathered_over_model[ENGINE:N]=X`` and ``relative_difference[ENGINE:N]=X``.

``--measure spectrum`` measures the top Hessian eigenvalue instead (`estimate_top_eigenvalues`, finite-difference
products, float32 Lanczos vectors, ``--fd-products`` products): each product takes two gradients through the engine,
which under ZeRO-3 were whole on every rank before they were cut to the partition. Its one arm is reported like
"steady"; the reference is the same call on one plain process.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
from _common import llama_100m  # noqa: E402
from large_model_trace import FIRST_WORD, PeakMemory  # noqa: E402
from transformers import LlamaForCausalLM  # noqa: E402

from hf_flatbias.flatness import build_masked_contexts, estimate_hessian_trace  # noqa: E402
from hf_flatbias.flatness.spectrum import estimate_top_eigenvalues  # noqa: E402

HERE = Path(__file__).resolve().parent


def build(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = llama_100m()
    if name == "llama50m":
        config = model.config
        config.num_hidden_layers, config.intermediate_size = 6, 1536
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
    return model


def rows(n: int, seq_len: int, vocab: int) -> list[dict]:
    generator = torch.Generator().manual_seed(0)
    draw = [torch.randint(FIRST_WORD, vocab, (seq_len,), generator=generator).tolist() for _ in range(n)]
    texts = [{"input_ids": ids} for ids in draw]
    return build_masked_contexts(texts, mask_token_id=None, causal=True, seed=0)


def shard(model: torch.nn.Module, engine: str, reuse_distance: int = 0) -> tuple[torch.nn.Module, object | None]:
    """The sharded module and, under ZeRO-3, the engine's optimizer (a finite-difference product releases the
    gathered parameters through it)."""
    if engine == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        return model, None
    import deepspeed

    config = {
        "train_micro_batch_size_per_gpu": 1,
        # nothing kept whole, fetched ahead or kept for reuse: the prefetch bucket (5e7 entries by default) adds to
        # what is gathered at once, and a parameter used again within the reuse distance (1e9 entries by default)
        # stays gathered from the forward to its backward, which is the whole model below 1e9 parameters
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "stage3_prefetch_bucket_size": 0,
            "stage3_max_reuse_distance": reuse_distance,
        },
    }
    engine_, *_ = deepspeed.initialize(model=model, config=config)
    return engine_.module, engine_.optimizer


def whole_parameter_bytes(model: torch.nn.Module, engine: str) -> int:
    """Parameter bytes the rank holds whole right now, read from the engine's state."""
    if engine == "zero3":
        # the Llama's RMSNorm weights read as plain tensors, without ZeRO-3's attributes, at moments of the measurement
        # (768 entries each): skipped rather than ending the sampler
        status = [(p, getattr(p, "ds_status", None)) for p in model.parameters()]
        return sum(p.ds_numel * p.element_size() for p, s in status if s is not None and s.name != "NOT_AVAILABLE")
    from torch.distributed.fsdp import FSDPModule

    total = 0
    for module in model.modules():
        if isinstance(module, FSDPModule):
            for group in module._get_fsdp_state()._fsdp_param_groups:
                for param in group.fsdp_params:
                    unsharded = getattr(param, "_unsharded_param", None)
                    if unsharded is not None and unsharded.untyped_storage().nbytes() > 0:
                        total += unsharded.numel() * unsharded.element_size()
    return total


def local_shard_bytes(model: torch.nn.Module, engine: str) -> int:
    if engine == "zero3":
        return sum(p.ds_tensor.numel() * p.ds_tensor.element_size() for p in model.parameters())
    return sum(p.to_local().numel() * p.element_size() for p in model.parameters())


class HighWater:
    """The largest value ``read()`` returned, sampled on a thread every ``interval`` seconds while the block runs.

    A reading that raises stops the sampler and is raised again when the block ends: a sampler that died silently
    once reported ZeRO-3's embedding (94 MiB) as the most held whole, where the whole model (382 MiB) was."""

    def __init__(self, read, interval: float = 0.002) -> None:
        self.read, self.interval, self.value = read, interval, 0
        self._stop = threading.Event()
        self._error: BaseException | None = None

    def _sample(self) -> None:
        try:
            while not self._stop.is_set():
                self.value = max(self.value, self.read())
                time.sleep(self.interval)
        except BaseException as error:  # noqa: BLE001 - handed to the main thread
            self._error = error

    def __enter__(self) -> HighWater:
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        if self._error is not None:
            raise RuntimeError("the high-water sampler failed") from self._error
        self.value = max(self.value, self.read())


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = build(args.model)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    largest_layer = max(sum(p.numel() * p.element_size() for p in layer.parameters()) for layer in model.model.layers)
    data = rows(args.n_contexts, args.seq_len, model.config.vocab_size)
    model, optimizer = shard(model, args.engine, args.zero3_reuse_distance)
    gc.collect()
    result = {
        "rank": rank,
        "world_size": dist.get_world_size(),
        "shard": local_shard_bytes(model, args.engine),
        "model": model_bytes,
        "largest_layer": largest_layer,
    }
    # the first estimate on a model runs the one-context check against a plain backward; the second is the
    # measurement as every later one runs
    for arm in ARMS[args.measure]:
        dist.barrier()
        start = time.perf_counter()
        gathered = HighWater(lambda: whole_parameter_bytes(model, args.engine))
        with PeakMemory(torch.device("cpu")) as peak, gathered as hw:
            held = PeakMemory._rss("VmRSS:")
            if args.measure == "spectrum":
                value = top_eigenvalue(model, data, args, optimizer)
            else:
                settings = {"n_draws": args.n_draws, "batch_size": args.batch_size}
                value = estimate_hessian_trace(model, data, across_processes=True, **settings).mean
        result[arm] = {
            "peak": peak.peak,
            "held": held,
            "gathered_max": hw.value,
            "mean": value,
            "seconds": time.perf_counter() - start,
        }
    Path(args.out, f"{args.engine}-{dist.get_world_size()}.rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


ARMS = {"trace": ("first", "steady"), "spectrum": ("steady",)}


def top_eigenvalue(model: torch.nn.Module, data: list[dict], args: argparse.Namespace, optimizer: object) -> float:
    # float32 vectors and few products: the basis (2-3 local vectors) stays small beside the gradients measured
    top = estimate_top_eigenvalues(
        model,
        data,
        k=1,
        matrix="hessian",
        product="finite_difference",
        max_iterations=args.fd_products,
        tol=1e-12,
        batch_size=args.batch_size,
        vector_dtype=torch.float32,
        optimizer=optimizer,
    )
    return top.eigenvalues[0]


def one_process_estimate(args: argparse.Namespace) -> float:
    model = build(args.model)
    data = rows(args.n_contexts, args.seq_len, model.config.vocab_size)
    if args.measure == "spectrum":
        return top_eigenvalue(model, data, args, None)
    return estimate_hessian_trace(model, data, n_draws=args.n_draws, batch_size=args.batch_size).mean


def driver(args: argparse.Namespace) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent), str(HERE)]), OMP_NUM_THREADS="1")
    results = {}
    for engine in args.engines.split(","):
        for n in [int(n) for n in args.processes.split(",")]:
            command = [
                sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(n),
                "--master_port", str(args.port), __file__, "--worker", "--engine", engine,
                *(f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                  if k in ("model", "n_contexts", "seq_len", "n_draws", "batch_size", "out", "zero3_reuse_distance",
                           "measure", "fd_products")),
            ]  # fmt: skip
            completed = subprocess.run(command, env=env, capture_output=True, text=True)
            if completed.returncode != 0:
                print(completed.stderr[-3000:], file=sys.stderr)
                raise SystemExit(f"{engine} with {n} processes failed")
            results[(engine, n)] = [json.loads((out / f"{engine}-{n}.rank{r}.json").read_text()) for r in range(n)]
            print(f"{engine} x{n} done", file=sys.stderr, flush=True)
    reference = one_process_estimate(args)
    mib = 2**20
    first = next(iter(results.values()))[0]
    print(f"model {args.model}: {first['model'] / mib:.0f} MiB of parameters, largest decoder layer "
          f"{first['largest_layer'] / mib:.1f} MiB; {args.n_contexts} contexts x {args.seq_len} tokens, "
          f"measure {args.measure} ({args.n_draws} draws / {args.fd_products} products), batch {args.batch_size}; "
          f"ZeRO-3 reuse distance {args.zero3_reuse_distance}; "
          f"one plain process: {reference:.6g}")  # fmt: skip
    print("arm: first = the first estimate on the model (with its one-context check against a plain backward), "
          "steady = every later one")  # fmt: skip
    print("engine  N  rank  arm     held MiB  shard MiB  gathered max MiB  peak above held MiB  seconds  estimate")
    for (engine, n), ranks in results.items():
        for r in ranks:
            for arm in ARMS[args.measure]:
                a = r[arm]
                print(f"{engine:6} {n:2} {r['rank']:5}  {arm:6} {a['held'] / mib:9.0f} {r['shard'] / mib:10.1f} "
                      f"{a['gathered_max'] / mib:17.1f} {a['peak'] / mib:20.0f} {a['seconds']:8.1f}  "
                      f"{a['mean']:.9g}")  # fmt: skip
    for (engine, n), ranks in results.items():
        gathered = max(r[arm]["gathered_max"] for r in ranks for arm in ARMS[args.measure]) / ranks[0]["model"]
        print(f"gathered_over_model[{engine}:{n}]={gathered:.3f}")
    for (engine, n), ranks in results.items():
        difference = max(abs(r[arm]["mean"] - reference) for r in ranks for arm in ARMS[args.measure])
        print(f"relative_difference[{engine}:{n}]={difference / abs(reference):.2e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", default="fsdp2,zero3")
    parser.add_argument("--processes", default="1,2,4")
    parser.add_argument("--model", default="llama100m", choices=["llama100m", "llama50m"])
    parser.add_argument("--n-contexts", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--n-draws", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--measure", default="trace", choices=list(ARMS))
    parser.add_argument("--fd-products", type=int, default=2, help="--measure spectrum: Lanczos products")
    parser.add_argument("--port", type=int, default=29631)
    parser.add_argument(
        "--zero3-reuse-distance",
        type=int,
        default=0,
        help="ZeRO-3's stage3_max_reuse_distance; DeepSpeed's default, 1e9, keeps a model below 1e9 parameters whole",
    )
    parser.add_argument("--out", default="/tmp/sharded_trace_memory")
    parser.add_argument("--worker", action="store_true", help="internal: one rank of a launched arm")
    parser.add_argument("--engine", default="fsdp2", help="internal: the worker's engine")
    args = parser.parse_args()
    worker(args) if args.worker else driver(args)


if __name__ == "__main__":
    main()
