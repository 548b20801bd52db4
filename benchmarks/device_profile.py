"""Device time per kernel of a jitted call, from a ``jax.profiler`` trace (no extra packages).

Benchmarks use it to split a step's device time into matmuls, attention and the rest, to time an
attention kernel without the XLA glue around it, and to see how long the device of a running engine
sits idle waiting for the host. On CPU there are no device events: empty results.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import re
import tempfile

import jax

# "qmatvec": the quantized matvec kernel (pallas_kernels/qmatvec.py), which a quantized batch-1 step's
# profile otherwise counted as "other"
MATMUL_MARKERS = ("gemm", "nvjet", "cublas", "cutlass", "sm90_xmma", "dot", "(gemv)", "qmatvec")
ATTENTION_MARKERS = ("paged_",)  # our Pallas kernels are named paged_decode_gpu / paged_prefill_gpu


def device_events(fn, *args, calls: int = 1) -> list[dict]:
    """The device's complete events (kernels, copies) while ``fn(*args)`` runs ``calls`` times."""
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            for _ in range(calls):
                out = fn(*args)
            jax.block_until_ready(out)
        files = glob.glob(f"{d}/plugins/profile/*/*.trace.json.gz")
        events = json.load(gzip.open(files[0]))["traceEvents"] if files else []
    devices = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
               and e["args"]["name"].startswith("/device:") and "CPU" not in e["args"]["name"]}
    return [e for e in events if e.get("ph") == "X" and e["pid"] in devices]


def grid(event: dict) -> str:
    """The kernel's launch grid as the trace gives it ("x,y,z"), or "" (copies)."""
    m = re.search(r"grid:([\d,]+)", event.get("args", {}).get("kernel_details", ""))
    return m.group(1) if m else ""


def kernel_name(event: dict, one_token: bool = False) -> str:
    """The kernel's name. In a one-token step, tagged "(gemv)" for an XLA reduction with one block
    per output row of at least 1,024 rows: a ``linear`` (models/layers.py), not a norm's reduction.
    (Larger steps have reductions of such grids that are not matmuls.)"""
    blocks = grid(event).split(",")[0]
    if one_token and "reduce" in event["name"] and blocks and int(blocks) >= 1024:
        return event["name"] + " (gemv)"
    return event["name"]


def per_kernel(events: list[dict], calls: int = 1, one_token: bool = False) -> dict[str, float]:
    """Seconds of device time per call, by kernel name."""
    total = collections.defaultdict(float)
    for e in events:
        total[kernel_name(e, one_token)] += e["dur"] * 1e-6 / calls
    return dict(total)


def launches(events: list[dict], calls: int = 1, top: int = 40) -> list[dict]:
    """The ``top`` kernels by device time per call, each with its grid and launches per call: where a
    step's time goes kernel by kernel. The categories of ``split`` hide what the small ones cost
    together (int8 llama3-8b at batch 1 on an H100: 6 small kernels a layer besides the matvecs and
    attention, 0.27 ms a step)."""
    total = collections.defaultdict(lambda: [0, 0.0])
    for e in events:
        entry = total[(e["name"], grid(e))]
        entry[0] += 1
        entry[1] += e["dur"]  # microseconds, as the trace gives them
    rows = [dict(name=name, grid=g, launches=n / calls, us=us / calls) for (name, g), (n, us) in total.items()]
    return sorted(rows, key=lambda r: -r["us"])[:top]


def kernel_times(fn, *args, calls: int = 5) -> dict[str, float]:
    """Seconds of device time per call of ``fn(*args)``, by kernel name (after two warm-up calls)."""
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    return per_kernel(device_events(fn, *args, calls=calls), calls)


def busy_idle(events: list[dict]) -> tuple[float, float]:
    """Seconds between the first event's start and the last one's end in which the device ran
    something (overlapping events counted once), and in which it ran nothing."""
    if not events:
        return 0.0, 0.0
    events = sorted(events, key=lambda e: e["ts"])
    busy, start, end = 0.0, events[0]["ts"], events[0]["ts"]
    for e in events:
        if e["ts"] > end:  # a gap: close the busy interval
            busy += end - start
            start = e["ts"]
        end = max(end, e["ts"] + e["dur"])
    busy += end - start
    return busy * 1e-6, (end - events[0]["ts"] - busy) * 1e-6


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
