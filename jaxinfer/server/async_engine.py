"""The engine on its own thread, so compiled steps never block the event loop.

Only the engine thread touches the ``LLMEngine`` after it is built. Handlers hand it commands
through a deque and get outputs back on an ``asyncio.Queue`` per HTTP request, filled with
``loop.call_soon_threadsafe`` (asyncio queues are not thread-safe). Admission control happens on
the event-loop side, where a full waiting queue can be answered at once.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import logging
import threading
import time
from typing import Callable

from jaxinfer.batching.engine import LLMEngine, RequestOutput
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.server.metrics import Metrics
from jaxinfer.server.protocol import APIError

log = logging.getLogger(__name__)


@dataclasses.dataclass
class _Timing:
    submission: "Submission"
    arrival: float
    first_token: float | None = None


class Submission:
    """The sub-requests of one HTTP request (``n`` choices times prompts), sharing one output queue."""

    def __init__(self, request_ids: list[str]):
        self.request_ids = request_ids
        self.unfinished = set(request_ids)
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()

    def _put(self, item) -> None:  # engine thread
        self._loop.call_soon_threadsafe(self._queue.put_nowait, item)

    async def next(self) -> RequestOutput:
        """The next output of any sub-request; raises the APIError that ended the submission, if any."""
        item = await self._queue.get()
        if isinstance(item, BaseException):
            raise item  # the siblings still in `unfinished` are aborted by AsyncEngine.release
        if item.finished:
            self.unfinished.discard(item.request_id)
        return item

    @property
    def done(self) -> bool:
        return not self.unfinished


class AsyncEngine:
    def __init__(self, build: Callable[[], LLMEngine], *, max_waiting: int,
                 on_fatal: Callable[[BaseException], None] | None = None):
        self._build = build
        self._on_fatal = on_fatal
        self.max_waiting = max_waiting
        self.engine: LLMEngine | None = None
        self.metrics = Metrics(lambda: self._stats)
        self.ready = threading.Event()
        self.warmup_seconds: float | None = None
        self.draining = False
        self._stats: dict | None = None  # last engine.stats(), replaced whole by the engine thread
        self._commands: collections.deque = collections.deque()
        self._wake = threading.Event()
        self._stop = False
        self._ids = itertools.count()
        self._inflight = 0  # sub-requests submitted and not yet finished (event-loop side)
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)

    # ---------------------------------------------------------------------------- event-loop side

    def start(self) -> None:
        self._thread.start()

    def submit(self, prefix: str, prompts: list[list[int]], params: list[SamplingParams]) -> Submission:
        """Queue one sub-request per (prompt, params) pair, or raise 503 at once if there is no room."""
        if self.draining:
            raise APIError(503, "the server is shutting down", type="server_error", code="shutting_down")
        if not self.ready.is_set():
            raise APIError(503, "the server is still warming up; retry when /health answers 200",
                           type="server_error", code="warming_up")
        count = len(prompts)
        if count > self.max_waiting:
            raise APIError(400, f"this request needs {count} sequences (prompts x n) but the server queues at "
                                f"most {self.max_waiting}", param="n")
        waiting = self._inflight - (self._stats or {}).get("running", 0)
        if waiting + count > self.max_waiting:
            raise APIError(503, f"the waiting queue is full ({waiting} requests waiting, max_waiting="
                                f"{self.max_waiting}); retry later", type="server_error", code="queue_full")
        ids = [f"{prefix}-{next(self._ids)}" for _ in prompts]
        sub = Submission(ids)
        self._inflight += count
        now = time.monotonic()
        self._commands.extend(("add", rid, ids_, p, _Timing(sub, now)) for rid, ids_, p in zip(ids, prompts, params))
        self._wake.set()
        return sub

    def release(self, sub: Submission) -> None:
        """Call once per submission when its handler is done: aborts what did not finish (a client
        that went away) so its KV pages are freed, and frees its admission slots."""
        for rid in sub.unfinished:
            self._commands.append(("abort", rid))
        self._inflight -= len(sub.request_ids)
        sub.unfinished.clear()
        self._wake.set()

    def shutdown(self, timeout: float | None = None) -> bool:
        """Stop the thread, failing whatever is still queued or running; True if it exited in time."""
        self.draining = True
        self._stop = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        return not self._thread.is_alive()

    # ------------------------------------------------------------------------------ engine thread

    def _run(self) -> None:
        t0 = time.monotonic()
        try:
            self.engine = self._build()
            if self._stop:
                return
            self.warmup_seconds = self.engine.warmup()
        except BaseException as e:  # noqa: BLE001 - reported to the server, which exits
            log.exception("engine failed to start")
            if self._on_fatal:
                self._on_fatal(e)
            return
        log.info("ready in %.1fs: model loaded, %d step shapes compiled in %.1fs", time.monotonic() - t0,
                 self.engine.num_compilations, self.warmup_seconds)
        self._stats = self.engine.stats()
        self.ready.set()
        timings: dict[str, _Timing] = {}
        while not self._stop:
            self._wake.clear()
            self._apply_commands(timings)
            if not self.engine.has_unfinished():
                self._wake.wait()
                continue
            try:
                outputs = self.engine.step()
            except Exception as e:  # noqa: BLE001 - fail the requests, keep serving
                log.exception("engine step failed")
                self._fail_all(timings, APIError(500, f"engine step failed: {e}", type="server_error"))
                continue
            now = time.monotonic()
            for out in outputs:
                t = timings.get(out.request_id)
                if t is None:
                    continue
                if t.first_token is None:
                    t.first_token = now
                if out.finished:
                    del timings[out.request_id]
                    self.metrics.observe(t.arrival, t.first_token, now, len(out.token_ids))
                t.submission._put(out)
            self._stats = self.engine.stats()
        self._apply_commands(timings)
        self._fail_all(timings, APIError(503, "the server shut down before this request finished",
                                         type="server_error", code="shutting_down"))

    def _apply_commands(self, timings: dict[str, _Timing]) -> None:
        applied = False
        while self._commands:
            cmd = self._commands.popleft()
            applied = True
            if cmd[0] == "abort":
                if timings.pop(cmd[1], None) is not None:
                    self.engine.abort(cmd[1])
                continue
            _, rid, prompt, params, timing = cmd
            try:
                self.engine.add_request(rid, prompt, params)
            except (ValueError, TypeError) as e:
                timing.submission._put(APIError(400, str(e)))
                continue
            timings[rid] = timing
        if applied:
            self._stats = self.engine.stats()

    def _fail_all(self, timings: dict[str, _Timing], error: APIError) -> None:
        for rid, t in list(timings.items()):
            self.engine.abort(rid)
            t.submission._put(error)
        timings.clear()
        self._stats = self.engine.stats()
