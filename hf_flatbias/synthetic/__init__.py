"""Synthetic languages with exact conditionals (PCFG, HMM, Dyck), their datasets and downstream tasks, and the small
BERT masked LMs trained on them."""

from .data import (
    MaskedWordCollator,
    OracleMLM,
    build_dyck_dataset,
    build_hmm_dataset,
    build_pcfg_dataset,
    context_word_ids,
    entropy_bound,
    masked_contexts,
    sentences_to_dataset,
    target_conditionals,
)
from .dyck import Dyck
from .hmm import HMM
from .models import bert_config, build_model
from .pcfg import PCFG
from .tokenizer import make_tokenizer

__all__ = [
    "HMM",
    "MaskedWordCollator",
    "PCFG",
    "Dyck",
    "OracleMLM",
    "bert_config",
    "build_dyck_dataset",
    "build_hmm_dataset",
    "build_model",
    "build_pcfg_dataset",
    "context_word_ids",
    "entropy_bound",
    "make_tokenizer",
    "masked_contexts",
    "sentences_to_dataset",
    "target_conditionals",
]
