"""Cost of one critical-sharpness measurement relative to one training step, on a ~15M BERT masked LM, in one run.

A training step is forward + backward + AdamW step on one batch. A measurement is `proposed_update` (one optimizer
step run and undone) plus `estimate_critical_sharpness` on the same batch (forward passes only, default tolerance
1e-3). The first search starts from the learning rate; the later ones from the previous ``eta_c``
(``initial_eta=``), as a callback measuring every N steps would. Training steps and measurements alternate, so load
on a shared machine hits both alike; medians are reported.

A second arm times the measure as the callback and the command line take it
(`hf_flatbias.flatness.beyond_trace.critical_sharpness`: its own gradient on the batch's rows with one labelled
position each, the optimizer's proposed update and the search from the learning rate), interleaved in the same loop.

    python benchmarks/critical_sharpness_cost.py [--quick] [--repeats N] [--zero-stage {1,2,3}]

The last lines are ``critical_sharpness_ratio=X`` (median measurement time / median training-step time),
``measure_ratio=Y`` (the callback's measure, gradient included) and ``paper_search_ratio=Z``: the proposed update plus
a search at the paper's precision warm-started from its own previous ``eta_c`` (`warm_started`), whose passes and
error against the rtol 1e-3 search are printed above it.

``--zero-stage N`` times the same under DeepSpeed ZeRO-N in this one process (AdamW wrapped by the engine): a
training step is the engine's forward, backward and step; the update is `zero_proposed_update` (the ZeRO optimizer's
AdamW stepped on its fp32 master partitions and undone) for the batch's gradient; the measure is the callback's
path. It prints ``zero_proposed_update_ratio=X`` and ``measure_ratio=Y``.
"""

from __future__ import annotations

import os
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from _common import build_model, choose_sizes, masked_lm_rows, timing_parser  # noqa: E402

from hf_flatbias.flatness import estimate_critical_sharpness, proposed_update, warm_started  # noqa: E402
from hf_flatbias.flatness.beyond_trace import critical_sharpness  # noqa: E402
from hf_flatbias.measures import MeasureSettings  # noqa: E402

HEAD_SIZE = 64


def main() -> None:
    parser = timing_parser(__doc__, "a ~3M model and fewer repeats (under a minute)")
    parser.add_argument("--zero-stage", type=int, choices=(1, 2, 3), default=None, help="time under DeepSpeed ZeRO")
    args = parser.parse_args()
    sizes, repeats, _, batch_size = choose_sizes(
        args,
        quick=(dict(hidden=128, layers=2, vocab=8000, seq_len=64), 3, 0, 8),
        full=(dict(hidden=384, layers=6, vocab=8000, seq_len=128), 5, 0, 8),
    )
    model = build_model(**sizes, head_size=HEAD_SIZE)
    n_params = sum(p.numel() for p in model.parameters())
    rows = masked_lm_rows(batch_size * (repeats + 2), sizes["seq_len"], sizes["vocab"])
    batches = [
        {k: torch.stack([r[k] for r in rows[i : i + batch_size]]) for k in rows[0]}
        for i in range(0, len(rows), batch_size)
    ]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if args.zero_stage is not None:
        zero_main(model, optimizer, batches, args.zero_stage, batch_size, n_params)
        return
    model.train()

    def train_step(batch) -> float:
        start = time.perf_counter()
        optimizer.zero_grad()
        model(**batch).loss.backward()
        optimizer.step()
        return time.perf_counter() - start

    for batch in batches[:2]:  # warm-up: allocation, AdamW's state
        train_step(batch)
    forward_times, step_times, update_times, search_times, passes, lambdas = [], [], [], [], [], []
    measure_times, measure_passes = [], []
    paper_passes, paper_errors, paper_times, previous_paper_eta_c = [], [], [], None
    settings = MeasureSettings(critical_batch_size=batch_size)
    previous_eta_c = None
    for batch in batches[2:]:
        start = time.perf_counter()
        with torch.no_grad():
            model(**batch)
        forward_times.append(time.perf_counter() - start)
        optimizer.zero_grad()
        model(**batch).loss.backward()
        start = time.perf_counter()
        proposed = proposed_update(optimizer)
        update_times.append(time.perf_counter() - start)
        result = estimate_critical_sharpness(model, batch, proposed, initial_eta=previous_eta_c)
        previous_eta_c = result.eta_c if result.converged else None
        if previous_paper_eta_c is not None:  # the paper's precision, warm-started from its own previous search
            paper = estimate_critical_sharpness(model, batch, proposed, **warm_started(previous_paper_eta_c))
            paper_passes.append(paper.n_forward_passes)
            paper_errors.append(abs(paper.lambda_c / result.lambda_c - 1))
            paper_times.append(paper.seconds)
            previous_paper_eta_c = paper.eta_c if paper.converged else result.eta_c
        else:
            previous_paper_eta_c = result.eta_c if result.converged else None
        search_times.append(result.seconds)
        passes.append(result.n_forward_passes)
        lambdas.append(result.lambda_c)
        measured = critical_sharpness(
            model, one_label_rows(batch), n_contexts=None, settings=settings, batch_size=batch_size, optimizer=optimizer
        )
        measure_times.append(measured.seconds)
        measure_passes.append(measured.n_forward_passes)
        step_times.append(train_step(batch))
    step = statistics.median(step_times)
    update, search = statistics.median(update_times), statistics.median(search_times[1:] or search_times)
    print(
        f"model: BERT-MLM {n_params / 1e6:.2f}M parameters, batch {batch_size} x {sizes['seq_len']} tokens, AdamW, "
        f"torch threads {torch.get_num_threads()}, {len(step_times)} measurements"
    )
    print(
        f"forward passes per measurement: {passes} (the first from lr, then from the previous eta_c; median of "
        f"the warm-started {statistics.median(passes[1:] or passes)})"
    )
    print(f"lambda_c: {[round(x, 2) for x in lambdas]}")
    print(
        f"median seconds: training step {step:.3f}, no-grad forward {statistics.median(forward_times):.3f}, "
        f"proposed_update {update:.3f}, line search {search:.3f} (warm-started; the first, from lr: "
        f"{search_times[0]:.3f})"
    )
    print(f"proposed_update_ratio={update / step:.3f}")
    print(f"line_search_ratio={search / step:.3f}")
    print(f"critical_sharpness_ratio={(update + search) / step:.3f}")
    print(
        f"measure (callback path: gradient + proposed update + search from lr, one context per row): forward passes "
        f"{measure_passes}, median seconds {statistics.median(measure_times):.3f}"
    )
    print(f"measure_ratio={statistics.median(measure_times) / step:.3f}")
    if paper_passes:
        print(
            f"warm_started (the paper's precision |1 - lo/hi| <= 1/16): forward passes {paper_passes}, error against "
            f"the rtol 1e-3 search {[f'{e:.2g}' for e in paper_errors]}"
        )
        print(f"paper_search_ratio={(update + statistics.median(paper_times)) / step:.3f}")


def zero_main(model, optimizer, batches, stage: int, batch_size: int, n_params: int) -> None:
    """The DeepSpeed arm: training steps, `zero_proposed_update` and the callback's measure, interleaved."""
    for key, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1").items():
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", "29547")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    from hf_flatbias.flatness.parameter_space import parameter_space
    from hf_flatbias.flatness.zero_update import zero_proposed_update

    config = {
        "train_micro_batch_size_per_gpu": batch_size,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
    }
    engine, zero, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)

    def train_step(batch) -> float:
        start = time.perf_counter()
        engine.backward(engine(**batch).loss)
        engine.step()
        return time.perf_counter() - start

    for batch in batches[:2]:  # warm-up: allocation, AdamW's state
        train_step(batch)
    settings = MeasureSettings(critical_batch_size=batch_size)
    step_times, update_times, measure_times, measure_passes = [], [], [], []
    for batch in batches[2:]:
        space = parameter_space(engine.module, zero)
        grads = space.gradient([engine.module(**batch).loss])
        space.release_gathered()
        start = time.perf_counter()
        zero_proposed_update(zero, space, grads)
        update_times.append(time.perf_counter() - start)
        measured = critical_sharpness(
            engine.module, one_label_rows(batch), n_contexts=None, settings=settings, batch_size=batch_size,
            optimizer=zero,
        )  # fmt: skip
        measure_times.append(measured.seconds)
        measure_passes.append(measured.n_forward_passes)
        step_times.append(train_step(batch))
    step = statistics.median(step_times)
    print(
        f"model: BERT-MLM {n_params / 1e6:.2f}M parameters, batch {batch_size}, DeepSpeed ZeRO-{stage} around AdamW, "
        f"1 process, torch threads {torch.get_num_threads()}, {len(step_times)} measurements"
    )
    print(
        f"median seconds: training step {step:.3f}, zero_proposed_update {statistics.median(update_times):.3f}, "
        f"measure {statistics.median(measure_times):.3f} (forward passes {measure_passes})"
    )
    print(f"zero_proposed_update_ratio={statistics.median(update_times) / step:.3f}")
    print(f"measure_ratio={statistics.median(measure_times) / step:.3f}")


def one_label_rows(batch: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """The batch's rows with only their first labelled position kept: one context each, as the measure takes them."""
    rows = []
    for ids, labels in zip(batch["input_ids"], batch["labels"], strict=True):
        first = int((labels != -100).nonzero()[0])
        kept = torch.full_like(labels, -100)
        kept[first] = labels[first]
        rows.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": kept})
    return rows


if __name__ == "__main__":
    main()
