"""The model's fused linear at decode batch sizes, as one Pallas (Triton) kernel for GPUs.

Why: at a few tokens per step a matmul is a GEMV that streams its weight once. XLA runs each of the
model's linears as a split-K GEMV plus a reduction kernel, next to separate kernels for the RMSNorm
before it and the SwiGLU after it: ~15 kernels per layer, where each small one costs a launch and a
ramp of ~1.5 us (an 8B batch-1 layer on an H200: ~107 us of GEMVs, ~20 us of small kernels).
Here each linear is one kernel:
- programs own ``block_n`` output columns times a K range (split-K, ~``_PROGRAMS`` programs in all)
  and add their partial sums straight into the float32 output with atomics: onto the residual
  (aliased, so the residual add is free) or onto zeros. No reduction kernel;
- RMSNorm as a prologue: the norm weight scales x along K, and each program computes the row's
  sum of squares itself and scales its partial sums by the rsqrt (the norm is per row, so it
  commutes with the matmul);
- SwiGLU as a prologue: ``x = silu(gate) * up`` of the gate|up input, as the chunks are loaded.
The float32 atomics make the summation order vary from run to run (last-bit differences), the price
of dropping the reduction kernels.

Same contract as ``jaxinfer.models.llama.fused_linear`` (the jnp reference), for at most ``MAX_ROWS``
rows (the model uses XLA's matmuls above that, where they are compute-bound). The rows are padded to
16 in registers (``tl.dot`` needs 16); K and the output width must be multiples of 16.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxinfer.pallas_kernels._blocks import next_pow2

MAX_ROWS = 16
# Programs to aim for when choosing the K split: a few per SM on an H200 (132 SMs).
_PROGRAMS = 512


def _divisor_block(n: int, target: int, name: str) -> int:
    """The largest power of two <= ``target`` dividing ``n`` (at least 16, for ``tl.dot``)."""
    b = next_pow2(target)
    while b >= 16:
        if n % b == 0:
            return b
        b //= 2
    raise ValueError(f"the GEMV kernel needs {name} to be a multiple of 16, got {n}")


def _gemv_kernel(*refs, rows, block_k, block_n, k_per_split, ss_chunk, eps, has_norm, swiglu, accumulate,
                 atomic, evict_first, interpret, precision):
    """Columns ``block_n * j ..`` over K rows ``k_per_split * s ..`` (grid ``(j, s)``). ``accumulate``:
    add into ``o_ref`` (aliased to the residual or zeros), with atomics when K is split."""
    x_ref, w_ref, *refs = refs
    g_ref = refs.pop(0) if has_norm else None
    o_ref = refs[-1]
    m, k_in = x_ref.shape
    k = k_in // 2 if swiglu else k_in
    c0, k_lo = pl.program_id(0) * block_n, pl.program_id(1) * k_per_split
    r = jax.lax.broadcasted_iota(jnp.int32, (rows,), 0)
    row_ok = r < m
    x_row = jnp.minimum(r, m - 1)[:, None]  # padding rows repeat the last one; they are not written
    hint = dict(eviction_policy="evict_first") if evict_first else {}

    def load_x(k0, size):
        cols = k0 + jax.lax.broadcasted_iota(jnp.int32, (1, size), 1)
        x = x_ref[x_row, cols].astype(jnp.float32)
        if swiglu:  # silu(gate) * up, gate | up side by side
            x = x * jax.nn.sigmoid(x) * x_ref[x_row, cols + k].astype(jnp.float32)
        return x  # [rows, size] float32

    def body(i, acc):
        k0 = pl.multiple_of(k_lo + i * block_k, block_k)
        x = load_x(k0, block_k)
        if has_norm:
            x = x * g_ref[pl.ds(k0, block_k)].astype(jnp.float32)[None, :]
        w = plgpu.load(w_ref.at[pl.ds(k0, block_k), pl.ds(c0, block_n)], **hint)
        return acc + jnp.dot(x.astype(w.dtype), w, precision=precision, preferred_element_type=jnp.float32)

    acc = jax.lax.fori_loop(0, k_per_split // block_k, body, jnp.zeros((rows, block_n), jnp.float32))
    if has_norm:  # the whole row's sum of squares, in wide chunks (a long loop of small loads is slow)
        def sumsq(i, ss):
            x = load_x(i * ss_chunk, ss_chunk)
            return ss + jnp.sum(x * x, axis=1)

        ss = jax.lax.fori_loop(0, k // ss_chunk, sumsq, jnp.zeros((rows,), jnp.float32))
        acc = acc * jax.lax.rsqrt(ss / k + eps)[:, None]
    # Padding rows point past the end. Natively they are masked; interpret mode has no masked
    # atomics and emulates a masked store by read-modify-write, but drops out-of-bounds writes.
    out_row = jnp.where(row_ok, r, m + r)[:, None]
    cols = c0 + jax.lax.broadcasted_iota(jnp.int32, (1, block_n), 1)
    mask = None if interpret else jnp.broadcast_to(row_ok[:, None], (rows, block_n))
    if atomic:
        plgpu.atomic_add(o_ref, (out_row, cols), acc, mask=mask)
    else:
        if accumulate:  # one split: this program owns these outputs
            acc = acc + plgpu.load(o_ref.at[jnp.minimum(out_row, m - 1), cols]).astype(jnp.float32)
        plgpu.store(o_ref.at[out_row, cols], acc.astype(o_ref.dtype), mask=mask)


def fused_linear(x: jax.Array, w: jax.Array, *, norm: jax.Array | None = None, eps: float = 0.0,
                 residual: jax.Array | None = None, swiglu: bool = False, out_dtype=None,
                 block_n: int = 128, block_k: int = 32, splits: int | None = None, num_warps: int = 4,
                 num_stages: int = 4, evict_first: bool = False, interpret: bool = False) -> jax.Array:
    """``residual + rms_norm(act(x), norm) @ w`` with each part optional, for ``x [M <= MAX_ROWS, K]``
    and ``w [K, N]``; ``swiglu``: ``x`` is ``[M, 2K]`` gate | up and ``act(x) = silu(gate) * up``.

    ``splits`` cuts K among programs (default: enough programs to fill the GPU). Split sums need a
    float32 output; others get one split. The rest is tuning (defaults from a sweep on an H200,
    see docs/benchmarks.md)."""
    m, k_in = x.shape
    k, n = (k_in // 2 if swiglu else k_in), w.shape[1]
    if m > MAX_ROWS:
        raise ValueError(f"the GEMV kernel takes at most {MAX_ROWS} rows, got {m}")
    if w.shape[0] != k:
        raise ValueError(f"x [{m}, {k_in}] does not fit w {w.shape} (swiglu={swiglu})")
    out_dtype = jnp.dtype(out_dtype or jnp.result_type(x, *([residual] if residual is not None else [])))
    bn = _divisor_block(n, block_n, "the output width")
    bk = _divisor_block(k, block_k, "the input width")
    rows = max(16, next_pow2(m))
    if splits is None:
        splits = max(1, _PROGRAMS // (n // bn))
    splits = max(1, min(next_pow2(splits), k // bk)) if out_dtype == jnp.float32 else 1
    while (k // bk) % splits:
        splits //= 2
    accumulate = splits > 1 or residual is not None
    operands = [x, w] + ([norm] if norm is not None else [])
    aliases = {}
    if accumulate:  # the output starts as the residual or zeros; programs add into it
        init = jnp.zeros((m, n), out_dtype) if residual is None else residual.astype(out_dtype)
        aliases = {len(operands): 0}
        operands.append(init)
    return pl.pallas_call(
        functools.partial(_gemv_kernel, rows=rows, block_k=bk, block_n=bn, k_per_split=k // splits,
                          ss_chunk=_divisor_block(k, 8192 // rows, "the input width"), eps=eps,
                          has_norm=norm is not None, swiglu=swiglu, accumulate=accumulate, atomic=splits > 1,
                          evict_first=evict_first, interpret=interpret,
                          precision=jax.lax.Precision.HIGHEST if w.dtype == jnp.float32 else None),
        grid=(n // bn, splits),
        out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="fused_gemv_gpu",
    )(*operands)
