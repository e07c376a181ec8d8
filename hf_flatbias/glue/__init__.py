"""GLUE: metrics through ``evaluate``, data through ``datasets``, and fine-tuning of checkpoints over several seeds.

Everything works offline: the metric falls back to an ``evaluate`` module shipped in this package
(``hf_flatbias/metrics/glue``), the data to local files, and SST-2 to a stand-in of Rotten Tomatoes review snippets
(the source SST-2 was built from). Nothing touches the network unless the Hub is reachable and ``HF_HUB_OFFLINE`` is
unset, and then only with short time-outs.

Modules: `tasks` (the registry and the fine-tuning modes), `data` (datasets, metrics, checks), `models` (classifier
and linear probe), `finetune` (`finetune_glue`), `compare` (checkpoints side by side) and `report` (its files).
"""

from typing import TYPE_CHECKING

from ..lazy_imports import lazy_module_attributes
from .tasks import (
    FINETUNE_MODES,
    GLUE_TASKS,
    LINEAR_PROBE_MODES,
    GlueTask,
    get_glue_task,
    parse_glue_tasks,
    resolve_finetune_mode,
)

if TYPE_CHECKING:
    from ..hub import hub_is_reachable
    from ..stats import Interval, mean_interval, paired_difference
    from .data import (
        GLUE_HUB_DATASET,
        LOCAL_GLUE_METRIC_PATH,
        check_labels,
        check_task_text_fits_tokenizer,
        load_glue_dataset,
        load_glue_metric,
    )
    from .finetune import GlueArguments, GlueConfig, GlueResult, finetune_glue
    from .models import LinearProbeClassifier, freeze_all_but, load_classifier, load_tokenizer, probe_parameter_names

# Only the task registry loads with the package: the command line builds its parser and rejects a bad task name
# before torch (models) or transformers (finetune: GlueConfig is a TrainingArguments) is imported.
_MODULE_OF_NAME = {
    **dict.fromkeys(("Interval", "mean_interval", "paired_difference"), "..stats"),
    "hub_is_reachable": "..hub",
    **dict.fromkeys(
        (
            "GLUE_HUB_DATASET",
            "LOCAL_GLUE_METRIC_PATH",
            "check_labels",
            "check_task_text_fits_tokenizer",
            "load_glue_dataset",
            "load_glue_metric",
        ),
        ".data",
    ),
    **dict.fromkeys(("GlueArguments", "GlueConfig", "GlueResult", "finetune_glue"), ".finetune"),
    **dict.fromkeys(
        ("LinearProbeClassifier", "freeze_all_but", "load_classifier", "load_tokenizer", "probe_parameter_names"),
        ".models",
    ),
}
_SUBMODULES = ("compare", "data", "finetune", "models", "report", "tasks")

__getattr__, __dir__ = lazy_module_attributes(__name__, _MODULE_OF_NAME, _SUBMODULES)

__all__ = [
    "FINETUNE_MODES",
    "GLUE_HUB_DATASET",
    "GLUE_TASKS",
    "LINEAR_PROBE_MODES",
    "LOCAL_GLUE_METRIC_PATH",
    "GlueArguments",
    "GlueConfig",
    "GlueResult",
    "GlueTask",
    "Interval",
    "LinearProbeClassifier",
    "check_labels",
    "check_task_text_fits_tokenizer",
    "finetune_glue",
    "freeze_all_but",
    "get_glue_task",
    "hub_is_reachable",
    "load_classifier",
    "load_glue_dataset",
    "load_glue_metric",
    "load_tokenizer",
    "mean_interval",
    "paired_difference",
    "parse_glue_tasks",
    "probe_parameter_names",
    "resolve_finetune_mode",
]
