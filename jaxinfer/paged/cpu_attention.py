"""Attention over the paged cache on CPU for steps of a few tokens (decode, speculative verify): a
native kernel (``cpu_attention.cc``, an XLA custom call; built by ``jaxinfer.native``) that reads each
key and value row where it lies in the cache.

Why: the reference (``attention.py``, still the path for longer steps and the oracle) gathers each
key block of a sequence's pages into a copy, and XLA:CPU transposes it around its dots. In
SmolLM2's batch-1 decode step (context 256) those copies took ~3.2 ms of thread time, against
~12.7 ms for all of its matmuls. The kernel reads the rows in place, spans of each token's context
as work items on XLA's intra-op pool, and takes the step's own new K/V rows as the reference does
(``Ops.defer_kv_write``: the cache is written after the layer loop). Float32 caches only; a
quantized or bf16 cache, more than ``MAX_TOKENS`` tokens, no C++ compiler, or a CPU without the
kernel's vector paths (``vectorized``): the reference.
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import native
from jaxinfer.paged.attention import ragged_paged_attention as reference, token_layout
from jaxinfer.paged.kv_cache import BatchMetadata

SOURCE = Path(__file__).with_name("cpu_attention.cc")
TARGET = "jaxinfer_cpu_attention"
# Most tokens in a step the kernel takes (each query walks its own context; the reference's
# einsums block a prefill chunk's queries over shared keys).
MAX_TOKENS = 16
_NO_WINDOW = 1 << 30


def supported(q: jax.Array, k_cache: jax.Array, new_kv, k_scale) -> bool:
    return (q.shape[0] <= MAX_TOKENS and new_kv is not None and k_scale is None and k_cache.dtype == jnp.float32
            and jax.default_backend() == "cpu" and native.available() and vectorized())


@functools.cache
def vectorized() -> bool:
    """Whether the kernel, as built for this CPU, has its vector paths (x86 with AVX2 + FMA or
    AVX512). Its portable scalar path ran SmolLM2's 8-sequence decode attention at 0.7x the reference
    (22.4 against 15.7 ms for 30 layers, built for baseline x86-64), so other CPUs keep the reference."""
    return bool(_register().JaxinferCpuAttentionVectorized())


def _register():
    return native.register(SOURCE, **{TARGET: "JaxinferCpuAttention"})


def ragged_paged_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, layer, md: BatchMetadata, *,
                           scale: float, soft_cap: float | None = None, sliding_window=None,
                           new_kv: tuple[jax.Array, jax.Array] | None = None,
                           k_scale: jax.Array | None = None, v_scale: jax.Array | None = None) -> jax.Array:
    """The reference's contract (``attention.ragged_paged_attention``), through the kernel where
    ``supported``."""
    if not supported(q, k_cache, new_kv, k_scale):
        return reference(q, k_cache, v_cache, layer, md, scale=scale, soft_cap=soft_cap, sliding_window=sliding_window,
                         new_kv=new_kv, k_scale=k_scale, v_scale=v_scale)
    _register()
    seq, pos, valid = token_layout(md, q.shape[0])
    first_row = md.query_start[seq]
    cached = md.seq_lens[seq] - (md.query_start[seq + 1] - first_row)  # positions already in the cache
    scalar = lambda x: jnp.asarray(x, jnp.int32).reshape(1)  # noqa: E731
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    out = call(q.astype(jnp.float32), new_kv[0].astype(jnp.float32), new_kv[1].astype(jnp.float32), k_cache, v_cache,
               scalar(layer), md.page_table, seq, jnp.where(valid, pos, -1), cached, first_row,
               scalar(_NO_WINDOW if sliding_window is None else sliding_window),
               scale=np.float32(scale), soft_cap=np.float32(soft_cap or 0.0))
    return out.astype(q.dtype)
