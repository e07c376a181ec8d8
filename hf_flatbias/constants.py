"""Names every part of hf_flatbias shares: one definition each."""

IGNORE_INDEX = -100
"""The label of positions that are not predicted (the default ``ignore_index`` of PyTorch's cross-entropy)."""
