"""The engine core: an ``LLMEngine`` stepping in its own process, fed and drained through two pipes.

Why a process: in one process the engine's host loop (scheduling, reading sampled tokens,
detokenizing) and the HTTP side (parsing, SSE encoding, socket writes for hundreds of streams)
take turns on one GIL, and every token the event loop handles is time the engine does not
dispatch its next step. Here the engine loop never waits on the HTTP side: it applies whatever
commands arrived, steps, and sends ONE message per step carrying every sequence's new tokens and
text (as vLLM's EngineCore does). Detokenization and stop strings stay in the engine, where the
offline path runs them too (overlapped with the device step), so streamed text equals ``LLM.generate``'s.

Messages, front end -> core (each a list of commands, sent in batches):
    ("add", request_id, prompt_ids, SamplingParams) | ("abort", request_id) | ("stop",)
core -> front end:
    ("ready", info) once, after warm-up; ("fatal", message) if the engine could not start;
    ("step", [Delta...], stats) once per step that produced outputs or changed state;
    ("error", request_id, status, message) for a request the engine refused;
    ("stopped", stats) as the last message.
"""

from __future__ import annotations

import logging
import queue
import signal
import threading
import time
import traceback
from multiprocessing.connection import Connection
from typing import NamedTuple

from jaxinfer.batching.config import EngineConfig
from jaxinfer.batching import multihost
from jaxinfer.batching.engine import LLMEngine, RequestOutput
from jaxinfer.batching.replicas import create_engine

log = logging.getLogger(__name__)


class Delta(NamedTuple):
    """What one step added to one request: compact, so a step's message pickles in microseconds."""

    request_id: str
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None  # one dict per new token, if the request asked for logprobs
    finish_reason: str | None
    num_cached_tokens: int

    @classmethod
    def of(cls, out: RequestOutput) -> "Delta":
        lps = out.logprobs[len(out.logprobs) - len(out.delta_token_ids):] if out.logprobs is not None else None
        return cls(out.request_id, out.delta_text, out.delta_token_ids, lps,
                   out.finish_reason if out.finished else None, out.num_cached_tokens)


def run(model: str, config: EngineConfig, commands: Connection, outputs: Connection,
        distributed: tuple[str, int, int] | None = None, warmup_structured: bool = False) -> None:
    """Process entry point: build and warm the engine, then serve commands until told to stop or
    until the front end goes away (its pipe end closes). ``distributed``: (coordinator address,
    processes, this process's id) when this core is process 0 of a multi-process run. ``warmup_structured``:
    also compile the steps constrained requests run as, so the first one does not stall the engine."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front end owns shutdown (SIGTERM drain)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s engine-core: %(message)s")
    t0 = time.monotonic()
    try:
        if distributed is not None:
            multihost.initialize(*distributed)
        engine = create_engine(model, config)
        warmup = engine.warmup(structured=warmup_structured)
    except BaseException as e:  # noqa: BLE001 - reported to the front end, which exits
        outputs.send(("fatal", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        return
    log.info("ready in %.1fs: model loaded, %d step shapes compiled in %.1fs", time.monotonic() - t0,
             engine.num_compilations, warmup)
    outputs.send(("ready", dict(max_model_len=engine.max_model_len, vocab_size=engine.model_config.vocab_size,
                                warmup_seconds=warmup, num_compilations=engine.num_compilations,
                                stats=engine.stats())))
    outbox = _Outbox(outputs)
    try:
        _loop(engine, commands, outbox)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass  # the front end is gone: nobody is left to serve
    outbox.close()


class _Outbox:
    """Sends messages from a thread, so a front end that is slow to read (its receiving thread waits
    for its GIL while the event loop is busy) never blocks the engine loop on a full pipe."""

    def __init__(self, conn: Connection):
        self._conn = conn
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="engine-core-send", daemon=True)
        self._thread.start()

    def send(self, msg) -> None:
        self._queue.put(msg)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while (msg := self._queue.get()) is not None:
            try:
                self._conn.send(msg)
            except (BrokenPipeError, ConnectionResetError, OSError):
                return


def _loop(engine: LLMEngine, commands: Connection, outputs: _Outbox) -> None:
    live: set[str] = set()
    while True:
        # Block only when there is nothing to compute; otherwise take what has arrived and step.
        batches = [commands.recv()] if not engine.has_unfinished() else []
        while commands.poll():
            batches.append(commands.recv())
        changed = bool(batches)
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
                        engine.abort(cmd[1])
                    continue
                _, rid, prompt, params = cmd
                try:
                    engine.add_request(rid, prompt, params)
                except (ValueError, TypeError) as e:
                    outputs.send(("error", rid, 400, str(e)))
                    continue
                live.add(rid)
        deltas = []
        if engine.has_unfinished():
            try:
                outs = engine.step()
            except Exception as e:  # noqa: BLE001 - fail the requests, keep serving
                log.exception("engine step failed")
                for rid in live:
                    engine.abort(rid)
                    outputs.send(("error", rid, 500, f"engine step failed: {e}"))
                live.clear()
                outs = []
                changed = True
            for out in outs:
                if out.finished:
                    live.discard(out.request_id)
                deltas.append(Delta.of(out))
        if deltas or changed:
            outputs.send(("step", deltas, engine.stats()))
