"""Device ceilings measured in the same run as a benchmark, so results can be reported as ratios."""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp


def timeit(fn, *args, reps: int = 7, inner: int = 10) -> float:
    """Median seconds per call of jitted ``fn``: ``inner`` calls are dispatched back to back so the
    device never waits for the host, as in a real step loop."""
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(inner):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t) / inner)
    return statistics.median(times)


def read_bandwidth(nbytes: int | None = None) -> float:
    """Bytes/s of a large sum reduction: the practical ceiling for streaming weights and KV."""
    nbytes = nbytes or (4 << 30 if jax.default_backend() != "cpu" else 256 << 20)
    x = jax.random.normal(jax.random.key(1), (nbytes // 2,), jnp.bfloat16)
    return x.nbytes / timeit(jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32)), x)


def matmul_rate(n: int | None = None, dtype=None) -> float:
    """FLOP/s of a square matmul: bf16 8192^3 on accelerators, f32 1024^3 on CPU."""
    gpu = jax.default_backend() != "cpu"
    n = n or (8192 if gpu else 1024)
    dtype = dtype or (jnp.bfloat16 if gpu else jnp.float32)
    a = jax.random.normal(jax.random.key(2), (n, n), dtype)
    b = jax.random.normal(jax.random.key(3), (n, n), dtype)
    return 2 * n ** 3 / timeit(jax.jit(jnp.matmul), a, b)
