"""Proposers for speculative decoding: cheap guesses of the tokens that follow a sequence.

The engine feeds a sequence's last token and its proposals through one target step and keeps the
prefix the target agrees with (``sampling.verify``), so a proposer only affects speed, never output.
A proposer sees the host-side sequences of one step and returns up to ``limit`` tokens for each; the
interface leaves room for proposers that need per-request state (a draft model's own KV cache) or the
target's hidden states (EAGLE/Medusa heads) later.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from jaxinfer.batching.sequence import Sequence

METHODS = ("ngram",)
MAX_SPECULATIVE_TOKENS = 16  # a verify step feeds 1 + k tokens per sequence and keeps k + 1 logits rows


class Proposer(Protocol):
    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        """At most ``limits[i]`` tokens proposed to follow ``seqs[i].token_ids`` (possibly none)."""


class NgramProposer:
    """Prompt lookup: find the latest earlier occurrence of the sequence's last ``n`` tokens (longest
    ``n`` in ``[ngram_min, ngram_max]`` first) in its own prompt and output, and propose the tokens
    that followed it. Pays off where the output copies its input (rewriting, editing, quoting code)."""

    def __init__(self, ngram_min: int = 1, ngram_max: int = 4):
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(f"ngram window sizes must satisfy 1 <= ngram_min <= ngram_max, got "
                             f"ngram_min={ngram_min}, ngram_max={ngram_max}")
        self.ngram_min, self.ngram_max = ngram_min, ngram_max

    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        return [self.lookup(s.token_ids, k) if k > 0 else [] for s, k in zip(seqs, limits)]

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        ids = np.asarray(tokens, np.int64)
        for n in range(min(self.ngram_max, len(ids) - 1), self.ngram_min - 1, -1):
            # Windows of n tokens ending before the last token; the latest one equal to the suffix.
            windows = np.lib.stride_tricks.sliding_window_view(ids[:-1], n)
            hits = np.flatnonzero((windows == ids[-n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return ids[start:start + k].tolist()
        return []
