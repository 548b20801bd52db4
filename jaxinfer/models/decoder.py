"""The decoder forward every family runs: a pure function over a ``Weights`` pytree and a paged KV cache.

A family is a choice of building blocks (``jaxinfer.models.layers``), recorded as static fields of
``ModelConfig``: Q/K/V biases (Qwen2), per-head Q/K norms (Qwen3, Gemma 3), post-norms, GeGLU,
scaled embeddings, soft caps and interleaved sliding windows (Gemma 2/3), fused checkpoint tensors
(Phi-3, split at load) and sparse experts (Mixtral, Qwen2-MoE, Qwen3-MoE). Since a layer's blocks
are static, each compiled step contains only the family's own work: Llama's step is unchanged.

Per-layer differences (Gemma's sliding windows and Gemma 3's local RoPE base) are static Python
values in the unrolled loop; in the scanned and indexed loops they are scanned over with the
weights, so no layer loses its own window.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.models.config import ModelConfig
from jaxinfer.models.layers import (LayerChoice, Ops, embed, gated_activation, layer_rope_frequencies, linear, rms_norm,
                                    rms_scale, rope_qkv)
from jaxinfer.models.spec import Weights
from jaxinfer.paged.kv_cache import BatchMetadata, KVCache, write_kv_layers

# The window a global layer passes when the scanned loop's windows are traced: longer than any context.
GLOBAL_WINDOW = 1 << 30
_OPTIONAL_ATTENTION_WEIGHTS = ("qkv_bias", "q_norm", "k_norm")
# The matrices ``layer_loop="indexed"`` leaves in place (each used through ``linear`` only); a layer's
# other weights (norm gains, biases, expert stacks) are stacked in the step and scanned over.
_INDEXED_WEIGHTS = ("wqkv", "wo", "w_gate_up", "w_down", "router", "shared_gate_up", "shared_down", "shared_gate")


def _layer(config: ModelConfig, ops: Ops, x, lw: dict, layer, cache: KVCache, positions, md: BatchMetadata,
           inv_freq, window):
    """One decoder layer on the residual stream ``x``; returns it, the cache and, with
    ``ops.defer_kv_write``, the layer's new (k, v) for the caller to write (else None)."""
    t = x.shape[0]
    h, kvh, hd, eps = config.num_heads, config.num_kv_heads, config.head_dim, config.rms_norm_eps
    extras = {name: lw[name] for name in _OPTIONAL_ATTENTION_WEIGHTS if name in lw}
    attn_kw = dict(scale=config.attention_scale, soft_cap=config.attn_soft_cap, sliding_window=window)

    qkv = ops.project(x, lw["wqkv"], "wqkv")
    new_kv = None
    if ops.defer_kv_write:
        q, k, v = rope_qkv(qkv, x, positions, inv_freq, num_heads=h, num_kv_heads=kvh, eps=eps, **extras)
        new_kv = (k.astype(cache.write_dtype), v.astype(cache.write_dtype))
        attn = ops.attention(q, cache.k, cache.v, layer, md, new_kv=new_kv, **attn_kw, **cache.scales())
    elif md.decode_only and ops.decode_attention is not None:
        attn, cache = ops.decode_attention(qkv, x, positions, inv_freq, cache, layer, md, num_heads=h, eps=eps,
                                           **attn_kw, **extras)
    else:
        q, cache = ops.rope_write_kv(qkv, x, positions, inv_freq, cache, layer, md.slot_mapping, num_heads=h,
                                     num_kv_heads=kvh, eps=eps, **extras)
        attn = ops.attention(q, cache.k, cache.v, layer, md, **attn_kw, **cache.scales())
    y = ops.project(attn.reshape(t, h * hd), lw["wo"], "wo")
    if config.post_norms:
        y = rms_norm(y, lw["post_attn_norm"], eps)
    x = x + y
    r = rms_scale(x, eps)  # the MLP norm's; XLA fuses its rsqrt into the gated activation
    if config.num_experts:
        y = ops.moe(x, r, lw, config)
    else:
        y = ops.mlp(x, lw["w_gate_up"], lw["w_down"], r, config.hidden_act)
    if config.post_norms:
        y = rms_norm(y, lw["post_mlp_norm"], eps)
    return x + y, cache, new_kv


def forward(weights: Weights, tokens: jax.Array, positions: jax.Array, kv_cache: KVCache, md: BatchMetadata,
            config: ModelConfig, ops: Ops = Ops(), hidden: bool = False) -> tuple[jax.Array, KVCache]:
    """One step over packed tokens ``[T]``; returns float32 logits ``[S, V]`` at ``md.logits_indices``
    and the updated cache (donate it at the jit boundary so it is updated in place). ``hidden`` (a
    Python bool): the final hidden states ``[S, hidden_size]`` there instead (float32, after the final
    norm, without the LM head), what ``pooling`` pools into embeddings.

    With ``ops.defer_kv_write`` the layers only read the cache (attention takes each layer's new K/V
    beside it) and every layer's K/V is written once, after the loop (``write_kv_layers``): XLA:CPU
    could not order a layer's reads before the next layer's in-place write and copied the pool. The
    layers must then be looped (scanned or indexed): after an unrolled loop that reads the cache,
    XLA:CPU copied the whole pool twice to write it (``batching.resolve`` refuses the pair).

    The layer loop follows ``config.layer_loop`` (per-layer weights unroll unless it is
    "indexed"): "indexed" scans over layer indices with the matrices left in their per-layer
    buffers (``layers.LayerChoice``): XLA:CPU copied each scanned layer's weight slice, a copy of
    every weight per step, which cost the scanned SmolLM2 batch-1 step ~1.5x its time."""
    x = embed(weights.embed, tokens, weights.final_norm.dtype)
    if config.embed_scale:
        x = x * jnp.asarray(config.hidden_size ** 0.5, x.dtype)
    freqs = layer_rope_frequencies(config)
    windows = [config.layer_window(i) for i in range(config.num_layers)]
    if isinstance(weights.layers, list) and config.layer_loop != "indexed":
        new = []
        for i, lw in enumerate(weights.layers):
            x, kv_cache, kv = _layer(config, ops, x, lw, i, kv_cache, positions, md, freqs[i], windows[i])
            new.append(kv)
        new_kv = jax.tree.map(lambda *xs: jnp.stack(xs), *new) if ops.defer_kv_write else None
    else:
        same_freqs = bool(np.all(freqs == freqs[:1]))
        same_windows = len(set(windows)) == 1
        per_layer = (None if same_freqs else jnp.asarray(freqs),
                     None if same_windows else jnp.asarray([w or GLOBAL_WINDOW for w in windows], jnp.int32))

        if isinstance(weights.layers, list):  # indexed: one loop body, each layer's matrices read in place
            layers = weights.layers
            chosen = [k for k in layers[0] if k in _INDEXED_WEIGHTS]
            scanned = jax.tree.map(lambda *xs: jnp.stack(xs), *[{k: v for k, v in lw.items() if k not in chosen}
                                                               for lw in layers])

            def layer_weights(lw, i):
                return dict(lw, **{k: LayerChoice(tuple(l[k] for l in layers), i) for k in chosen})
        else:
            scanned = weights.layers

            def layer_weights(lw, i):
                return lw

        def body(carry, xs):
            x, cache = carry
            lw, i, f, w = xs
            lw = layer_weights(lw, i)
            f = freqs[0] if f is None else f
            w = windows[0] if w is None else w
            if ops.defer_kv_write:  # the cache is read-only in the loop: a constant, not a carry
                x, _, kv = _layer(config, ops, x, lw, i, kv_cache, positions, md, f, w)
                return (x, cache), kv
            x, cache, _ = _layer(config, ops, x, lw, i, cache, positions, md, f, w)
            return (x, cache), None

        carry = (x, None if ops.defer_kv_write else kv_cache)
        (x, cache), new_kv = jax.lax.scan(
            body, carry, (scanned, jnp.arange(config.num_layers, dtype=jnp.int32), *per_layer))
        kv_cache = kv_cache if ops.defer_kv_write else cache
    x = x[md.logits_indices]
    x = rms_norm(x, weights.final_norm, config.rms_norm_eps)
    if hidden:
        out = x.astype(jnp.float32)
    else:
        head = "embed" if weights.lm_head is None else "lm_head"
        out = ops.project(x, getattr(weights, head), head, jnp.float32)
        if config.final_soft_cap is not None:
            out = config.final_soft_cap * jnp.tanh(out / config.final_soft_cap)
    if ops.defer_kv_write:
        kv_cache = write_kv_layers(kv_cache, *new_kv, md.slot_mapping)
    return out, kv_cache


def first_token_layer(config: ModelConfig, lw: dict, layer: int, x: jax.Array) -> tuple[jax.Array, dict]:
    """The residual stream ``x`` ``[hidden]`` of a one-token sequence (position 0) after decoder layer
    ``layer`` (float weights ``lw``), through the same ``_layer`` as the step, and what that token's
    attention output and dense MLP fed to ``wo``, ``w_gate_up`` (normalized, before the norm's gain)
    and ``w_down``, by name (MoE experts: not recorded). The loaders follow the first token through
    the model, layer by layer as it loads, to find the attention sink's massive activations that
    quantized weights must keep (``models.weights``). Compiled once for all layers of one shape: run
    op by op it compiled each operation, and the attention's loop once per layer (SmolLM2: 17 s)."""
    return _first_token_layer(config, lw, jnp.asarray(x, jnp.float32), layer_rope_frequencies(config)[layer],
                              window=config.layer_window(layer))


@functools.partial(jax.jit, static_argnames=("config", "window"))
def _first_token_layer(config: ModelConfig, lw: dict, x: jax.Array, inv_freq: jax.Array, window) -> tuple:
    inputs, ops = {}, Ops()

    def attention(*args, **kwargs):
        out = ops.attention(*args, **kwargs)
        inputs["wo"] = out.reshape(-1)
        return out

    def mlp(x, w_gate_up, w_down, r, act):
        a = gated_activation(x, w_gate_up, r, act)
        inputs["w_gate_up"], inputs["w_down"] = (x * r)[0], a[0]
        return linear(a, w_down)

    cache = KVCache.zeros(1, 1, 1, config.num_kv_heads, config.head_dim, jnp.float32)
    zero = jnp.zeros((1,), jnp.int32)
    md = BatchMetadata(slot_mapping=zero, page_table=zero[None], seq_lens=zero + 1,
                       query_start=jnp.asarray([0, 1], jnp.int32), logits_indices=zero)
    y, _, _ = _layer(config, dataclasses.replace(ops, attention=attention, mlp=mlp), x[None], lw, 0, cache, zero, md,
                     inv_freq, window)
    return y[0], inputs
