"""Compiled steps: an LRU of executables, the warm-up plan, and compiling ahead in the background.

Compiled steps are held in an LRU of at most ``max_executables``: every XLA:CPU executable keeps
its code in memory mappings, and a process that compiled ~400 SmolLM2 step shapes died with
"LLVM ERROR: Unable to allocate section memory" (``vm.max_map_count`` 65530). An evicted step is
dropped together with JAX's own caches, which would otherwise keep it alive.

Warm-up may leave most of its plan to a background thread (``warmup(background=True)``, what the
server does): the steps a single request runs first are compiled before it returns, the rest while
requests are already served (compiling every step was nearly all of the SmolLM2 server's start-up on
a 2-core CPU: 40 steps, 47 s from an empty compilation cache). A step whose shape is still being
compiled waits for that compilation rather than starting a second one; the set compiled is the plan
either way.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import os
import threading
from typing import Callable

import jax
from tqdm.auto import tqdm

from jaxinfer.batching.buckets import Buckets

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class PlannedStep:
    """One executable warm-up compiles: a step shape ``(tokens, seqs, pages)``, whether it is the
    decode-only variant, its greedy flag (None: decided in the step) and the decode steps it runs."""

    shape: tuple[int, int, int]
    decode_only: bool
    greedy: bool | None
    steps: int = 1


def warmup_plan(buckets: Buckets, decode_max_seqs: int, greedy_in_step: bool, num_scheduler_steps: int,
                shapes=None, greedy_only: bool = False) -> list[PlannedStep]:
    """Every step warm-up compiles: for each bucket (or the given shapes) greedy and (unless
    ``greedy_only``) sampled, or one that does both where the step decides; the decode-only variant of
    the shapes a decode-only step can take (up to ``decode_max_seqs`` sequences); and with several
    decode steps per dispatch the multi-step decode of the shapes a batch of decodes takes. Logprobs
    and penalties compile on first use."""
    shapes = buckets.all_shapes() if shapes is None else shapes
    decode = {x for x in buckets.decode_shapes() if x[1] <= decode_max_seqs}
    steps = [(x, False) for x in shapes] + [(x, True) for x in shapes if x in decode]
    variants = (None,) if greedy_in_step else (True,) if greedy_only else (True, False)
    plan = [PlannedStep(x, d, g) for x, d in steps for g in variants]
    if num_scheduler_steps > 1:  # a batch of decodes is decode-only where the backend has the kernel
        decodes = set(buckets.decode_shapes())
        plan += [dataclasses.replace(p, steps=num_scheduler_steps) for p in plan
                 if p.shape in decodes and p.decode_only == (p.shape[1] <= decode_max_seqs)]
    return plan


def first_steps(plan: list[PlannedStep], buckets: Buckets) -> list[PlannedStep]:
    """The steps of ``plan`` a single request meets: one sequence at the smallest page bucket, its
    prompt prefilled in any token bucket (whatever its length) and its decode, one step and several
    per dispatch, greedy and sampled. What a background warm-up compiles before it returns, so the
    server's first request (a chat of any length) waits for no compilation."""
    b = buckets
    return [p for p in plan if p.shape[1:] == (b.seqs[0], b.pages[0])]


class CompilationManager:
    def __init__(self, max_executables: int, spec):
        """``spec``: the static argument every step function takes besides the per-step flags (the
        model and its ops: ``model_runner.StepSpec``), the same for all of this manager's steps."""
        self.max_executables = max_executables
        self.spec = spec
        self.num_compilations = 0
        self._executables: collections.OrderedDict = collections.OrderedDict()  # LRU: key -> compiled step
        self._compiling: dict = {}  # key -> Future of a compilation under way (warm-up's thread or a step)
        self._lock = threading.Lock()  # guards both maps
        self._trace_lock = threading.Lock()  # tracing (Python, GIL-bound anyway) one step at a time
        self._background: threading.Thread | None = None
        self._stop_background = threading.Event()

    @property
    def num_executables(self) -> int:
        return len(self._executables)

    @property
    def warming(self) -> bool:
        """Whether a background warm-up is still compiling its plan."""
        return self._background is not None and self._background.is_alive()

    def get(self, fn, args, packing, flags: dict, only_if_ready: bool = False):
        """``fn`` (a jitted step function taking ``spec``, ``packing`` and ``flags`` as static arguments) compiled
        for these arguments: from the LRU, from a compilation already under way in another thread
        (waited for), or compiled now (through the persistent compilation cache when one is set),
        evicting the least recently used; ``only_if_ready``: from the LRU or None. Thread-safe:
        warm-up's background thread and the engine's steps both come here."""
        key = (fn, packing, tuple(sorted(flags.items())))
        with self._lock:
            exe = self._executables.get(key)
            if exe is not None:
                self._executables.move_to_end(key)
                return exe
            if only_if_ready:
                return None
            pending = self._compiling.get(key)
            if pending is None:
                pending = self._compiling[key] = concurrent.futures.Future()
                owner = True
            else:
                owner = False
        if not owner:
            return pending.result()
        try:
            with self._trace_lock:
                lowered = fn.lower(*args, spec=self.spec, packing=packing, **flags)
            exe = lowered.compile()  # XLA releases the GIL: steps run meanwhile
        except BaseException as e:
            with self._lock:
                del self._compiling[key]
            pending.set_exception(e)
            raise
        with self._lock:
            del self._compiling[key]
            self._executables[key] = exe
            self.num_compilations += 1
            evict = len(self._executables) > self.max_executables
            if evict:
                self._executables.popitem(last=False)
        if evict:
            jax.clear_caches()  # JAX's compilation caches hold a reference to every executable
        pending.set_result(exe)
        return exe

    def warmup(self, plan: list[PlannedStep], first: list[PlannedStep], compile_one: Callable[[PlannedStep], None],
               count: int) -> None:
        """Compile ``first`` now, a thread per core (XLA compiles one executable on one core), and the
        rest of ``plan`` in a daemon thread (``wait``). ``count``: the executables the plan makes in all
        (variants included), refused above ``max_executables``."""
        if count > self.max_executables:
            raise ValueError(f"warm-up would compile {count} steps but max_executables is "
                             f"{self.max_executables}: raise it or use fewer buckets")
        first = [p for p in plan if p in set(first)]
        with concurrent.futures.ThreadPoolExecutor(max(1, min(len(first), os.cpu_count() or 1))) as pool:
            list(tqdm(pool.map(compile_one, first), total=len(first), desc="compiling buckets", unit="step"))
        done = set(first)
        rest = sorted((p for p in plan if p not in done),
                      key=lambda p: (p.shape[1], p.shape[2], p.shape[0], p.decode_only, p.greedy is False, p.steps))
        if not rest:
            return

        def compile_rest():
            for step in rest:
                if self._stop_background.is_set():
                    return
                try:
                    compile_one(step)
                except Exception:  # noqa: BLE001 - the step compiles on first use instead
                    log.exception("background compilation of %s failed", step)
            log.info("background warm-up done: %d more steps", len(rest))

        self._background = threading.Thread(target=compile_rest, name="warmup", daemon=True)
        self._background.start()

    def wait(self, stop: bool = False) -> None:
        """Return once a background warm-up has compiled its steps; ``stop``: once it has finished the
        step it is compiling, leaving the rest. A process must not exit while the thread is inside XLA
        (it aborts: "terminate called after throwing")."""
        if stop:
            self._stop_background.set()
        if self._background is not None:
            self._background.join()
