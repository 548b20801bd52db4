"""The CPU matmul of quantized weights: a native kernel (``cpu_qmatmul.cc``) called as an XLA custom call.

Why a custom call: XLA:CPU's dot calls a library GEMM on materialized float operands, so a
``QArray`` through XLA is decoded into a float copy of the whole weight every step and then
multiplied, moving more bytes than the float32 weight would (GGUF Q4_1 measured 2.5-4x slower than
float32 per step, docs/benchmarks.md), and no blocked ``dot_general`` over int8 codes did better.
The kernel decodes each block of codes in registers and multiply-adds it in float32 against the
float32 activations, so it reads only the codes and equals dequantize-then-matmul within float32
rounding. It splits the output rows over XLA's own intra-op thread pool (the FFI's ``ThreadPool``),
so the ops around it keep that pool's threads awake.

Built on first use, not at install (``jaxinfer.native``).

Formats: ``q4_0``, ``q4_1``, ``q8_0``, ``int4`` and ``q4_k`` (4-bit codes, a scale and offset per
group of any multiple of 32), ``int8`` (one scale per row) and ``mixed8`` (int8 codes, a scale and
optional offset per 16 or a multiple of 32 columns), 2-D weights whose input dimension is a multiple
of 32. The 5- and 6-bit GGUF formats (Q5_0, Q5_1, Q5_K, Q6_K: what Q4_K_M files hold beside Q4_K)
have no decode of their own here: ``for_kernel`` widens them at load, losslessly, to int8 codes
(``q8_0`` or ``mixed8``), trading their 5.5-6.6 bits a weight for 8.5-10 so that they stream through
the kernel (SmolLM2 Q4_K_M at batch 1: 10.8 tok/s through XLA's decode, docs/benchmarks.md).
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import native
from jaxinfer.quant.qarray import QArray

SOURCE = Path(__file__).with_name("cpu_qmatmul.cc")
FORMAT_IDS = {"q4_0": 0, "q4_1": 1, "q8_0": 2, "int4": 3, "q4_k": 3, "int8": 4, "mixed8": 5}  # the kernel's Format
_WIDENED = ("q5_0", "q5_1", "q5_k", "q6_k")  # for_kernel's
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
    if w.scheme == "mixed8" and w.group_size == 16:
        return n % 32 == 0
    return n % 32 == 0 and w.group_size % 32 == 0 and n % w.group_size == 0


def for_kernel(w):
    """``w`` in a format the kernel reads, where it is a 2-D 5- or 6-bit GGUF ``QArray``: Q5_0 as Q8_0
    (codes ``q - 16``, the same float16 scales), Q5_1 / Q5_K / Q6_K as ``mixed8`` (codes ``q - zero``,
    the same scales and offsets). Every weight decodes to the same float32. Anything else as it is."""
    if not isinstance(w, QArray) or w.scheme not in _WIDENED or w.values.ndim != 2:
        return w
    codes = (w.codes() - w.format.zero).astype(jnp.int8)
    scheme = "q8_0" if w.scheme == "q5_0" else "mixed8"
    return QArray(codes, w.scales, w.offsets, None, w.col_scale, scheme, w.group_size)


def available() -> bool:
    """Whether the kernel can be built here (a C++ compiler is found): what ``quantization="auto"``
    asks before running a GGUF file in its own blocks on CPU."""
    return native.available()


def qmatmul(x: jax.Array, w: QArray) -> jax.Array:
    """``x [T, in]`` (float32; ``col_scale`` already applied) times ``dequantize(w) [out, in]``
    transposed, as float32 ``[T, out]``, through the kernel."""
    native.register(SOURCE, **{TARGET: "JaxinferQMatmul"})
    offsets = w.offsets if w.offsets is not None else jnp.zeros((0,), jnp.float16)
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((x.shape[0], w.shape[-2]), jnp.float32))
    return call(x.astype(jnp.float32), w.values, w.scales, offsets, fmt=np.int64(FORMAT_IDS[w.scheme]),
                group=np.int64(w.group_size), threads=np.int64(THREADS))
