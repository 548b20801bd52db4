"""The model's fused linear at decode batch sizes, as one Pallas (Triton) kernel for GPUs.

Why: at a few tokens per step a matmul is a GEMV that streams its weight once, and XLA runs each of
the model's linears as a split-K matmul plus a reduction, next to separate kernels for the RMSNorm
before it and the SwiGLU or residual add after it: ~10 small kernels per layer, ~20 us of an 8B
batch-1 layer on an H200 besides ~107 us of matmuls. Here one program owns ``block_n`` output columns
over the whole K: it streams its weight columns in ``block_k`` rows (pipelined loads), and folds the
rest in:
- RMSNorm as a prologue: the norm weight scales x along K, the row's sum of squares is accumulated
  in the same loop, and the per-row ``rsqrt`` scales the result (the norm is per row, so it commutes
  with the matmul);
- SwiGLU as an epilogue: a program reads its gate and its up columns, writes ``silu(gate) * up``;
- the residual add as an epilogue.

Same contract as ``jaxinfer.models.llama.fused_linear`` (the jnp reference), for at most ``MAX_ROWS``
rows (the model uses XLA's matmuls above that, where they are compute-bound and fine). The rows are
padded to 16 in registers (``tl.dot`` needs 16); K and the output width must be multiples of 16.
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


def _gemv_kernel(*refs, rows, ss_chunk, block_k, block_n, n_out, k_per_split, eps, has_norm, has_residual, swiglu,
                 partial, evict_first, precision):
    """Columns ``block_n * j ..`` over K rows ``k_per_split * s ..`` (grid ``(j, s)``). With ``partial``
    the program writes its float32 partial sums (norm scale applied) to ``o_ref [S, M, N]``; otherwise
    the finished rows to ``o_ref [M, N]``."""
    x_ref, w_ref, *refs = refs
    g_ref = refs.pop(0) if has_norm else None
    r_ref = refs.pop(0) if has_residual else None
    (o_ref,) = refs
    m, k = x_ref.shape
    c0, split = pl.program_id(0) * block_n, pl.program_id(1)
    r = jax.lax.broadcasted_iota(jnp.int32, (rows,), 0)
    row_ok = r < m
    x_row = jnp.minimum(r, m - 1)[:, None]  # padding rows repeat the last one; they are not stored
    kk = jax.lax.broadcasted_iota(jnp.int32, (1, block_k), 1)
    cols = c0 + jax.lax.broadcasted_iota(jnp.int32, (1, block_n), 1)
    hint = dict(eviction_policy="evict_first") if evict_first else {}

    def weights(k0, c):
        return plgpu.load(w_ref.at[pl.ds(k0, block_k), pl.ds(c, block_n)], **hint).astype(x_ref.dtype)

    def dot(x, w, acc):
        return acc + jnp.dot(x, w, precision=precision, preferred_element_type=jnp.float32)

    def body(i, carry):
        acc, acc_up = carry
        k0 = pl.multiple_of(split * k_per_split + i * block_k, block_k)
        x = x_ref[x_row, k0 + kk]  # [rows, block_k]
        if has_norm:
            x = (x.astype(jnp.float32) * g_ref[pl.ds(k0, block_k)].astype(jnp.float32)[None, :]).astype(x_ref.dtype)
        acc = dot(x, weights(k0, c0), acc)
        if swiglu:
            acc_up = dot(x, weights(k0, c0 + n_out), acc_up)
        return acc, acc_up

    zeros = jnp.zeros((rows, block_n), jnp.float32)
    acc, acc_up = jax.lax.fori_loop(0, k_per_split // block_k, body, (zeros, zeros))
    if has_norm:  # the norm is per row, so its rsqrt scales the result; the sum of squares needs all of x
        # In wide chunks: a long loop of small loads here cost as much as the whole matmul.
        chunk = ss_chunk
        cc = jax.lax.broadcasted_iota(jnp.int32, (1, chunk), 1)

        def sumsq(i, ss):
            x = x_ref[x_row, i * chunk + cc].astype(jnp.float32)
            return ss + jnp.sum(x * x, axis=1)

        ss = jax.lax.fori_loop(0, k // chunk, sumsq, jnp.zeros((rows,), jnp.float32))
        scale = jax.lax.rsqrt(ss / k + eps)[:, None]
        acc, acc_up = acc * scale, acc_up * scale
    # Masked rows point past the end: interpret mode emulates a masked store by read-modify-write,
    # so they must not alias a stored row (out of bounds, it drops them).
    out_row = jnp.where(row_ok, r, m + r)[:, None]
    mask = jnp.broadcast_to(row_ok[:, None], (rows, block_n))
    if partial:
        plgpu.store(o_ref.at[split, out_row, cols], acc, mask=mask)
        if swiglu:
            plgpu.store(o_ref.at[split, out_row, cols + n_out], acc_up, mask=mask)
        return
    if swiglu:
        acc = acc * jax.nn.sigmoid(acc) * acc_up
    if has_residual:
        acc = acc + r_ref[x_row, cols].astype(jnp.float32)
    plgpu.store(o_ref.at[out_row, cols], acc.astype(o_ref.dtype), mask=mask)


def fused_linear(x: jax.Array, w: jax.Array, *, norm: jax.Array | None = None, eps: float = 0.0,
                 residual: jax.Array | None = None, swiglu: bool = False, out_dtype=None,
                 block_n: int = 128, block_k: int = 64, splits: int | None = None, num_warps: int = 4,
                 num_stages: int = 3, evict_first: bool = False, interpret: bool = False) -> jax.Array:
    """``residual + act(rms_norm(x, norm) @ w)``, each part optional, for ``x [M <= MAX_ROWS, K]`` and
    ``w [K, N]``; ``swiglu`` splits the result into gate | up halves and returns ``silu(gate) * up``.

    ``splits`` cuts K among programs (default: enough programs to fill the GPU); their float32
    partials are then summed, with the epilogue, by one XLA reduction. The rest is tuning
    (defaults from scripts/bench_kernels.py on an H200)."""
    m, k = x.shape
    n_out = w.shape[1] // 2 if swiglu else w.shape[1]
    if m > MAX_ROWS:
        raise ValueError(f"the GEMV kernel takes at most {MAX_ROWS} rows, got {m}")
    bn = _divisor_block(n_out, block_n, "the output width")
    bk = _divisor_block(k, block_k, "the input width")
    if splits is None:
        splits = max(1, _PROGRAMS // (n_out // bn))
    splits = max(1, min(next_pow2(splits), k // bk))
    while (k // bk) % splits:
        splits //= 2
    out_dtype = out_dtype or x.dtype
    rows = max(16, next_pow2(m))
    partial = splits > 1
    out_shape = (splits, m, w.shape[1]) if partial else (m, n_out)
    operands = [x, w] + ([norm] if norm is not None else []) + ([residual] if residual is not None else [])
    y = pl.pallas_call(
        functools.partial(_gemv_kernel, rows=rows, ss_chunk=_divisor_block(k, 8192 // rows, "the input width"), block_k=bk, block_n=bn, n_out=n_out,
                          k_per_split=k // splits, eps=eps, has_norm=norm is not None,
                          has_residual=residual is not None, swiglu=swiglu, partial=partial,
                          evict_first=evict_first,
                          precision=jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None),
        grid=(n_out // bn, splits),
        out_shape=jax.ShapeDtypeStruct(out_shape, jnp.float32 if partial else out_dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="fused_gemv_gpu",
    )(*operands)
    if not partial:
        return y
    y = jnp.sum(y, axis=0)  # one XLA reduction kernel, with the epilogue fused into it
    if swiglu:
        y = jax.nn.silu(y[:, :n_out]) * y[:, n_out:]
    if residual is not None:
        y = y + residual.astype(jnp.float32)
    return y.astype(out_dtype)
