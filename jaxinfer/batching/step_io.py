"""What one step takes and gives: ``SchedulerOutput`` (the scheduler -> the model runner) and
``ModelRunnerOutput`` (the model runner -> the scheduler), plain host data both ways.

The scheduler never touches a device array and the runner never touches a request: the scheduler
describes a step by columns (one entry per scheduled request), the runner pads them into a bucketed
step, and the step's sampled tokens come back as numpy arrays.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from jaxinfer.sampling_params import SamplingParams


@dataclasses.dataclass(frozen=True)
class RowTerms:
    """What a row's logit terms need beside its ``SamplingParams`` (``InputBuilder.build`` makes
    ``sampling.LogitTerms`` of them): token lists the scheduler owns, passed only where used."""

    prompt: Sequence[int] = ()  # the prompt, where the repetition penalty reads it
    generated: Sequence[int] = ()  # the generated tokens, where a penalty counts them
    held: Sequence[int] = ()  # end tokens ``min_tokens`` holds back while it is not reached


@dataclasses.dataclass
class SchedulerOutput:
    """One step, by scheduled request (row), in scheduling order."""

    request_ids: list[str]
    num_tokens: list[int]  # tokens fed per request
    starts: list[int]  # position of each request's first fed token (its computed tokens)
    token_ids: list[int]  # every request's fed tokens, concatenated; ``-1 - r``: row r of the last step's samples
    page_tables: list[list[int]]  # each request's KV pages (the scheduler's; read only)
    params: list[SamplingParams]
    seeds: list[int]
    output_index: list[int]  # index of each request's next generated token: its sampling key
    logit_terms: dict[int, "RowTerms"]  # for the rows whose logits get terms (``SamplingParams.adjusts_logits``)
    proposals: list[list[int]]  # row -> proposed tokens the step verifies (empty: none)
    num_speculative: int = 0  # proposals per row of a verifying step (0: a plain step)
    num_steps: int = 1  # decode steps one dispatch runs (``num_scheduler_steps``); > 1 only for decode batches
    constrained: bool = False  # some request samples under a token bitmask (``ModelRunner.run_forward``)

    def __len__(self) -> int:
        return len(self.request_ids)


@dataclasses.dataclass
class ModelRunnerOutput:
    """A step's sampled tokens on the host. Plain step: ``tokens [S]``, or ``[S, steps]`` when it ran
    several decode steps. Verifying step: ``tokens [S, k + 1]``, each row's emitted tokens followed by
    -1 (the accepted proposals, then the target's own next token). ``logprobs`` (the sampled tokens'
    own, same shape) and the top alternatives ``[..., n]`` where the step computed them."""

    tokens: np.ndarray
    verify: bool = False
    logprobs: np.ndarray | None = None
    top_ids: np.ndarray | None = None
    top_logprobs: np.ndarray | None = None

    def row(self, i: int) -> tuple[list[int], slice | tuple]:
        """Row ``i``'s new tokens and the index that selects their logprob entries."""
        if self.verify:
            n = int((self.tokens[i] >= 0).sum())
            return self.tokens[i, :n].tolist(), np.s_[i, :n]
        if self.tokens.ndim == 2:
            return self.tokens[i].tolist(), np.s_[i]
        return [int(self.tokens[i])], np.s_[i:i + 1]
