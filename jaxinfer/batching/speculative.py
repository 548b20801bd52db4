"""Proposers for speculative decoding: cheap guesses of the tokens that follow a sequence.

The engine feeds a sequence's last token and its proposals through one target step and keeps the
prefix the target agrees with (``sampling.verify``), so a proposer only affects speed, never output.
A proposer sees the host-side sequences of one step and returns up to ``limit`` tokens for each; the
interface leaves room for proposers that need per-request state (a draft model's own KV cache) or the
target's hidden states (EAGLE/Medusa heads) later.
"""

from __future__ import annotations

from typing import Protocol

import itertools

import numpy as np

from jaxinfer.batching.request import Request
from jaxinfer.sampling_params import SamplingParams


class Proposer(Protocol):
    def propose(self, seqs: list[Request], limits: list[int]) -> list[list[int]]:
        """At most ``limits[i]`` tokens (possibly none) proposed to follow ``seqs[i].assumed_context()``:
        the sequence's tokens as if its step in flight accepts every proposal, then ``skip`` (0 or 1)
        tokens that step samples, unknown to the host. The proposals follow those too: a proposer may
        guess them (the n-gram and draft proposers take ``skip + limit`` tokens and drop the first);
        a wrong guess only costs acceptance."""


class NgramProposer:
    """Prompt lookup: find the latest earlier occurrence of the sequence's last ``n`` tokens (longest
    ``n`` in ``[ngram_min, ngram_max]`` first) in its own prompt and output, and propose the tokens
    that followed it. Pays off where the output copies its input (rewriting, editing, quoting code)."""

    def __init__(self, ngram_min: int = 1, ngram_max: int = 4):
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(f"ngram window sizes must satisfy 1 <= ngram_min <= ngram_max, got "
                             f"ngram_min={ngram_min}, ngram_max={ngram_max}")
        self.ngram_min, self.ngram_max = ngram_min, ngram_max

    def propose(self, seqs: list[Request], limits: list[int]) -> list[list[int]]:
        out = []
        for s, k in zip(seqs, limits):
            context, skip = s.assumed_context()
            out.append(self.lookup(context, k + skip)[skip:] if k > 0 else [])
        return out

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


class DraftProposer:
    """A smaller model with the target's vocabulary proposes its greedy continuation. It runs in its own
    engine (weights, paged KV cache, compiled steps), where each step's proposals for the whole batch
    are short greedy requests run together. A request's prompt is the sequence's tokens so far: prefix
    caching finds all but the tail past the last full page, and since the draft engine publishes only
    pages of tokens it was given, nothing of a rejected proposal is ever reused.

    With a sampling target, the proposal is a point mass (the draft's argmax), which keeps
    ``sampling.verify``'s rejection sampling exact."""

    def __init__(self, engine):
        self.engine = engine
        self._ids = itertools.count()

    def propose(self, seqs: list[Request], limits: list[int]) -> list[list[int]]:
        eng = self.engine
        rids, skips = [], []
        for s, k in zip(seqs, limits):
            context, skip = s.assumed_context()
            rids.append(f"draft-{next(self._ids)}")
            skips.append(skip)
            eng.add_request(rids[-1], context, SamplingParams(max_tokens=max(1, k + skip), temperature=0.0,
                                                              ignore_eos=True))
        out = {}
        while eng.has_unfinished():
            for o in eng.step():
                if o.finished:
                    out[o.request_id] = o.token_ids
        return [out[r][skip:skip + k] for r, k, skip in zip(rids, limits, skips)]


def check_draft(target, draft) -> None:
    """A draft model must share the target's vocabulary (ids and, where both have one, the tokenizer)."""
    if draft.model_config.vocab_size != target.model_config.vocab_size:
        raise ValueError(f"speculative_model has a vocabulary of {draft.model_config.vocab_size} tokens but the "
                         f"target's has {target.model_config.vocab_size}: they must share a tokenizer")
    if (target.tokenizer is None) != (draft.tokenizer is None) or (
            target.tokenizer is not None and target.tokenizer.get_vocab() != draft.tokenizer.get_vocab()):
        raise ValueError("speculative_model's tokenizer differs from the target's: they must share a tokenizer")
