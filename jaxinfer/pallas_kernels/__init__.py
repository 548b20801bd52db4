"""Kernels behind one switch: ``get_kernels(backend)`` returns the step operations a backend
replaces, by the field names of ``jaxinfer.models.layers.Ops``; the rest stay the model's jnp reference.
Every kernel takes every option the decoder passes (soft cap, a static or traced sliding window, Q/K/V
biases, q/k head norms), so a family never loses a kernel for having them.

- ``attention``, with the reference's signature ``(q, k_cache, v_cache, layer, md, *, scale,
  soft_cap=None, sliding_window=None)``: every backend.
- ``rope_write_kv`` (RoPE + K/V cache write in one kernel, rope_kv.py): ``pallas_gpu``, where it
  replaces about five small XLA kernels per layer.
- ``decode_attention`` (both of the above in the decode kernel, for decode-only steps of at most
  ``decode_attention_max_seqs`` sequences, which comes with it): ``pallas_gpu``.

Backends: ``reference`` (pure jnp, jaxinfer.paged.attention, with ``Ops.defer_kv_write``: the
cache is written once after the layer loop, which XLA:CPU keeps in place), ``cpu`` (the reference,
with steps of a few tokens through a native kernel that reads the cache in place,
jaxinfer.paged.cpu_attention), ``pallas_gpu`` (Pallas Triton, see
gpu.py for why Triton), ``pallas_tpu`` (Pallas Mosaic TPU, untested on hardware), ``interpret`` (the
TPU kernel in Pallas interpret mode; runs on CPU, slow, for tests), ``auto`` (by
``jax.default_backend()``: gpu -> pallas_gpu, tpu -> pallas_tpu, cpu -> cpu, else reference; a model whose
head_dim the GPU kernels cannot take, Phi-3's 96, gets the reference on a GPU).
Outside this switch: ``qmatvec`` (the quantized weights' matvec for decode on GPUs), which
``jaxinfer.quant.qlinear`` calls by itself for a few tokens on a GPU.
A quantized KV cache (int8/fp8 codes plus per-token scales, ``paged.kv_cache``) is read by the
reference and the ``pallas_gpu`` kernels (which dequantize after each page load, so only the codes
cross memory); the TPU kernel refuses it.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax

from jaxinfer.paged.attention import ragged_paged_attention as reference_attention

BACKENDS = ("auto", "reference", "cpu", "pallas_gpu", "pallas_tpu", "interpret")


def get_kernels(backend: str = "auto", head_dim: int | None = None,
                kv_quantized: bool = False) -> dict[str, Callable | int]:
    """The operations ``backend`` (one of ``BACKENDS``) implements as kernels, for a model of
    ``head_dim`` (None: any the kernels take), over a quantized (int8/fp8) KV cache if ``kv_quantized``."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; allowed: {', '.join(BACKENDS)}")
    from jaxinfer.pallas_kernels import rope_kv
    if backend == "auto":
        backend = {"gpu": "pallas_gpu", "tpu": "pallas_tpu", "cpu": "cpu"}.get(jax.default_backend(), "reference")
        if backend == "pallas_gpu" and head_dim is not None and head_dim not in rope_kv.HEAD_DIMS:
            backend = "reference"
    if kv_quantized and backend in ("pallas_tpu", "interpret"):
        # The TPU kernel's page DMAs and its (untested on hardware) tiling are for float pages only.
        raise ValueError(f"a quantized KV cache (kv_cache_dtype int8/fp8) is not supported by the {backend} "
                         f"attention backend; use attention_backend='reference' or kv_cache_dtype='auto'")
    if backend == "reference":
        return {"attention": reference_attention, "defer_kv_write": True}
    if backend == "cpu":
        from jaxinfer.paged import cpu_attention
        return {"attention": cpu_attention.ragged_paged_attention, "defer_kv_write": True}
    if backend == "pallas_gpu":
        from jaxinfer.pallas_kernels import gpu
        if head_dim is not None:
            rope_kv.check_head_dim(head_dim)
        return {"attention": gpu.ragged_paged_attention, "rope_write_kv": rope_kv.rope_write_kv,
                "decode_attention": gpu.rope_decode_attention, "decode_attention_max_seqs": gpu.FUSED_MAX_SEQS}
    from jaxinfer.pallas_kernels import tpu
    if backend == "interpret":
        return {"attention": functools.partial(tpu.ragged_paged_attention, interpret=True)}
    return {"attention": tpu.ragged_paged_attention}

