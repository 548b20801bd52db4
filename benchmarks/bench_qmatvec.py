"""Time the quantized matvec kernel (``pallas_kernels.qmatvec``) on llama3-8b's decode shapes.

For each weight (wqkv 6144x4096, wo 4096x4096, w_gate_up 28672x4096, w_down 4096x14336, lm_head
128256x4096) and each format (int8 per channel, int4 g32/g64/g128, GGUF Q8_0/Q4_0/Q4_1; random codes
and scales: the time does not depend on them), at ``--tokens`` rows of activations (bf16):
- ``kernel``: the kernel with its default blocks and ``--configs`` other block choices; the best is
  reported with its blocks (the defaults to pick from);
- ``xla``: the XLA fusion the kernel replaces (``matmul.rowsum_matvec``: ``sum(x * dequantize(W))``;
  one token only);
- ``bf16``: the same shape's bf16 weight through ``layers.linear`` (what the unquantized model runs);
- ``error``: the kernel against float32 dequantize-then-matmul (largest difference / largest output);
- ``device us``: the kernel's own device time per matvec from a profiled run (``device_profile``):
  the chain's wall time per call also holds the kernels around each matvec (x's reorder, the
  split-K sum, the nudge), 8-15 us more than the same kernel took inside the engine's step on an
  H100, so sweeps rank block choices by this;
- the ceiling: bytes read (codes, scales, offsets) over 4.8 TB/s, and over the read bandwidth
  measured in the same run (a multi-GB sum).
Each timing is a jitted chain of ``--chain`` calls, each call's input depending on the previous
output (a decode step's matvecs are serial; the dependency is one tiny fusion, as the norm before
a real matvec), dispatched ``--inner`` times back to back (so the host's dispatch and sync are not
timed: the first run of this script, with one jit call per timing, added ~5-10 us to every matvec)
and timed ``--reps`` times; the median per call is reported in microseconds, with GB/s achieved and
the ratio to bf16's time. Prints a table, writes JSON to ``--out``.

    PYTHONPATH=$PWD python3 benchmarks/bench_qmatvec.py --out $OUT/qmatvec-h200.json
"""

from __future__ import annotations

import argparse
import functools
import json
import time

import jax
import jax.numpy as jnp

from ceilings import read_bandwidth, timeit  # benchmarks/ is on sys.path when run as a script
from device_profile import kernel_times
from jaxinfer.models import layers
from jaxinfer.pallas_kernels.qmatvec import default_blocks
from jaxinfer.quant import FORMATS, QArray, dequantize
from jaxinfer.quant.matmul import kernel_matvec, rowsum_matvec

SHAPES = {"wqkv": (6144, 4096), "wo": (4096, 4096), "w_gate_up": (28672, 4096), "w_down": (4096, 14336),
          "lm_head": (128256, 4096)}
# name: (format, group size; None: per row)
SCHEMES = {"int8": ("int8", None), "int4-g32": ("int4", 32), "int4-g64": ("int4", 64), "int4-g128": ("int4", 128),
           "q8_0": ("q8_0", 32), "q4_0": ("q4_0", 32), "q4_1": ("q4_1", 32)}
HBM_BYTES_PER_S = 4.8e12  # the H200's specified bandwidth


def random_qarray(key, out: int, n_in: int, scheme: str) -> QArray:
    fmt, group = SCHEMES[scheme]
    f = FORMATS[fmt]
    group = group or n_in
    k1, k2, k3 = jax.random.split(key, 3)
    n_codes = n_in if f.bits == 8 else n_in // 2
    values = jax.random.randint(k1, (out, n_codes), -128 if f.signed else 0, 128 if f.signed else 256, jnp.int32)
    values = values.astype(jnp.int8 if f.signed else jnp.uint8)
    sdtype = jnp.float32 if fmt == "int8" else jnp.float16
    scales = (jax.random.uniform(k2, (out, n_in // group)) * 1e-3).astype(sdtype)
    offsets = (jax.random.normal(k3, (out, n_in // group)) * 1e-3).astype(sdtype) if f.offsets else None
    return QArray(values, scales, offsets, None, None, fmt, group)


@jax.jit
def max_error(x, w):
    """The kernel (default blocks) against float32 dequantize-then-matmul: the largest difference
    over the largest output (a check that the timed kernel computes the right thing on this GPU)."""
    got = kernel_matvec(x, w, jnp.float32)
    want = jnp.dot(x.astype(jnp.float32), dequantize(w, jnp.float32).T, precision=jax.lax.Precision.HIGHEST)
    return jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want))


def chained(matvec, chain: int):
    """A jitted function running ``chain`` matvecs, each on ``x`` nudged by the previous output."""
    def run(x, w):
        y = matvec(x, w)
        for _ in range(chain - 1):
            y = matvec(x + y[:, :1].astype(x.dtype) * 1e-30, w)
        return y
    return jax.jit(run)


def configs(out: int, n_in: int, bits: int, extra: int) -> list[dict]:
    """The default blocks and up to ``extra`` variations of them (prefetch depth, rows, tile width,
    splits, warps)."""
    d = default_blocks(out, n_in, bits)
    d = dict(d, num_warps=4, num_stages=3)
    variants = [dict(d, prefetch=3 - d["prefetch"]),
                dict(d, block_rows=d["block_rows"] * 2, split_k=max(1, d["split_k"] // 2), num_warps=8),
                dict(d, block_chunks=d["block_chunks"] * 2, num_stages=1),
                dict(d, num_stages=1),
                dict(d, block_rows=max(8, d["block_rows"] // 2), split_k=d["split_k"] * 2),
                dict(d, block_chunks=max(1, d["block_chunks"] // 2), num_warps=8)]
    return [d] + variants[:extra]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="JSON output path")
    p.add_argument("--tokens", type=int, default=1, help="rows of activations (decode batch)")
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {list(SHAPES)}")
    p.add_argument("--schemes", default=",".join(SCHEMES), help=f"comma-separated, of {list(SCHEMES)}")
    p.add_argument("--configs", type=int, default=2, help="block configurations tried beside the default (0-6)")
    p.add_argument("--chain", type=int, default=10, help="serial calls per timed jit call")
    p.add_argument("--inner", type=int, default=5, help="timed jit calls dispatched back to back per repetition")
    p.add_argument("--reps", type=int, default=5)
    F = p.parse_args()
    t_start = time.perf_counter()
    bw = read_bandwidth()
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}, read bandwidth {bw / 1e9:.0f} GB/s, "
          f"tokens {F.tokens}")
    key = jax.random.key(0)
    x = jax.random.normal(key, (F.tokens, max(n for _, n in SHAPES.values())), jnp.bfloat16)
    rows = []

    def time_us(run, xs, w):
        """Wall time per matvec of ``run``, a ``chained`` function (compiled once for both timings)."""
        return timeit(run, xs, w, reps=F.reps, inner=F.inner) / F.chain * 1e6

    def device_us(run, xs, w):
        """Device time of the quantized kernels per matvec (profiled), or None where the trace has none."""
        times = kernel_times(run, xs, w, calls=3)
        mine = sum(t for name, t in times.items() if name.startswith("qmatvec"))
        return mine / F.chain * 1e6 if mine else None

    for shape_name in F.shapes.split(","):
        out, n_in = SHAPES[shape_name]
        xs = x[:, :n_in]
        wb = jax.random.normal(jax.random.fold_in(key, out), (out, n_in), jnp.bfloat16)
        bf16_us = time_us(chained(lambda a, w: layers.linear(a, w), F.chain), xs, wb)
        bf16_bytes = wb.nbytes
        del wb
        print(f"\n{shape_name} {out}x{n_in}: bf16 {bf16_us:.1f} us ({bf16_bytes / bf16_us / 1e3:.0f} GB/s)")
        print(f"  {'scheme':10} {'MB':>7} {'ceil us':>8} {'kernel us':>10} {'GB/s':>6} {'x bf16':>7} {'device us':>9} "
              f"{'xla us':>8} {'x bf16':>7} {'error':>8}  best blocks")
        for scheme in F.schemes.split(","):
            w = random_qarray(jax.random.fold_in(key, hash(scheme) % 1000), out, n_in, scheme)
            nbytes = sum(a.nbytes for a in (w.values, w.scales, w.offsets) if a is not None)
            tried = []
            for cfg in configs(out, n_in, w.format.bits, F.configs):
                run = chained(functools.partial(kernel_matvec, out_dtype=jnp.bfloat16, **cfg), F.chain)
                try:
                    us, dev = time_us(run, xs, w), device_us(run, xs, w)
                except Exception as e:  # a block choice Triton cannot compile: reported, not fatal
                    us = dev = None
                    print(f"    {cfg}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
                tried.append(dict(blocks=cfg, us=us, device_us=dev))
            ok = [t for t in tried if t["us"] is not None]
            by = "device_us" if ok and all(t["device_us"] for t in ok) else "us"
            best = min(ok, key=lambda t: t[by]) if ok else None
            xla_us = time_us(chained(lambda a, ww: rowsum_matvec(a, ww, jnp.bfloat16), F.chain), xs, w) \
                if F.tokens == 1 else None
            try:
                err = float(max_error(xs, w))
            except Exception as e:  # the default blocks failed to compile: reported above, not fatal
                err = float("nan")
                print(f"    error check: {type(e).__name__}")
            row = dict(shape=shape_name, out=out, n_in=n_in, scheme=scheme, tokens=F.tokens, bytes=nbytes,
                       max_rel_error=err,
                       ceiling_us=nbytes / HBM_BYTES_PER_S * 1e6, measured_ceiling_us=nbytes / bw * 1e6,
                       kernel_default_us=tried[0]["us"], kernel_best_us=best and best["us"],
                       kernel_default_device_us=tried[0]["device_us"], kernel_best_device_us=best and best["device_us"],
                       kernel_best_blocks=best and best["blocks"], kernel_tried=tried, xla_us=xla_us,
                       bf16_us=bf16_us, bf16_bytes=bf16_bytes)
            rows.append(row)
            k = best["us"] if best else float("nan")
            xl = f"{xla_us:8.1f} {bf16_us / xla_us:7.2f}" if xla_us else f"{'-':>8} {'-':>7}"
            dev_col = f"{best['device_us']:9.1f}" if best and best["device_us"] else f"{'-':>9}"
            print(f"  {scheme:10} {nbytes / 1e6:7.1f} {row['ceiling_us']:8.1f} {k:10.1f} {nbytes / k / 1e3:6.0f} "
                  f"{bf16_us / k:7.2f} {dev_col} {xl} {err:8.1e}  {best and best['blocks']}")
            del w
    result = dict(device=jax.devices()[0].device_kind, jax=jax.__version__, tokens=F.tokens,
                  read_bandwidth_bytes_per_s=bw, hbm_bytes_per_s=HBM_BYTES_PER_S, chain=F.chain, inner=F.inner,
                  reps=F.reps,
                  wall_s=time.perf_counter() - t_start, rows=rows)
    with open(F.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"\n(json: {F.out}; {result['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
