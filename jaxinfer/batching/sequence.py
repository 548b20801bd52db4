"""Host-side state of one request as it moves through the scheduler."""

from __future__ import annotations

import dataclasses
import enum

from jaxinfer.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclasses.dataclass
class Sequence:
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

    page_table: list[int] = dataclasses.field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_cached_tokens: int = 0  # of the prompt, found in the prefix cache at the last admission
    committed_pages: int = 0  # full pages published to the prefix cache
    committed_key: int | None = None
    swapped: object = None  # host copy of the pages while swapped out

    # Tokens sampled by dispatched steps whose results the host has not read yet (0-2): the next
    # step takes the newest from the device (row `pending_row` of the step dispatched last).
    pending: int = 0
    pending_row: int = -1
    pending_step: int = -1
    final_pending: bool = False  # the newest pending token ends the request (max_tokens / length)
    # Speculation: tokens proposed to follow the last known one, fed after it in the next step and
    # verified there. A step then advances the sequence by a variable number of tokens (see
    # ``LLMEngine._read_verified``), so speculating steps have nothing pending: their results are read
    # before the next step is scheduled.
    draft_token_ids: list[int] = dataclasses.field(default_factory=list)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def tokens_between(self, start: int, end: int) -> list[int]:
        """``token_ids[start:end]`` without building the whole list (the hot path feeds one token)."""
        lp = len(self.prompt_token_ids)
        if start >= lp:
            return self.output_token_ids[start - lp:end - lp]
        return self.prompt_token_ids[start:end] + self.output_token_ids[:max(0, end - lp)]

    def step_inputs(self, start: int, n: int) -> list[int]:
        """Token ids fed at positions ``start:start + n``: known tokens, then the proposals; a token
        still pending on device is not among them (the caller feeds it from there)."""
        known = min(start + n, self.num_tokens - self.pending)
        ids = self.tokens_between(start, known)
        if self.draft_token_ids and known < start + n:
            assert not self.pending and known == self.num_tokens
            ids += self.draft_token_ids[:start + n - known]
        return ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.pending

    @property
    def num_remaining(self) -> int:
        """Tokens still to feed through the model before the next token can be sampled."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_prefill(self) -> bool:
        return self.num_remaining > 1
