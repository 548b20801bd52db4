"""The paged KV cache (device pytree) and the per-step batch metadata that addresses it.

Layout: ``k`` and ``v`` are each one array ``[num_layers, num_pages, page_size, num_kv_heads, head_dim]``.
- One buffer per K and V (not one per layer) so the whole cache is two donated arrays, and both an
  unrolled and a scanned layer loop can address a layer by index without slicing out a copy: the
  layer index is passed down to attention, which reads pages of that layer in place.
- A page holds ``page_size`` consecutive token positions of one sequence; ``page_size * kv_heads *
  head_dim`` contiguous elements make one DMA-friendly block for the Pallas kernels.
- A token's slot is ``page * page_size + offset``; the host-side allocator (``block_manager``) owns
  which pages belong to which sequence.

Quantized caches (``kv_cache_dtype`` ``"int8"`` or ``"fp8"``, float8_e4m3fn): ``k``/``v`` hold codes and
``k_scale``/``v_scale`` ``[num_layers, num_pages, page_size, num_kv_heads]`` (float32) one scale per
token per kv head (symmetric, ``scale = max|x| / qmax``), beside the pages with the same page axis, so
every copy of pages (swap, prefix sharing: pages are shared whole) carries its scales along. Why this
granularity rather than vLLM's (one per-tensor scale, 1.0 unless calibrated offline with
llm-compressor; per-head scales only from calibration) or per page:
- Accuracy without calibration: a token's own amax is known when it is written, so nothing is
  guessed and no outlier token widens the grid of its neighbours. A per-page scale would have to be
  fixed by the page's first token (later, larger ones clip) or re-quantize the page's earlier tokens
  on every write; a static 1.0 loses int8 entirely (its grid is integers) and leaves fp8's range to
  chance.
- Bandwidth: 4 scale bytes per ``head_dim`` code bytes, +3% at head_dim 128 (the cache read per
  step is 0.52x of bf16's rather than 0.5x); the kernels apply them to the scores (K) and to the
  probabilities (V), one multiply per key, not per element.
fp8 codes are stored as uint32 words of four (``[..., head_dim / 4]``; byte ``j`` of word ``c`` is element
``4c + j``, the same bytes as a float8 array): XLA cannot reinterpret an array at another element width
without copying it, and the GPU decode kernel wants words. Loaded from shared memory as bytes and
widened one at a time, an fp8 cache made the kernel slower than bf16's although it reads half the
bytes; as words, two codes become two float16 with one ``cvt.rn.f16x2.e4m3x2`` and the kernel is
0.70x the bytes' time (H200, 256 sequences x 640 tokens). ``pack_codes`` and
``unpack_codes`` convert; ``code_dtype`` names what a stored array holds.
Attention always sees the dequantized values, the step's own new tokens included (as if written,
then read), so every path (reference, deferred write, Pallas kernels) computes the same thing.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

# Largest code magnitude of each quantized storage dtype (e4m3fn has no inf: values past 448 become NaN).
_QMAX = {jnp.dtype(jnp.int8): 127.0, jnp.dtype(jnp.float8_e4m3fn): 448.0}


def kv_storage_dtype(kv_cache_dtype: str, model_dtype) -> jnp.dtype:
    """The cache's element dtype for the ``kv_cache_dtype`` option (one of ``KV_CACHE_DTYPES``, checked by
    ``EngineConfig``; ``"auto"``: the model's dtype)."""
    return jnp.dtype({"auto": model_dtype, "int8": jnp.int8, "fp8": jnp.float8_e4m3fn}[kv_cache_dtype])


def is_quantized(dtype) -> bool:
    return jnp.dtype(dtype) in _QMAX


def packed(stored) -> bool:
    """Whether a stored cache array (or a kernel's ref to one) holds fp8 codes as uint32 words."""
    return stored.dtype == jnp.uint32


def head_dim_of(stored) -> int:
    """The head_dim of a stored cache array (or a kernel's ref to one): 4 codes a word when packed."""
    return stored.shape[-1] * (4 if packed(stored) else 1)


def code_dtype(stored) -> jnp.dtype:
    """The code dtype a stored cache array holds: float8_e4m3fn for uint32 words, else its own."""
    return jnp.dtype(jnp.float8_e4m3fn) if packed(stored) else jnp.dtype(stored.dtype)


def pack_codes(codes: jax.Array) -> jax.Array:
    """fp8 codes ``[..., D]`` as the cache stores them, uint32 words ``[..., D / 4]``; other dtypes as
    they are."""
    if codes.dtype != jnp.float8_e4m3fn:
        return codes
    return jax.lax.bitcast_convert_type(codes.reshape(*codes.shape[:-1], codes.shape[-1] // 4, 4), jnp.uint32)


def unpack_codes(stored: jax.Array) -> jax.Array:
    """``pack_codes`` undone: the codes of a stored cache array (or a gathered part of one)."""
    if not packed(stored):
        return stored
    codes = jax.lax.bitcast_convert_type(stored, jnp.float8_e4m3fn)  # [..., D / 4, 4]
    return codes.reshape(*stored.shape[:-1], 4 * stored.shape[-1])


def quantize(x: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """Symmetric codes of ``x [..., D]`` in ``dtype`` and one float32 scale per row ``[...]``.
    The Pallas kernels compute exactly these operations (``quantize_rows``)."""
    x = x.astype(jnp.float32)
    return quantize_rows(x, jnp.max(jnp.abs(x), axis=-1), dtype)


def quantize_rows(x: jax.Array, amax: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """``quantize`` given each row's ``amax`` (float32), for kernels that hold a row in pieces."""
    qmax = _QMAX[jnp.dtype(dtype)]
    scale = amax / qmax
    y = jnp.clip(x / jnp.where(scale > 0, scale, 1.0)[..., None], -qmax, qmax)
    if jnp.issubdtype(dtype, jnp.integer):
        y = jnp.floor(y + 0.5)  # round half up: Pallas' Triton lowering has floor, not round
    return y.astype(dtype), scale


def dequantize(codes: jax.Array, scale: jax.Array) -> jax.Array:
    return codes.astype(jnp.float32) * scale[..., None]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    k: jax.Array
    v: jax.Array
    # Quantized caches only (else None): per token and kv head, ``[layers, pages, page_size, kv_heads]``.
    k_scale: jax.Array | None = None
    v_scale: jax.Array | None = None

    @property
    def num_pages(self) -> int:
        return self.k.shape[1]

    @property
    def page_size(self) -> int:
        return self.k.shape[2]

    @property
    def head_dim(self) -> int:
        return head_dim_of(self.k)

    @property
    def quantized(self) -> bool:
        return self.k_scale is not None

    @property
    def write_dtype(self):
        """The dtype new K/V are handed to the writes in: the cache's, or float32 to be quantized."""
        return jnp.dtype(jnp.float32) if self.quantized else self.k.dtype

    def scales(self) -> dict:
        """The attention kernels' extra keyword arguments for this cache: none, or its scales."""
        return dict(k_scale=self.k_scale, v_scale=self.v_scale) if self.quantized else {}

    @classmethod
    def zeros(cls, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
              dtype=jnp.float32) -> "KVCache":
        """An empty pool of element ``dtype``; int8 / float8_e4m3fn make a quantized one (with scales;
        fp8 codes as uint32 words, ``pack_codes``)."""
        shape = (num_layers, num_pages, page_size, num_kv_heads, head_dim)
        if not is_quantized(dtype):
            return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
        if jnp.dtype(dtype) == jnp.float8_e4m3fn:
            if head_dim % 4:
                raise ValueError(f"an fp8 KV cache needs head_dim divisible by 4, got {head_dim}")
            shape, dtype = shape[:-1] + (head_dim // 4,), jnp.uint32
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros(shape[:-1], jnp.float32),
                   jnp.zeros(shape[:-1], jnp.float32))

    @staticmethod
    def bytes_per_page(num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype) -> int:
        per_head = head_dim * jnp.dtype(dtype).itemsize + (4 if is_quantized(dtype) else 0)
        return 2 * num_layers * page_size * num_kv_heads * per_head


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class BatchMetadata:
    """Where a step's packed (ragged) tokens live. Shapes are bucketed; padding is inert.

    T = tokens in the step, S = sequences in the step, P = pages per sequence (all padded).
    Sequence ``s`` owns query tokens ``query_start[s]:query_start[s+1]``; its context after this
    step is ``seq_lens[s]`` tokens, so its tokens sit at positions ``seq_lens[s] - q_len + i``.
    Padding sequences have ``q_len == 0`` and ``seq_lens == 0``; padding tokens have a slot past the
    end of the pool so their K/V writes are dropped.
    """

    slot_mapping: jax.Array  # int32 [T]: flat slot (page * page_size + offset) for each token's K/V
    page_table: jax.Array  # int32 [S, P]: pages of each sequence, in order
    seq_lens: jax.Array  # int32 [S]: context length of each sequence including this step's tokens
    query_start: jax.Array  # int32 [S + 1]: cumulative query lengths (packed token offsets)
    logits_indices: jax.Array  # int32 [S]: packed index of the token whose logits are sampled
    # Static: every sequence has one query token (or none, padding). Steps compile separately for it,
    # so a backend may run such steps through a decode-only kernel (``Ops.decode_attention``).
    decode_only: bool = dataclasses.field(default=False, metadata=dict(static=True))


def segment_of(ends: jax.Array, idx: jax.Array) -> jax.Array:
    """Which segment each of ``idx`` falls in, given the segments' cumulative ``ends`` (sorted).

    All pairs are compared rather than binary-searched: XLA:GPU runs ``searchsorted``'s search
    loop as a while loop whose every iteration syncs with the host (measured ~40 us each on an
    H200, stalling the next step's dispatch), while the compare is one fused kernel at these sizes."""
    return jnp.searchsorted(ends, idx, side="right", method="compare_all").astype(jnp.int32)


def _put(cache: KVCache, slots: jax.Array, k: jax.Array, v: jax.Array) -> KVCache:
    """Scatter rows ``[N, kv_heads, head_dim]`` into the flat slots ``slots`` of every layer (a free
    reshape to ``[layers * pages * page_size, ...]``), quantizing them first for a quantized cache."""
    nl, n, ps = cache.k.shape[:3]

    def put(pages, new):
        return pages.reshape(nl * n * ps, *pages.shape[3:]).at[slots].set(new.astype(pages.dtype), mode="drop") \
            .reshape(pages.shape)
    if not cache.quantized:
        return KVCache(put(cache.k, k), put(cache.v, v))
    (kq, ks), (vq, vs) = quantize(k, code_dtype(cache.k)), quantize(v, code_dtype(cache.v))
    return KVCache(put(cache.k, pack_codes(kq)), put(cache.v, pack_codes(vq)), put(cache.k_scale, ks),
                   put(cache.v_scale, vs))


def write_kv(cache: KVCache, layer, k: jax.Array, v: jax.Array, slot_mapping: jax.Array) -> KVCache:
    """Scatter one layer's new K/V ``[T, kv_heads, head_dim]`` into their slots, in place (donated).

    The scatter goes through a flat ``[layers * pages * page_size, ...]`` view (a free reshape):
    a one-index scatter measured 0.7 ms faster per 8B decode step on an H200 than indexing
    (layer, page, offset) separately. Out-of-pool slots (padding) are dropped."""
    nl, n, ps = cache.k.shape[:3]
    slots = jnp.where(slot_mapping < n * ps, layer * (n * ps) + slot_mapping, nl * n * ps)
    return _put(cache, slots, k, v)


def write_kv_layers(cache: KVCache, k: jax.Array, v: jax.Array, slot_mapping: jax.Array) -> KVCache:
    """Every layer's new K/V ``[layers, T, kv_heads, head_dim]`` scattered into their slots at once,
    in place (donated); out-of-pool slots (padding) are dropped.

    The reference path writes the cache once per step, after the forward, instead of once per
    layer before that layer's attention reads it (``Ops.defer_kv_write``): on CPU, XLA could not
    order a layer's reads before the next layer's in-place write and copied the whole pool several
    times per layer (SmolLM2 batch-1 decode with a 1,024-page pool: ~28 s per step on this
    contended 2-core box, ~0.1 s after)."""
    nl, n, ps = cache.k.shape[:3]
    layer_rows = jnp.arange(nl, dtype=jnp.int32)[:, None] * (n * ps)
    slots = jnp.where(slot_mapping[None, :] < n * ps, layer_rows + slot_mapping[None, :], nl * n * ps).reshape(-1)
    return _put(cache, slots, k.reshape(-1, *k.shape[-2:]), v.reshape(-1, *v.shape[-2:]))
