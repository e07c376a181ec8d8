"""A word-level ``PreTrainedTokenizerFast`` for the synthetic languages.

Every synthetic language has a closed vocabulary of words ``w0, w1, ...`` (or brackets). Token ids are laid out so
that word ``i`` has id ``len(SPECIAL_TOKENS) + i``: dataset builders write token ids directly (tokenizing 100k
generated sentences through text would cost more than generating them) and the tokenizer still round-trips text.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

PAD, UNK, CLS, SEP, MASK = "[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"
SPECIAL_TOKENS: tuple[str, ...] = (PAD, UNK, CLS, SEP, MASK)
N_SPECIAL = len(SPECIAL_TOKENS)
PAD_ID, UNK_ID, CLS_ID, SEP_ID, MASK_ID = range(N_SPECIAL)

#: value of a masked position in a word-id array: exact inference marginalises it over all words
MASKED_WORD = -2
#: value of a padding position in a word-id array
PAD_WORD = -1


def make_tokenizer(words: Sequence[str], *, model_max_length: int = 64) -> PreTrainedTokenizerFast:
    """A whitespace word-level tokenizer over ``words`` that wraps each sentence as ``[CLS] ... [SEP]``.

    Args:
        words: the language's words, in the order of their word index (word ``i`` gets token id ``5 + i``).
        model_max_length: longest tokenized sequence, special tokens included.

    Returns:
        A BERT-style tokenizer (``pad``/``mask``/``cls``/``sep`` tokens set) that ``DataCollatorForLanguageModeling``
        and the Trainer accept as they are.
    """
    words = list(words)
    if len(set(words)) != len(words):
        raise ValueError("make_tokenizer: `words` has duplicates; every word must map to one token id.")
    clash = set(words) & set(SPECIAL_TOKENS)
    if clash:
        raise ValueError(f"make_tokenizer: words {sorted(clash)} collide with special tokens; rename them.")
    if any(not w or any(c.isspace() for c in w) for w in words):
        raise ValueError("make_tokenizer: words must be non-empty and contain no whitespace (sentences split on it).")
    vocab = {token: i for i, token in enumerate([*SPECIAL_TOKENS, *words])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.post_processor = processors.TemplateProcessing(
        single=f"{CLS} $A {SEP}",
        pair=f"{CLS} $A {SEP} $B:1 {SEP}:1",
        special_tokens=[(CLS, CLS_ID), (SEP, SEP_ID)],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD,
        unk_token=UNK,
        cls_token=CLS,
        sep_token=SEP,
        mask_token=MASK,
        model_max_length=model_max_length,
    )


def word_ids_to_token_ids(word_ids: Sequence[int]) -> list[int]:
    """``[CLS] + (word ids shifted past the special tokens) + [SEP]``: what the tokenizer makes of the sentence."""
    return [CLS_ID, *(int(w) + N_SPECIAL for w in word_ids), SEP_ID]
