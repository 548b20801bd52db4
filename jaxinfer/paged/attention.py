"""Reference ragged paged attention in pure ``jnp``: the CPU path and the oracle for the Pallas kernels.

One step packs decode tokens (one query each) and prefill chunks (many queries, causal) of different
sequences into one ragged batch; every query reads its own sequence's context through the page table.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.paged.kv_cache import BatchMetadata, dequantize, quantize, segment_of

# Scores are materialized for a block of queries at a time; this bounds a block's
# (queries x context) so prefill of long prompts stays within memory.
_BLOCK_ELEMENTS = 1 << 16
# Queries per block when a step has several sequences (see ``ragged_paged_attention``).
_SEGMENT_BLOCK = 16


def token_layout(md: BatchMetadata, num_tokens: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """For each packed token: its sequence index, its position, and whether it is a real token."""
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    num_seqs = md.seq_lens.shape[0]
    seq = segment_of(md.query_start[1:], t)
    valid = seq < num_seqs
    seq = jnp.minimum(seq, num_seqs - 1)
    q_len = md.query_start[seq + 1] - md.query_start[seq]
    pos = md.seq_lens[seq] - q_len + (t - md.query_start[seq])
    return seq, pos, valid


def ragged_paged_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, layer, md: BatchMetadata, *,
                           scale: float, soft_cap: float | None = None,
                           sliding_window: int | None = None,
                           new_kv: tuple[jax.Array, jax.Array] | None = None,
                           k_scale: jax.Array | None = None, v_scale: jax.Array | None = None) -> jax.Array:
    """Attention of packed queries ``q [T, H, D]`` over layer ``layer`` of the paged cache.

    ``k_cache``/``v_cache`` are ``[layers, pages, page_size, kv_heads, D]`` and already hold this
    step's K/V, unless the step's K/V ``[T, kv_heads, D]`` are given as ``new_kv`` (the cache is then
    written after every layer has run; see ``kv_cache.write_kv_layers``): they are placed at their
    positions in the gathered context, a copy made anyway, and the cache is only read. Query ``t`` of sequence ``s`` at position ``p`` attends to positions ``<= p`` of ``s``
    (and ``> p - sliding_window`` when set). Padding tokens produce zeros.
    A quantized cache (int8/fp8 codes) comes with its scales ``k_scale``/``v_scale``
    ``[layers, pages, page_size, kv_heads]`` (``kv_cache.KVCache``); ``new_kv`` is then float and is
    quantized and dequantized here exactly as its write will store it.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[3]
    group = num_heads // num_kv_heads
    num_seqs, pages_per_seq = md.page_table.shape
    ctx = pages_per_seq * k_cache.shape[2]

    # Each sequence's context, gathered once: [S, ctx, kv_heads, D].
    k_seq = k_cache[layer][md.page_table].reshape(num_seqs, ctx, num_kv_heads, head_dim)
    v_seq = v_cache[layer][md.page_table].reshape(num_seqs, ctx, num_kv_heads, head_dim)
    if k_scale is not None:
        k_seq = dequantize(k_seq, k_scale[layer][md.page_table].reshape(num_seqs, ctx, num_kv_heads))
        v_seq = dequantize(v_seq, v_scale[layer][md.page_table].reshape(num_seqs, ctx, num_kv_heads))
        if new_kv is not None:
            new_kv = tuple(dequantize(*quantize(x, c.dtype)) for x, c in zip(new_kv, (k_cache, v_cache)))
    seq, pos, valid = token_layout(md, num_tokens)
    if new_kv is not None:
        at = jnp.where(valid, pos, ctx)  # padding: out of range, dropped
        k_seq = k_seq.at[seq, at].set(new_kv[0].astype(k_seq.dtype), mode="drop")
        v_seq = v_seq.at[seq, at].set(new_kv[1].astype(v_seq.dtype), mode="drop")

    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    key_pos = jnp.arange(ctx, dtype=jnp.int32)

    # With one sequence (a batch-1 step) every query reads the same context: no per-query copy of it.
    # A batch-1 verify step (speculative decoding: last token + k proposals) copied it k + 1 times per
    # layer where a decode step copies it once (docs/benchmarks.md, issue 26). With several, blocks of
    # _SEGMENT_BLOCK queries: one whose queries are all one sequence's (the packed tokens are grouped
    # by sequence, so all but the blocks at a boundary in a prefill chunk) reads that context alone;
    # the others copy each query's context. Copying it for every query of a 128-token step cost
    # SmolLM2 on CPU ~1.6x the step (125 prefill + 3 decode tokens, 1.04 s -> 0.62 s, contended).
    one = num_seqs == 1
    block = max(1, min(num_tokens, _BLOCK_ELEMENTS // ctx, num_tokens if one else _SEGMENT_BLOCK))
    num_blocks = -(-num_tokens // block)
    pad = num_blocks * block - num_tokens

    def blocks(x):
        x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
        return x.reshape(num_blocks, block, *x.shape[1:])

    def attend_to(qb, pb, vb, kb, vvb):
        ctx_of = "ckd" if kb.ndim == 3 else "bckd"  # one context for the block, or one per query
        s = jnp.einsum(f"bkgd,{ctx_of}->bkgc", qb.astype(jnp.float32), kb.astype(jnp.float32),
                       precision=jax.lax.Precision.HIGHEST) * scale
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        mask = key_pos[None, :] <= pb[:, None]
        if sliding_window is not None:
            mask &= key_pos[None, :] > pb[:, None] - sliding_window
        mask &= vb[:, None]
        s = jnp.where(mask[:, None, None, :], s, -jnp.inf)
        m = jnp.max(s, axis=-1, keepdims=True)
        p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))
        denom = jnp.sum(p, axis=-1, keepdims=True)
        out = jnp.einsum(f"bkgc,{ctx_of}->bkgd", p, vvb.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
        out = out / jnp.where(denom > 0, denom, 1.0)
        return out.astype(q.dtype)

    def attend(args):
        qb, sb, pb, vb = args  # [B, KVH, G, D], [B], [B], [B]
        if one:
            return attend_to(qb, pb, vb, k_seq[0], v_seq[0])
        first = sb[0]  # padding queries (~vb) may name any sequence: they are masked out
        return jax.lax.cond(jnp.all((sb == first) | ~vb),
                            lambda: attend_to(qb, pb, vb, k_seq[first], v_seq[first]),
                            lambda: attend_to(qb, pb, vb, k_seq[sb], v_seq[sb]))  # [B, ctx, KVH, D] each

    out = jax.lax.map(attend, (blocks(qg), blocks(seq), blocks(pos), blocks(valid)))
    return out.reshape(num_blocks * block, num_heads, head_dim)[:num_tokens]
