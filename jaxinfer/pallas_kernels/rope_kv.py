"""The attention norm's scale and RoPE on the fused QKV projection plus the K/V cache write, as one
Pallas (Triton) kernel for GPUs.

Why: XLA runs the same work as about seven small kernels per layer (the norm's reduction and rsqrt,
rotate q, rotate k, two scatters, a select), each mostly launch latency at decode batch sizes. Here a
program reads its token's residual row for the RMSNorm scale (see ``jaxinfer.models.layers``) and its
QKV heads once, scales them, rotates the q and k heads (rotate-half layout, float32 math), writes q
out and k/v straight into their cache slot (the cache is aliased, so donated caches are updated in
place). Computing the norm's scale here too took the 8B batch-1 step on an H200 from 4.20 to 4.12 ms
per token.

Same contract as ``jaxinfer.models.layers.rope_write_kv`` (the jnp reference, the CPU path),
including its optional parts: Q/K/V biases (Qwen2) and per-head RMS norms of q and k (Qwen3, Gemma 3).
They are static: a family without them compiles a kernel that neither loads nor computes them.
Head counts and the hidden size need not be powers of two: rows are padded to one and masked;
head_dim must be one (16 to 256; ``get_kernels`` gives a model whose head_dim is not, Phi-3's 96, the
reference instead). A quantized cache (int8/fp8 plus per-token-per-head scales, ``paged.kv_cache``) is
written quantized: each k/v head's amax is taken over its two halves, then both halves are coded
against it (``kv_cache.quantize_rows``) and the scale is stored beside them; fp8 codes packed four to a
uint32 word, as the cache stores them (``pack_fp8_words``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxinfer.paged.kv_cache import KVCache, code_dtype, packed, quantize_rows
from jaxinfer.pallas_kernels._blocks import next_pow2, words_of_bytes


HEAD_DIMS = (16, 32, 64, 128, 256)


def check_head_dim(head_dim: int) -> None:
    """Triton block shapes are powers of two, and its dots want at least 16 along every dimension;
    above 256 a key block no longer fits shared memory with room to pipeline."""
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim {head_dim} is not supported by the pallas_gpu kernels; allowed: {HEAD_DIMS} "
                         f"(use attention_backend='reference')")


def pack_fp8_words(codes: jax.Array) -> jax.Array:
    """fp8 codes ``[n, D]`` as the cache stores them (``kv_cache.pack_codes``), in a kernel: uint32
    words ``[n, D / 4]``, byte ``j`` of word ``c`` being code ``4c + j``."""
    b = jax.lax.bitcast_convert_type(codes, jnp.uint8)
    return words_of_bytes(b.reshape(codes.shape[0], codes.shape[1] // 4, 4))


def head_norm(halves, w_halves, eps: float):
    """``layers.rms_norm`` of heads given as their two halves ``[n, D/2]`` (float32), with the gain's
    halves ``w_halves`` (each ``[n, D/2]`` or ``[1, D/2]``): Qwen3's and Gemma 3's per-head q/k norm."""
    x1, x2 = halves
    ms = (jnp.sum(x1 * x1, axis=1, keepdims=True) + jnp.sum(x2 * x2, axis=1, keepdims=True)) / (2 * x1.shape[1])
    r = jax.lax.rsqrt(ms + eps)
    return [x * r * w for x, w in zip(halves, w_halves)]


def row_rms_scale(x_ref, t, hidden: int, eps: float):
    """``layers.rms_scale`` of token ``t``'s row of the residual stream ``x_ref`` (flat ``[T * hidden]``)."""
    col = jax.lax.broadcasted_iota(jnp.int32, (next_pow2(hidden),), 0)
    row = plgpu.load(x_ref.at[t * hidden + col], mask=col < hidden, other=0).astype(jnp.float32)
    return jax.lax.rsqrt(jnp.sum(row * row) / hidden + eps)


def _rope_kv_kernel(layer_ref, pos_ref, slot_ref, freq_ref, x_ref, qkv_ref, *refs,
                    num_heads, num_kv_heads, num_slots, kv_per_program, hidden, eps, has_bias, has_norm):
    """One token's ``kv_per_program`` kv heads and their query heads. Refs are viewed as rows of half a
    head (``[..., D/2]``): ``qkv_ref`` row ``2 * (t * heads + n) + j`` is half ``j`` of head ``n``;
    ``q_ref`` likewise with H heads; the cache refs row ``2 * ((layer * slots + slot) * KVH + n) + j``.
    ``x_ref`` is the residual stream, flat. ``refs``: the bias (rows like a token's qkv) if
    ``has_bias``, the q and k norm gains ``[2, D/2]`` if ``has_norm``, then the caches (aliased inputs)
    and the outputs; a quantized cache's are (codes, scales) pairs, scales flat ``[rows / 2]``."""
    refs = list(refs)
    bias_ref = refs.pop(0) if has_bias else None
    qn_ref, kn_ref = (refs.pop(0), refs.pop(0)) if has_norm else (None, None)
    _k, _v, q_ref, k_ref, v_ref = refs
    t, g = pl.program_id(0), pl.program_id(1)
    half = qkv_ref.shape[1]
    heads = num_heads + 2 * num_kv_heads
    col = jax.lax.broadcasted_iota(jnp.int32, (1, half), 1)
    angle = pos_ref[t].astype(jnp.float32) * freq_ref[...]  # [D/2]
    cos, sin = jnp.cos(angle)[None, :], jnp.sin(angle)[None, :]
    slot = slot_ref[t]
    # The attention norm's scale: in XLA it would be two kernels of its own (reduction, rsqrt), mostly
    # launch latency at decode batch sizes.
    scale = row_rms_scale(x_ref, t, hidden, eps)
    cache_head0 = (layer_ref[0] * num_slots + slot) * num_kv_heads
    write_kv = slot < num_slots  # padding tokens' slots lie past the pool: no write

    def load(head, valid):  # both halves of heads ``head`` of this token, scaled (plus bias), in float32
        mask = jnp.broadcast_to(valid[:, None], (head.shape[0], half))
        row = 2 * (t * heads + head)  # masked lanes past the end: skipped (native) or clamped (interpret)
        halves = [plgpu.load(qkv_ref.at[(row + j)[:, None], col], mask=mask, other=0).astype(jnp.float32) * scale
                  for j in (0, 1)]
        if has_bias:
            halves = [x + plgpu.load(bias_ref.at[(2 * head + j)[:, None], col], mask=mask, other=0).astype(jnp.float32)
                      for j, x in enumerate(halves)]
        return halves

    def store(ref, halves, head, valid):
        # Masked lanes point past the end: interpret mode emulates a masked store by
        # read-modify-write, so they must not alias a written row (out of bounds, it drops them).
        lane = jax.lax.broadcasted_iota(jnp.int32, head.shape, 0)
        if isinstance(ref, tuple):  # quantized: codes against the head's amax, the scale beside them
            ref, scale_ref = ref
            amax = jnp.maximum(jnp.max(jnp.abs(halves[0]), axis=1), jnp.max(jnp.abs(halves[1]), axis=1))
            codes = [quantize_rows(x, amax, code_dtype(ref)) for x in halves]
            halves = [c for c, _ in codes]
            plgpu.store(scale_ref.at[jnp.where(valid, head, scale_ref.shape[0] + lane)], codes[0][1], mask=valid)
            if packed(ref):
                halves = [pack_fp8_words(x) for x in halves]
        width = ref.shape[1]  # half a head: D / 2 elements, or D / 8 words of fp8 codes
        mask = jnp.broadcast_to(valid[:, None], (head.shape[0], width))
        cols = jax.lax.broadcasted_iota(jnp.int32, (1, width), 1)
        for j, x in enumerate(halves):
            row = jnp.where(valid, 2 * head + j, ref.shape[0] + 2 * lane + j)
            plgpu.store(ref.at[row[:, None], cols], x.astype(ref.dtype), mask=mask)

    # Local rows 0 .. c * group - 1 are this program's q heads, the next c its k heads (both rotated);
    # then its c v heads (as they are). Every load is issued before the first store.
    c = kv_per_program
    group = num_heads // num_kv_heads
    n = jax.lax.broadcasted_iota(jnp.int32, (next_pow2(c * (group + 1)),), 0)
    is_q = n < c * group
    valid = n < c * (group + 1)
    head = jnp.where(is_q, g * c * group + n, num_heads + g * c + n - c * group)  # in the qkv row
    x1, x2 = load(head, valid)
    nv = jax.lax.broadcasted_iota(jnp.int32, (next_pow2(c),), 0)
    v_valid = (nv < c) & write_kv
    v = load(num_heads + num_kv_heads + g * c + nv, v_valid)
    if has_norm:  # each q row takes the q gain, each k row the k gain
        w = [jnp.where(is_q[:, None], qn_ref[j][None, :].astype(jnp.float32), kn_ref[j][None, :].astype(jnp.float32))
             for j in (0, 1)]
        x1, x2 = head_norm((x1, x2), w, eps)
    rotated = (x1 * cos - x2 * sin, x2 * cos + x1 * sin)
    store(q_ref, rotated, t * num_heads + head, is_q)
    store(k_ref, rotated, cache_head0 + head - num_heads, valid & ~is_q & write_kv)
    store(v_ref, v, cache_head0 + g * c + nv, v_valid)


def rope_write_kv(qkv: jax.Array, x: jax.Array, positions: jax.Array, inv_freq, cache: KVCache, layer,
                  slot_mapping: jax.Array, *, num_heads: int, num_kv_heads: int, eps: float,
                  qkv_bias: jax.Array | None = None, q_norm: jax.Array | None = None,
                  k_norm: jax.Array | None = None, kv_per_program: int | None = None,
                  interpret: bool = False) -> tuple[jax.Array, KVCache]:
    """Scale ``qkv [T, (H + 2 * KVH) * D]`` by the RMSNorm scale of ``x [T, hidden]`` (plus
    ``qkv_bias``; q and k heads RMS-normalized with ``q_norm``/``k_norm`` if given), rotate its q and
    k at ``positions``; write k and v to ``slot_mapping`` of layer ``layer`` in ``cache``. Returns
    (q ``[T, H, D]``, the updated cache).

    A program handles one token's ``kv_per_program`` kv heads (with their query heads). Default: one
    kv head per program for a few tokens (at batch 1, 8 programs instead of 1 cut the 8B kernel from
    3.4 to 2.7 us on an H200), all of a token's heads for many (each program reads the token's
    residual row for its scale, so more programs per token would multiply that read)."""
    num_tokens, hidden = x.shape
    if (q_norm is None) != (k_norm is None):
        raise ValueError("q_norm and k_norm are given together or not at all")
    check_head_dim(cache.head_dim)
    if kv_per_program is None:
        kv_per_program = 1 if num_tokens <= 16 else num_kv_heads
    if num_kv_heads % kv_per_program:
        raise ValueError(f"kv_per_program={kv_per_program} must divide num_kv_heads={num_kv_heads}")
    nl, num_pages, page_size = cache.k.shape[:3]
    head_dim = cache.head_dim
    num_slots = num_pages * page_size
    half = head_dim // 2
    flat = (nl * num_slots * num_kv_heads * 2, cache.k.shape[-1] // 2)  # free reshapes: (row, half) addressing
    if flat[0] >= 2 ** 31:
        raise ValueError(f"KV cache of {flat[0]} half-head rows overflows the kernel's int32 row index")
    extras = [] if qkv_bias is None else [qkv_bias.reshape(-1, half)]
    if q_norm is not None:
        extras += [q_norm.reshape(2, half), k_norm.reshape(2, half)]
    args = [jnp.asarray(layer, jnp.int32).reshape(1), positions.astype(jnp.int32), slot_mapping,
            jnp.asarray(inv_freq, jnp.float32), x.reshape(-1), qkv.reshape(-1, half), *extras]
    caches = [cache.k.reshape(flat), cache.v.reshape(flat)]
    if cache.quantized:  # (codes, scales) pairs; a scale per half-head row pair
        caches = [(c, x.reshape(-1)) for c, x in zip(caches, (cache.k_scale, cache.v_scale))]
    cache_shapes = jax.tree.map(lambda c: jax.ShapeDtypeStruct(c.shape, c.dtype), caches)
    num_cache = len(jax.tree.leaves(caches))
    q, k, v = pl.pallas_call(
        functools.partial(_rope_kv_kernel, num_heads=num_heads, num_kv_heads=num_kv_heads, num_slots=num_slots,
                          kv_per_program=kv_per_program, hidden=hidden, eps=eps, has_bias=qkv_bias is not None,
                          has_norm=q_norm is not None),
        grid=(num_tokens, num_kv_heads // kv_per_program),
        out_shape=[jax.ShapeDtypeStruct((num_tokens * num_heads * 2, half), qkv.dtype), *cache_shapes],
        input_output_aliases={len(args) + i: 1 + i for i in range(num_cache)},
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="rope_write_kv_gpu",
    )(*args, *caches)
    return q.reshape(num_tokens, num_heads, head_dim), unflat_cache(cache, k, v)


def unflat_cache(cache: KVCache, k, v) -> KVCache:
    """``cache``'s layout again from a kernel's flat cache outputs (each a (codes, scales) pair if
    quantized)."""
    if not cache.quantized:
        return KVCache(k.reshape(cache.k.shape), v.reshape(cache.v.shape))
    return KVCache(k[0].reshape(cache.k.shape), v[0].reshape(cache.v.shape), k[1].reshape(cache.k_scale.shape),
                   v[1].reshape(cache.v_scale.shape))
