"""The records of the measures beyond the trace: each result turned into the card's record (its value, standard error
and settings), and the record put in words for the card and ``compare``. `hf_flatbias.measures.MEASURE_TABLE` names
one of each per measure; torch-free, as the table is."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any


def _finite(value: Any) -> float | None:
    value = float(value)
    return value if math.isfinite(value) else None


def _drop_none(record: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in record.items() if value is not None}


def join_parts(*parts: str | None) -> str:
    return ", ".join(part for part in parts if part)


def eigenvalue_record(result: Any) -> dict[str, Any]:
    return _drop_none(
        {
            "value": float(result.eigenvalues[0]),
            "residual": float(result.residuals[0]),
            "matrix": result.matrix,
            "k": len(result.eigenvalues),
            "eigenvalues": [float(v) for v in result.eigenvalues] if len(result.eigenvalues) > 1 else None,
            "n_contexts": int(result.n_contexts),
            "n_matvecs": int(result.n_matvecs),
            "product": getattr(result, "product", None),
            "seconds": float(result.seconds),
        }
    )


def sam_record(result: Any) -> dict[str, Any]:
    return _drop_none(
        {
            "value": float(result.mean),
            "stderr": _finite(result.stderr),
            "rho": float(result.rho),
            "adaptive": bool(result.adaptive),
            "batch_size": int(result.batch_size),
            "n_contexts": int(result.n_contexts),
            "seconds": float(result.seconds),
        }
    )


def noise_record(result: Any) -> dict[str, Any]:
    headline = result.points[-1]
    several = len(result.points) > 1
    return _drop_none(
        {
            "value": float(headline.mean),
            "stderr": _finite(headline.stderr),
            "sigma": float(headline.sigma),
            "scale": result.scale,
            "antithetic": bool(result.antithetic),
            "n_draws": int(result.n_draws),
            "seed": int(result.seed),
            "base_loss": float(result.base_loss),
            "n_contexts": int(result.n_contexts),
            "seconds": float(result.seconds),
            "sigmas": [float(p.sigma) for p in result.points] if several else None,
            "means": [float(p.mean) for p in result.points] if several else None,
            "stderrs": [_finite(p.stderr) for p in result.points] if several else None,
        }
    )


def quantization_record(result: Any) -> dict[str, Any]:
    headline = result.points[-1]
    several = len(result.points) > 1
    return _drop_none(
        {
            "value": float(headline.loss_increase),
            "stderr": _finite(headline.stderr),
            "bits": int(headline.bits),
            "granularity": result.granularity,
            "group_size": result.group_size,
            "include_embeddings": bool(result.include_embeddings),
            "relative_weight_error": float(headline.relative_weight_error),
            "base_loss": float(result.base_loss),
            "n_contexts": int(result.n_contexts),
            "seconds": float(result.seconds),
            "bit_widths": [int(p.bits) for p in result.points] if several else None,
            "increases": [float(p.loss_increase) for p in result.points] if several else None,
            "stderrs": [_finite(p.stderr) for p in result.points] if several else None,
        }
    )


def critical_record(result: Any) -> dict[str, Any]:
    return _drop_none(
        {
            "value": float(result.mean),
            "stderr": _finite(result.stderr),
            "direction": result.direction,
            "learning_rate": _finite(result.learning_rate) if result.learning_rate is not None else None,
            "rtol": float(result.rtol),
            "batch_size": int(result.batch_size),
            "n_batches": int(result.n_batches),
            "n_converged": int(result.n_converged),
            "n_forward_passes": int(result.n_forward_passes),
            "n_contexts": int(result.n_contexts),
            "seconds": float(result.seconds),
        }
    )


def spectrum_shape_record(result: Any) -> dict[str, Any]:
    return _drop_none(
        {
            "value": float(result.alpha),
            "stderr": _finite(result.alpha_stderr),
            "r_squared": float(result.r_squared),
            "log_scale": float(result.log_scale),
            "n_fitted": int(result.n_fitted),
            "matrix": result.matrix,
            "k": int(result.k),
            "eigenvalues": [float(v) for v in result.eigenvalues],
            "n_contexts": int(result.n_contexts),
            "n_matvecs": int(result.n_matvecs),
            "converged": bool(result.converged),
            "seconds": float(result.seconds),
        }
    )


def spectrum_shape_details(record: Mapping[str, Any]) -> str:
    return join_parts(
        f"the {record['n_fitted']} largest positive {record.get('matrix', '')} eigenvalues".replace("  ", " ")
        if "n_fitted" in record
        else None,
        f"R² {record['r_squared']:.3f}" if "r_squared" in record else None,
        "the error is the fit's, not over contexts",
        "Lanczos not converged" if record.get("converged") is False else None,
    )


def alignment_record(result: Any) -> dict[str, Any]:
    return _drop_none(
        {
            "value": float(result.mean),
            "stderr": _finite(result.stderr),
            "column": result.column,
            "n_sources": len(result.sources),
            "sources": [str(s) for s in result.sources],
            "contexts_per_source": [int(n) for n in result.contexts_per_source],
            "pair_cosines": [float(c) for c in result.pair_cosines],
            "n_blocks": int(result.n_blocks),
            "n_contexts": int(result.n_contexts),
            "batch_size": int(result.batch_size),
            "seconds": float(result.seconds),
        }
    )


def alignment_details(record: Mapping[str, Any]) -> str:
    sources = record.get("sources")
    return join_parts(
        f"sources from {record['column']!r}" if "column" in record else None,
        f"{len(sources)} sources ({', '.join(map(str, sources[:6]))}{', ...' if len(sources) > 6 else ''})"
        if isinstance(sources, list)
        else None,
        f"jackknife over {record['n_blocks']} blocks a source" if "n_blocks" in record else None,
    )


def relative_critical_record(result: Any) -> dict[str, Any]:
    return _drop_none(
        {
            "value": float(result.mean),  # nan when every step raised the pre-training loss: logged, not carded
            "stderr": _finite(result.stderr),
            "task": result.task,
            "optimizer": result.optimizer,
            "learning_rate": float(result.learning_rate),
            "rtol": float(result.rtol),
            "batch_size": int(result.batch_size),
            "downstream_batch_size": int(result.downstream_batch_size),
            "n_batches": int(result.n_batches),
            "n_converged": int(result.n_converged),
            "n_rose_at_once": int(result.n_rose_at_once),
            "n_forward_passes": int(result.n_forward_passes),
            "seed": int(result.seed),
            "n_contexts": int(result.n_contexts),
            "seconds": float(result.seconds),
        }
    )


def relative_critical_details(record: Mapping[str, Any]) -> str:
    rose = record.get("n_rose_at_once")
    return join_parts(
        f"along a fresh {record['optimizer']}'s first step on {record.get('task', '?')}"
        if "optimizer" in record
        else None,
        f"downstream batches of {record['downstream_batch_size']}" if "downstream_batch_size" in record else None,
        f"{rose}/{record['n_batches']} steps raised the pre-training loss at once (left out)"
        if rose and "n_batches" in record
        else None,
    )


def _grid(values: Any, means: Any, stderrs: Any, headline: Any, label: Any) -> str | None:
    """The points of a grid other than the headline one, ``label(value): mean ± stderr`` each; ``None`` without one."""
    if not isinstance(values, list) or not isinstance(means, list) or len(values) < 2:
        return None
    stderrs = stderrs if isinstance(stderrs, list) and len(stderrs) == len(values) else [None] * len(values)
    parts = [
        f"{label(value)}: {mean:.4g}" + (f" ± {stderr:.2g}" if stderr is not None else "")
        for value, mean, stderr in zip(values, means, stderrs, strict=False)
        if value != headline and mean is not None
    ]
    return "; ".join(parts) or None


def noise_details(record: Mapping[str, Any]) -> str:
    draws = record.get("n_draws")
    return join_parts(
        f"sigma = {record['sigma']:g}" if "sigma" in record else None,
        f"{record['scale']} noise" if "scale" in record else None,
        f"{draws} {'antithetic ' if record.get('antithetic') else ''}draws" if draws is not None else None,
        f"seed {record['seed']}" if "seed" in record else None,
        _grid(record.get("sigmas"), record.get("means"), record.get("stderrs"), record.get("sigma"),
              lambda sigma: f"at sigma {sigma:g}"),
    )  # fmt: skip


def quantization_describe(record: Mapping[str, Any]) -> str:
    groups = f"groups of {record['group_size']}" if "group_size" in record else None
    return join_parts(f"{record.get('bits', '?')} bit", groups or str(record.get("granularity", "?")).replace("_", "-"))


def quantization_details(record: Mapping[str, Any]) -> str:
    return join_parts(
        f"{record['bits']} bit" if "bits" in record else None,
        f"groups of {record['group_size']}"
        if "group_size" in record
        else str(record.get("granularity", "")).replace("_", "-") or None,
        "embeddings kept" if record.get("include_embeddings") is False else None,
        _grid(record.get("bit_widths"), record.get("increases"), record.get("stderrs"), record.get("bits"),
              lambda bits: f"at {bits} bit"),
    )  # fmt: skip


def forgetting_record(result: Any) -> dict[str, Any]:
    trace_before, trace_after = result.trace_before, result.trace_after
    return _drop_none(
        {
            "value": float(result.forgetting),
            "stderr": _finite(result.stderr),
            "task": result.task,
            "label_column": result.label_column,
            "steps": int(result.steps),
            "learning_rate": float(result.learning_rate),
            "batch_size": int(result.batch_size),
            "optimizer": result.optimizer,
            "weight_decay": float(result.weight_decay),
            "seed": int(result.seed),
            "num_labels": int(result.num_labels),
            "lm_loss_before": float(result.lm_loss_before),
            "lm_loss_after": float(result.lm_loss_after),
            "accuracy_before": float(result.accuracy_before),
            "accuracy_before_stderr": _finite(result.accuracy_before_stderr),
            "accuracy_after": float(result.accuracy_after),
            "accuracy_after_stderr": _finite(result.accuracy_after_stderr),
            "accuracy_on": result.accuracy_on,
            "n_task_rows": int(result.n_task_rows),
            "n_eval_rows": int(result.n_eval_rows),
            "trace_before": None if trace_before is None else float(trace_before.mean),
            "trace_before_stderr": None if trace_before is None else _finite(trace_before.stderr),
            "trace_after": None if trace_after is None else float(trace_after.mean),
            "trace_after_stderr": None if trace_after is None else _finite(trace_after.stderr),
            "trace_n_draws": None if trace_before is None else int(trace_before.n_draws),
            "n_contexts": int(result.n_contexts),
            "seconds": float(result.seconds),
        }
    )


def _plus_minus(record: Mapping[str, Any], key: str, digits: str = ".4g") -> str:
    stderr = record.get(f"{key}_stderr")
    return f"{record[key]:{digits}}" + (f" ± {stderr:.2g}" if stderr is not None else "")


def forgetting_details(record: Mapping[str, Any]) -> str:
    steps = (
        f"{record['steps']} {record.get('optimizer', '')} steps".replace("  ", " ")
        + (f" at lr {record['learning_rate']:g}" if "learning_rate" in record else "")
        + (f" in batches of {record['batch_size']}" if "batch_size" in record else "")
        if "steps" in record
        else None
    )
    rows = "validation" if record.get("accuracy_on") == "eval_rows" else "training"
    accuracy = (
        f"accuracy {_plus_minus(record, 'accuracy_before', '.3f')} -> {_plus_minus(record, 'accuracy_after', '.3f')}"
        + (f" on {record['n_eval_rows']} {rows} rows" if "n_eval_rows" in record else "")
        if "accuracy_after" in record and "accuracy_before" in record
        else None
    )
    trace = (
        f"Fisher trace {_plus_minus(record, 'trace_before')} -> {_plus_minus(record, 'trace_after')}"
        if "trace_before" in record and "trace_after" in record
        else None
    )
    loss = (
        f"loss {record['lm_loss_before']:.4g} -> {record['lm_loss_after']:.4g}"
        if "lm_loss_before" in record and "lm_loss_after" in record
        else None
    )
    return join_parts(_task_name(record), steps, loss, accuracy, trace)


def _task_name(record: Mapping[str, Any]) -> str | None:
    task = record.get("task")
    if task is None:
        return None
    column = record.get("label_column")
    return f"{task} ({column})" if column not in (None, "label") else str(task)


def forgetting_describe(record: Mapping[str, Any]) -> str:
    accuracy = f"acc {_plus_minus(record, 'accuracy_after', '.3f')}" if "accuracy_after" in record else None
    steps = f"{record['steps']} steps" if "steps" in record else None
    return join_parts(_task_name(record) or "?", steps, accuracy)
