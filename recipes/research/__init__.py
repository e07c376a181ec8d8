"""The research code behind ``recipes/pcfg_saturated_start.py`` (and its GPU driver ``pcfg_protocol_gpu_v1.py``), the
paper-shaped synthetic-language protocol of docs/reproduction/synthetic.md, and behind
``recipes/sam_variants_comparison.py``. It sits beside the recipes, outside the installed package, and builds on
``hf_flatbias`` (trainer, estimators, synthetic languages and their models); the recipes import it as ``research``
(``recipes/`` is first on their path). One module per job:

- `paper_language`: the fixed material of one grammar (training, KL and probe sentences, trace contexts).
- `runs`: `RunSpec`, one training run, its `FlatBiasConfig` fields and its device.
- `saturation`: KL to the exact conditionals over every position, with a bootstrap interval.
- `distillation`: reaching the optimum by training on the exact conditionals (the saturated start).
- `branches`: anneal-to-evaluate copies of a constant-rate trunk.
- `paper_probes`: fixed-width linear probes, their reference rows and paired (McNemar) tests.
- `protocol`: one branch measured (KL, traces, probes) and a trunk trained with its branches, resumable.
- `campaign`: the saturated-start campaign's phases (distilled start, rate pilot, each claim's continued training),
  each resumable from what it left on disk.
- `gate`: the language gate (issue 23): which candidate language distils to the saturated tier, at what cost.
- `claims`: the campaign's result files: each claim's records and recomputed verdict, the C1 plot, markdown.
- `verdicts`: the claims' rules and result file names, the verdicts recomputed from the committed JSON;
  `analysis`: the rank statistics they use.
- `plots`: the figures the recipes draw (into docs/plots/, beside the report pages).
- `deadline`: processes run against a wall-clock deadline (the GPU drivers' budget per command).
- `sam_variants`: the SAM-variants comparison (issue 25): its methods, rule, tiny BERT/Llama runs and verdicts.

The committed results are under ``results/`` here: the campaign's work folder (``results/saturated_start/``: each
claim's JSON, ``campaign_state/``, the checkpoints), the grammar gate, and the earlier research JSON the docs quote.
The models (`hf_flatbias.synthetic.build_model`), the demo's small language and JSON writing
(`hf_flatbias.results.write_json`) are the package's.

A recipe is a parser and a ``main()`` that put these together; what only one recipe needs stays in the recipe. The
names below are the research code's surface; the modules hold more for the recipe and the tests that read them
directly. The earlier protocols' recipes (from-scratch training at matched loss, the grammar gate) were retired with
the code only they used; docs/reproduction/synthetic.md names the commit that still has them.
"""

from .distillation import ConditionalPool, distil_to_saturation, distillation_batches, soft_masked_lm_loss
from .paper_language import MIN_PROBE_WORDS, PaperLanguage, setup_paper_language
from .paper_probes import mcnemar, onehot_position_word, without_predictions
from .protocol import measure_branch, reference_rows, train_with_branches
from .runs import RunSpec, trains_on_cpu
from .saturation import SaturationResult, measure_saturation
from .verdicts import C1_RULE, c1_verdict, saturated_start_c1

__all__ = [
    "C1_RULE",
    "ConditionalPool",
    "MIN_PROBE_WORDS",
    "PaperLanguage",
    "RunSpec",
    "SaturationResult",
    "c1_verdict",
    "distil_to_saturation",
    "distillation_batches",
    "measure_branch",
    "measure_saturation",
    "mcnemar",
    "onehot_position_word",
    "reference_rows",
    "saturated_start_c1",
    "setup_paper_language",
    "soft_masked_lm_loss",
    "train_with_branches",
    "trains_on_cpu",
    "without_predictions",
]
