"""GLUE metrics as an ``evaluate`` module that works without the Hugging Face Hub.

``evaluate.load("glue", task)`` fetches its script from the Hub; this module computes the same numbers with
scikit-learn and scipy so that ``hf_flatbias.glue.load_glue_metric`` still works offline. The task is the module's
``config_name``, exactly as with the Hub's ``glue`` metric.
"""

from __future__ import annotations

import datasets
import evaluate
import numpy as np
from scipy.stats import pearsonr, spearmanr
from sklearn.metrics import f1_score, matthews_corrcoef

_DESCRIPTION = """\
Metrics of the GLUE benchmark (Wang et al., 2019): Matthews correlation for CoLA, Pearson and Spearman
correlations for STS-B, accuracy and F1 for MRPC and QQP, accuracy for every other task.
"""

_CITATION = """\
@inproceedings{wang2019glue,
  title={{GLUE}: A Multi-Task Benchmark and Analysis Platform for Natural Language Understanding},
  author={Wang, Alex and Singh, Amanpreet and Michael, Julian and Hill, Felix and Levy, Omer and Bowman, Samuel R.},
  booktitle={International Conference on Learning Representations},
  year={2019}
}
"""

_INPUTS_DESCRIPTION = """\
Args:
    predictions: predicted labels (class ids; real-valued scores for stsb).
    references: gold labels (class ids; real-valued scores for stsb).
Returns, by task (the config name):
    cola: {"matthews_correlation"}
    stsb: {"pearson", "spearmanr"}
    mrpc, qqp: {"accuracy", "f1"}
    sst2, mnli, mnli_matched, mnli_mismatched, qnli, rte, wnli, hans: {"accuracy"}
Example:
    >>> metric = evaluate.load("hf_flatbias/metrics/glue", "mrpc")
    >>> metric.compute(predictions=[0, 1, 1], references=[0, 1, 0])
    {'accuracy': 0.6666666666666666, 'f1': 0.6666666666666666}
"""

# Same config names as the Hub's glue metric, so code written for one runs against the other.
ACCURACY_TASKS = ("sst2", "mnli", "mnli_mismatched", "mnli_matched", "qnli", "rte", "wnli", "hans")
ACCURACY_F1_TASKS = ("mrpc", "qqp")
CORRELATION_TASKS = ("stsb",)
MATTHEWS_TASKS = ("cola",)
GLUE_METRIC_CONFIGS = ACCURACY_TASKS + ACCURACY_F1_TASKS + CORRELATION_TASKS + MATTHEWS_TASKS


def _accuracy(predictions: np.ndarray, references: np.ndarray) -> float:
    return float((predictions == references).mean())


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _INPUTS_DESCRIPTION)
class Glue(evaluate.Metric):
    """The GLUE metric of one task (``config_name``)."""

    def _info(self) -> evaluate.MetricInfo:
        if self.config_name not in GLUE_METRIC_CONFIGS:
            raise KeyError(
                f"Unknown GLUE task {self.config_name!r}: pass one of {list(GLUE_METRIC_CONFIGS)} as the config name."
            )
        value_type = "float32" if self.config_name in CORRELATION_TASKS else "int64"
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_INPUTS_DESCRIPTION,
            features=datasets.Features(
                {"predictions": datasets.Value(value_type), "references": datasets.Value(value_type)}
            ),
            codebase_urls=[],
            reference_urls=["https://gluebenchmark.com/"],
            format="numpy",
        )

    def _compute(self, predictions, references) -> dict[str, float]:
        predictions = np.asarray(predictions)
        references = np.asarray(references)
        if self.config_name in MATTHEWS_TASKS:
            return {"matthews_correlation": float(matthews_corrcoef(references, predictions))}
        if self.config_name in CORRELATION_TASKS:
            return {
                "pearson": float(pearsonr(predictions, references)[0]),
                "spearmanr": float(spearmanr(predictions, references)[0]),
            }
        if self.config_name in ACCURACY_F1_TASKS:
            return {
                "accuracy": _accuracy(predictions, references),
                "f1": float(f1_score(y_true=references, y_pred=predictions)),
            }
        return {"accuracy": _accuracy(predictions, references)}
