"""Tiny BERT models, rows and trainer arguments shared by the SAM / regularizer tests and the launched script; the
word-level masked LM the trace-callback tests train, and the checks those tests share.

Importable as ``tests.helpers.tiny_models`` from the tests (pytest puts the repository root on the path) and from
``tests/helpers/distributed_sam_script.py`` (launched with the repository root on PYTHONPATH). Only builders live here;
the plain-PyTorch reference algorithms stay in the test files, independent of each other and of the package.
"""

from __future__ import annotations

import torch
from transformers import BertConfig, BertForMaskedLM, BertForSequenceClassification

VOCAB = 30
SEQ_LEN = 6


def tiny_bert_config(**overrides) -> BertConfig:
    """The tiny models' BERT: hidden 16, one layer, two heads, no dropout, 3 labels (``overrides`` change any field)."""
    values = dict(
        vocab_size=VOCAB,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=16,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_labels=3,
    )
    values.update(overrides)
    return BertConfig(**values)


def tiny_classifier(seed: int = 0, layers: int = 2) -> BertForSequenceClassification:
    """Dropout-free BERT classifier with 3 labels (two layers unless ``layers`` says otherwise)."""
    torch.manual_seed(seed)
    return BertForSequenceClassification(tiny_bert_config(num_hidden_layers=layers))


def classification_rows(n: int = 12, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    """``n`` rows of random tokens in [1, VOCAB) with a full attention mask and a random label in {0, 1, 2}."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (n, SEQ_LEN), generator=g)
    labels = torch.randint(0, 3, (n,), generator=g)
    return [
        {"input_ids": ids[i], "attention_mask": torch.ones(SEQ_LEN, dtype=torch.long), "labels": labels[i]}
        for i in range(n)
    ]


def tiny_mlm(seed: int = 0) -> BertForMaskedLM:
    """One-layer, dropout-free BERT masked LM (BERT's forward ignores ``num_items_in_batch``)."""
    torch.manual_seed(seed)
    return BertForMaskedLM(tiny_bert_config())


def randomly_masked_rows(n: int = 16, seed: int = 7) -> list[dict[str, torch.Tensor]]:
    """15% of positions labelled at random (at least one per row): rows hold unequal label counts."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (n, SEQ_LEN), generator=g)
    labelled = torch.rand(n, SEQ_LEN, generator=g) < 0.15
    labelled[:, 0] = True
    labels = torch.where(labelled, ids, torch.full_like(ids, -100))
    return [{"input_ids": ids[i], "labels": labels[i]} for i in range(n)]


def stack(rows):
    """Rows (dicts of tensors) to one batch."""
    return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}


def trainer_arguments(output_dir, **overrides) -> dict:
    """Trainer fields of the exactness tests: SGD lr 0.1, constant schedule, 3 steps of 4 sequential rows, no
    clipping, no decay, logs every step (the launched script adds its engine's fields)."""
    values = dict(
        output_dir=str(output_dir),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=1,
        max_steps=3,
        learning_rate=0.1,
        optim="sgd",
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=0.0,
        train_sampling_strategy="sequential",
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        seed=0,
    )
    values.update(overrides)
    return values


def flatbias_config(tmp_path, config_class=None, **overrides):
    """FlatBiasConfig (or ``config_class``, e.g. a trl config) of `trainer_arguments` for single-process CPU tests."""
    # imported on use, as the launched script does: importing this module does not import the package
    from hf_flatbias import FlatBiasConfig

    return (config_class or FlatBiasConfig)(**trainer_arguments(tmp_path, **{"use_cpu": True, **overrides}))


def small_bert_config(vocab_size: int, **overrides) -> BertConfig:
    """Hidden 8, one layer, two heads, intermediate 16, 16 positions, padding id 0: the masked LMs the trace and
    command-line tests measure or save (``overrides`` change any field)."""
    values = dict(
        vocab_size=vocab_size,
        hidden_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=16,
        max_position_embeddings=16,
        pad_token_id=0,
    )
    values.update(overrides)
    return BertConfig(**values)


def wide_masked_lm(seed: int = 0, *, vocab_size: int, **overrides) -> BertForMaskedLM:
    """A `small_bert_config` eager masked LM whose wide initialisation makes predictions far from uniform, as a trained
    model's are: the trace tests' model (``overrides`` change any config field)."""
    torch.manual_seed(seed)
    config = small_bert_config(vocab_size, **{"initializer_range": 0.4, "attn_implementation": "eager", **overrides})
    return BertForMaskedLM(config).eval()


# 4 query heads sharing 2 key/value heads: grouped-query attention; a wide initialisation makes the predictions far
# from uniform (wider ones give per-context traces too heavy-tailed for a useful standard error on 24 contexts).
TINY_DECODER = dict(
    vocab_size=16,
    hidden_size=8,
    intermediate_size=12,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=32,
    initializer_range=0.25,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=1,
)
"""Config fields of the tiny Llama-family decoders (Llama, Mistral, Qwen2, Gemma, GPT-NeoX) of the trace tests."""


def randomize_norms(model: torch.nn.Module) -> torch.nn.Module:
    """Norm weights start at 1 (0 for Gemma): random values make a wrong coefficient visible."""
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.copy_(0.5 + torch.rand(p.shape, generator=generator))
    return model


def word_tokenizer(n_words: int = 20):
    """A whitespace word-level tokenizer over ``w0 .. w{n-1}`` with ``<pad>`` 0, ``<s>`` 1 (bos), ``</s>`` 2 (eos),
    ``<unk>`` 3 and no template: what trl's trainers need of a causal LM's tokenizer, built offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    vocab = {token: i for i, token in enumerate([*specials, *(f"w{i}" for i in range(n_words))])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def tiny_llama(vocab_size: int, seed: int = 0):
    """A two-layer Llama (hidden 16, grouped-query attention, random norms) for the trl tests, in float32."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    fields = dict(TINY_DECODER, hidden_size=16, intermediate_size=32, initializer_range=0.1)
    fields.update(vocab_size=vocab_size, eos_token_id=2)
    config = LlamaConfig(**fields)
    return randomize_norms(LlamaForCausalLM(config))


# ---------------------------------------------------------------- a word-level masked LM trained by the Trainer

MLM_WORDS = [f"w{i}" for i in range(12)]


def word_mlm_tokenizer(words=MLM_WORDS):
    """A word-level BERT tokenizer over ``words`` (`hf_flatbias.synthetic.make_tokenizer`), 16 tokens at most."""
    from hf_flatbias.synthetic import make_tokenizer

    return make_tokenizer(words, model_max_length=16)


def word_rows(tokenizer, n: int, seed: int):
    """``n`` tokenized rows of 8 random words of `MLM_WORDS`, as a `datasets.Dataset`."""
    from datasets import Dataset

    generator = torch.Generator().manual_seed(seed)
    texts = [
        " ".join(MLM_WORDS[i] for i in torch.randint(0, len(MLM_WORDS), (8,), generator=generator)) for _ in range(n)
    ]
    encoded = tokenizer(texts)
    return Dataset.from_dict({"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]})


def word_mlm(tokenizer) -> BertForMaskedLM:
    """A one-layer BERT masked LM over ``tokenizer``'s words, with dropout 0.1: a consumed random number shows."""
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=16,
        pad_token_id=tokenizer.pad_token_id,
        hidden_dropout_prob=0.1,
    )
    return BertForMaskedLM(config)


def train_word_mlm(output_dir, tokenizer, callbacks, trainer_class=None, bind=True):
    """Six AdamW steps of `word_mlm` on 24 `word_rows` (30% of tokens masked), evaluated on 8 more every 3 steps,
    with ``callbacks`` (bound to the trainer unless ``bind`` is False); returns the trained ``trainer_class``
    (the stock `Trainer` by default)."""
    from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments

    args = TrainingArguments(
        output_dir=str(output_dir),
        max_steps=6,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        logging_steps=1,
        eval_strategy="steps",
        eval_steps=3,
        save_strategy="no",
        report_to=[],
        seed=7,
        use_cpu=True,
        dataloader_num_workers=0,
    )
    trainer = (trainer_class or Trainer)(
        model=word_mlm(tokenizer),
        args=args,
        train_dataset=word_rows(tokenizer, 24, 0),
        eval_dataset=word_rows(tokenizer, 8, 1),
        data_collator=DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.3),
        processing_class=tokenizer,
        callbacks=callbacks,
    )
    if bind:
        for callback in callbacks:
            if hasattr(callback, "bind_trainer"):
                callback.bind_trainer(trainer)
    trainer.train()
    return trainer


def logged_losses(trainer) -> list[float]:
    """The training losses ``trainer`` logged, in order."""
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def assert_training_unchanged(plain, measured) -> None:
    """``measured`` (a run with a measuring callback) trained as ``plain`` (the run without) did, bit for bit: the
    same logged losses, final weights and train/eval mode. Dropout, the collator's masking and AdamW's moments would
    show any random number the callback consumed or any weight or state it touched."""
    assert logged_losses(plain) == logged_losses(measured)
    for (name, p), q in zip(plain.model.named_parameters(), measured.model.parameters(), strict=True):
        assert torch.equal(p, q), name
    assert measured.model.training == plain.model.training


def trace_command_contexts(tokenizer, lines, *, n_contexts: int, seed: int):
    """The contexts ``hf-flatbias trace`` measures on the first ``n_contexts`` text ``lines``, built here from
    `build_masked_contexts` rather than through the command (its special tokens never masked)."""
    from hf_flatbias.flatness import build_masked_contexts

    encoded = tokenizer(lines[:n_contexts], truncation=True, max_length=128)
    rows = [
        {"input_ids": ids, "attention_mask": mask}
        for ids, mask in zip(encoded["input_ids"], encoded["attention_mask"], strict=True)
    ]
    return build_masked_contexts(
        rows,
        mask_token_id=tokenizer.mask_token_id,
        n_contexts=n_contexts,
        seed=seed,
        special_token_ids=tokenizer.all_special_ids,
    )
