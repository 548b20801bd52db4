"""Reference ragged paged attention in pure ``jnp``: the CPU path and the oracle for the Pallas kernels.

One step packs decode tokens (one query each) and prefill chunks (many queries, causal) of different
sequences into one ragged batch; every query reads its own sequence's context through the page table.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxinfer.paged.kv_cache import BatchMetadata, code_dtype, dequantize, quantize, segment_of, unpack_codes

# Scores are materialized for a block of queries at a time; this bounds a block's
# (queries x context) so prefill of long prompts stays within memory.
_BLOCK_ELEMENTS = 1 << 16
# Queries per block when a step has several sequences (see ``ragged_paged_attention``).
_SEGMENT_BLOCK = 16
# Context tokens read per iteration of the key loop: 16 pages of 16, the CPU's smallest page bucket
# before the loop replaced its page buckets, so short contexts cost what they did.
_KEY_BLOCK = 256


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

    The context is read in blocks of ``_KEY_BLOCK`` tokens (an online softmax across them). On CPU
    only as many as the batch's longest sequence fills: a loop with a run-time trip count, so the
    cost follows the real context, not the page table's width, and a step compiled for the longest
    context serves every shorter one: the CPU compiles one page bucket, not four (warm-up was nearly
    all compilation, ~2.3 s a step on 2 cores). Elsewhere (the oracle for the GPU/TPU
    kernels, a fallback for head sizes they lack) every block of the page table, as before.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[3]
    group = num_heads // num_kv_heads
    num_seqs, pages_per_seq = md.page_table.shape
    page_size = k_cache.shape[2]
    block_pages = max(1, min(pages_per_seq, _KEY_BLOCK // page_size))
    key_block = block_pages * page_size
    num_key_blocks = -(-pages_per_seq // block_pages)
    page_table = jnp.pad(md.page_table, ((0, 0), (0, num_key_blocks * block_pages - pages_per_seq)))
    if new_kv is not None and k_scale is not None:
        new_kv = tuple(dequantize(*quantize(x, code_dtype(c))) for x, c in zip(new_kv, (k_cache, v_cache)))
    seq, pos, valid = token_layout(md, num_tokens)

    def context(j):
        """Keys and values of key block ``j`` of every sequence: [S, key_block, kv_heads, D] each."""
        pages = jax.lax.dynamic_slice_in_dim(page_table, j * block_pages, block_pages, axis=1)
        k = unpack_codes(k_cache[layer, pages]).reshape(num_seqs, key_block, num_kv_heads, head_dim)
        v = unpack_codes(v_cache[layer, pages]).reshape(num_seqs, key_block, num_kv_heads, head_dim)
        if k_scale is not None:
            k = dequantize(k, k_scale[layer, pages].reshape(num_seqs, key_block, num_kv_heads))
            v = dequantize(v, v_scale[layer, pages].reshape(num_seqs, key_block, num_kv_heads))
        if new_kv is not None:
            at = pos - j * key_block
            at = jnp.where(valid & (at >= 0) & (at < key_block), at, key_block)  # elsewhere: dropped
            k = k.at[seq, at].set(new_kv[0].astype(k.dtype), mode="drop")
            v = v.at[seq, at].set(new_kv[1].astype(v.dtype), mode="drop")
        return k, v

    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim).astype(jnp.float32)

    # With one sequence (a batch-1 step) every query reads the same context: no per-query copy of it.
    # A batch-1 verify step (speculative decoding: last token + k proposals) copied it k + 1 times per
    # layer where a decode step copies it once (k = 4, SmolLM2 at the 64-page bucket: ~236 MB a step
    # against 47 MB). With several, blocks of _SEGMENT_BLOCK queries: one whose queries are all one
    # sequence's (the packed tokens are grouped by sequence, so all but the blocks at a boundary in a
    # prefill chunk) reads that context alone; the others copy each query's context. Copying it for
    # every query of a 128-token step cost SmolLM2 on CPU ~1.6x the step (125 prefill + 3 decode
    # tokens, 1.04 s -> 0.62 s, contended).
    one = num_seqs == 1
    block = max(1, min(num_tokens, _BLOCK_ELEMENTS // key_block, num_tokens if one else _SEGMENT_BLOCK))
    num_blocks = -(-num_tokens // block)
    pad = num_blocks * block - num_tokens

    def blocks(x):
        x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
        return x.reshape(num_blocks, block, *x.shape[1:])

    def attend_to(qb, pb, vb, kb, vvb, key_pos, state):
        """One query block's running (max, sum, unnormalized output) after the keys ``kb``/``vvb``."""
        m, l, acc = state
        kb, vvb = kb.astype(jnp.float32), vvb.astype(jnp.float32)
        hi = jax.lax.Precision.HIGHEST
        if qb.shape[0] == 1 and kb.ndim == 3:
            # One query over one context (batch-1 decode): dots over the context in its stored
            # [c, kv_heads, D] order. The block-shaped einsums below made XLA:CPU transpose K and V
            # around two small library calls per layer, and a broadcast product and sum still
            # transposed them: SmolLM2's batch-1 step went 22.83 -> 21.58 ms at a 128-token context.
            scores = lambda q, k: jnp.einsum("ckd,kgd->kgc", k, q[0], precision=hi)[None]  # noqa: E731
            mix = lambda p, v: jnp.einsum("kgc,ckd->kgd", p[0], v, precision=hi)[None]  # noqa: E731
        else:
            ctx_of = "ckd" if kb.ndim == 3 else "bckd"  # one context for the block, or one per query
            scores = functools.partial(jnp.einsum, f"bkgd,{ctx_of}->bkgc", precision=hi)
            mix = functools.partial(jnp.einsum, f"bkgc,{ctx_of}->bkgd", precision=hi)
        s = scores(qb, kb) * scale
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        mask = key_pos[None, :] <= pb[:, None]
        if sliding_window is not None:
            mask &= key_pos[None, :] > pb[:, None] - sliding_window
        mask &= vb[:, None]
        s = jnp.where(mask[:, None, None, :], s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1, keepdims=True))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.exp(s - m_safe)
        correction = jnp.exp(m - m_safe)  # 0 where nothing was seen yet (m = -inf)
        out = mix(p, vvb)
        return m_new, l * correction + jnp.sum(p, axis=-1, keepdims=True), acc * correction + out

    def key_step(j, state):
        k_seq, v_seq = context(j)
        key_pos = j * key_block + jnp.arange(key_block, dtype=jnp.int32)

        def attend(args):
            qb, sb, pb, vb, st = args  # [B, KVH, G, D], [B], [B], [B], the block's state
            if one:
                return attend_to(qb, pb, vb, k_seq[0], v_seq[0], key_pos, st)
            first = sb[0]  # padding queries (~vb) may name any sequence: they are masked out
            # Query i of the block is sequence first + i's (a decode step: one token per sequence, in
            # order; any queries past the sequences are padding): their contexts are a slice of k_seq,
            # the whole of it when the block spans every sequence, not a per-query copy. SmolLM2's
            # 8-sequence decode step on CPU copied 3 MB per layer that way: 60.0 -> 53.7 ms at a
            # ~300-token context.
            n = min(block, num_seqs)

            def one_sequence():
                return attend_to(qb, pb, vb, k_seq[first], v_seq[first], key_pos, st)

            def in_order():
                k = jax.lax.dynamic_slice_in_dim(k_seq, first, n)
                v = jax.lax.dynamic_slice_in_dim(v_seq, first, n)
                part = attend_to(qb[:n], pb[:n], vb[:n], k, v, key_pos, tuple(x[:n] for x in st))
                return tuple(jnp.concatenate([a, x[n:]]) for a, x in zip(part, st))

            def per_query():
                return attend_to(qb, pb, vb, k_seq[sb], v_seq[sb], key_pos, st)
            is_one = jnp.all((sb == first) | ~vb)
            is_in_order = jnp.all((sb == first + jnp.arange(block)) | ~vb) & (first + n <= num_seqs)
            return jax.lax.switch(jnp.where(is_one, 0, jnp.where(is_in_order, 1, 2)),
                                  [one_sequence, in_order, per_query])
        return jax.lax.map(attend, (blocks(qg), blocks(seq), blocks(pos), blocks(valid), state))

    shape = (num_blocks, block, num_kv_heads, group)
    state = (jnp.full((*shape, 1), -jnp.inf, jnp.float32), jnp.zeros((*shape, 1), jnp.float32),
             jnp.zeros((*shape, head_dim), jnp.float32))
    if jax.default_backend() == "cpu":
        longest = jnp.max(jnp.where(valid, pos, -1)) + 1  # keys past the last query's position are masked
        state = jax.lax.fori_loop(0, jnp.minimum(-(-longest // key_block), num_key_blocks), key_step, state)
    else:  # every block, unrolled: XLA:GPU would read a loop's run-time bound on the host each step
        for j in range(num_key_blocks):
            state = key_step(j, state)
    m, l, acc = state
    out = (acc / jnp.where(l > 0, l, 1.0)).astype(q.dtype)
    return out.reshape(num_blocks * block, num_heads, head_dim)[:num_tokens]
