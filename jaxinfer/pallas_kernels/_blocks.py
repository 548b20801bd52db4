"""Query blocks: how the kernels cut a step's packed ragged queries into fixed-size work items.

A kernel's grid must be static, but how many tokens each sequence contributes changes every step.
So each sequence's query tokens are cut into blocks of at most ``tokens_per_block`` tokens (a block
never spans two sequences), and the grid is sized by the static bound
``cdiv(num_tokens, tokens_per_block) + num_seqs`` (each sequence wastes at most one partial block;
fewer when a caller knows fewer sequences can take part).
Blocks past the real ones have ``ntok == 0`` and do nothing. This metadata is a handful of int32
vectors computed by XLA outside the kernel; the kernels read it as scalars.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxinfer.paged.kv_cache import BatchMetadata, segment_of


def cdiv(a, b):
    return -(-a // b)


def next_pow2(n: int) -> int:
    """Triton block shapes must be powers of two: the smallest one >= ``n``."""
    return 1 << max(0, (n - 1).bit_length())


def words_of_bytes(b: jax.Array) -> jax.Array:
    """Bytes ``[..., 4]`` (uint8) as the little-endian uint32 words ``[...]`` they make, in a kernel:
    Triton cannot bitcast across element widths, so the bytes are summed at their shifts (where
    they came from one load, LLVM folds this back into the loaded registers)."""
    b = b.astype(jnp.uint32)
    return jnp.sum(b << (8 * jax.lax.broadcasted_iota(jnp.uint32, b.shape, b.ndim - 1)), axis=-1)


@dataclasses.dataclass
class QueryBlocks:
    seq: jax.Array  # int32 [NB]: the block's sequence
    tok0: jax.Array  # int32 [NB]: packed index of its first query token
    ntok: jax.Array  # int32 [NB]: real tokens in the block (0 for unused blocks)
    pos0: jax.Array  # int32 [NB]: position of its first token in the sequence
    kv_lo: jax.Array  # int32 [NB]: first key position any of its tokens may see (sliding window)
    kv_hi: jax.Array  # int32 [NB]: one past the last key position it may see (causal)


def query_blocks(md: BatchMetadata, num_tokens: int, tokens_per_block: int, include: jax.Array | None = None,
                 sliding_window: int | None = None, max_seqs: int | None = None) -> QueryBlocks:
    """Cut the packed queries into blocks; ``include`` [S] (bool) restricts to some sequences, of
    which at most ``max_seqs`` (static; default all) can be included in one step."""
    num_seqs = md.seq_lens.shape[0]
    tq = tokens_per_block
    q_len = md.query_start[1:] - md.query_start[:-1]
    nblk = cdiv(q_len, tq)
    if include is not None:
        nblk = jnp.where(include, nblk, 0)
    ends = jnp.cumsum(nblk).astype(jnp.int32)
    num_blocks = cdiv(num_tokens, tq) + (num_seqs if max_seqs is None else min(max_seqs, num_seqs))
    b = jnp.arange(num_blocks, dtype=jnp.int32)
    seq = jnp.minimum(segment_of(ends, b), num_seqs - 1)
    real = b < ends[-1]
    j = b - (ends[seq] - nblk[seq])  # block index within its sequence
    tok0 = md.query_start[seq] + j * tq
    ntok = jnp.where(real, jnp.clip(q_len[seq] - j * tq, 0, tq), 0)
    pos0 = md.seq_lens[seq] - q_len[seq] + j * tq
    kv_hi = jnp.where(real, pos0 + ntok, 0)
    kv_lo = jnp.zeros_like(kv_hi) if sliding_window is None else jnp.maximum(pos0 - sliding_window + 1, 0)
    kv_lo = jnp.minimum(kv_lo, kv_hi)
    return QueryBlocks(seq, tok0.astype(jnp.int32), ntok.astype(jnp.int32), pos0.astype(jnp.int32),
                       kv_lo.astype(jnp.int32), kv_hi.astype(jnp.int32))
