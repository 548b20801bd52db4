"""Ragged paged attention for TPU (Pallas, Mosaic TPU backend).

NOT RUN ON A TPU: this project has no TPU. The kernel is checked only in Pallas interpret mode
(``interpret=True``, backend ``interpret``) on CPU against the reference. Interpret mode checks the
indexing, masking and online-softmax logic, not Mosaic's layout rules or speed; expect to fix
lowering details the first time it meets a real chip.

Design, and why:
- Work items are query blocks (``_blocks.query_blocks``): up to ``tokens_per_block`` tokens of one
  sequence, so decodes (1 token) and prefill chunks (many) share one kernel and one launch.
- Grid ``(query block, kv page step)``. The page step axis walks the block's pages; the K/V
  BlockSpec index map reads the page number from the page table, which (with the per-block
  metadata) is scalar-prefetched into SMEM, so Pallas' pipeline DMAs page j+1 while page j is used.
  Steps past the block's last page clamp to that page: the block index repeats, so no DMA is issued
  and ``pl.when`` skips the math.
- One DMA brings a whole page ``[page_size, kv_heads, head_dim]`` (the cache's contiguous unit, last
  two dims full as Mosaic wants); all query heads of a GQA group use the K/V of their kv head from it.
- Queries are regrouped per kv head as ``[kv_heads, tokens*group, head_dim]`` so each kv head does one
  ``(tokens*group, D) x (D, page_size)`` matmul; softmax state (m, l, acc) lives in VMEM scratch
  across page steps, and the output is written once at the last step.
- The layer is a scalar-prefetched index into the stacked cache: no per-layer slice is copied. A
  sliding window (static or traced: the scanned layer loop passes each layer's) is prefetched with
  it; a block's first page step starts at its window, so pages before it are neither copied nor used.
Padding tokens (past ``query_start[S]``) produce zeros, like the reference.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxinfer.paged.kv_cache import BatchMetadata, segment_of
from jaxinfer.pallas_kernels._blocks import cdiv, query_blocks

_MASK = -1e30  # finite, so fully masked rows never produce inf - inf


def _kernel(layer_ref, pt_ref, seq_ref, pos0_ref, ntok_ref, lo_ref, hi_ref, first_ref, last_ref,
            q_ref, k_ref, v_ref, o_ref, m_sc, l_sc, acc_sc, *,
            group, page_size, scale, soft_cap, windowed, precision):
    del pt_ref, seq_ref  # used by the index maps only
    b, j = pl.program_id(0), pl.program_id(1)
    num_kv_heads, rows, _ = q_ref.shape

    @pl.when(j == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, _MASK, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    page = first_ref[b] + j

    @pl.when((page <= last_ref[b]) & (ntok_ref[b] > 0))
    def _step():
        row_pos = pos0_ref[b] + jax.lax.broadcasted_iota(jnp.int32, (rows, page_size), 0) // group
        key_pos = page * page_size + jax.lax.broadcasted_iota(jnp.int32, (rows, page_size), 1)
        mask = (key_pos <= row_pos) & (key_pos >= lo_ref[b]) & (key_pos < hi_ref[b])
        if windowed:  # layer_ref is [layer, window]
            mask &= key_pos > row_pos - layer_ref[1]
        for h in range(num_kv_heads):  # K/V of kv head h serve all `group` query heads in its rows
            q = q_ref[h]
            k = k_ref[:, h, :]
            v = v_ref[:, h, :]
            s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                                    preferred_element_type=jnp.float32) * scale
            if soft_cap is not None:
                s = soft_cap * jnp.tanh(s / soft_cap)
            s = jnp.where(mask, s, _MASK)
            m_prev = m_sc[h]
            m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
            p = jnp.where(mask, jnp.exp(s - m_new), 0.0)
            alpha = jnp.exp(m_prev - m_new)
            l_sc[h] = alpha * l_sc[h] + jnp.sum(p, axis=1, keepdims=True)
            pv = jax.lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=precision,
                                     preferred_element_type=jnp.float32)
            acc_sc[h] = alpha * acc_sc[h] + pv
            m_sc[h] = m_new

    @pl.when(j == pl.num_programs(1) - 1)
    def _finish():
        l = l_sc[...]
        o_ref[...] = (acc_sc[...] / jnp.where(l > 0, l, 1.0)).astype(o_ref.dtype)


def ragged_paged_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, layer, md: BatchMetadata, *,
                           scale: float, soft_cap: float | None = None, sliding_window=None,
                           tokens_per_block: int = 8, interpret: bool = False) -> jax.Array:
    """Same contract as ``jaxinfer.paged.attention.ragged_paged_attention``; see the module docstring.
    ``sliding_window``: None, an int or a traced int32 scalar."""
    num_tokens, num_heads, head_dim = q.shape
    _, num_pages, page_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    num_seqs, pages_per_seq = md.page_table.shape
    tq = tokens_per_block
    rows = tq * group

    blk = query_blocks(md, num_tokens, tq, sliding_window=sliding_window)
    num_blocks = blk.seq.shape[0]
    first = blk.kv_lo // page_size
    last = jnp.maximum(cdiv(blk.kv_hi, page_size) - 1, first)

    # Queries regrouped per block and kv head: [NB, KVH, tq * G, D], rows ordered (token, head in group).
    i = jnp.arange(tq, dtype=jnp.int32)
    tok = blk.tok0[:, None] + i[None]
    tok_ok = i[None] < blk.ntok[:, None]
    qb = jnp.where(tok_ok[:, :, None, None], q[jnp.clip(tok, 0, num_tokens - 1)], 0)
    qb = qb.reshape(num_blocks, tq, num_kv_heads, group, head_dim).transpose(0, 2, 1, 3, 4)
    qb = qb.reshape(num_blocks, num_kv_heads, rows, head_dim)

    layer_arr = jnp.asarray(layer, jnp.int32).reshape(1)
    if sliding_window is not None:
        layer_arr = jnp.concatenate([layer_arr, jnp.asarray(sliding_window, jnp.int32).reshape(1)])
    page_table = jnp.clip(md.page_table, 0, num_pages - 1).reshape(-1)

    def kv_map(b, j, layer_r, pt, seq, pos0, ntok, lo, hi, fst, lst):
        page_idx = jnp.minimum(fst[b] + j, lst[b])
        return layer_r[0], pt[seq[b] * pages_per_seq + page_idx], 0, 0, 0

    def q_map(b, j, *_):
        return b, 0, 0, 0

    kv_spec = pl.BlockSpec((pl.squeezed, pl.squeezed, page_size, num_kv_heads, head_dim), kv_map)
    q_spec = pl.BlockSpec((pl.squeezed, num_kv_heads, rows, head_dim), q_map)
    precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    kernel = functools.partial(_kernel, group=group, page_size=page_size, scale=scale, soft_cap=soft_cap,
                               windowed=sliding_window is not None, precision=precision)
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=9,
            grid=(num_blocks, pages_per_seq),
            in_specs=[q_spec, kv_spec, kv_spec],
            out_specs=q_spec,
            scratch_shapes=[pltpu.VMEM((num_kv_heads, rows, 1), jnp.float32),
                            pltpu.VMEM((num_kv_heads, rows, 1), jnp.float32),
                            pltpu.VMEM((num_kv_heads, rows, head_dim), jnp.float32)],
        ),
        out_shape=jax.ShapeDtypeStruct(qb.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret,
        name="ragged_paged_attention_tpu",
    )(layer_arr, page_table, blk.seq, blk.pos0, blk.ntok, blk.kv_lo, blk.kv_hi, first, last, qb, k_cache, v_cache)

    # Back to packed tokens: token t lives in block blk_of[t] at row group (t - tok0).
    out = out.reshape(num_blocks, num_kv_heads, tq, group, head_dim).transpose(0, 2, 1, 3, 4)
    out = out.reshape(num_blocks * tq, num_heads, head_dim)
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    blk_ends = jnp.cumsum(blk.ntok)
    blk_of = jnp.minimum(segment_of(blk_ends, t), num_blocks - 1)
    valid = t < md.query_start[-1]
    out = out[blk_of * tq + jnp.clip(t - blk.tok0[blk_of], 0, tq - 1)]
    return jnp.where(valid[:, None, None], out, 0).astype(q.dtype)
