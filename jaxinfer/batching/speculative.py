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

from jaxinfer.batching.sequence import Sequence
from jaxinfer.sampling_params import SamplingParams

METHODS = ("ngram", "draft")
MAX_SPECULATIVE_TOKENS = 16  # a verify step feeds 1 + k tokens per sequence and keeps k + 1 logits rows


class Proposer(Protocol):
    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        """At most ``limits[i]`` tokens (possibly none) proposed to follow ``seqs[i].assumed_context()``:
        the sequence's tokens as if its step in flight accepts every proposal, then ``skip`` (0 or 1)
        tokens that step samples, unknown to the host. The proposals follow those too: a proposer may
        guess them (the n-gram and draft proposers take ``skip + limit`` tokens and drop the first);
        a wrong guess only costs acceptance."""


def default_ngram_min(backend: str, ngram_max: int) -> int:
    """The shortest n-gram worth proposing from where ``ngram_min`` is not given: 2 on CPU, 1 elsewhere.

    Proposing pays when the tokens a step is expected to accept exceed the verify step's extra cost,
    in plain decode steps. On XLA:CPU a batch-1 verify step costs ~2 plain ones whatever k (the
    matmuls of 2+ query tokens leave the matrix-vector path), and over the input-grounded prompts of
    ``tests/data/spec_prompts.json`` (SmolLM2, k = 4) a 1-token match's proposals were accepted 0.7
    tokens on average (2-token: 1.4; 4-token: 3.6), so they cost more than they gained. On an H200 a
    batch-1 verify step of k = 4 costs 1.14 plain ones (docs/benchmarks.md, issue 26), so they pay."""
    return min(ngram_max, 2 if backend == "cpu" else 1)


def default_overlap(backend: str, method: str) -> bool:
    """Where ``speculative_overlap`` is not given: on with the ``ngram`` proposer, except on CPU.

    Keeping a verifying step in flight hides the host's work between steps (reading the outcome,
    proposing, preparing, dispatching: on an H200 a speculating llama3-8b batch-1 step took 6.6-7.2 ms
    against 4.9 ms on device, docs/benchmarks.md, issue 26) but discards the next step of every
    sequence whose step in flight rejects a proposal, and proposals that follow a guessed token are
    accepted less. On XLA:CPU there is little to hide (a few hundred us of host work next to 30+ ms
    steps) while a discarded step costs a whole verify step: SmolLM2 with n-gram proposals on the
    six input-grounded prompts ran 1.60x plain decode overlapped against 1.83x synchronously
    (docs/benchmarks.md). Only a host-bound model gains there (tiny-llama3, replayed proposals:
    3.8-4.2x against 2.3-2.5x). A draft model proposes by running its own steps on the device, which
    wait for the step in flight anyway."""
    return backend != "cpu" and method == "ngram"


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

    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
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
