"""The memory-bandwidth ceiling of a batch-1 float32 decode of the embedded SmolLM2-135M on this CPU:
every step reads all 537.9 MB of float32 weights (30 layers of QKV, O, gate|up and down, and the
49,152 x 576 tied embedding as the lm_head), so ``1 / (bytes / bandwidth)`` bounds tok/s (numpy's sum
on 2 threads read 33.0 GB/s on the project's idle 2-core CPU: 61.3 tok/s).

Reads of that many bytes, timed in rounds (each candidate once per round, medians and bests):
numpy's sum on one thread and on two (a half each), numpy's BLAS GEMV, XLA's sum, max and GEMV,
torch's sum; then what XLA's matmuls reach on the model's own shapes: the 30-layer chain of
``[1, in] x [in, out]`` dots plus the lm_head (the matmuls of a batch-1 step, nothing else).

    python benchmarks/cpu_bandwidth.py --out docs/results/cpu-bandwidth.json
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from jaxinfer.cli.options import Parser


def parser() -> Parser:
    p = Parser("cpu_bandwidth.py", __doc__)
    p.option(None, "rounds", type=int, default=9, help="Timed rounds [default: 9].")
    p.option(None, "threads", type=int, default=2, help="Threads for numpy's two-thread sum and torch (this "
             "machine's cores) [default: 2].")
    p.option(None, "out", default="", help="JSON results (optional).")
    return p

D, Q, KV, FF, V, L = 576, 576, 192, 1536, 49152, 30  # SmolLM2-135M
NBYTES = 4 * (L * ((Q + 2 * KV) * D + D * Q + 2 * FF * D + D * FF) + V * D)


def main(argv: list[str]) -> None:
    F = parser().parse(argv)
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch
    torch.set_num_threads(F.threads)
    rng = np.random.default_rng(0)
    rows = NBYTES // 4 // D
    a = rng.standard_normal(rows * D, dtype=np.float32)
    m, v = a.reshape(rows, D), np.ones(D, np.float32)
    pool = ThreadPoolExecutor(F.threads)
    parts = np.array_split(a, F.threads)
    xa, xm, xv = jnp.asarray(a), jnp.asarray(m), jnp.asarray(v)
    xsum, xmax, xgemv = jax.jit(jnp.sum), jax.jit(jnp.max), jax.jit(jnp.matmul)
    tm = torch.from_numpy(m)

    def w(i, o):  # [in, out]: the engine's CPU layout (spec.InOut)
        return jnp.asarray(rng.standard_normal((i, o), dtype=np.float32) / np.float32(np.sqrt(i)))

    layers = [(w(D, Q + 2 * KV), w(Q, D), w(D, 2 * FF), w(FF, D)) for _ in range(L)]
    head = w(D, V)

    @jax.jit
    def chain(x, layers, head):
        for wqkv, wo, wgu, wd in layers:
            x = x + (x @ wqkv)[:, :Q] @ wo
            gu = x @ wgu
            x = x + (jax.nn.silu(gu[:, :FF]) * gu[:, FF:]) @ wd
        return x @ head

    x1 = jnp.ones((1, D), jnp.float32)
    candidates = {
        "numpy sum, 1 thread": lambda: a.sum(),
        f"numpy sum, {F.threads} threads": lambda: sum(pool.map(np.sum, parts)),
        "numpy BLAS GEMV": lambda: m @ v,
        "XLA sum": lambda: xsum(xa).block_until_ready(),
        "XLA max": lambda: xmax(xa).block_until_ready(),
        "XLA GEMV": lambda: xgemv(xm, xv).block_until_ready(),
        "torch sum": lambda: tm.sum(),
        "XLA SmolLM2 matmul chain, 1 row": lambda: chain(x1, layers, head).block_until_ready(),
    }
    for f in candidates.values():
        f(), f()
    times = {k: [] for k in candidates}
    for _ in range(F.rounds):
        for k, f in candidates.items():
            t = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t)
    results = {}
    for k, ts in times.items():
        med, best = statistics.median(ts), min(ts)
        results[k] = dict(median_ms=med * 1e3, best_ms=best * 1e3, gb_s_median=NBYTES / med / 1e9,
                          gb_s_best=NBYTES / best / 1e9, tok_s_ceiling_median=1 / med, tok_s_ceiling_best=1 / best)
        print(f"{k:34s} median {med * 1e3:6.1f} ms ({NBYTES / med / 1e9:5.1f} GB/s, {1 / med:5.1f} tok/s)   "
              f"best {best * 1e3:6.1f} ms ({NBYTES / best / 1e9:5.1f} GB/s, {1 / best:5.1f} tok/s)")
    print(f"bytes per batch-1 step {NBYTES / 1e6:.1f} MB; load average {os.getloadavg()}")
    if F.out:
        with open(F.out, "w") as f:
            json.dump(dict(bytes_per_step=NBYTES, load_average=os.getloadavg(), results=results), f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
