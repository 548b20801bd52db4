"""Device time per kernel of a jitted call, from a ``jax.profiler`` trace (no extra packages).

Benchmarks use it to split a step's device time into matmuls, attention and the rest, and to time
an attention kernel without the XLA glue around it. On CPU there are no device events: empty result.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import tempfile

import jax

MATMUL_MARKERS = ("gemm", "nvjet", "cublas", "cutlass", "sm90_xmma", "dot")
ATTENTION_MARKERS = ("paged_",)  # our Pallas kernels are named paged_decode_gpu / paged_prefill_gpu


def kernel_times(fn, *args, calls: int = 5) -> dict[str, float]:
    """Seconds of device time per call of ``fn(*args)``, by kernel name (after two warm-up calls)."""
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            for _ in range(calls):
                out = fn(*args)
            jax.block_until_ready(out)
        files = glob.glob(f"{d}/plugins/profile/*/*.trace.json.gz")
        events = json.load(gzip.open(files[0]))["traceEvents"] if files else []
    devices = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
               and e["args"]["name"].startswith("/device:") and "CPU" not in e["args"]["name"]}
    total = collections.defaultdict(float)
    for e in events:
        if e.get("ph") == "X" and e["pid"] in devices:
            total[e["name"]] += e["dur"] * 1e-6 / calls
    return dict(total)


def split(times: dict[str, float]) -> dict[str, float]:
    """Device seconds per call in matmuls, attention kernels and everything else."""
    out = {"matmul_s": 0.0, "attention_s": 0.0, "other_s": 0.0}
    for name, t in times.items():
        low = name.lower()
        key = ("attention_s" if any(m in low for m in ATTENTION_MARKERS) else
               "matmul_s" if any(m in low for m in MATMUL_MARKERS) else "other_s")
        out[key] += t
    out["kernels_s"] = sum(times.values())
    return out
