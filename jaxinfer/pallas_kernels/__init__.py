"""Attention kernels behind one switch: ``get_attention(backend)`` returns a function with the
reference's signature ``(q, k_cache, v_cache, layer, md, *, scale, soft_cap=None, sliding_window=None)``.

Backends: ``reference`` (pure jnp, jaxinfer.paged.attention), ``pallas_gpu`` (Pallas Triton, see
gpu.py for why Triton), ``pallas_tpu`` (Pallas Mosaic TPU, untested on hardware), ``interpret`` (the
TPU kernel in Pallas interpret mode; runs on CPU, slow, for tests), ``auto`` (by
``jax.default_backend()``: gpu -> pallas_gpu, tpu -> pallas_tpu, else reference).
"""

from __future__ import annotations

import functools
from typing import Callable

import jax

from jaxinfer.paged.attention import ragged_paged_attention as reference_attention

BACKENDS = ("auto", "reference", "pallas_gpu", "pallas_tpu", "interpret")


def get_attention(backend: str = "auto") -> Callable:
    """The attention function for ``backend`` (one of ``BACKENDS``)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; allowed: {', '.join(BACKENDS)}")
    if backend == "auto":
        backend = {"gpu": "pallas_gpu", "tpu": "pallas_tpu"}.get(jax.default_backend(), "reference")
    if backend == "reference":
        return reference_attention
    if backend == "pallas_gpu":
        from jaxinfer.pallas_kernels import gpu
        return gpu.ragged_paged_attention
    from jaxinfer.pallas_kernels import tpu
    if backend == "interpret":
        return functools.partial(tpu.ragged_paged_attention, interpret=True)
    return tpu.ragged_paged_attention
