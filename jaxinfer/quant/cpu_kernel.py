"""The CPU matmul of quantized weights: a native kernel (``cpu_qmatmul.cc``) called as an XLA custom call.

Why a custom call: XLA:CPU's dot calls a library GEMM on materialized float operands, so a
``QArray`` through XLA is decoded into a float copy of the whole weight every step and then
multiplied, moving more bytes than the float32 weight would (the embedded SmolLM2's batch-1 decode
step: 697 ms in GGUF Q4_1 against 179 ms in float32, 2 cores), and no blocked ``dot_general`` over
int8 codes did better.
The kernel decodes each block of codes in registers and multiply-adds it in float32 against the
float32 activations, so it reads only the codes and equals dequantize-then-matmul within float32
rounding. It splits the output rows over XLA's own intra-op thread pool (the FFI's ``ThreadPool``),
so the ops around it keep that pool's threads awake.

Built on first use, not at install (``jaxinfer.native``).

Formats: ``q4_0``, ``q4_1``, ``q8_0``, ``int4`` and ``q4_k`` (4-bit codes, a scale and offset per
group of any multiple of 32), ``q5_0``, ``q5_1``, ``q5_k`` and ``q6_k`` (nibbles plus their fifth /
sixth bits, whose bit planes in ``high`` the kernel uses as lane masks; Q6_K in groups of 16), ``int8`` (one
scale per row) and ``mixed8`` (int8 codes, a scale and optional offset per 16 or a multiple of 32
columns), 2-D weights whose input dimension is a multiple of 32.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import native
from jaxinfer.quant.qarray import QArray

SOURCE = Path(__file__).with_name("cpu_qmatmul.cc")
FORMAT_IDS = {"q4_0": 0, "q4_1": 1, "q8_0": 2, "int4": 3, "q4_k": 3, "int8": 4, "mixed8": 5, "q5_0": 6, "q5_1": 7,
              "q5_k": 7, "q6_k": 8}  # as the kernel's Format
TARGET = "jaxinfer_cpu_qmatmul"
# Workers per call: 0 = the caller plus XLA's intra-op pool (its size); n > 0 = the caller plus n - 1
# pool tasks (1: the caller alone). For benchmarks.
THREADS = 0


def supported(w) -> bool:
    """Whether the kernel takes ``w``: a 2-D ``QArray`` of its formats, input a multiple of 32, float16
    or float32 scales and offsets."""
    if not isinstance(w, QArray) or w.scheme not in FORMAT_IDS or w.values.ndim != 2:
        return False
    if any(a is not None and a.dtype not in (jnp.float16, jnp.float32) for a in (w.scales, w.offsets)):
        return False
    n = w.shape[-1]
    if w.scheme == "int8":
        return n % 32 == 0 and w.group_size == n
    if w.group_size == 16:  # mixed8, Q6_K
        return n % 32 == 0
    return n % 32 == 0 and w.group_size % 32 == 0 and n % w.group_size == 0


def available() -> bool:
    """Whether the kernel can be built here (a C++ compiler is found): what ``quantization="auto"``
    asks before running a GGUF file in its own blocks on CPU."""
    return native.available()


def qmatmul(x: jax.Array, w: QArray) -> jax.Array:
    """``x [T, in]`` (float32; ``col_scale`` already applied) times ``dequantize(w) [out, in]``
    transposed, as float32 ``[T, out]``, through the kernel."""
    native.register(SOURCE, **{TARGET: "JaxinferQMatmul"})
    offsets = w.offsets if w.offsets is not None else jnp.zeros((0,), jnp.float16)
    high = w.high if w.high is not None else jnp.zeros((0,), jnp.uint8)
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((x.shape[0], w.shape[-2]), jnp.float32))
    return call(x.astype(jnp.float32), w.values, high, w.scales, offsets, fmt=np.int64(FORMAT_IDS[w.scheme]),
                group=np.int64(w.group_size), threads=np.int64(THREADS))
