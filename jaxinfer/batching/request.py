"""A request's host state as it moves through the engine.

``Request`` fields are written in two places only: ``scheduler.py`` (queues, computed tokens, output
tokens, finishing) and ``inflight.py`` (the tokens of steps dispatched but not yet read). Everything
else reads them. A request's KV pages are not here: the scheduler's ``KVCacheManager`` keeps them by
request id.
"""

from __future__ import annotations

import dataclasses
import enum

from jaxinfer.sampling_params import SamplingParams

SAMPLED = -1  # an in-flight token sampled on device (``Request.inflight``)


@dataclasses.dataclass(frozen=True)
class RequestError:
    """Why a request failed alone. ``invalid``: the request cannot be served as it asked (its
    constraint broke down inside a step: the client's to fix); else the engine failed it."""

    message: str
    invalid: bool = False


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclasses.dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # the request's seed, or one drawn for it at arrival
    priority: int = 0
    arrival_index: int = 0  # tie-breaker: FCFS among equal priorities

    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    output_top_logprobs: list[dict[int, float]] = dataclasses.field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None
    error: RequestError | None = None  # why it failed (``finish_reason == "error"``)

    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_cached_tokens: int = 0  # of the prompt, found in the prefix cache at the last admission
    swapped: object = None  # host copy of the pages while swapped out
    failed_steps: int = 0  # whole steps that failed with this request in them (``Scheduler.recover``)

    # The in-flight protocol (``inflight.InFlight``): what the steps dispatched but not yet read add
    # to the request if they accept every proposal, oldest step first: each step's proposals, then
    # ``SAMPLED`` for each token it samples (known only on device; the next step feeds the newest from
    # there: row ``pending_row`` of dispatched step number ``pending_step``).
    inflight: list[int] = dataclasses.field(default_factory=list)
    pending_row: int = -1
    pending_step: int = -1
    # The step in flight must be read before this request is scheduled again: its newest in-flight
    # token ends the request (max_tokens / length), or it verifies proposals after a verification
    # that rejected one.
    held: bool = False
    rejected: bool = False  # its last verification rejected a proposal
    # Proposals for the step being scheduled: tokens guessed to follow its known and in-flight tokens,
    # fed after them and verified in that step.
    draft_token_ids: list[int] = dataclasses.field(default_factory=list)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_known(self) -> int:
        """Tokens whose ids the host knows (prompt and output; not the in-flight ones)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def tokens_between(self, start: int, end: int) -> list[int]:
        """``token_ids[start:end]`` without building the whole list (the hot path feeds one token)."""
        lp = len(self.prompt_token_ids)
        if start >= lp:
            return self.output_token_ids[start - lp:end - lp]
        return self.prompt_token_ids[start:end] + self.output_token_ids[:max(0, end - lp)]

    def step_inputs(self, start: int, n: int) -> list[int]:
        """Token ids fed at positions ``start:start + n``: known tokens, in-flight ones (``SAMPLED``
        where the step in flight samples it: the caller feeds it from the device), then proposals."""
        ids = self.tokens_between(start, start + n)
        if len(ids) < n:
            known = self.num_known
            ids += self.inflight[max(0, start - known):start + n - known]
            ids += self.draft_token_ids[:n - len(ids)]
        return ids

    def assumed_context(self) -> tuple[list[int], int]:
        """What proposals follow while a step is in flight: the tokens the request holds if that step
        accepts every proposal (known tokens, then its proposals), and how many tokens sampled on
        device come after them, unknown to the host (0 or 1)."""
        if not self.inflight:
            return self.token_ids, 0
        assert self.inflight.count(SAMPLED) == 1 and self.inflight[-1] == SAMPLED
        return self.token_ids + self.inflight[:-1], 1

    @property
    def num_tokens(self) -> int:
        return self.num_known + len(self.inflight)

    @property
    def num_remaining(self) -> int:
        """Tokens still to feed through the model before the next token can be sampled."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_prefill(self) -> bool:
        return self.num_remaining > 1

    @property
    def penalized(self) -> bool:
        """Presence, frequency or repetition penalties: the step needs every generated token on the host."""
        return self.params.penalized
