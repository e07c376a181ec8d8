"""The masked LMs trained on the synthetic languages (by ``hf-flatbias demo`` and the research recipes): small BERTs
built from a config (nothing is downloaded)."""

from __future__ import annotations

import torch
from transformers import BertConfig, BertForMaskedLM


def build_model(
    vocab_size: int,
    *,
    hidden: int = 64,
    layers: int = 2,
    dropout: float = 0.0,
    seed: int = 0,
    heads: int | None = None,
) -> BertForMaskedLM:
    """A small BERT masked LM, initialised from ``seed``; ``heads`` defaults to ``hidden // 32``."""
    torch.manual_seed(seed)
    config = bert_config(vocab_size, hidden=hidden, layers=layers, dropout=dropout, heads=heads)
    return BertForMaskedLM(config)


def bert_config(
    vocab_size: int, *, hidden: int = 64, layers: int = 2, dropout: float = 0.0, heads: int | None = None
) -> BertConfig:
    """The config of `build_model` (also the target architecture a smaller model is embedded into)."""
    heads = max(1, hidden // 32) if heads is None else heads
    if heads < 1 or hidden % heads:
        raise ValueError(f"hidden size {hidden} is not divisible into {heads} attention heads; pick heads dividing it.")
    return BertConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=4 * hidden,
        max_position_embeddings=64,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
        type_vocab_size=1,
    )
