"""The padded shapes a step compiles for: one executable per (tokens, sequences, pages per sequence)
bucket, so a step of any size reuses a compiled one (the defaults per platform: ``backend.py``)."""

from __future__ import annotations

import bisect
import dataclasses
import itertools


def geometric(low: int, high: int, factor: int) -> tuple[int, ...]:
    """``low, low*factor, ...`` below ``high``, then ``high``."""
    out, b = [], max(1, min(low, high))
    while b < high:
        out.append(b)
        b *= factor
    return tuple(out) + (high,)


@dataclasses.dataclass(frozen=True)
class Buckets:
    tokens: tuple[int, ...]
    seqs: tuple[int, ...]
    pages: tuple[int, ...]

    @staticmethod
    def pick(buckets: tuple[int, ...], n: int) -> int:
        i = bisect.bisect_left(buckets, n)
        if i == len(buckets):
            raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")
        return buckets[i]

    def all_shapes(self):
        """Every (tokens, seqs, pages) a step can take: a sequence has at least one token."""
        return [(t, s, p) for t, s, p in itertools.product(self.tokens, self.seqs, self.pages)
                if s <= t or s == self.seqs[0]]

    def decode_shapes(self):
        """The (tokens, seqs, pages) a decode-only step (one token per sequence) can take."""
        pairs = {(self.pick(self.tokens, n), self.pick(self.seqs, n)) for n in range(1, self.seqs[-1] + 1)}
        return [(t, s, p) for t, s in sorted(pairs) for p in self.pages]
