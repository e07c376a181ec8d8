"""One module per flatness method's training step, as `FlatnessTrainerMixin.training_step` dispatches them.

A step is a function ``step(trainer, model, inputs, num_items_in_batch) -> loss at w`` that runs the method's two
passes over one micro-batch. It takes its numbers from `hf_flatbias.sharpness` and `hf_flatbias.tensors` and
reaches the host trainer only through the mixin's pass helpers (``_start_step``, ``_scaled_loss``, ``_backward``,
``_first_gradient``, ``_host_metrics_suspended``, the ``_record_*`` logging), so the same step runs inside
`Trainer` and trl's trainers alike.
"""

from .fisher_penalty import SampledLabelSource, fisher_penalty_step
from .grad_norm_penalty import grad_norm_penalty_step
from .looksam import LookSamState, looksam_step
from .sam import BatchScopeSam, sam_step

__all__ = [
    "BatchScopeSam",
    "LookSamState",
    "SampledLabelSource",
    "fisher_penalty_step",
    "grad_norm_penalty_step",
    "looksam_step",
    "sam_step",
]
