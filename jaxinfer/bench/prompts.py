"""Random prompts of token ids drawn from a seeded generator (vLLM's random dataset draws ids too):
sent as ids, every prompt has exactly the length asked, whatever the tokenizer."""

from __future__ import annotations

from typing import Iterable

import numpy as np

# Left out at both ends of the vocabulary, where special tokens usually sit.
RESERVED_IDS = 10


def random_prompts(rng: np.random.Generator, lengths: Iterable[int], vocab_size: int) -> list[list[int]]:
    """One prompt per length, its ids drawn uniformly from ``[10, vocab_size - 10)``."""
    if vocab_size <= 2 * RESERVED_IDS:
        raise ValueError(f"a vocabulary of {vocab_size} ids leaves none to draw prompts from")
    return [rng.integers(RESERVED_IDS, vocab_size - RESERVED_IDS, int(n)).tolist() for n in lengths]
