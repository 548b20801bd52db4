"""One engine over several processes (hosts): JAX's multi-controller model.

Every process builds the same engine over the mesh of all processes' devices (each loads only its
own devices' shards) and must run the same compiled steps, with the same host inputs, in the same
order. Process 0 runs the scheduler (and the server): before each step its ``ModelRunner`` calls
``send_step``, which broadcasts the step's static shape and flags (a fixed-size header), then the
packed int32 input buffer (``multihost_utils.broadcast_one_to_all``, itself an XLA collective). The
other processes ``follow``: they receive and run each step on their own runner until process 0
sends stop (at its exit). XLA's own
collectives carry the rest: gloo on CPU, NCCL on GPU. Data parallel replicas and swap preemption
stay within one process (the engine refuses them here).
"""

from __future__ import annotations

import atexit

import jax
import numpy as np

_STOP, _STEP = 0, 1
# cmd, buffer length, tokens, seqs, pages, logit term slots, decode_only, greedy_only (-1: None),
# num_logprobs (-1: None), logit_terms, whether the step's sampled tokens feed the next step (engine steps; not warm-up)
_HEADER = 11


def initialize(coordinator_address: str, num_processes: int, process_id: int) -> None:
    """``jax.distributed.initialize``, with gloo as the CPU backend's collectives (JAX's default
    CPU client has none across processes)."""
    if not 0 <= process_id < num_processes:
        raise ValueError(f"process_id must be in [0, num_processes={num_processes}), got {process_id}")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address, num_processes, process_id)


def active() -> bool:
    return jax.process_count() > 1


def is_leader() -> bool:
    return jax.process_index() == 0


def _broadcast(x: np.ndarray) -> np.ndarray:
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.broadcast_one_to_all(x))


def send_step(inputs: np.ndarray, shape: tuple[int, int, int, int], decode_only: bool, flags: dict,
              feeds_next: bool) -> None:
    """Process 0: tell the followers to run this step (``shape``: tokens, seqs, pages, logit term slots)."""
    lp = flags["num_logprobs"]
    header = np.asarray([_STEP, inputs.size, *shape, decode_only,
                         -1 if flags["greedy_only"] is None else flags["greedy_only"], -1 if lp is None else lp,
                         flags["logit_terms"], feeds_next], np.int32)
    _broadcast(header)
    _broadcast(inputs)


def send_stop() -> None:
    _broadcast(np.asarray([_STOP] + [0] * (_HEADER - 1), np.int32))


def receive_step():
    """A follower: the next step's ``(inputs, shape, decode_only, flags, feeds_next)``, or None at stop."""
    h = _broadcast(np.zeros(_HEADER, np.int32)).tolist()
    if h[0] == _STOP:
        return None
    inputs = _broadcast(np.zeros(h[1], np.int32))
    flags = dict(greedy_only=None if h[7] < 0 else bool(h[7]), num_logprobs=None if h[8] < 0 else h[8],
                 logit_terms=bool(h[9]))
    return inputs, tuple(h[2:6]), bool(h[6]), flags, bool(h[10])


def stop_followers_at_exit() -> None:
    """Process 0: release the followers when it exits (they wait in ``receive_step`` until then)."""
    atexit.register(send_stop)


def follow(runner) -> None:
    """A follower process's loop: run each step process 0 sends on ``runner`` (the ``ModelRunner`` of
    the engine process 0 also built: ``factory.run_follower``) until it stops."""
    while (step := receive_step()) is not None:
        runner.run_sent(*step)
