"""The flatness methods, one module each, and the one table that names them.

A method is a `FlatnessMethod` subclass: its ``training_step`` runs one micro-batch's passes, and its
``state_dict``/``load_state_dict`` carry what it remembers between updates through checkpoints. It takes its numbers
from `hf_flatbias.sharpness` and `hf_flatbias.tensors` and reaches the trainer only through `FlatnessHost`, so the
same class runs inside `Trainer` and trl's trainers alike.

A new method is a module here plus one line in ``FLATNESS_METHOD_CLASSES``; its name and the hyperparameters it reads
go in `hf_flatbias.constants.FLATNESS_METHOD_HYPERPARAMETERS`, which model cards read without torch (a test checks
that the two tables name the same methods).
"""

from .base import FlatnessHost, FlatnessMethod, NoFlatnessMethod
from .fisher_penalty import FisherPenalty
from .grad_norm_penalty import GradNormPenalty
from .looksam import LookSam
from .sam import SamFamily

FLATNESS_METHOD_CLASSES: dict[str, type[FlatnessMethod]] = {
    "none": NoFlatnessMethod,
    "sam": SamFamily,
    "asam": SamFamily,
    "functional_sam": SamFamily,
    "looksam": LookSam,
    "fisher_penalty": FisherPenalty,
    "grad_norm_penalty": GradNormPenalty,
}

__all__ = ["FLATNESS_METHOD_CLASSES", "FlatnessHost", "FlatnessMethod"]
