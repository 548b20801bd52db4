"""The engine core: an ``LLMEngine`` stepping in its own process, fed and drained through two pipes.

Why a process: in one process the engine's host loop (scheduling, reading sampled tokens,
detokenizing) and the HTTP side (parsing, SSE encoding, socket writes for hundreds of streams)
take turns on one GIL, and every token the event loop handles is time the engine does not
dispatch its next step. Here the engine loop never waits on the HTTP side: it applies whatever
commands arrived, steps, and sends ONE message per step carrying every sequence's new tokens and
text (as vLLM's EngineCore does). Detokenization and stop strings stay in the engine, where the
offline path runs them too (overlapped with the device step), so streamed text equals ``LLM.generate``'s.

Messages, front end -> core (each a list of commands, sent in batches):
    ("add", request_id, prompt_ids, SamplingParams, priority) | ("abort", request_id) | ("stop",)
    | ("score", score_id, kind, args): a pass over prompts, run between two steps: kind "embed" with
        args ([prompt_ids, ...], pooling, normalize) (``LLMEngine.embed``), or "prompt_logprobs" with
        args (prompt_ids, k) (``LLMEngine.score_prompt``)
core -> front end:
    ("ready", info) once, after warm-up; ("fatal", message) if the engine could not start;
    ("step", StepOutputs, stats) once per step that produced outputs or changed state;
    ("error", request_id, status, message) for a request the engine refused or that failed alone (400:
        the request's own fault, the message is for the client; else the engine's, logged);
    ("scored", score_id, result | None, None | (status, message)) per "score": "embed"'s float32 array
        [prompts, hidden], "prompt_logprobs"' ``PromptLogprobs``; or why not (400: the request's fault);
    ("stopped", stats) as the last message.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import queue
import signal
import threading
import time
import traceback
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from typing import NamedTuple

import jax
import numpy as np

from jaxinfer.batching import multihost
from jaxinfer.batching.config import EngineConfig
from jaxinfer.batching.engine import LLMEngine
from jaxinfer.batching.factory import create_engine
from jaxinfer.batching.outputs import EngineOutput
from jaxinfer.batching.structured import compile_constraint

log = logging.getLogger(__name__)


class StepOutputs(NamedTuple):
    """What one step added to every request that produced output, as columns: a step's message
    pickles as a few flat lists (~25 us for 256 requests on a 2-core CPU, where a tuple per request
    cost ~260 us to build and pickle, on the engine's host time)."""

    request_ids: list[str]
    texts: list[str]  # new text of each request
    token_ids: list[int]  # every request's new ids, concatenated
    num_tokens: list[int] | None  # new ids of each request; None: exactly one each (the usual step)
    finished: dict[int, str]  # index -> finish reason, for requests that finished
    num_cached_tokens: dict[int, int]  # index -> prompt tokens found in the prefix cache, where not 0
    logprobs: dict[int, list[dict[int, float]]]  # index -> one dict per new token, where asked for

    @classmethod
    def of(cls, outs: list[EngineOutput]) -> "StepOutputs":
        num_tokens = [len(o.delta_token_ids) for o in outs]
        return cls([o.request_id for o in outs], [o.delta_text for o in outs],
                   [t for o in outs for t in o.delta_token_ids],
                   None if all(n == 1 for n in num_tokens) else num_tokens,
                   {i: o.finish_reason for i, o in enumerate(outs) if o.finished},
                   {i: o.num_cached_tokens for i, o in enumerate(outs) if o.num_cached_tokens},
                   {i: o.logprobs[len(o.logprobs) - len(o.delta_token_ids):]
                    for i, o in enumerate(outs) if o.logprobs is not None})

    def rows(self):
        """``(request_id, text, token_ids, finish_reason, num_cached_tokens, logprobs)`` per request;
        ``num_cached_tokens`` is None where the step did not say (it is fixed by a request's first output)."""
        start = 0
        for i, rid in enumerate(self.request_ids):
            end = start + (1 if self.num_tokens is None else self.num_tokens[i])
            yield (rid, self.texts[i], self.token_ids[start:end], self.finished.get(i),
                   self.num_cached_tokens.get(i), self.logprobs.get(i))
            start = end


def run(model: str, config: EngineConfig, commands: Connection, outputs: Connection,
        distributed: tuple[str, int, int] | None = None, warmup_structured: bool = False) -> None:
    """Process entry point: build and warm the engine, then serve commands until told to stop or
    until the front end goes away (its pipe end closes). ``distributed``: (coordinator address,
    processes, this process's id) when this core is process 0 of a multi-process run. ``warmup_structured``:
    also compile the steps constrained requests run as, so the first one does not stall the engine."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front end owns shutdown (SIGTERM drain)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s engine-core: %(message)s")
    logging.getLogger("jax").setLevel(logging.WARNING)  # its INFO lines (no libtpu, cache resets) are noise here
    t0 = time.monotonic()
    heartbeat = _Heartbeat()
    try:
        if distributed is not None:
            multihost.initialize(*distributed)
        log.info("started: JAX %s on %s", jax.__version__, jax.default_backend())
        with heartbeat.phase(f"loading {model}"):
            engine = create_engine(model, config)
        # /health answers once a single request's steps are compiled; the rest compile meanwhile
        with heartbeat.phase("compiling the steps of a first request"):
            warmup = engine.warmup(structured=warmup_structured, background=True)
    except BaseException as e:  # noqa: BLE001 - reported to the front end, which exits
        outputs.send(("fatal", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        return
    finally:
        heartbeat.stop()
    log.info("ready in %.1fs: model loaded, %d step shapes compiled in %.1fs", time.monotonic() - t0,
             engine.num_compilations, warmup)
    outputs.send(("ready", dict(max_model_len=engine.max_model_len, vocab_size=engine.model_config.vocab_size,
                                hidden_size=engine.model_config.hidden_size,
                                config=engine.resolved.summary(),
                                warmup_seconds=warmup, num_compilations=engine.num_compilations,
                                stats=engine.stats())))
    outbox = _Outbox(outputs)
    try:
        _loop(engine, commands, outbox)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass  # the front end is gone: nobody is left to serve
    finally:
        engine.wait_warmup(stop=True)  # exiting while the warm-up thread is inside XLA aborts the process
    outbox.close()


class _Heartbeat:
    """While a start-up phase runs, a log line every ``every`` seconds saying what is still under way,
    so a start-up never goes quiet long enough to look hung (one XLA compile or a weight conversion
    can take seconds without a word)."""

    def __init__(self, every: float = 2.5):
        self.every = every
        self._what: tuple[str, float] | None = None
        self._done = threading.Event()
        threading.Thread(target=self._run, name="heartbeat", daemon=True).start()

    @contextlib.contextmanager
    def phase(self, what: str):
        self._what = (what, time.monotonic())
        try:
            yield
        finally:
            self._what = None

    def stop(self) -> None:
        self._done.set()

    def _run(self) -> None:
        while not self._done.wait(self.every):
            current = self._what
            if current is not None:
                log.info("still %s (%.0fs)", current[0], time.monotonic() - current[1])


class _Outbox:
    """Writes messages from a thread, so a front end that is slow to read (its receiving thread waits
    for its GIL while the event loop is busy) never blocks the engine loop on a full pipe. Messages
    are pickled by the caller (the engine thread, right after dispatching a step, while the device
    runs): the thread then only writes bytes, which it does without the GIL, instead of taking the
    GIL from the engine thread to pickle while the next step is being prepared."""

    def __init__(self, conn: Connection):
        self._conn = conn
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="engine-core-send", daemon=True)
        self._thread.start()

    def send(self, msg) -> None:
        self._queue.put(ForkingPickler.dumps(msg))  # what Connection.send does, read by its recv()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while (buf := self._queue.get()) is not None:
            try:
                self._conn.send_bytes(buf)
            except (BrokenPipeError, ConnectionResetError, OSError):
                return


class _Constraints:
    """Requests whose constraint is being compiled, off the engine loop: the front end compiled it in
    its own process, but this one compiles it again, and a large schema took tens of seconds, which
    would stall every request's next step. A request joins the engine once its constraint is ready
    (compiled constraints are cached, so the engine's own matcher then costs a copy)."""

    def __init__(self, engine):
        self._engine = engine
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="constraint-compile")
        self._pending: dict[str, tuple[concurrent.futures.Future, list[int], object, int]] = {}

    def __bool__(self) -> bool:
        return bool(self._pending)

    def add(self, rid: str, prompt: list[int], params, priority: int) -> None:
        e = self._engine
        future = self._pool.submit(compile_constraint, e.tokenizer, params.structured, e.model_config.vocab_size,
                                   e.model_config.eos_token_ids, e.config.structured_outputs_whitespace)
        self._pending[rid] = (future, prompt, params, priority)

    def abort(self, rid: str) -> bool:
        return self._pending.pop(rid, None) is not None

    def ready(self):
        """``(request id, prompt, params, priority, error)`` of each request whose compilation has ended."""
        for rid, (future, prompt, params, priority) in list(self._pending.items()):
            if future.done():
                del self._pending[rid]
                yield rid, prompt, params, priority, future.exception()


# What each "score" command runs on the engine.
_SCORES = {
    "embed": lambda engine, prompts, pooling, normalize: np.stack(engine.embed(prompts, pooling, normalize)),
    "prompt_logprobs": lambda engine, prompt, k: engine.score_prompt(prompt, k)}


def _score(engine: LLMEngine, outputs: _Outbox, sid: str, kind: str, args) -> None:
    """One "score" command, answered with its result or why not (400: the request's fault)."""
    try:
        result = _SCORES[kind](engine, *args)
    except (ValueError, TypeError) as e:
        outputs.send(("scored", sid, None, (400, str(e))))
    except Exception as e:  # noqa: BLE001 - the pass failed, not the engine: answered, logged, serving goes on
        log.exception("%s %s failed", kind, sid)
        outputs.send(("scored", sid, None, (500, f"{type(e).__name__}: {e}")))
    else:
        outputs.send(("scored", sid, result, None))


def _loop(engine: LLMEngine, commands: Connection, outputs: _Outbox) -> None:
    live: set[str] = set()
    compiling = _Constraints(engine)

    def add(rid, prompt, params, priority):
        try:
            engine.add_request(rid, prompt, params, priority)
        except (ValueError, TypeError) as e:
            live.discard(rid)
            outputs.send(("error", rid, 400, str(e)))

    # The loop's host time per step: the engine's own (step's wall time less the device wait) plus
    # the loop's work around step() (commands, the step message; not the idle wait for commands);
    # and its thread's CPU time, step included. Comparable with the offline loop's.
    around = loop_cpu = 0.0
    while True:
        # Block only when there is nothing to compute (waiting a little while constraints compile);
        # otherwise take what has arrived and step.
        idle = not engine.has_unfinished()
        batches = [commands.recv()] if idle and not compiling else []
        if idle and compiling and commands.poll(0.01):
            batches.append(commands.recv())
        t0, c0 = time.perf_counter(), time.thread_time()
        while commands.poll():
            batches.append(commands.recv())
        changed = bool(batches)
        scores = []
        for batch in batches:
            for cmd in batch:
                if cmd[0] == "stop":
                    for rid in live:
                        engine.abort(rid)
                    outputs.send(("stopped", engine.stats()))
                    return
                if cmd[0] == "abort":
                    if cmd[1] in live:
                        live.discard(cmd[1])
                        compiling.abort(cmd[1]) or engine.abort(cmd[1])
                    continue
                if cmd[0] == "score":
                    scores.append(cmd[1:])
                    continue
                _, rid, prompt, params, priority = cmd
                live.add(rid)
                if params.structured is not None and engine.tokenizer is not None:
                    compiling.add(rid, prompt, params, priority)
                else:
                    add(rid, prompt, params, priority)
        for sid, kind, args in scores:  # between two steps: a pass reads only the weights
            _score(engine, outputs, sid, kind, args)
        for rid, prompt, params, priority, error in compiling.ready():
            changed = True
            if error is None:
                add(rid, prompt, params, priority)
            else:
                live.discard(rid)
                outputs.send(("error", rid, 400, str(error)))
        outs = []
        if engine.has_unfinished():
            try:
                s0 = time.perf_counter()
                outs = engine.step()
                around -= time.perf_counter() - s0
            except Exception as e:  # noqa: BLE001 - the engine recovers a failed step itself; past that, fail them
                log.exception("engine step failed")
                for rid in live:
                    engine.abort(rid)
                    outputs.send(("error", rid, 500, f"engine step failed: {type(e).__name__}: {e}"))
                live.clear()
                outs = []
                changed = True
        # A request that failed alone ends with its error; the others' outputs go in the step's message.
        for o in outs:
            if o.finish_reason == "error":
                live.discard(o.request_id)
                outputs.send(("error", o.request_id, 400 if o.error.invalid else 500, o.error.message))
                changed = True
        outs = [o for o in outs if o.finish_reason != "error"]
        if outs or changed:
            step = StepOutputs.of(outs)
            for i in step.finished:
                live.discard(step.request_ids[i])
            stats = engine.stats()
            steps = max(1, stats["steps"])
            stats["loop_host_time_per_step"] = (around + time.perf_counter() - t0) / steps + stats["host_time_per_step"]
            stats["loop_cpu_time_per_step"] = (loop_cpu + time.thread_time() - c0) / steps
            outputs.send(("step", step, stats))
        around += time.perf_counter() - t0
        loop_cpu += time.thread_time() - c0
