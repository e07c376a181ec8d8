"""The synthetic-experiment library behind recipes/: language set-up, model building, runs, checkpoint evaluation,
matched-loss analysis, plots and result files.

A recipe is a parser and a ``main()`` that put these together (as trl's ``trl/scripts/`` do with ``trl/scripts/
utils.py``); a new experiment adds a recipe, and a module here only for what a second recipe will share. One module
per job: `language` (the language, its contexts, probe tasks and entropy floor), `models` (small BERTs from a config),
`runs` (`RunSpec`, training through `FlatBiasTrainer`), `branches` (anneal-to-evaluate copies of a constant-rate
trunk), `saturation` (KL to the exact conditionals over every position),
`distillation` (reaching the optimum on soft targets), `paper_language` / `paper_probes` /
`protocol` / `verdicts` (the paper-shaped protocol: its fixed material, fixed-width probes, branch measurements and
claim verdicts), `evaluation` (one record per checkpoint:
one-mask loss, Fisher trace, probes), `analysis` (correlations, matched loss, selection by flatness), `results` (JSON
and tables), `plots`, `summary` (results as the markdown tables of docs/), and `arguments` (the synthetic recipes'
flags).
"""

from .analysis import at_common_loss, correlations, flatness_selection, matched_loss, partial_spearman, spearman
from .arguments import (
    add_common_arguments,
    add_paper_protocol_arguments,
    add_target_loss_argument,
    apply_paper_smoke,
    apply_smoke,
    default_output_dir,
    paper_run_spec,
    parse_recipe_arguments,
    run_spec_arguments,
    setup_language_from_args,
    trains_on_cpu,
)
from .branches import BranchEvaluator, anneal_branch, branch_batches, linear_anneal_rates
from .distillation import ConditionalPool, distil_to_saturation, distillation_batches, soft_masked_lm_loss
from .evaluation import (
    CheckpointEvaluator,
    context_batch,
    evaluate_checkpoint,
    features_probe_scores,
    format_record,
    hessian_trace,
    one_mask_loss,
    probe_scores,
)
from .language import LanguageSetup, setup_language
from .models import bert_config, build_model
from .paper_language import MIN_PROBE_WORDS, PaperLanguage, SentenceSet, setup_paper_language
from .paper_probes import (
    REGULARIZATION_GRID,
    encoder_features,
    exact_conditional_features,
    lexical_features,
    mcnemar,
    onehot_position_word,
    probe_all_tasks,
    selected_probe,
    without_predictions,
)
from .plots import plot_branches, plot_runs
from .protocol import measure_branch, reference_rows, train_annealed, train_with_branches
from .results import config_of, final_row, is_main_process, markdown_table, task_accuracies, write_json, write_results
from .runs import RunSpec, train_and_evaluate
from .saturation import SaturationResult, measure_saturation, model_masked_log_probs, saturation
from .summary import summarize
from .verdicts import C1_RULE, c1_verdict, compared_branches, in_progress, saturated_start_c1, t_interval

__all__ = [
    "BranchEvaluator",
    "C1_RULE",
    "CheckpointEvaluator",
    "LanguageSetup",
    "MIN_PROBE_WORDS",
    "PaperLanguage",
    "REGULARIZATION_GRID",
    "RunSpec",
    "SaturationResult",
    "SentenceSet",
    "add_common_arguments",
    "add_paper_protocol_arguments",
    "add_target_loss_argument",
    "anneal_branch",
    "apply_paper_smoke",
    "apply_smoke",
    "at_common_loss",
    "bert_config",
    "branch_batches",
    "build_model",
    "c1_verdict",
    "compared_branches",
    "ConditionalPool",
    "distil_to_saturation",
    "distillation_batches",
    "in_progress",
    "plot_branches",
    "saturated_start_c1",
    "soft_masked_lm_loss",
    "config_of",
    "context_batch",
    "correlations",
    "default_output_dir",
    "encoder_features",
    "evaluate_checkpoint",
    "exact_conditional_features",
    "features_probe_scores",
    "final_row",
    "flatness_selection",
    "format_record",
    "hessian_trace",
    "is_main_process",
    "lexical_features",
    "linear_anneal_rates",
    "markdown_table",
    "matched_loss",
    "mcnemar",
    "measure_branch",
    "measure_saturation",
    "model_masked_log_probs",
    "one_mask_loss",
    "onehot_position_word",
    "parse_recipe_arguments",
    "partial_spearman",
    "plot_runs",
    "probe_all_tasks",
    "probe_scores",
    "reference_rows",
    "run_spec_arguments",
    "saturation",
    "selected_probe",
    "setup_language",
    "setup_language_from_args",
    "paper_run_spec",
    "trains_on_cpu",
    "setup_paper_language",
    "spearman",
    "summarize",
    "t_interval",
    "task_accuracies",
    "train_and_evaluate",
    "train_annealed",
    "train_with_branches",
    "without_predictions",
    "write_json",
    "write_results",
]
