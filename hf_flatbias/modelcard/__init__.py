"""Flatness model cards: what a checkpoint's flatness was, written into its README.md and read back.

A card carries, for people, a summary rendered from ``flatness_card.md`` (beside this package's modules) and, for
programs, two metadata blocks in the README's YAML front matter:

- ``model-index``: [`huggingface_hub.EvalResult`] entries, the Hub's standard place for results, under the task that
  was trained. The trace is a metric of type ``hessian_trace`` (its standard error, estimator settings, objective
  and parameter count in the metric's ``args``), next to the loss (type ``loss``) and any GLUE results;
- ``flatness``: the same numbers flat and typed (``hessian_trace``, ``hessian_trace_stderr``, ``trace_step``,
  ``estimator``, ``n_contexts``, ``n_draws``, ``method`` and the hyperparameters that method reads,
  ``pretraining_loss``...), which [`load_flatness_card`] reads. Keys without a value are left out. ``objective``
  says what was trained (pre-training ``masked_lm``/``causal_lm``, SFT, DPO: `objective.what_was_trained` decides)
  and so names the task and the loss (its key too: ``pretraining_loss``, ``sft_loss`` or ``dpo_loss``; cards written
  before say ``pretraining_loss`` whatever they trained, and are read as they are),
  ``trace_objective`` what the trace's contexts predict, ``trainable_parameters`` (beside ``num_parameters``) the
  parameters the trace covers and ``adapter`` the PEFT method; a card without them reads them as unknown.
  Measures beyond the trace, when taken, are one mapping each (``top_eigenvalue``, ``sam_sharpness``) holding the
  ``value``, its settings and the ``step`` it was measured at.

Each field of [`FlatnessCard`] is declared once with its schema (`schema.card_field`: block, key, writer, reader,
check); the ``flatness:`` block, the Hub metadata and the reader are generated from those declarations. The
methods and the hyperparameters each one reads come from `hf_flatbias.constants`
(``FLATNESS_METHOD_HYPERPARAMETERS``), so a card exists for every method the trainer runs and records exactly what
that method used. Nothing here imports torch, transformers or the Trainer.
"""

from .card import HESSIAN_TRACE_METRIC, METHOD_HYPERPARAMETERS, PAPER_CITATION, FlatnessCard
from .formatting import METHOD_TITLES, format_comparison_table, measure_summaries
from .from_trainer import flatness_card_from_trainer, measure_record
from .loading import add_glue_results, load_flatness_card

__all__ = [
    "FlatnessCard",
    "add_glue_results",
    "HESSIAN_TRACE_METRIC",
    "METHOD_HYPERPARAMETERS",
    "METHOD_TITLES",
    "PAPER_CITATION",
    "flatness_card_from_trainer",
    "format_comparison_table",
    "load_flatness_card",
    "measure_record",
    "measure_summaries",
]
