"""Checking a prompt's token ids, the same way in every engine."""

from __future__ import annotations

import operator
from collections.abc import Sequence


def checked_token_ids(tokens: Sequence[int], vocab_size: int, error: type[ValueError]) -> list[int]:
    """`tokens` as a list of ints, or `error` saying why not: not integers, empty, outside the vocabulary."""
    try:
        ids = [operator.index(t) for t in tokens]
    except TypeError:
        raise error("prompt token ids must be integers") from None
    if not ids:
        raise error("empty prompt: at least one token is needed")
    low, high = min(ids), max(ids)
    if low < 0 or high >= vocab_size:
        raise error(f"prompt token id {low if low < 0 else high} lies outside the vocabulary [0, {vocab_size})")
    return ids
