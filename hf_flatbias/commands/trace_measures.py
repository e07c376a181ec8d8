"""``hf-flatbias trace --measures``: the flags, checks, computation and printed lines of the measures beyond the trace,
each read from `hf_flatbias.measures.MEASURE_TABLE` (the parser stays torch-free: the functions load on use)."""

from __future__ import annotations

import argparse
import dataclasses
import math
from typing import Any

from ..constants import ADAM_PRECONDITIONED
from ..measures import (
    EXTRA_MEASURES,
    MEASURE_TABLE,
    MEASURES,
    MeasureSettings,
    check_required_settings,
    needs_downstream_task,
)


def measure_list(text: str) -> tuple[str, ...]:
    """``--measures``: a comma-separated list of `MEASURES`."""
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    unknown = [name for name in names if name not in MEASURES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"{text!r}: choose a comma-separated list of {', '.join(MEASURES)}.")
    return names


def add_measure_arguments(parser: argparse.ArgumentParser) -> None:
    """``--measures`` and one flag per `MeasureSettings` field (``--noise-sigmas`` for ``noise_sigmas``...)."""
    described = "; ".join(f"{spec.name}: {spec.help}" for spec in MEASURE_TABLE.values())
    parser.add_argument(
        "--measures",
        type=measure_list,
        default=("trace",),
        help=f"Comma-separated measures to take, of {','.join(MEASURES)} (default: trace). {described}. Each is "
        "written with its standard error and settings.",
    )
    for item in dataclasses.fields(MeasureSettings):
        parser.add_argument(
            "--" + item.name.replace("_", "-"),
            dest=item.name,
            type=item.metadata["parse"],
            default=item.default,
            choices=list(item.metadata["choices"]) if item.metadata.get("choices") else None,
            help=item.metadata["help"],
        )


def check_measure_arguments(args: argparse.Namespace) -> MeasureSettings:
    """The measures' settings of the flags, or `ValueError` naming the flag; a setting a chosen measure needs
    (forgetting's task, and for a GLUE task a place to read it from) is checked here too, before anything loads."""
    try:
        settings = MeasureSettings.from_namespace(args)
        check_required_settings(getattr(args, "measures", ()), settings)
    except ValueError as error:
        name = str(error).split("=")[0].split(" ")[0]
        raise ValueError(f"--{name.replace('_', '-')}: {error}") from None
    measures = getattr(args, "measures", ())
    for item in dataclasses.fields(MeasureSettings):
        if getattr(args, item.name, item.default) == item.default:
            continue
        # a flag no requested measure reads would be ignored without a word
        owners = [spec.name for spec in MEASURE_TABLE.values() if item.name in spec.settings]
        if owners and not any(owner in measures for owner in owners):
            flag = "--" + item.name.replace("_", "-")
            raise ValueError(
                f"{flag} is a setting of {' and '.join(owners)}, which --measures does not name: add {owners[0]} "
                f"to --measures (e.g. --measures trace,{owners[0]}), or drop {flag}."
            )
    measures = [MEASURE_TABLE[name] for name in getattr(args, "measures", ()) if name in MEASURE_TABLE]
    reads_matrix = any("eigenvalue_matrix" in spec.settings for spec in measures)
    if reads_matrix and settings.eigenvalue_matrix == ADAM_PRECONDITIONED:
        raise ValueError(
            f"--eigenvalue-matrix {ADAM_PRECONDITIONED} needs the Adam state of the run, which the command line does "
            "not load; measure it in training (HessianTraceCallback(eigenvalue_matrix='adam_preconditioned')) or "
            "call estimate_top_eigenvalues(..., optimizer=), or choose hessian or fisher."
        )
    if needs_downstream_task(getattr(args, "measures", ())):
        from ..glue.tasks import GLUE_TASKS

        if settings.forgetting_task in GLUE_TASKS:
            from ..glue.data import glue_data_source

            try:
                glue_data_source(settings.forgetting_task)
            except ValueError:
                raise ValueError(
                    f"--forgetting-task {settings.forgetting_task}: this GLUE task needs the Hugging Face Hub (unset "
                    "HF_HUB_OFFLINE, check the network; only sst2 has an offline stand-in), or pass a file or "
                    "save_to_disk folder of its rows."
                ) from None
    return settings


def load_measure_task(args: argparse.Namespace, model: Any, tokenizer: Any, seed: int) -> Any:
    """Forgetting's downstream task (`load_forgetting_task`) when ``--measures`` takes forgetting, else ``None``:
    loaded and tokenized before anything is measured, so that bad task data fails first."""
    if not needs_downstream_task(args.measures):
        return None
    from ..flatness.forgetting_task import load_forgetting_task
    from ..flatness.lm import output_vocab_size
    from ..glue.tasks import DEFAULT_MAX_LENGTH
    from .trace_inputs import token_limit

    settings = check_measure_arguments(args)
    try:
        return load_forgetting_task(
            settings.forgetting_task,
            tokenizer=tokenizer,
            label_column=settings.forgetting_label_column,
            n_train=settings.forgetting_train_rows,
            n_eval=settings.forgetting_eval_rows,
            seed=seed,
            max_length=token_limit(DEFAULT_MAX_LENGTH, model.config),
            vocab_size=output_vocab_size(model),
        )
    except ValueError as error:
        raise ValueError(f"--forgetting-task {settings.forgetting_task}: {error}") from None


def measures_beyond_trace(
    args: argparse.Namespace, model: Any, contexts: Any, n_contexts: int | None, causal: bool, task: Any = None
) -> dict[str, Any]:
    """Each measure of ``args.measures`` beyond the trace: its result under the entry's ``result_key`` and its
    record (value, standard error, settings) under ``measures``. ``critical_sharpness`` has no optimizer here: it
    searches along the negative gradient (plain gradient descent). ``task``: forgetting's (`load_measure_task`)."""
    settings = check_measure_arguments(args)
    results: dict[str, Any] = {}
    records: dict[str, Any] = {}
    for name in EXTRA_MEASURES:
        if name not in args.measures:
            continue
        spec = MEASURE_TABLE[name]
        result = spec.function()(
            model,
            contexts,
            n_contexts=n_contexts,
            settings=settings,
            seed=args.seed,
            batch_size=args.batch_size,
            causal=causal,
            optimizer=None,
            task=task,
        )
        results[spec.result_key] = result.to_dict()
        records[name] = spec.record(result)
        check_finite_record(name, records[name])
    if records:
        results["measures"] = records
    return results


def check_finite_record(name: str, record: dict[str, Any]) -> None:
    """`ValueError` saying why, for a measure whose value is not a finite number: written as ``nan`` with exit 0 it
    would read as a measurement."""
    value = record.get("value")
    if value is not None and math.isfinite(value):
        return
    base = record.get("base_loss")
    if base is not None and not math.isfinite(base):
        why = (
            f"the loss of the checkpoint itself is {base} on these contexts: its weights or the data give non-finite "
            "logits; check the checkpoint (a diverged run) and the data"
        )
    elif name == "relative_critical_sharpness":
        why = (
            f"every one of its {record.get('n_batches', '?')} downstream steps raised the pre-training loss at once: "
            "the fine-tuning direction goes uphill on it from the first step, so no critical step size exists; "
            "read forgetting instead, or a smaller --forgetting-batch-size"
        )
    elif name == "weight_noise":
        sigmas, means = record.get("sigmas") or [record.get("sigma")], record.get("means") or [value]
        sigma = next((s for s, m in zip(sigmas, means, strict=False) if m is None or not math.isfinite(m)), sigmas[-1])
        why = (
            f"the loss under noise of sigma={sigma:g} ({record.get('scale', '?')}) overflows the model's forward; "
            "lower --noise-sigmas"
        )
    else:
        why = "a loss it takes is not finite; check the checkpoint (a diverged run?) and the data"
    raise ValueError(f"{name} came out {value}: {why}.")


def contexts_fingerprint(contexts: Any, n_contexts: int | None) -> str:
    """A SHA-256 of the contexts measured (their ids, masks and labels), so that rows of a series can be checked to
    share them."""
    import hashlib

    digest = hashlib.sha256()
    for row in contexts:
        for key in ("input_ids", "attention_mask", "labels"):
            if key in row:
                values = row[key].tolist() if hasattr(row[key], "tolist") else list(row[key])
                digest.update(f"{key}:{values};".encode())
    digest.update(f"n={n_contexts}".encode())
    return digest.hexdigest()


def measure_lines(result: dict[str, Any]) -> list[str]:
    """One printed line per measure beyond the trace in ``result``: value ± standard error, settings, seconds."""
    from ..modelcard.formatting import measure_text

    lines = []
    for name, record in (result.get("measures") or {}).items():
        spec = MEASURE_TABLE[name]
        seconds = f" ({record['seconds']:.1f} s)" if "seconds" in record else ""
        lines.append(f"{spec.title(record)}: {measure_text(name, record)}{seconds}")
    return lines
