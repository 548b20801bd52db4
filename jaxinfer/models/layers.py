"""The building blocks every family's decoder composes: the one matmul helper, RMSNorm, RoPE and its
variants, the fused RoPE + K/V write, gated MLPs, the mixture-of-experts block, and ``Ops``, the
operations a backend may replace with kernels.

RMSNorm is split so that no normalized copy of the residual stream is written and read back:
``rms_norm(x, w) @ W.T == rsqrt(mean(x^2) + eps) * (x @ (W * w[None, :]).T)``. A norm whose output
feeds only projections has its weight folded into their columns at load time (``fold_norm``); the
per-token rsqrt (``rms_scale``) is applied to the projections' outputs: in the RoPE step for Q/K/V
(whose GPU kernel computes it from the residual row itself), in the gated MLP for gate/up, and to the
router's logits. At decode batch sizes each small kernel is mostly launch latency: the 8B batch-1 step
on an H200 went from 14 to 12 kernels per layer. Norms whose input is not the residual stream
(Gemma's post-norms, Qwen3's per-head Q/K norms) are applied as they are.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.models.config import ModelConfig, RopeScaling
from jaxinfer.models.spec import InOut
from jaxinfer.paged.attention import ragged_paged_attention
from jaxinfer.paged.kv_cache import KVCache, write_kv
from jaxinfer.quant import QArray, qlinear, take, to_dense, with_col_scale


def _precision(dtype):
    # float32 means float32: GPUs would otherwise run it as TF32 and drift from the CPU/oracle result.
    # CPU dots are full float32 already, and HIGHEST there took a slower path (88 -> 123 ms per
    # SmolLM2 decode step at batch 8).
    return jax.lax.Precision.HIGHEST if dtype == jnp.float32 and jax.default_backend() != "cpu" else None


@dataclasses.dataclass(frozen=True)
class LayerChoice:
    """One weight matrix of every layer (``weights``, per-layer arrays) and a traced layer ``index``:
    what a layer of ``layer_loop="indexed"`` passes to ``linear`` instead of its own matrix.

    ``linear`` picks the layer's matrix with ``lax.switch`` over one dot per layer, so each dot reads
    its layer's buffer where it lies. A scan over stacked weights slices the layer out first, and
    XLA:CPU materializes that slice, a copy of every weight per step: SmolLM2's batch-1 step took
    43.1 ms scanned against 29.6 ms indexed on a quiet 2-core CPU."""

    weights: tuple
    index: jax.Array


def linear(x: jax.Array, w: jax.Array | QArray | LayerChoice | InOut, out_dtype=None) -> jax.Array:
    """``x [T, in]`` times ``w [out, in]`` transposed: the one matmul helper, for bf16/f32 weights,
    quantized ones (``jaxinfer.quant.qlinear``) and the CPU's transposed ones (``spec.InOut``).
    Accumulates in float32; returns ``out_dtype`` (default: x's).

    A one-token step on a GPU runs a weight with at least as many rows as columns as a float32 row
    reduction (one block per contiguous row), which XLA streams faster than its GEMV: the 8B
    batch-1 step on an H200 went from 4.046 to 3.944 ms per token (QKV, ``wo``, gate/up and the
    lm_head). The down projection's 4,096 rows of 14,336 ran ~1 us per layer
    slower that way, so it stays a dot. Otherwise a plain dot: the matmul units accumulate bf16 in
    float32 anyway, and a float32 result plus a cast measured 16% slower for the batch-1 GEMV."""
    out_dtype = out_dtype or x.dtype
    if isinstance(w, LayerChoice):
        return jax.lax.switch(w.index, [functools.partial(linear, w=wi, out_dtype=out_dtype) for wi in w.weights], x)
    if isinstance(w, QArray):
        return qlinear(x, w, out_dtype)
    if isinstance(w, InOut):
        return jax.lax.dot_general(x, w.t.astype(x.dtype), (((1,), (0,)), ((), ())), precision=_precision(x.dtype),
                                   preferred_element_type=out_dtype)
    w = w.astype(x.dtype)
    if x.shape[0] == 1 and w.shape[0] >= w.shape[1] and jax.default_backend() == "gpu":
        return jnp.sum(x.astype(jnp.float32) * w.astype(jnp.float32), axis=-1)[None].astype(out_dtype)
    return jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), precision=_precision(x.dtype),
                               preferred_element_type=out_dtype)


def fold_norm(norm_weight, w):
    """``w [..., out, in]`` with column i scaled by ``norm_weight[i]``, in float32 (the caller casts once).

    A quantized weight's blocks share one scale across columns, so the gain cannot enter them: it
    stays explicit as the ``QArray``'s ``col_scale``, applied to the activations inside ``linear``
    (one multiply of a ``[T, in]`` row block, fused by XLA into the matmul's input)."""
    if isinstance(w, QArray):
        return with_col_scale(w, norm_weight)
    return np.asarray(w, np.float32) * np.asarray(norm_weight, np.float32)


def embed(table: jax.Array | QArray | InOut, tokens: jax.Array, dtype) -> jax.Array:
    """Rows ``tokens`` of the embedding ``table [V, D]`` in ``dtype`` (a quantized table decodes only
    those rows; a transposed one, ``InOut``, gives them as its columns)."""
    if isinstance(table, QArray):
        return to_dense(take(table, tokens), dtype)
    if isinstance(table, InOut):
        return table.t[:, tokens].T.astype(dtype)
    return table[tokens].astype(dtype)


def rms_scale(x: jax.Array, eps: float) -> jax.Array:
    """Per-row float32 ``rsqrt(mean(x^2) + eps)`` ``[..., 1]``: RMSNorm without its weight."""
    xf = x.astype(jnp.float32)
    return jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """RMSNorm in float32, cast back to x's dtype (``w`` is the effective gain: Gemma's ``1 + w`` is
    added at load)."""
    return (x.astype(jnp.float32) * rms_scale(x, eps) * w.astype(jnp.float32)).astype(x.dtype)


# ------------------------------------------------------------------------------------------ RoPE

def rope_frequencies(config: ModelConfig, theta: float | None = None,
                     scaling: RopeScaling | None | str = "config") -> np.ndarray:
    """Inverse frequencies ``[head_dim // 2]`` for base ``theta`` (default: the config's) with
    ``scaling`` applied (default: the config's; None: unscaled), plus GGUF's per-frequency factors."""
    d = config.head_dim
    theta = config.rope_theta if theta is None else theta
    rs = config.rope_scaling if scaling == "config" else scaling
    inv = 1.0 / (theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    if config.rope_freq_factors is not None:
        inv = inv / np.asarray(config.rope_freq_factors, np.float64)
    if rs is None:
        return inv.astype(np.float32)
    if rs.kind == "linear":
        return (inv / rs.factor).astype(np.float32)
    if rs.kind == "longrope":
        factors = rs.long_factor if rs.use_long else rs.short_factor
        return (inv / np.asarray(factors, np.float64)).astype(np.float32)
    low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
    high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
    wavelen = 2 * math.pi / inv
    smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
        rs.high_freq_factor - rs.low_freq_factor)
    scaled = np.where(wavelen > low_wavelen, inv / rs.factor, inv)
    mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    scaled = np.where(mid, (1 - smooth) * inv / rs.factor + smooth * inv, scaled)
    return scaled.astype(np.float32)


def layer_rope_frequencies(config: ModelConfig) -> np.ndarray:
    """``[num_layers, head_dim // 2]``: each layer's inverse frequencies. Gemma 3's sliding layers
    use their own unscaled base; every other layer the config's."""
    glob = rope_frequencies(config)
    if config.rope_local_theta is None:
        return np.broadcast_to(glob, (config.num_layers, glob.shape[0]))
    local = rope_frequencies(config, config.rope_local_theta, None)
    return np.stack([local if config.layer_window(i) is not None else glob for i in range(config.num_layers)])


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq) -> jax.Array:
    """Rotate-half RoPE on ``x [T, heads, head_dim]`` at ``positions [T]``."""
    angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq, jnp.float32)[None, :]
    cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def rope_qkv(qkv: jax.Array, x: jax.Array, positions: jax.Array, inv_freq, *, num_heads: int, num_kv_heads: int,
             eps: float, qkv_bias: jax.Array | None = None, q_norm: jax.Array | None = None,
             k_norm: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``rope_write_kv`` without the write: (q ``[T, H, D]`` in qkv's dtype, k and v ``[T, KVH, D]`` in float32)."""
    t = qkv.shape[0]
    hd = qkv.shape[1] // (num_heads + 2 * num_kv_heads)
    scaled = qkv.astype(jnp.float32) * rms_scale(x, eps)
    if qkv_bias is not None:
        scaled = scaled + qkv_bias.astype(jnp.float32)
    q, k, v = jnp.split(scaled.reshape(t, num_heads + 2 * num_kv_heads, hd), [num_heads, num_heads + num_kv_heads],
                        axis=1)
    if q_norm is not None:
        q = q * rms_scale(q, eps) * q_norm.astype(jnp.float32)
        k = k * rms_scale(k, eps) * k_norm.astype(jnp.float32)
    q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
    return q.astype(qkv.dtype), k, v


def rope_write_kv(qkv: jax.Array, x: jax.Array, positions: jax.Array, inv_freq, cache: KVCache,
                  layer, slot_mapping: jax.Array, *, num_heads: int, num_kv_heads: int, eps: float,
                  qkv_bias: jax.Array | None = None, q_norm: jax.Array | None = None,
                  k_norm: jax.Array | None = None) -> tuple[jax.Array, KVCache]:
    """The fused projection ``[T, (H + 2 * KVH) * D]`` of the residual stream ``x [T, hidden]`` times
    each token's RMSNorm scale (``rms_scale(x)``), plus ``qkv_bias`` ``[(H + 2 * KVH) * D]`` if given,
    each q and k head RMS-normalized with gains ``q_norm`` / ``k_norm`` ``[D]`` if given (the same
    ``eps``), RoPE on q and k, then k and v written to their slots. Returns (q ``[T, H, D]``, the cache).
    The jnp reference of ``pallas_kernels.rope_kv``, which does it in one kernel."""
    q, k, v = rope_qkv(qkv, x, positions, inv_freq, num_heads=num_heads, num_kv_heads=num_kv_heads, eps=eps,
                       qkv_bias=qkv_bias, q_norm=q_norm, k_norm=k_norm)
    return q, write_kv(cache, layer, k, v, slot_mapping)


# ------------------------------------------------------------------------------------------ MLPs

_ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True)}


def gated_mlp(x: jax.Array, w_gate_up: jax.Array, w_down: jax.Array, r: jax.Array, act: str) -> jax.Array:
    """``down(act(gate) * up)`` of the normalized ``x`` (``r``: its rms scale ``[T, 1]``; the norm's
    gain is folded into ``w_gate_up`` ``[2F, D]``)."""
    return linear(gated_activation(x, w_gate_up, r, act), w_down)


def gated_activation(x: jax.Array, w_gate_up: jax.Array, r: jax.Array, act: str) -> jax.Array:
    """``act(gate) * up``: ``gated_mlp``'s down projection's input."""
    gate, up = jnp.split(linear(x, w_gate_up), 2, axis=-1)
    return (_ACTIVATIONS[act](gate * r) * (up * r)).astype(x.dtype)


def moe(x: jax.Array, r: jax.Array, lw: dict, config: ModelConfig) -> jax.Array:
    """A sparse mixture of experts on the normalized ``x [T, D]`` (``r``: its rms scale; the norm's
    gain is folded into the router and the experts' gate/up).

    Softmax over the router's logits, then top-k (renormalized when ``norm_topk_prob``), as
    Mixtral, Qwen2-MoE and Qwen3-MoE define it. Tokens run through only their k experts:
    - few rows (``T * k`` at most the expert count, decode): each row's expert weights are gathered
      and applied as a batched matvec, reading k experts per token and nothing else;
    - many rows: rows sorted by expert and one grouped matmul per projection (``jax.lax.ragged_dot``),
      so no expert computes a token it was not given, with no Python loop over experts; on GPU,
      whose ``ragged_dot`` is a masked dense dot, every expert densely (``_dense_experts``).
    Qwen2-MoE's shared expert (a dense gated MLP times ``sigmoid(x . w)``) is added to the result."""
    return moe_partial(x, r, lw, config).astype(x.dtype)


def moe_partial(x: jax.Array, r: jax.Array, lw: dict, config: ModelConfig, first_expert=0) -> jax.Array:
    """``moe`` in float32 from the experts ``lw`` holds, ``first_expert`` onwards (the stacks' leading
    axis may be a slice of the experts, e.g. one device's under expert parallelism): rows routed to
    other experts contribute zero, so the slices' results sum to the whole. The same holds for a
    slice of the shared expert's hidden dimension."""
    t, d = x.shape
    k, e = config.num_experts_per_tok, config.num_experts
    logits = linear(x, lw["router"], jnp.float32) * r
    probs = jax.nn.softmax(logits, axis=-1)
    weights, experts = jax.lax.top_k(probs, k)  # [T, k]
    if config.norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    act = _ACTIVATIONS[config.hidden_act]
    xs = (x.astype(jnp.float32) * r).astype(x.dtype)  # the normalized rows (the gain is folded)
    local = lw["experts_gate_up"].shape[0]
    flat = experts.reshape(-1) - first_expert  # [T * k]: index into the local stacks
    mine = None if local == e else (flat >= 0) & (flat < local)  # None: every expert is here
    if mine is not None:
        flat = jnp.where(mine, flat, local)  # other experts' rows: out of range (dropped, zeroed)
    if t * k > e and jax.default_backend() == "gpu":
        out = _dense_experts(xs, flat.reshape(t, k), weights, lw, act)
    else:
        out = _routed_rows(xs, flat, mine, lw, act, k, few=t * k <= e).reshape(t, k, d)
        out = jnp.sum(out * weights[..., None], axis=1)
    if "shared_gate_up" in lw:
        shared = gated_mlp(x, lw["shared_gate_up"], lw["shared_down"], r, config.hidden_act).astype(jnp.float32)
        out = out + jax.nn.sigmoid(linear(x, lw["shared_gate"], jnp.float32) * r) * shared
    return out


def _routed_rows(xs: jax.Array, flat: jax.Array, mine, lw: dict, act, k: int, few: bool) -> jax.Array:
    """Each (token, chosen expert) row ``[T * k, D]`` through its expert alone, in float32 (rows of
    experts not held here, ``mine`` false, give zero); ``few``: gathered matvecs, else grouped matmuls."""
    local = lw["experts_gate_up"].shape[0]
    rows = jnp.repeat(xs, k, axis=0)  # [T * k, D]: row i*k + j is token i for its j-th expert
    if few:
        gathered = jnp.minimum(flat, local - 1)  # quantized experts are gathered in their blocks
        gate, up = jnp.split(_gathered_matvec(rows, take(lw["experts_gate_up"], gathered)), 2, axis=-1)
        h = (act(gate) * up).astype(xs.dtype)
        out = _gathered_matvec(h, take(lw["experts_down"], gathered))
    else:
        order = jnp.argsort(flat)
        sizes = jnp.bincount(flat, length=local).astype(jnp.int32)
        sorted_rows = rows[order]
        gu = jax.lax.ragged_dot(sorted_rows, jnp.swapaxes(to_dense(lw["experts_gate_up"], xs.dtype), 1, 2), sizes,
                                precision=_precision(xs.dtype), preferred_element_type=jnp.float32)
        gate, up = jnp.split(gu, 2, axis=-1)
        h = (act(gate) * up).astype(xs.dtype)
        out_sorted = jax.lax.ragged_dot(h, jnp.swapaxes(to_dense(lw["experts_down"], xs.dtype), 1, 2), sizes,
                                        precision=_precision(xs.dtype), preferred_element_type=jnp.float32)
        out = jnp.zeros_like(out_sorted).at[order].set(out_sorted)
    if mine is not None:
        out = jnp.where(mine[:, None], out, 0.0)  # rows past the groups are not defined by ragged_dot
    return out


def _dense_experts(xs: jax.Array, experts: jax.Array, weights: jax.Array, lw: dict, act) -> jax.Array:
    """Every expert held here on every token, each token's hidden activations scaled by its routing
    weight for that expert (zero where not chosen) before one down projection summed over experts.
    GPU, many rows: XLA:GPU rewrites ``ragged_dot`` into a dense dot over every group anyway, plus
    masks and a ``[E, rows, out]`` result (a Mixtral decode step of 94 sequences took 112 ms, half
    of it outside the matmuls); this reads each expert once and does the same matmul work."""
    local = lw["experts_gate_up"].shape[0]
    combine = jnp.sum(jnp.where(experts[..., None] == jnp.arange(local), weights[..., None], 0.0), axis=1)  # [T, E]
    gu = jnp.einsum("td,efd->tef", xs, to_dense(lw["experts_gate_up"], xs.dtype), preferred_element_type=jnp.float32,
                    precision=_precision(xs.dtype))
    gate, up = jnp.split(gu, 2, axis=-1)
    h = (act(gate) * up * combine[..., None]).astype(xs.dtype)
    return jnp.einsum("tef,edf->td", h, to_dense(lw["experts_down"], xs.dtype), preferred_element_type=jnp.float32,
                      precision=_precision(xs.dtype))


def _gathered_matvec(rows: jax.Array, w) -> jax.Array:
    """Each row ``[R, in]`` times its own weight ``[R, out, in]``, in float32. On GPU as float32 row
    reductions: XLA fuses the gather into the reduction and streams only the chosen experts, where
    a gathered dot copies them first (one Mixtral layer's two experts at batch 1 on an H200: 166 us
    as row reductions against 612 us as a gathered dot)."""
    if jax.default_backend() == "gpu":
        return jnp.sum(rows[:, None, :].astype(jnp.float32) * to_dense(w, jnp.float32), axis=-1)
    return jnp.einsum("rd,rfd->rf", rows, to_dense(w, rows.dtype), preferred_element_type=jnp.float32,
                      precision=_precision(rows.dtype))


# ------------------------------------------------------------------------------------------ Ops

def project(x: jax.Array, w, name: str, out_dtype=None) -> jax.Array:
    """``linear(x, w)`` for the step's named projection (``"wqkv"``, ``"wo"``, or the logits' ``"lm_head"``
    / tied ``"embed"``): the name lets ``models.sharding`` run a quantized one per device."""
    return linear(x, w, out_dtype)


@dataclasses.dataclass(frozen=True)
class Ops:
    """The step's operations a backend may replace with kernels (``pallas_kernels.get_kernels``);
    the pure-jnp reference by default (the CPU path and the oracle).

    ``attention(q, k_cache, v_cache, layer, md, *, scale, soft_cap, sliding_window)`` and
    ``rope_write_kv`` (the contract above, with ``qkv_bias``/``q_norm``/``k_norm``). A layer's
    ``sliding_window`` is a Python int or None in an unrolled loop and a traced int32 scalar in a
    scanned one whose layers differ (global layers then pass a window longer than any context)."""

    attention: Callable[..., jax.Array] = ragged_paged_attention
    rope_write_kv: Callable[..., tuple[jax.Array, KVCache]] = rope_write_kv
    # rope_write_kv and attention in one, for steps with ``md.decode_only``: ``(qkv, x, positions, inv_freq,
    # cache, layer, md, *, num_heads, eps, scale, soft_cap, sliding_window, qkv_bias, q_norm, k_norm) ->
    # (attention output [T, H, D], cache)``. None: the two.
    decode_attention: Callable[..., tuple[jax.Array, KVCache]] | None = None
    # The most sequences (the step's padded count) a decode-only step may have to be marked
    # ``decode_only``; larger ones run the two operations and compile no variant of their own.
    decode_attention_max_seqs: int = 0
    # The feed-forward blocks, with ``gated_mlp``'s and ``moe``'s signatures: replaced by
    # ``models.sharding`` with per-device versions that sum their partial outputs over the mesh.
    mlp: Callable[..., jax.Array] = gated_mlp
    moe: Callable[..., jax.Array] = moe
    # The attention's and the logits' projections, ``project``'s signature: replaced by
    # ``models.sharding`` so that a quantized one runs per device on its shard.
    project: Callable[..., jax.Array] = project
    # The reference path's structure (``get_kernels("reference")``): no layer writes the cache; each
    # passes its new K/V to ``attention(..., new_kv=(k, v))`` and all layers' are written after the
    # loop (``kv_cache.write_kv_layers``), so the cache is only read inside it and XLA updates it in
    # place. Needs an ``attention`` that takes ``new_kv``; ``rope_write_kv`` is then unused. One device
    # only (``models.sharding.sharded_ops`` turns it off).
    defer_kv_write: bool = False
