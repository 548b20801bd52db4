"""Llama 2/3 family as pure functions over a weight pytree and a paged KV cache.

RMSNorm, RoPE (with Llama-3.1 scaling), GQA attention, SwiGLU, tied or untied embeddings. The Q/K/V
and gate/up projections are fused (one matmul each) and every matmul goes through :func:`linear`,
the single place where quantized weights will slot in.

RMSNorm is split so that no normalized copy of the residual stream is written and read back:
``rms_norm(x, w) @ W.T == rsqrt(mean(x^2) + eps) * (x @ (W * w[None, :]).T)``. The norm weights are
folded into the columns of the projection after them at load time (``fold_norm``); the per-token
rsqrt (``rms_scale``) is applied to the projection's output: in the RoPE step for Q/K/V (whose GPU
kernel computes it from the residual row itself) and in SwiGLU for gate/up. At decode batch sizes
each small kernel is mostly launch latency: the 8B batch-1 step on an H200 went from 15 to 12
kernels per layer (docs/benchmarks.md).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.models.config import ModelConfig
from jaxinfer.paged.attention import ragged_paged_attention
from jaxinfer.paged.kv_cache import BatchMetadata, KVCache, write_kv


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LayerWeights:
    """One decoder layer. Linear weights are ``[out, in]`` (the checkpoints' orientation; see
    `linear`); Q/K heads use the HF (rotate-half) layout. ``wqkv`` and ``w_gate_up`` carry their
    RMSNorm's weight (``fold_norm``)."""

    wqkv: jax.Array  # [(H + 2 * KVH) * head_dim, D]: q | k | v, columns scaled by the attention norm
    wo: jax.Array  # [D, H * head_dim]
    w_gate_up: jax.Array  # [2 * F, D]: gate | up, columns scaled by the MLP norm
    w_down: jax.Array  # [D, F]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Weights:
    embed: jax.Array  # [V, D]
    # A list of per-layer weights (unrolled loop) or one LayerWeights of arrays stacked on a
    # leading layer axis (scanned loop); see `arrange_layers`.
    layers: list[LayerWeights] | LayerWeights
    final_norm: jax.Array  # [D]
    lm_head: jax.Array | None  # [V, D]; None when tied to the embedding


def arrange_layers(weights: Weights, config: ModelConfig) -> Weights:
    """Stack per-layer weights for ``layer_loop == "scan"``, or split stacked ones for ``"unroll"``."""
    layers = weights.layers
    if config.layer_loop == "scan" and isinstance(layers, list):
        layers = jax.tree.map(lambda *xs: jnp.stack(xs), *layers)
    elif config.layer_loop == "unroll" and not isinstance(layers, list):
        layers = [jax.tree.map(lambda x, i=i: x[i], layers) for i in range(config.num_layers)]
    return dataclasses.replace(weights, layers=layers)


def _precision(dtype):
    # float32 means float32: GPUs would otherwise run it as TF32 and drift from the CPU/oracle result.
    # CPU dots are full float32 already, and HIGHEST there took a slower path (88 -> 123 ms per
    # SmolLM2 decode step at batch 8).
    return jax.lax.Precision.HIGHEST if dtype == jnp.float32 and jax.default_backend() != "cpu" else None


def linear(x: jax.Array, w: jax.Array, out_dtype=None) -> jax.Array:
    """``x [T, in]`` times ``w [out, in]`` transposed: the one matmul helper (bf16/f32 weights now,
    quantized weight pytrees later). Accumulates in float32; returns ``out_dtype`` (default: x's).

    A one-token step on a GPU runs a weight with at least as many rows as columns as a float32 row
    reduction (one block per contiguous row), which XLA streams faster than its GEMV: the 8B
    batch-1 step on an H200 went from 4.05-4.08 to 3.91-3.93 ms per token (QKV, ``wo``, gate/up and
    the lm_head; docs/benchmarks.md). The down projection's 4,096 rows of 14,336 ran ~1 us per layer
    slower that way, so it stays a dot. Otherwise a plain dot: the matmul units accumulate bf16 in
    float32 anyway, and a float32 result plus a cast measured 16% slower for the batch-1 GEMV."""
    out_dtype = out_dtype or x.dtype
    w = w.astype(x.dtype)
    if x.shape[0] == 1 and w.shape[0] >= w.shape[1] and jax.default_backend() == "gpu":
        return jnp.sum(x.astype(jnp.float32) * w.astype(jnp.float32), axis=-1)[None].astype(out_dtype)
    return jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), precision=_precision(x.dtype),
                               preferred_element_type=out_dtype)


def fold_norm(norm_weight, w) -> np.ndarray:
    """``w [out, in]`` with column i scaled by ``norm_weight[i]``, in float32 (the caller casts once)."""
    return np.asarray(w, np.float32) * np.asarray(norm_weight, np.float32)[None, :]


def rms_scale(x: jax.Array, eps: float) -> jax.Array:
    """Per-token float32 ``rsqrt(mean(x^2) + eps)`` ``[T, 1]``: RMSNorm without its weight."""
    xf = x.astype(jnp.float32)
    return jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)


def rope_frequencies(config: ModelConfig) -> np.ndarray:
    """Inverse frequencies ``[head_dim // 2]``, with Llama-3.1 scaling applied when configured (as
    parameters, from Hugging Face configs, or as per-frequency factors, from GGUF files)."""
    d = config.head_dim
    inv = 1.0 / (config.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    if config.rope_freq_factors is not None:
        inv = inv / np.asarray(config.rope_freq_factors, np.float64)
    rs = config.rope_scaling
    if rs is None:
        return inv.astype(np.float32)
    low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
    high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
    wavelen = 2 * math.pi / inv
    smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
        rs.high_freq_factor - rs.low_freq_factor)
    scaled = np.where(wavelen > low_wavelen, inv / rs.factor, inv)
    mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    scaled = np.where(mid, (1 - smooth) * inv / rs.factor + smooth * inv, scaled)
    return scaled.astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotate-half RoPE on ``x [T, heads, head_dim]`` at ``positions [T]``."""
    angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]
    cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def rope_write_kv(qkv: jax.Array, x: jax.Array, positions: jax.Array, inv_freq: np.ndarray, cache: KVCache,
                  layer, slot_mapping: jax.Array, *, num_heads: int, num_kv_heads: int,
                  eps: float) -> tuple[jax.Array, KVCache]:
    """The fused projection ``[T, (H + 2 * KVH) * D]`` of the residual stream ``x [T, hidden]`` times
    each token's RMSNorm scale (``rms_scale(x)``), RoPE on its q and k, then k and v written to their
    slots. Returns (q ``[T, H, D]``, the cache).
    The jnp reference of ``pallas_kernels.rope_kv``, which does it in one kernel."""
    t, hd = qkv.shape[0], cache.k.shape[-1]
    scaled = (qkv.astype(jnp.float32) * rms_scale(x, eps)).reshape(t, num_heads + 2 * num_kv_heads, hd)
    q, k, v = jnp.split(scaled, [num_heads, num_heads + num_kv_heads], axis=1)
    q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
    return q.astype(qkv.dtype), write_kv(cache, layer, k, v, slot_mapping)


@dataclasses.dataclass(frozen=True)
class Ops:
    """The step's operations a backend may replace with kernels (``pallas_kernels.get_kernels``);
    the pure-jnp reference by default (the CPU path and the oracle)."""

    attention: Callable[..., jax.Array] = ragged_paged_attention
    rope_write_kv: Callable[..., tuple[jax.Array, KVCache]] = rope_write_kv
    # rope_write_kv and attention in one, for steps with ``md.decode_only``: ``(qkv, x, positions, inv_freq,
    # cache, layer, md, *, num_heads, eps, scale) -> (attention output [T, H, D], cache)``. None: the two.
    decode_attention: Callable[..., tuple[jax.Array, KVCache]] | None = None
    # The most sequences (the step's padded count) a decode-only step may have to be marked
    # ``decode_only``; larger ones run the two operations and compile no variant of their own.
    decode_attention_max_seqs: int = 0


def _layer(config: ModelConfig, ops: Ops, x, lw: LayerWeights, layer, cache: KVCache, positions, md: BatchMetadata):
    """One decoder layer on the residual stream ``x``; returns it and the cache."""
    t = x.shape[0]
    h, kvh, hd, eps = config.num_heads, config.num_kv_heads, config.head_dim, config.rms_norm_eps

    qkv, inv_freq = linear(x, lw.wqkv), rope_frequencies(config)
    if md.decode_only and ops.decode_attention is not None:
        attn, cache = ops.decode_attention(qkv, x, positions, inv_freq, cache, layer, md, num_heads=h, eps=eps,
                                           scale=hd ** -0.5)
    else:
        q, cache = ops.rope_write_kv(qkv, x, positions, inv_freq, cache, layer, md.slot_mapping, num_heads=h,
                                     num_kv_heads=kvh, eps=eps)
        attn = ops.attention(q, cache.k, cache.v, layer, md, scale=hd ** -0.5)
    x = x + linear(attn.reshape(t, h * hd), lw.wo)
    r = rms_scale(x, eps)  # the MLP norm's; XLA fuses its rsqrt into SwiGLU
    gate, up = jnp.split(linear(x, lw.w_gate_up), 2, axis=-1)
    x = x + linear((jax.nn.silu(gate * r) * (up * r)).astype(x.dtype), lw.w_down)
    return x, cache


def forward(weights: Weights, tokens: jax.Array, positions: jax.Array, kv_cache: KVCache, md: BatchMetadata,
            config: ModelConfig, ops: Ops = Ops()) -> tuple[jax.Array, KVCache]:
    """One step over packed tokens ``[T]``; returns float32 logits ``[S, V]`` at ``md.logits_indices``
    and the updated cache (donate it at the jit boundary so it is updated in place)."""
    x = weights.embed[tokens]
    if isinstance(weights.layers, list):
        for i, lw in enumerate(weights.layers):
            x, kv_cache = _layer(config, ops, x, lw, i, kv_cache, positions, md)
    else:
        def body(carry, xs):
            x, cache = carry
            lw, i = xs
            return _layer(config, ops, x, lw, i, cache, positions, md), None

        (x, kv_cache), _ = jax.lax.scan(body, (x, kv_cache),
                                        (weights.layers, jnp.arange(config.num_layers, dtype=jnp.int32)))
    x = x[md.logits_indices]
    norm = rms_scale(x, config.rms_norm_eps) * weights.final_norm.astype(jnp.float32)
    x = (x.astype(jnp.float32) * norm).astype(x.dtype)
    logits = linear(x, weights.embed if weights.lm_head is None else weights.lm_head, jnp.float32)
    return logits, kv_cache


def init_dummy_weights(config: ModelConfig, key: jax.Array, dtype=jnp.float32) -> Weights:
    """Random weights of the right shapes (``load_format="dummy"``), scaled so activations stay O(1);
    the norm weights are ones, so nothing is folded."""
    d, f, v = config.hidden_size, config.intermediate_size, config.vocab_size
    qkv = config.q_size + 2 * config.kv_size
    keys = iter(jax.random.split(key, 6 * config.num_layers + 2))

    def normal(shape, fan_in):
        return (jax.random.normal(next(keys), shape, jnp.float32) / math.sqrt(fan_in)).astype(dtype)

    layers = [LayerWeights(
        wqkv=normal((qkv, d), d), wo=normal((d, config.q_size), config.q_size),
        w_gate_up=normal((2 * f, d), d), w_down=normal((d, f), f),
    ) for _ in range(config.num_layers)]
    weights = Weights(embed=normal((v, d), 1.0), layers=layers, final_norm=jnp.ones((d,), dtype),
                      lm_head=None if config.tie_word_embeddings else normal((v, d), d))
    return arrange_layers(weights, config)
