"""hf_flatbias: flatness (the Hessian trace of the pre-training loss) as a training and evaluation signal."""

from .config import FlatBiasConfig
from .trainer import FlatBiasTrainer

__version__ = "0.1.0"

__all__ = ["FlatBiasConfig", "FlatBiasTrainer", "__version__"]
