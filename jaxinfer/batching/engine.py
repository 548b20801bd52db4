"""The engine loop: ``step`` = the scheduler's ``schedule`` -> the model runner's ``execute`` -> the
scheduler's ``update_from_output``, with the reading of each step overlapped with the next.

``add_request`` tokenizes and validates; each ``step`` dispatches one compiled step and turns the
previous step's sampled tokens into incremental outputs (text, stop strings). The scheduler owns
every request's state, the model runner the device's, the output processor the text's; the engine
only moves data between them. Built by ``factory.build_engine``.
"""

from __future__ import annotations

import logging
import time
from typing import Sequence as Seq

import numpy as np

from jaxinfer.batching.buckets import Buckets, geometric
from jaxinfer.batching.inflight import DispatchedStep
from jaxinfer.batching.model_runner import ModelRunner
from jaxinfer.batching.outputs import EngineOutput, OutputProcessor, PromptLogprobs
from jaxinfer.batching.request import Request, RequestError, Status
from jaxinfer.batching.resolve import ResolvedConfig
from jaxinfer.batching.scheduler import Scheduler
from jaxinfer.batching.speculative import Proposer
from jaxinfer.models.config import ModelConfig
from jaxinfer.models.pooling import POOLING
from jaxinfer.sampling import VerifyResult
from jaxinfer.sampling_params import SamplingParams, check_logit_bias

log = logging.getLogger(__name__)


def encode_prompt(prompt: str | Seq[int], tokenizer, vocab_size: int, max_model_len: int,
                  generate: bool = True) -> list[int]:
    """Token ids of a prompt (text or ids), checked against the vocabulary and ``max_model_len``
    (``generate``: leaving room for a generated token; an embedding's prompt may fill the context).

    A free function so that a front end in another process (the server's) validates prompts exactly
    as the engine does, without holding the engine.
    """
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt must not be empty")
        if tokenizer is None:
            raise ValueError("this model has no tokenizer (dummy weights, or skip_tokenizer_init=True): pass "
                             "prompts as token ids")
        ids = list(tokenizer.encode(prompt))
        if not ids:  # its characters are bytes the vocabulary has no token for (SmolLM2 lacks 21)
            raise ValueError("prompt encodes to no tokens: the tokenizer has no token for its characters")
    else:
        ids = list(prompt)
        if any(isinstance(t, bool) or not isinstance(t, (int, np.integer)) for t in ids):
            raise TypeError("a token-id prompt must be a list of integers")
        ids = [int(t) for t in ids]
        if not ids:
            raise ValueError("prompt must not be empty")
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt token ids must be in [0, {vocab_size}), got {bad[:5]}")
    if len(ids) > (max_model_len - 1 if generate else max_model_len):
        raise ValueError(f"prompt has {len(ids)} tokens but max_model_len is {max_model_len}" +
                         (" (the prompt must leave room for at least one generated token)" if generate else ""))
    return ids


class LLMEngine:
    """One model replica: ``resolved.tensor_parallel`` devices (a row of the ``data_parallel x
    tensor_parallel`` mesh); ``data_parallel`` replicas are run side by side by
    ``replicas.ReplicatedEngine``."""

    def __init__(self, config, resolved: ResolvedConfig, model_config: ModelConfig, tokenizer,
                 runner: ModelRunner, scheduler: Scheduler, proposer: Proposer | None = None,
                 multihost: bool = False):
        self.config = config  # the EngineConfig asked for; ``resolved`` is what runs
        self.resolved = resolved
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.max_model_len = resolved.max_model_len
        self.runner = runner
        self.scheduler = scheduler
        self.processor = OutputProcessor(tokenizer)
        self.proposer = proposer
        self._multihost = multihost
        self._rng = np.random.default_rng(resolved.seed)
        self._arrivals = 0
        self._last: DispatchedStep | None = None  # the step dispatched last, not yet read
        self._scheduled = None  # the step being dispatched (``step``: a failure counts against its requests)
        self._host_time = 0.0
        spec = resolved.speculative
        self._speculating = proposer is not None
        self._overlap = spec is not None and spec.overlap

    # ----------------------------------------------------------------------------------- input side

    def encode(self, prompt: str | Seq[int]) -> list[int]:
        """Token ids of a prompt (text or ids), checked against the vocabulary and ``max_model_len``."""
        return encode_prompt(prompt, self.tokenizer, self.model_config.vocab_size, self.max_model_len)

    def add_request(self, request_id: str, prompt: str | Seq[int], params: SamplingParams | None = None,
                    priority: int = 0) -> None:
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        if request_id in self.scheduler.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise TypeError(f"priority must be an integer, got {priority!r}")
        if params.logprobs is not None and params.logprobs > self.resolved.max_logprobs:
            raise ValueError(f"logprobs must be in [0, {self.resolved.max_logprobs}] (the engine's max_logprobs), "
                             f"got {params.logprobs}")
        if params.structured is not None and self._multihost:
            raise ValueError("structured outputs are not supported over several processes")
        check_logit_bias(params, self.model_config.vocab_size)
        if params.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs are computed apart from generation: LLM.generate does, with "
                             "LLMEngine.prompt_logprobs")
        ids = self.encode(prompt)
        seed = params.seed if params.seed is not None else int(self._rng.integers(2**32))
        req = Request(request_id, ids, params, seed, priority=priority, arrival_index=self._arrivals)
        self.scheduler.add_request(req)  # ValueError for a bad constraint, before anything is queued
        self._arrivals += 1
        self.processor.add(req)

    def embed(self, prompts: Seq[Seq[int]], pooling: str = "last", normalize: bool = True) -> list[np.ndarray]:
        """Each token-id prompt's embedding (float32 ``[hidden_size]``): its final hidden states pooled
        (``models.pooling``: "last" or "mean"), L2-normalized if ``normalize``. A prompt may fill
        ``max_model_len``; a longer one is a ValueError naming the limit.

        Runs at once, on the caller's thread: the engine's thread, between two steps (the server's
        engine core runs it between ``step`` calls; ``LLM.embed`` when no request is running). A
        pass reads only the weights, never the KV pool or the scheduler's state, so a step may still
        be in flight: the device runs the two one after the other, and the next step waits for the
        pass, as it would for a prefill chunk of the same tokens. Prompts are packed in order into
        passes of at most ``max_num_batched_tokens`` tokens (a longer prompt runs alone) and
        ``max_num_seqs`` prompts; a pass's tokens and prompts are padded to powers of two (tokens up
        to ``max_model_len``), so repeated calls reuse the compiled passes."""
        if pooling not in POOLING:
            raise ValueError(f"pooling must be one of {', '.join(POOLING)}, got {pooling!r}")
        if self._multihost:
            raise ValueError("embeddings are not supported over several processes")
        ids = [encode_prompt(list(p), None, self.model_config.vocab_size, self.max_model_len, generate=False)
               for p in prompts]
        r = self.resolved
        budget, most = min(r.max_num_batched_tokens, self.max_model_len), r.max_num_seqs
        passes: list[list[list[int]]] = []
        total = 0
        for p in ids:
            if not passes or len(passes[-1]) == most or total + len(p) > budget:
                passes.append([])
                total = 0
            passes[-1].append(p)
            total += len(p)
        token_buckets, seq_buckets = geometric(16, self.max_model_len, 2), geometric(1, most, 2)
        out: list[np.ndarray] = []
        for batch in passes:
            tokens = Buckets.pick(token_buckets, sum(len(p) for p in batch))
            out += list(self.runner.embed(batch, tokens, Buckets.pick(seq_buckets, len(batch)), pooling, normalize))
        return out

    def prompt_logprobs(self, prompt: Seq[int], k: int) -> list[dict[int, float] | None]:
        """vLLM's prompt logprobs of a token-id prompt: None for its first token, then per token a dict of
        its own log-probability given the tokens before it and the ``k`` most likely tokens' (under the
        model's raw distribution); ``score_prompt``'s arrays as dicts."""
        return self.score_prompt(prompt, k).as_dicts()

    def score_prompt(self, prompt: Seq[int], k: int) -> PromptLogprobs:
        """The prompt logprobs of a token-id prompt as arrays, with each token's rank: one pass over the
        prompt (``models.pooling.token_logprobs``), run at once on the caller's thread as ``embed`` is;
        its token count padded to a power of two."""
        if self._multihost:
            raise ValueError("prompt_logprobs are not supported over several processes")
        if not 0 <= k <= self.resolved.max_logprobs:
            raise ValueError(f"prompt_logprobs must be in [0, {self.resolved.max_logprobs}] (the engine's "
                             f"max_logprobs), got {k}")
        ids = encode_prompt(list(prompt), None, self.model_config.vocab_size, self.max_model_len, generate=False)
        tokens = Buckets.pick(geometric(16, self.max_model_len, 2), len(ids))
        target, rank, top = self.runner.prompt_logprobs(ids, tokens, k)
        if top is None:
            top = np.zeros((len(target), 0), np.float32), np.zeros((len(target), 0), np.int32)
        return PromptLogprobs(ids, target, rank, *top)

    def abort(self, request_id: str) -> bool:
        """Stop a request wherever it is; its pages are freed at once. False if it is unknown."""
        if self.scheduler.abort(request_id) is None:
            return False
        self.processor.drop(request_id)
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()  # a request whose last token is in flight is still running

    @property
    def num_unfinished(self) -> int:
        return len(self.scheduler.requests)

    # ---------------------------------------------------------------------------------- the step

    def step(self) -> list[EngineOutput]:
        """Dispatch the next step and read the previous one (``_step``). A step that fails as a whole
        (the device, the runtime, a compilation) is recovered from, not raised: every request goes back
        to its known tokens and is computed again (``Scheduler.recover``), so none is lost or changed;
        one that was in ``MAX_STEP_FAILURES`` failed steps in a row fails alone with an error. Over
        several processes the followers cannot follow a recovery: there the failure is raised."""
        self._scheduled, outputs = None, []
        try:
            self._step(outputs)
        except Exception as e:  # noqa: BLE001 - recovered: every request is recomputed or failed with its error
            if self._multihost:
                raise
            outputs += self._recover(e)
        return outputs

    def _recover(self, error: Exception) -> list[EngineOutput]:
        s = self.scheduler
        ids = [rid for step in s.inflight.steps for rid in step.out.request_ids]
        ids += self._scheduled.request_ids if self._scheduled is not None else []
        log.error("a step failed (%s: %s); recomputing its %d requests", type(error).__name__, error, len(set(ids)),
                  exc_info=error)
        self._last = None
        failed = s.recover(ids)
        self.runner.reset()
        for req in s.requests.values():
            self.processor.resync(req)
        return [self._output(req) for req in failed]

    def _step(self, outputs: list[EngineOutput]) -> None:
        """Dispatch the next step, then read the previous one's tokens while the device works (into
        ``outputs``, which keeps what was read should a later part of the step fail).

        Decode inputs of the new step come from the previous step's sampled tokens on device, so
        the host never waits for them before dispatching; outputs therefore lag one step. A request
        that turns out to have finished in the previous step wastes its slot in the new one
        (``inflight.py`` has the protocol).

        Steps that verify proposals stay in flight the same way where ``speculative_overlap`` is on:
        the new step's proposals follow the context that assumes the step in flight accepts all of its
        own, and where it turns out to have rejected one, what the new step computed for that request
        is discarded. On an H200 dispatching a batch-1 llama3-8b verify step from an idle device cost
        ~1-1.2 ms next to its 4.9 ms on device. Without it, the step in flight is read before proposing.
        """
        t0 = time.perf_counter()
        s = self.scheduler
        speculate = self.proposer is not None and self._speculate_now()
        if self._last is not None and (
                (speculate and not self._overlap)  # proposals from known tokens only
                or (not speculate and isinstance(self._last.result, VerifyResult))  # see ``InFlight.roll_back``
                or s.needs_tokens()):
            outputs += self._read(self._last)  # counts its own host time
            self._last = None
            t0 = time.perf_counter()
        if speculate:
            s.propose(self.proposer, self.resolved.speculative.num_tokens)
        out = self._scheduled = s.schedule()
        previous, self._last = self._last, None
        if out is not None and out.constrained:
            # Constrained rows need their bitmask, which needs the last step's tokens: dispatch the
            # forward pass; read the last step while it runs, its matchers advancing first so that the
            # bitmask fills (off the GIL) while its tokens are turned into outputs; then sample.
            sample = self.runner.run_forward(out)
            step = s.dispatched(out, 1)
            rows: list[tuple[int, str]] = []
            filling = None

            def fill():  # every earlier step's tokens are read by now: the bitmask's buffer is free
                nonlocal filling
                rows[:] = [(i, req.request_id) for i in step.sampled if (req := step.requests[i]).status
                           is not Status.FINISHED and req.request_id in s.matchers]
                free = np.ones(sample.rows, bool)
                free[[i for i, _ in rows]] = False
                sample.bitmask[free] = -1  # every token allowed: rows of free requests, padding, prefill chunks
                filling = s.matchers.fill(sample.bitmask, rows)

            host = time.perf_counter() - t0
            if previous is not None:
                outputs += self._read(previous, advanced=fill)  # counts its own host time
                previous = None
            t0 = time.perf_counter()
            if filling is None:
                fill()
            filling.result()
            for i, rid in rows:  # a matcher that could not compute its mask: that request fails alone
                error = s.matchers.errors([rid]).get(rid)
                if error is not None:
                    sample.bitmask[i] = -1
                    req = step.requests[i]
                    s.finish(req, "error", RequestError(error, invalid=True))
                    outputs.append(self._output(req))
            step.result = sample()
            self._last = step
            host += time.perf_counter() - t0
        else:
            if out is not None:
                result, steps = self.runner.execute(out)
                self._last = s.dispatched(out, steps)
                self._last.result = result
            host = time.perf_counter() - t0
        if previous is not None:
            outputs += self._read(previous)
        self._host_time += host

    def _read(self, step: DispatchedStep, advanced=None) -> list[EngineOutput]:
        """Turn a dispatched step's sampled tokens into outputs (blocks until the device has them);
        ``advanced`` is called once the constrained requests' matchers have taken their tokens."""
        host = self.runner.fetch(step.result, any(step.requests[i].params.logprobs is not None for i in step.sampled))
        t0 = time.perf_counter()
        changed = self.scheduler.update_from_output(step, host, self.processor, advanced)
        outputs = [self._output(req) for req in changed]
        self._host_time += time.perf_counter() - t0
        return outputs

    def _output(self, req: Request) -> EngineOutput:
        """The processor's output for ``req``, or the request failed alone where making it raised (a
        detokenizer bug must not fail the step of every request beside it)."""
        try:
            return self.processor.output(req)
        except Exception:  # noqa: BLE001 - logged; the client gets the request's error, not the trace
            log.exception("request %s: its output could not be made", req.request_id)
            error = RequestError("internal error while processing the request's output")
            if req.status is not Status.FINISHED:
                self.scheduler.finish(req, "error", error)
            self.processor.drop(req.request_id)
            return EngineOutput(req.request_id, req.prompt_token_ids, "", list(req.output_token_ids), True, "error",
                                error=error)

    def _speculate_now(self) -> bool:
        """Whether this step speculates: not above ``speculative_max_num_seqs`` running requests, where
        verifying k more tokens per request stops being free next to reading the weights, and not while
        a request with structured outputs is live (its bitmask would be needed at every proposed position)."""
        s, spec = self.scheduler, self.resolved.speculative
        on = len(s.running) <= spec.max_num_seqs and not s.constraining
        if on != self._speculating:
            log.info("speculative decoding %s: %d requests running (speculative_max_num_seqs=%d)",
                     "resumed" if on else "paused", len(s.running), spec.max_num_seqs)
            self._speculating = on
        return on

    # ------------------------------------------------------------------------------- introspection

    def warmup(self, shapes=None, greedy_only: bool = False, structured: bool = False,
               background: bool = False) -> float:
        """Compile every step shape now (or the given ``(tokens, seqs, pages)`` ones); returns seconds.
        ``structured``: also what steps with constrained requests run (else compiled on first use).
        ``background``: only the steps a single request meets first now, the rest in a background
        thread (``wait_warmup`` joins it)."""
        t0 = time.perf_counter()
        spec = self.resolved.speculative
        self.runner.warmup(shapes, greedy_only, structured, spec.num_tokens if spec is not None else 0, background)
        draft = getattr(self.proposer, "engine", None)
        if draft is not None:  # a draft model's proposals are greedy
            draft.warmup(greedy_only=True)
        return time.perf_counter() - t0

    def wait_warmup(self, stop: bool = False) -> None:
        """Block until a background warm-up has compiled the rest of its plan (``stop``: until it
        has stopped, after the step under way)."""
        self.runner.wait_warmup(stop)

    @property
    def num_compilations(self) -> int:
        return self.runner.num_compilations

    def stats(self) -> dict:
        s = self.scheduler
        c = s.counters
        steps = max(1, c["steps"])
        return dict(
            **s.stats(), compilations=self.num_compilations,
            prompt_tokens=c["prompt_tokens"], generation_tokens=c["generation_tokens"],
            computed_prompt_tokens=c["computed_prompt_tokens"], steps=c["steps"],
            tokens_per_step=c["step_tokens"] / steps, host_time_per_step=self._host_time / steps,
            spec_steps=c["spec_steps"], spec_proposed_tokens=c["spec_proposed"],
            spec_accepted_tokens=c["spec_accepted"],
            spec_acceptance_rate=c["spec_accepted"] / max(1, c["spec_proposed"]),
            # requests' parts of steps dispatched ahead of a verification that then rejected a proposal
            spec_discarded=c["spec_discarded"],
            # tokens a request gained per verification of its proposals (1 without speculation)
            spec_mean_accepted_length=(c["spec_accepted"] + c["spec_verified"]) / max(1, c["spec_verified"]),
        )
