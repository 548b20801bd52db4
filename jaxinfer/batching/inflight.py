"""The in-flight protocol: steps dispatched before the previous one is read, and how reading one
confirms, or rolls back, what the host assumed when it dispatched the next.

The engine dispatches step N + 1 while step N runs and reads step N afterwards (``LLMEngine.step``),
so the host never waits for a step's tokens before dispatching the next one: step N + 1 feeds each
decoding request the token step N sampled straight from the device (``ModelRunner.last_tokens``).
While steps are in flight a request's ``inflight`` list holds what they add to it if they accept
every proposal, oldest step first: each step's proposals, then ``SAMPLED`` for each token it samples
(``num_scheduler_steps`` per dispatch of a decode batch). Reading a step takes its entries off the
front (``take``). A verifying step that rejected a proposal takes all of them (``roll_back``):
whatever the step dispatched after it computed from the rejected proposals is discarded.

Sampling stays exact through a roll-back: each output index draws from its own key (seed, index),
and whether the later step is discarded depends only on the keys of the indices this step emitted,
so the keys the discarded step used are independent of that decision and serve the same indices
again.

Only the scheduler owns an ``InFlight`` and only this class writes a request's in-flight fields.
"""

from __future__ import annotations

import collections
import dataclasses

from jaxinfer.batching.request import SAMPLED, Request
from jaxinfer.batching.step_io import SchedulerOutput


@dataclasses.dataclass
class DispatchedStep:
    """A step dispatched and not yet read: what was scheduled, the rows that sample a token (``steps``
    tokens each), and the device's result (set by the engine; read with ``ModelRunner.fetch``)."""

    out: SchedulerOutput
    requests: list[Request]
    sampled: list[int]
    steps: int
    number: int  # dispatch count when it was dispatched
    result: object = None


class InFlight:
    def __init__(self):
        self.num_dispatched = 0
        self.steps: collections.deque[DispatchedStep] = collections.deque()  # oldest first; at most two

    def device_fed(self, req: Request) -> int:
        """The input that feeds ``req``'s newest in-flight token from the device: ``-1 - row`` of the
        last step's samples (``ModelRunner``). Only the step dispatched last is on device."""
        assert req.pending_step == self.num_dispatched - 1, "a token fed from the device is the last step's"
        return -1 - req.pending_row

    def dispatch(self, out, requests: list[Request], num_tokens: list[int], steps: int,
                 max_model_len: int) -> DispatchedStep:
        """Advance each request as if the step had run ``steps`` decode steps and accepted every
        proposal; return the record the engine reads the step by. A request is held (not scheduled until
        this step is read) when these tokens would end it, or when it verifies proposals after a
        verification that rejected one: with the step after a rejected one discarded, going ahead from
        a proposal pays only when it is likely to be accepted whole (on an H200 a discarded batch-1
        llama3-8b step wastes ~4.9 ms of device time where going ahead saves ~1.7 ms of dispatch gap)."""
        sampled = []
        for i, (req, n) in enumerate(zip(requests, num_tokens)):
            req.num_computed_tokens += n + steps - 1
            proposed = req.draft_token_ids
            if req.num_computed_tokens < req.num_tokens + len(proposed) + steps - 1:
                continue  # a prefill chunk that is not the last: nothing sampled
            req.inflight += proposed + [SAMPLED] * steps
            req.draft_token_ids = []
            req.pending_row, req.pending_step = i, self.num_dispatched
            req.held = (len(req.output_token_ids) + len(req.inflight) >= req.params.max_tokens
                        or req.num_tokens >= max_model_len or (bool(proposed) and req.rejected))
            sampled.append(i)
        step = DispatchedStep(out, requests, sampled, steps, self.num_dispatched)
        self.num_dispatched += 1
        self.steps.append(step)
        return step

    def oldest(self) -> DispatchedStep:
        return self.steps.popleft()

    @staticmethod
    def proposed(req: Request) -> int:
        """How many proposals the oldest step in flight verifies for ``req``."""
        return req.inflight.index(SAMPLED)

    @staticmethod
    def take(req: Request, n: int) -> None:
        """The oldest step in flight read for ``req``: its ``n`` in-flight entries are known now."""
        assert req.inflight[n - 1] == SAMPLED
        del req.inflight[:n]
        if not req.inflight:
            req.held = False

    def roll_back(self, req: Request, computed: int) -> bool:
        """``req``'s oldest step in flight rejected a proposal: forget every in-flight token. The K/V
        written from position ``computed`` on (the rejected proposals', and whatever the step
        dispatched after it computed from them) are no longer counted, so later steps overwrite them;
        the request leaves that later step's sampled rows (its tokens there are never read); a
        swapped-out copy keeps only its counted pages. Returns whether a later step's work was
        discarded. The later step is the only one still in flight: a verifying step in flight is read
        before any other kind of step is dispatched (``LLMEngine.step``)."""
        discarded = req.inflight.count(SAMPLED) > 1  # in the step dispatched after it too
        if discarded:
            later = self.steps[-1]
            assert req.pending_step == later.number
            later.sampled.remove(req.pending_row)
        req.inflight = []
        req.held = False
        req.num_computed_tokens = min(req.num_computed_tokens, computed)
        return discarded

    def reset(self, requests) -> None:
        """Forget every step in flight, and what they would have added to ``requests`` (a whole step
        failed: ``Scheduler.recover``)."""
        self.steps.clear()
        for req in requests:
            req.inflight, req.held, req.rejected, req.draft_token_ids = [], False, False, []
