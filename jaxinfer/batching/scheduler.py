"""Iteration-level scheduler: the one owner of request state. Each step it decides which requests
run and how many tokens each gets (``schedule``), records the step as dispatched (``dispatched``),
and applies the step's sampled tokens when the engine reads it (``update_from_output``).

Running requests go first (a decode needs one token, an unfinished prefill its next chunk), then
preempted and waiting ones are admitted while sequence slots, the token budget and KV pages allow.
Prefill chunks and decodes share one step (in-flight batching). When pages run short the
lowest-priority, latest-arrived running request is preempted, by recompute (pages dropped, prompt
and generated tokens re-prefilled later) or swap (pages copied to host memory and restored later).

Steps run padded to a token bucket, so a few prefill tokens on top of a full decode batch would make
a step cost a bucket several times larger (255 decodes + a 10-token prompt: 265 tokens run as 1024).
A step whose padded bucket would be less than ``min_bucket_fill`` full gives its prefill chunks only
what fits the next smaller bucket; the rest follows in later steps (chunked prefill is exact). This
matters most when requests arrive one by one, as they do at a server: measured on CPU, a server run
of 292 steps had 52 in the large bucket where the same requests added in waves had 8.

The scheduler owns the requests, their KV pages (``KVCacheManager``), their in-flight tokens
(``InFlight``) and their constraint matchers (``structured.Matchers``); the engine reads them and
asks the scheduler to change them. Only this module and ``inflight.py`` write a ``Request``.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
from typing import Callable, Protocol


from jaxinfer.batching.inflight import DispatchedStep, InFlight
from jaxinfer.batching.kv_manager import KVCacheManager
from jaxinfer.batching.request import SAMPLED, Request, RequestError, Status
from jaxinfer.batching.speculative import Proposer
from jaxinfer.batching.step_io import ModelRunnerOutput, RowTerms, SchedulerOutput
from jaxinfer.batching.structured import Matchers

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    prefill_chunk_size: int  # most prompt tokens one request gets in one step
    max_model_len: int
    policy: str = "fcfs"  # or "priority": lower value first, ties first-come first-served
    preemption_mode: str = "recompute"  # or "swap"
    token_buckets: tuple[int, ...] = ()  # the step's padded token counts; () = no bucket-aware trimming
    min_bucket_fill: float = 0.5
    num_scheduler_steps: int = 1  # decode steps one dispatch may run for a batch of decodes
    num_speculative_tokens: int = 0  # most proposals a step verifies per request; 0: no speculation
    eos_token_ids: tuple[int, ...] = ()


class TextStops(Protocol):
    """The output side's part in appending a token (``outputs.OutputProcessor``): it detokenizes and
    says whether the request's text now contains one of its stop strings; it is told of the stop token
    that ended a request, which is not appended."""

    def add_token(self, req: Request, token: int) -> bool: ...

    def add_stop_token(self, req: Request, token: int) -> None: ...


# A request in this many failed steps in a row (none of its steps read in between) is finished with an
# error rather than retried again: a request that makes every step it is in fail must not stall the
# engine, and one transient failure must not fail anyone.
MAX_STEP_FAILURES = 3

_COUNTERS = ("prompt_tokens", "generation_tokens", "computed_prompt_tokens", "steps", "step_tokens", "spec_steps",
             "spec_verified", "spec_proposed", "spec_accepted", "spec_discarded")


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, matchers: Matchers | None = None,
                 swap_out: Callable[[list[int]], object] | None = None,
                 swap_in: Callable[[object, list[int]], None] | None = None):
        self.config = config
        self.kv = kv
        self.matchers = matchers  # None: the model has no tokenizer, so no request can be constrained
        self.inflight = InFlight()
        self.swap_out, self.swap_in = swap_out, swap_in
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.preempted: list[Request] = []
        self.num_preemptions = 0
        self.counters = dict.fromkeys(_COUNTERS, 0)

    # ------------------------------------------------------------------------------- requests

    def key(self, req: Request) -> tuple[int, int]:
        return (req.priority if self.config.policy == "priority" else 0, req.arrival_index)

    def add_request(self, req: Request) -> None:
        """Queue a request (validated by the engine); its constraint's matcher is made here
        (``ValueError`` for a bad constraint, before anything is queued)."""
        if req.params.structured is not None:
            if self.matchers is None:
                raise ValueError("structured outputs need a tokenizer; this model has none")
            self.matchers.add(req.request_id, req.params.structured)
        req.status = Status.WAITING
        self.requests[req.request_id] = req
        self.waiting.append(req)
        self.counters["prompt_tokens"] += len(req.prompt_token_ids)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.preempted)

    def finish(self, req: Request, reason: str, error: RequestError | None = None) -> None:
        """End a request (``reason``: stop, length, abort, error): out of every queue, pages freed at
        once; steps in flight that still hold it skip it when read."""
        for queue in (self.running, self.waiting, self.preempted):
            if req in queue:
                queue.remove(req)
        self.kv.free(req)
        self.requests.pop(req.request_id, None)
        if self.matchers is not None:
            self.matchers.remove(req.request_id)
        req.swapped = None
        req.status = Status.FINISHED
        req.finish_reason, req.error = reason, error

    def abort(self, request_id: str) -> Request | None:
        """Stop a request wherever it is; None if it is unknown."""
        req = self.requests.get(request_id)
        if req is not None:
            self.finish(req, "abort")
        return req

    @property
    def constraining(self) -> bool:
        """Whether a constrained request is live (structured outputs: no speculation, single steps)."""
        return self.matchers is not None and len(self.matchers) > 0

    # ------------------------------------------------------------------------------- schedule

    def schedule(self) -> SchedulerOutput | None:
        """The next step: which requests run and how many tokens each feeds; None if none can."""
        suspects = [r for r in self.running + self.preempted if r.failed_steps]
        if suspects:
            return self._schedule_alone(min(suspects, key=self.key))
        budget = self.config.max_num_batched_tokens
        batch: dict[int, tuple[Request, int]] = {}  # id(req) -> (req, tokens), insertion-ordered
        preempted_now = False

        self.running.sort(key=self.key)
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.held:  # the step in flight must be read first (``Request.held``)
                i += 1
                continue
            n = self._chunk(req, budget)
            if req.draft_token_ids and self.kv.short(req, n):
                req.draft_token_ids = []  # proposals never preempt anyone
                n = 1
            while self.kv.short(req, n):
                victim = self.running[-1]
                batch.pop(id(victim), None)
                self._preempt(victim)
                preempted_now = True
                if victim is req:
                    break
            if req.status is not Status.RUNNING:
                break
            self.kv.grow(req, req.num_computed_tokens + n)
            batch[id(req)] = (req, n)
            budget -= n
            i += 1

        if not preempted_now:
            candidates = sorted(self.preempted + self.waiting, key=self.key)
            for req in candidates:
                if budget <= 0:
                    break
                has_slot = len(self.running) < self.config.max_num_seqs
                if not (has_slot and self._admit(req)) and not self._preempt_for(req, batch):
                    break
                budget = self.config.max_num_batched_tokens - sum(n for _, n in batch.values())
                (self.preempted if req in self.preempted else self.waiting).remove(req)
                req.status = Status.RUNNING
                self.running.append(req)
                n = self._chunk(req, budget)
                self.kv.grow(req, req.num_computed_tokens + n)
                batch[id(req)] = (req, n)
                budget -= n

        self._fit_bucket(batch)
        if not batch:
            return None
        reqs = [r for r, _ in batch.values()]
        counts = [n for _, n in batch.values()]
        return self._output(reqs, counts, self._num_steps(reqs, counts))

    def _schedule_alone(self, req: Request) -> SchedulerOutput | None:
        """A step of ``req`` and nothing else: after a failed step each of its requests runs alone until
        it samples a token again, so a request that makes every step fail fails only its own steps and
        reaches ``MAX_STEP_FAILURES`` alone, while the others get past the failure and go on together."""
        if req.status is Status.PREEMPTED:
            while not (len(self.running) < self.config.max_num_seqs and self._admit(req)):
                if not self.running:
                    return None  # its pages do not fit an empty pool: left to the normal path's errors
                self._preempt(self.running[-1])
            self.preempted.remove(req)
            req.status = Status.RUNNING
            self.running.append(req)
        if req.held:
            return None
        n = self._chunk(req, self.config.max_num_batched_tokens)
        while self.kv.short(req, n) and len(self.running) > 1:
            self._preempt(next(r for r in reversed(self.running) if r is not req))
        self.kv.grow(req, req.num_computed_tokens + n)
        return self._output([req], [n], 1)

    def _output(self, reqs: list[Request], counts: list[int], num_steps: int) -> SchedulerOutput:
        """The step as the runner takes it (one pass over the scheduled requests)."""
        token_ids, terms = [], {}
        for i, (r, n) in enumerate(zip(reqs, counts)):
            fed = r.step_inputs(r.num_computed_tokens, n)
            if SAMPLED in fed:  # the token the last step sampled, still on device
                j = fed.index(SAMPLED)
                assert r.num_computed_tokens + j == r.num_tokens - 1
                fed[j] = self.inflight.device_fed(r)
            token_ids += fed
            if r.params.adjusts_logits:
                terms[i] = self._row_terms(r)
        proposals = [r.draft_token_ids for r in reqs]
        return SchedulerOutput(
            request_ids=[r.request_id for r in reqs], num_tokens=counts,
            starts=[r.num_computed_tokens for r in reqs], token_ids=token_ids,
            page_tables=[self.kv.page_table(r.request_id) for r in reqs], params=[r.params for r in reqs],
            seeds=[r.seed for r in reqs], output_index=[len(r.output_token_ids) + len(r.inflight) for r in reqs],
            logit_terms=terms, proposals=proposals,
            num_speculative=self.config.num_speculative_tokens if any(proposals) else 0,
            num_steps=num_steps, constrained=self.constraining and any(r.request_id in self.matchers for r in reqs))

    def _row_terms(self, r: Request) -> RowTerms:
        p = r.params
        held = ()
        if p.min_tokens > len(r.output_token_ids) + len(r.inflight):
            held = (*p.stop_token_ids, *(() if p.ignore_eos else self.config.eos_token_ids))
        return RowTerms(r.prompt_token_ids if p.repetition_penalty != 1.0 else (),
                        r.output_token_ids if r.penalized else (), held)

    def _chunk(self, req: Request, budget: int) -> int:
        """Tokens ``req`` feeds this step: a prefill chunk, or its last token and the proposals after it
        (those that fit the budget)."""
        if req.is_prefill:
            return min(req.num_remaining, budget, self.config.prefill_chunk_size)
        n = min(1 + len(req.draft_token_ids), budget)
        del req.draft_token_ids[max(0, n - 1):]
        return n

    def _preempt(self, req: Request) -> None:
        log.debug("preempted %s (%s): %d tokens computed, %d in flight, %d of them proposals", req.request_id,
                  self.config.preemption_mode, req.num_computed_tokens, len(req.inflight),
                  sum(t != SAMPLED for t in req.inflight))
        self.running.remove(req)
        if self.config.preemption_mode == "swap":
            req.swapped = self.swap_out(self.kv.page_table(req.request_id)[:self.kv.pages_needed(req.num_computed_tokens)])
        else:
            req.num_computed_tokens = 0
        self.kv.free(req)
        req.draft_token_ids = []
        req.status = Status.PREEMPTED
        self.num_preemptions += 1
        self.preempted.append(req)

    def _admit(self, req: Request) -> bool:
        """Give a waiting or preempted request its pages; False if they don't fit."""
        if req.swapped is not None:
            # Room for every known token: one preempted mid-prefill resumes with a whole chunk.
            table = self.kv.allocate_fresh(req, req.num_tokens)
            if table is None:
                return False
            self.swap_in(req.swapped, table)
            req.swapped = None
            return True
        assert not req.inflight, "a request is re-admitted only once its in-flight steps are read"
        cached = self.kv.allocate(req)
        if cached is None:
            return False
        req.num_computed_tokens = cached
        if not req.output_token_ids:
            req.num_cached_tokens = cached
        return True

    def _fit_bucket(self, batch: dict) -> None:
        """Trim prefill chunks, newest first, down to the largest bucket below the step's tokens when
        the bucket the step needs would be mostly padding (module docstring). Decodes are never
        trimmed; a trimmed-away request stays running (its pages stay allocated) and goes next step."""
        buckets, total = self.config.token_buckets, sum(n for _, n in batch.values())
        if not buckets or total <= buckets[0] or total > buckets[-1]:
            return
        i = bisect.bisect_left(buckets, total)
        if buckets[i] == total or total >= self.config.min_bucket_fill * buckets[i]:
            return
        excess = total - buckets[i - 1]
        for key in reversed(list(batch)):
            req, n = batch[key]
            if not req.is_prefill:
                continue
            cut = min(n, excess)
            if cut == n:
                del batch[key]
            else:
                batch[key] = (req, n - cut)
            excess -= cut
            if not excess:
                return

    def _preempt_for(self, req: Request, batch: dict) -> bool:
        """Priority policy: preempt lower-priority running requests until ``req`` has a slot and pages."""
        if self.config.policy != "priority":
            return False
        while self.running and self.key(self.running[-1]) > self.key(req):
            victim = self.running[-1]
            batch.pop(id(victim), None)
            self._preempt(victim)
            if len(self.running) < self.config.max_num_seqs and self._admit(req):
                return True
        return False

    def _num_steps(self, reqs: list[Request], counts: list[int]) -> int:
        """How many decode steps the batch runs in one dispatch: ``num_scheduler_steps`` where every
        request decodes (one token) without logit terms, has room for that many tokens within
        ``max_model_len``, and the pool has their pages (reserved here), while no request that a free
        slot could take waits to be admitted (it would wait for all of them), none is preempted, and
        nothing speculates or is constrained; else one. Tokens past a request's end (EOS, a stop,
        ``max_tokens``) within the run are computed and dropped: waiting for the request nearest its
        ``max_tokens`` instead would run most steps of a batch one at a time."""
        n, c = self.config.num_scheduler_steps, self.config
        admissible = self.waiting and len(self.running) < c.max_num_seqs
        if n == 1 or admissible or self.preempted or c.num_speculative_tokens or self.constraining:
            return 1
        for req, k in zip(reqs, counts):
            if k != 1 or req.num_remaining != 1 or req.params.adjusts_logits or req.num_tokens + n > c.max_model_len:
                return 1
        need = sum(max(0, self.kv.pages_needed(r.num_computed_tokens + n) - self.kv.num_pages(r.request_id))
                   for r in reqs)
        if need > self.kv.num_free:
            return 1  # never preempts for it: the batch runs one step
        for r in reqs:
            self.kv.grow(r, r.num_computed_tokens + n)
        return n

    # ------------------------------------------------------------------------------- dispatch

    def dispatched(self, out: SchedulerOutput, steps: int) -> DispatchedStep:
        """The step ``out`` was dispatched, running ``steps`` decode steps (fewer than asked when the
        runner had not compiled the multi-step executable yet): advance every request as if it accepted
        every proposal (``InFlight.dispatch``) and publish the pages its known tokens filled."""
        reqs = [self.requests[rid] for rid in out.request_ids]
        c = self.counters
        for req, n in zip(reqs, out.num_tokens):
            c["computed_prompt_tokens"] += max(0, min(n, len(req.prompt_token_ids) - req.num_computed_tokens))
        step = self.inflight.dispatch(out, reqs, out.num_tokens, steps, self.config.max_model_len)
        for req in reqs:
            self.kv.commit(req)
        for req in self.running:  # proposals of requests the budget left out of this step
            req.draft_token_ids = []
        c["steps"] += steps
        c["step_tokens"] += sum(out.num_tokens) * steps
        c["spec_steps"] += bool(out.num_speculative)
        return step

    def propose(self, proposer: Proposer, k: int) -> None:
        """Proposals for the running requests that may speculate this step, each to follow its tokens
        as if its step in flight accepts every proposal (``Request.assumed_context``), at most k and
        leaving room for the step's own token within ``max_tokens`` and ``max_model_len``. A request a
        step would verify proposals for advances by the number accepted plus one; a step in which none
        has proposals is a plain step (the verifying variant would still take ``k + 1`` logits rows per
        request: on XLA:CPU the lm_head of 5 rows cost a batch-1 SmolLM2 step ~25% more than that of one)."""
        eligible, limits = [], []
        for req in self.running:
            if req.is_prefill or req.held or req.params.adjusts_logits:
                continue  # logit terms apply at a verified step's first position only
            limit = min(k, req.params.max_tokens - len(req.output_token_ids) - len(req.inflight) - 1,
                        self.config.max_model_len - req.num_tokens - 1)
            if limit > 0:
                eligible.append(req)
                limits.append(limit)
        for req, draft in zip(eligible, proposer.propose(eligible, limits) if eligible else []):
            req.draft_token_ids = list(draft)

    def needs_tokens(self) -> bool:
        """Whether a running request needs every generated token on the host before its next step
        (penalties count them), so the step in flight must be read first."""
        return any(r.inflight and r.penalized for r in self.running)

    # ------------------------------------------------------------------------------- update

    def update_from_output(self, step: DispatchedStep, out: ModelRunnerOutput, text: TextStops,
                           advanced: Callable[[], None] | None = None) -> list[Request]:
        """Apply a read step (the oldest in flight): each sampled request takes its tokens (a verifying
        step's accepted proposals plus the target's next token; a rejected proposal rolls back what was
        assumed), up to the first that ends it. Returns the requests that changed, finished ones
        included; a request whose constraint failed on its token finishes alone with ``error``.
        ``advanced`` is called once the matchers have taken their tokens, before the text is made: the
        engine starts the next step's bitmask there, filled while the tokens become text."""
        assert self.inflight.oldest() is step
        rows = [(i, step.requests[i]) for i in step.sampled if step.requests[i].status is not Status.FINISHED]
        new = {i: out.row(i) for i, _ in rows}  # rows finished or aborted since the step was dispatched: skipped
        complete, failed = set(), {}
        if self.constraining:
            # Constrained requests' matchers take their tokens; "complete": nothing but EOS may follow.
            # (A verifying step never has a constrained request: matchers stop speculation.)
            complete, failed = self.matchers.advance([(req.request_id, new[i][0]) for i, req in rows])
        if advanced is not None:
            advanced()
        changed = []
        for i, req in rows:
            ids, index = new[i]
            req.failed_steps = 0  # a step of its was read
            if out.verify:
                self._verified(req, len(ids) - 1)
            else:
                self.inflight.take(req, len(ids))
            if req.request_id in failed:
                self.finish(req, "error", RequestError(failed[req.request_id], invalid=True))
                changed.append(req)
                continue
            try:
                self._append(req, ids, self._tops(req, ids, out, index), text, req.request_id in complete)
            except Exception:  # noqa: BLE001 - logged; this request fails, the step goes on for the rest
                log.exception("request %s: its tokens could not be turned into output", req.request_id)
                self.finish(req, "error", RequestError("internal error while processing the request's output"))
            else:
                if out.verify and req.status is Status.RUNNING:
                    self.kv.truncate(req, req.num_tokens)  # pages left empty by rejected proposals
                    self.kv.commit(req)
            changed.append(req)
        return changed

    def _verified(self, req: Request, accepted: int) -> None:
        proposed, c = self.inflight.proposed(req), self.counters
        if proposed:
            c["spec_verified"] += 1
            c["spec_proposed"] += proposed
            c["spec_accepted"] += accepted
            req.rejected = accepted < proposed
        if accepted < proposed:
            c["spec_discarded"] += self.inflight.roll_back(req, req.num_known + accepted)
            if req.swapped is not None:
                req.swapped = [x[:, :self.kv.pages_needed(req.num_computed_tokens)] for x in req.swapped]
        else:
            self.inflight.take(req, proposed + 1)

    @staticmethod
    def _tops(req: Request, new: list[int], out: ModelRunnerOutput, index) -> list:
        """The logprob entry of each new token (None without ``logprobs``): its own logprob plus the
        step's top ``logprobs`` alternatives."""
        n = req.params.logprobs
        if n is None:
            return [None] * len(new)
        tops = [{t: float(lp)} for t, lp in zip(new, out.logprobs[index])]
        if n and out.top_ids is not None:
            for top, ids, lps in zip(tops, out.top_ids[index], out.top_logprobs[index]):
                top.update(zip(ids[:n].tolist(), lps[:n].tolist()))
        return tops

    def _append(self, req: Request, tokens: list[int], tops: list, text: TextStops, complete: bool) -> None:
        """Append a step's new tokens (one, or several from a multi-step or verifying step) up to the
        first that ends the request. ``complete``: the last token completes its structured output."""
        p = req.params
        for j, (token, top) in enumerate(zip(tokens, tops)):
            self.counters["generation_tokens"] += 1
            if (token in self.config.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids:
                text.add_stop_token(req, token)
                return self.finish(req, "stop")
            req.output_token_ids.append(token)
            if top is not None:
                req.output_top_logprobs.append(top)
            if text.add_token(req, token) or (complete and j == len(tokens) - 1):
                return self.finish(req, "stop")
            if len(req.output_token_ids) >= p.max_tokens or req.num_known >= self.config.max_model_len:
                return self.finish(req, "length")

    # ------------------------------------------------------------------------------- failures

    def recover(self, request_ids) -> list[Request]:
        """A whole step failed (the device, the runtime, a compilation): forget every step in flight and
        take every running or preempted request back to its known tokens, to be computed again from
        there (a recompute preemption); the pool's contents are no longer trusted, so the prefix cache
        forgets them too. Sampling is keyed by (seed, output index), so the recomputed tokens are
        those the failed steps would have given. The requests of the failed steps (``request_ids``)
        count a failure; those that reached ``MAX_STEP_FAILURES`` are finished with an error and
        returned."""
        live = self.running + self.preempted
        self.inflight.reset(live)
        for req in live:
            self.kv.free(req)
            req.num_computed_tokens, req.swapped, req.status = 0, None, Status.PREEMPTED
        self.preempted = sorted(live, key=self.key)
        self.running = []
        self.kv.reset_prefix_cache()
        if self.matchers is not None:
            for req in self.requests.values():
                if req.request_id in self.matchers:
                    self.matchers.replay(req.request_id, req.output_token_ids)
        failed = []
        for rid in dict.fromkeys(request_ids):
            req = self.requests.get(rid)
            if req is None:
                continue
            req.failed_steps += 1
            if req.failed_steps >= MAX_STEP_FAILURES:
                self.finish(req, "error", RequestError(f"the engine failed to run a step with this request "
                                                       f"{req.failed_steps} times in a row"))
                failed.append(req)
        return failed

    # ------------------------------------------------------------------------------- introspection

    def stats(self) -> dict:
        stored = sum(r.num_computed_tokens for r in self.running)
        slots = sum(self.kv.num_pages(r.request_id) for r in self.running) * self.kv.page_size
        return dict(running=len(self.running), waiting=len(self.waiting), preempted=len(self.preempted),
                    kv_utilization=stored / slots if slots else 1.0, preemptions=self.num_preemptions,
                    **self.kv.stats())
