"""The HTTP side's handle on the engine core process (``engine_core.py``).

The API process never touches an ``LLMEngine``: it validates and tokenizes prompts with the same
``encode_prompt`` the engine uses, sends commands down a pipe from a sender thread, and a receiver
thread hands each step's message to the event loop with ONE ``call_soon_threadsafe`` per step. There
each sub-request's new text and tokens are appended to its ``_Choice`` and its submission is woken;
a handler that reads slower than steps arrive finds several steps' worth merged into one output
(one SSE event), so a slow reader costs one string per choice, not a queue that grows per token.

Admission is answered on the event loop at once, before a request is tokenized: it counts the
sub-requests admitted and not yet released, which the front end knows exactly, against the
sequences the engine runs (``max_num_seqs`` per replica) plus ``max_waiting`` queued behind them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import multiprocessing
import queue
import threading
import time
from typing import Callable

from jaxinfer.batching.config import EngineConfig
from jaxinfer.batching.engine import encode_prompt
from jaxinfer.batching.outputs import EngineOutput
from jaxinfer.batching.structured import ConstraintCompiler, compiler_for
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.server import engine_core
from jaxinfer.server.metrics import Metrics
from jaxinfer.server.protocol import APIError
from jaxinfer.tokenizer import load_tokenizer, tokenizer_source

log = logging.getLogger(__name__)


@dataclasses.dataclass
class _Choice:
    """One sub-request as the front end sees it: everything so far, and what no reader has taken yet."""

    request_id: str
    prompt_token_ids: list[int]
    arrival: float
    wants_logprobs: bool
    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[dict[int, float]] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    first_token: float | None = None
    unread_chars: int = 0  # len(text) when a reader last took it
    unread_tokens: int = 0

    def take(self) -> EngineOutput:
        """The output since the last take (several steps merged if the reader fell behind)."""
        out = EngineOutput(self.request_id, self.prompt_token_ids, self.text, list(self.token_ids),
                           self.finish_reason is not None, self.finish_reason, self.text[self.unread_chars:],
                           self.token_ids[self.unread_tokens:], list(self.logprobs) if self.wants_logprobs else None,
                           self.num_cached_tokens)
        self.unread_chars, self.unread_tokens = len(self.text), len(self.token_ids)
        return out


class Submission:
    """The sub-requests of one HTTP request (``n`` choices times prompts), woken together."""

    def __init__(self, request_id: str, choices: list[_Choice]):
        self.request_id = request_id  # the HTTP request's, for the log
        self.request_ids = [c.request_id for c in choices]
        self.unfinished = set(self.request_ids)
        self._choices = {c.request_id: c for c in choices}
        self._dirty: dict[str, None] = {}  # ordered set of choices with unread output
        self._error: APIError | None = None
        self._wake = asyncio.Event()
        self._timer: asyncio.TimerHandle | None = None  # fails it at its deadline
        self.hung_up = False  # the client went away: next() returns at once

    def _update(self, rid: str) -> None:  # event loop
        self._dirty[rid] = None
        self._wake.set()

    def _fail(self, error: APIError) -> None:  # event loop
        if self._error is None:
            self._error = error
        self._wake.set()

    def hang_up(self) -> None:  # event loop
        self.hung_up = True
        self._wake.set()

    async def next(self) -> list[EngineOutput]:
        """Outputs of the sub-requests that changed since the last call, one per sub-request; raises
        the APIError that ended the submission, if any, at once (the siblings are aborted by
        ``release``). Returns [] once the client has hung up."""
        while not self._dirty and self._error is None and not self.hung_up:
            self._wake.clear()
            await self._wake.wait()
        if self._error is not None:
            raise self._error
        outs = [self._choices[rid].take() for rid in self._dirty]
        self._dirty.clear()
        for out in outs:
            if out.finished:
                self.unfinished.discard(out.request_id)
        return outs

    @property
    def done(self) -> bool:
        return not self.unfinished


class AsyncEngine:
    """Starts the engine core process and routes its per-step messages to submissions."""

    def __init__(self, model: str, config: EngineConfig, *, max_waiting: int,
                 on_fatal: Callable[[BaseException], None] | None = None,
                 distributed: tuple[str, int, int] | None = None, warmup_structured: bool = False):
        self._model, self._config, self._distributed = model, config, distributed
        self._warmup_structured = warmup_structured  # also compile constrained steps before /health is 200
        self._on_fatal = on_fatal
        self.max_waiting = max_waiting
        self.scheduling_policy = config.scheduling_policy
        self.max_running = config.max_num_seqs * config.data_parallel
        self.capacity = self.max_running + max_waiting  # sub-requests admitted at once
        self.metrics = Metrics(lambda: self._stats)
        self.ready = threading.Event()
        self.resolved_config: dict | None = None  # what the engine runs with (``ResolvedConfig.summary``)
        self.warmup_seconds: float | None = None
        self.draining = False
        self.failed = False  # the engine core could not start or exited while serving
        self.tokenizer = None
        self.constraints: ConstraintCompiler | None = None  # with the tokenizer (structured outputs)
        self.max_model_len: int | None = None
        self.vocab_size = 0
        self.hidden_size: int | None = None  # the model's (an embedding's length), once ready
        self.max_logprobs = 0  # the most top logprobs a request may ask for per token, once ready
        self._stats: dict | None = None  # the engine's last stats(), replaced whole per step
        self._ids = itertools.count()
        self._inflight = 0  # sub-requests admitted and not yet released (event-loop side)
        self._live: dict[str, tuple[_Choice, Submission]] = {}
        self._scores: dict[str, tuple[asyncio.Future, str]] = {}  # "score" commands unanswered, and their field
        self._loop: asyncio.AbstractEventLoop | None = None
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._stopped = threading.Event()
        self._process = None

    # ---------------------------------------------------------------------------- event-loop side

    def start(self) -> None:
        """Start the core process and the threads that talk to it (call on the serving event loop)."""
        self._loop = asyncio.get_running_loop()
        ctx = multiprocessing.get_context("spawn")  # never fork a process that may hold JAX/CUDA state
        cmd_recv, cmd_send = ctx.Pipe(duplex=False)
        out_recv, out_send = ctx.Pipe(duplex=False)
        self._process = ctx.Process(target=engine_core.run, args=(self._model, self._config, cmd_recv, out_send, self._distributed,
                                                                      self._warmup_structured),
                                    name="engine-core", daemon=True)
        self._process.start()
        log.info("engine core process %d: loading %s", self._process.pid, self._model)
        cmd_recv.close()
        out_send.close()
        threading.Thread(target=self._send_loop, args=(cmd_send,), name="engine-send", daemon=True).start()
        threading.Thread(target=self._receive_loop, args=(out_recv,), name="engine-receive", daemon=True).start()

    @property
    def alive(self) -> bool:
        """Whether the engine core process is up (loading, warming up or serving)."""
        return self._process is not None and self._process.is_alive() and not self.failed

    def encode(self, prompt, generate: bool = True) -> list[int]:
        return encode_prompt(prompt, self.tokenizer, self.vocab_size, self.max_model_len, generate)

    def embed(self, prompts: list[list[int]], pooling: str, normalize: bool) -> asyncio.Future:
        """Encoded prompts' embeddings (``LLMEngine.embed``): a future of float32 ``[prompts, hidden]``."""
        return self._score("embed", (prompts, pooling, normalize), "input")

    def prompt_logprobs(self, prompt: list[int], k: int) -> asyncio.Future:
        """An encoded prompt's logprobs with the top ``k`` per token (``LLMEngine.score_prompt``): a future
        of its ``PromptLogprobs``."""
        return self._score("prompt_logprobs", (prompt, k), "prompt_logprobs")

    def _score(self, kind: str, args: tuple, param: str) -> asyncio.Future:
        """Send a pass over prompts to the engine core, which runs it between two steps; the future's
        result is the pass's, or an APIError (400: naming ``param``, the field the prompts came from)."""
        self.check_serving()
        sid = f"score-{next(self._ids)}"
        future = self._loop.create_future()
        future.add_done_callback(lambda f: f.cancelled() or f.exception())  # an error nobody awaits is not logged
        self._scores[sid] = (future, param)
        self._outbox.put([("score", sid, kind, args)])
        return future

    def check_serving(self) -> None:
        if self.draining:
            raise APIError(503, "the server is shutting down", type="server_error", code="shutting_down")
        if self.failed:
            raise APIError(503, "the engine process exited; the server is stopping", type="server_error",
                           code="engine_failed")
        if not self.ready.is_set():
            raise APIError(503, "the server is still warming up; retry when /health answers 200",
                           type="server_error", code="warming_up")

    def admit(self, count: int, param: str) -> None:
        """Take ``count`` sub-request slots for a request about to be prepared, or raise at once: 400
        if it could never fit (``param`` names the field that made it big), 503 if there is no room
        now. Every admission ends in ``submit`` (then ``release``) or ``cancel``."""
        self.check_serving()
        holds = (f"the server holds {self.capacity} sequences: max_num_seqs={self.max_running} running + "
                 f"max_waiting={self.max_waiting} waiting")
        if count > self.capacity:
            raise APIError(400, f"this request needs {count} sequences (prompts x n), but {holds}", param=param,
                           code="too_many_sequences")
        if self._inflight + count > self.capacity:
            raise APIError(503, f"the server is full ({self._inflight} sequences running or waiting; {holds}); "
                                "retry later", type="server_error", code="queue_full")
        self._inflight += count

    def cancel(self, count: int) -> None:
        """Give back the slots of an admission that will not be submitted (its preparation failed)."""
        self._inflight -= count

    def submit(self, request_id: str, prefix: str, prompts: list[list[int]], params: list[SamplingParams], *,
               priority: int = 0, deadline: float | None = None, timeout_error: APIError | None = None) -> Submission:
        """Queue one sub-request per (prompt, params) pair, each with ``priority``, on slots ``admit`` took.
        At ``deadline`` (``time.monotonic()``) a submission not yet released fails with ``timeout_error``."""
        self.check_serving()  # shutdown may have begun while the request was prepared
        now = time.monotonic()
        choices = [_Choice(f"{prefix}-{next(self._ids)}", ids, now, p.logprobs is not None)
                   for ids, p in zip(prompts, params)]
        sub = Submission(request_id, choices)
        for c, ids, p in zip(choices, prompts, params):
            self._live[c.request_id] = (c, sub)
        self._outbox.put([("add", c.request_id, ids, p, priority) for c, ids, p in zip(choices, prompts, params)])
        if deadline is not None:
            sub._timer = self._loop.call_later(deadline - now, sub._fail, timeout_error)
        return sub

    def release(self, sub: Submission) -> None:
        """Call once per submission when its handler is done: aborts what did not finish (a client
        that went away, a deadline) so its KV pages are freed, and frees its admission slots."""
        aborts = [("abort", rid) for rid in sub.unfinished if self._live.pop(rid, None) is not None]
        if aborts:
            self._outbox.put(aborts)
        if sub._timer is not None:
            sub._timer.cancel()
        self._inflight -= len(sub.request_ids)
        sub.unfinished.clear()

    def drain(self, timeout: float) -> None:
        """Refuse new requests from now on and fail those still unfinished after ``timeout`` seconds
        with a 503 ``shutting_down`` (streams end with that error event and ``[DONE]``). Safe to call
        from a signal handler."""
        self.draining = True
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._loop.call_later, timeout, self._abort_all)

    def _abort_all(self) -> None:
        subs = {id(sub): sub for _, sub in self._live.values()}
        for sub in subs.values():
            log.warning("request %s aborted: still running when the shutdown timeout passed", sub.request_id)
        self._on_error(None, APIError(503, "the server shut down before this request finished",
                                      type="server_error", code="shutting_down"))

    def shutdown(self, timeout: float | None = None) -> bool:
        """Stop the core, failing whatever is still queued or running; True if it exited in time."""
        self.draining = True
        if self._process is None:
            return True
        if self._process.is_alive():
            self._outbox.put([("stop",)])
            self._stopped.wait(timeout)
            self._process.join(timeout)
        return not self._process.is_alive()

    def _on_step(self, step: engine_core.StepOutputs, stats: dict) -> None:
        now = time.monotonic()
        for rid, text, token_ids, finish_reason, num_cached, logprobs in step.rows():
            entry = self._live.get(rid)
            if entry is None:
                continue  # released (client gone) while this step ran
            c, sub = entry
            if c.first_token is None:
                c.first_token = now
            c.text += text
            c.token_ids += token_ids
            if logprobs is not None:
                c.logprobs += logprobs
            if num_cached is not None:
                c.num_cached_tokens = num_cached
            if finish_reason is not None:
                c.finish_reason = finish_reason
                del self._live[rid]
                self.metrics.observe(c.arrival, c.first_token, now, len(c.token_ids))
            sub._update(rid)
        self._stats = stats

    def _on_scored(self, sid: str, result, error: tuple[int, str] | None) -> None:
        future, param = self._scores.pop(sid, (None, None))
        if future is None or future.done():
            return  # its handler gave up (a timeout)
        if error is None:
            future.set_result(result)
        elif error[0] == 400:
            future.set_exception(APIError(400, f"{param}: {error[1]}", param=param))
        else:
            log.error("%s: %s", sid, error[1])
            future.set_exception(APIError(error[0], f"internal error ({sid})", type="server_error"))

    def _on_error(self, rid: str | None, error: APIError) -> None:
        """Fail one sub-request's submission, or every live one (rid None), passes over prompts included."""
        if rid is None:
            for future, _ in self._scores.values():
                if not future.done():
                    future.set_exception(error)
            self._scores.clear()
        rids = list(self._live) if rid is None else [rid]
        for r in rids:
            entry = self._live.pop(r, None)
            if entry is not None:
                entry[1]._fail(error)

    def _on_engine_error(self, rid: str, status: int, message: str) -> None:
        """A sub-request the engine refused (400: the message is for the client) or failed (the
        message is internal: logged, and the client gets the request id to quote)."""
        entry = self._live.get(rid)
        if entry is None:
            return
        if status == 400:
            self._on_error(rid, APIError(400, message))
            return
        sub = entry[1]
        if sub._error is None:  # one line per request, not per choice
            log.error("request %s: %s", sub.request_id, message)
        self._on_error(rid, APIError(status, f"internal error (request id {sub.request_id})", type="server_error"))

    # ------------------------------------------------------------------------------ pipe threads

    def _send_loop(self, conn) -> None:
        """Batch whatever commands piled up into one pipe message (blocking here, never on the loop)."""
        while True:
            batch = self._outbox.get()
            while not self._outbox.empty():
                batch += self._outbox.get_nowait()
            try:
                conn.send(batch)
            except (BrokenPipeError, OSError):
                return
            if batch[-1] == ("stop",):
                return

    def _receive_loop(self, conn) -> None:
        cause = None  # why serving ends: "" when the front end stopped it, else the one line the log says
        try:
            # While the core warms up (a Hub id: from the cache `jaxinfer serve` fetched it into first).
            source = tokenizer_source(self._model, self._config)
            self.tokenizer = None if source is None else load_tokenizer(source)
            if self.tokenizer is not None:
                # This process compiles constraints too (to answer a bad one with a 400 and name its
                # relaxations), with the engine's JSON whitespace. Built now rather than by the first
                # constrained request, whose preparation would hold the GIL for its ~0.3 s of Python
                # (seconds on a busy CPU) and stall the event loop.
                self.constraints = compiler_for(self.tokenizer, whitespace=self._config.structured_outputs_whitespace)
            while cause is None:
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    cause = "" if self.draining else f"the engine core process exited unexpectedly ({self._exit()})"
                    break
                kind = msg[0]
                if kind == "step":
                    cause = self._post(self._on_step, msg[1], msg[2])
                elif kind == "scored":
                    cause = self._post(self._on_scored, msg[1], msg[2], msg[3])
                elif kind == "error":
                    cause = self._post(self._on_engine_error, msg[1], msg[2], msg[3])
                elif kind == "ready":
                    info = msg[1]
                    self.max_model_len, self.vocab_size = info["max_model_len"], info["vocab_size"]
                    self.hidden_size, self.max_logprobs = info["hidden_size"], info["config"]["max_logprobs"]
                    self.warmup_seconds, self._stats = info["warmup_seconds"], info["stats"]
                    self.resolved_config = info["config"]
                    self.ready.set()
                elif kind == "stopped":
                    self._stats = msg[1]
                    cause = ""
                elif kind == "fatal":
                    cause = f"the engine failed to start: {msg[1]}"
        except Exception as e:  # noqa: BLE001 - reported once, and the server exits
            cause = f"the server {'lost its engine core' if self.ready.is_set() else 'could not start'}: " \
                    f"{type(e).__name__}: {e}"
        finally:
            self._stopped.set()
        error = APIError(503, "the server shut down before this request finished", type="server_error",
                         code="shutting_down")
        if cause:  # the core could not start or died under us: fail everything and stop serving
            self.failed = True
            log.error("%s", cause)
            error = APIError(500, "the engine process exited before this request finished", type="server_error")
            if self._on_fatal:
                self._on_fatal(RuntimeError(cause))
        self._post(self._on_error, None, error)

    def _post(self, callback, *args) -> str | None:
        """Run ``callback(*args)`` on the event loop; "" (serving is over) once that loop has closed."""
        try:
            self._loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # the loop closed: the server is exiting
            return ""
        return None

    def _exit(self) -> str:
        """How the core process ended, in words (it has closed its pipe, so it is exiting)."""
        self._process.join(5)
        code = self._process.exitcode
        if code is None:
            return "still running"
        return f"killed by signal {-code}" if code < 0 else f"exit code {code}"
