"""The matmuls that read a ``QArray``: inside the compiled step, the decode fused by XLA or in a kernel.

- Up to ``KERNEL_MAX_TOKENS`` tokens (one) on a GPU, int8 (a scale per row) and 4-bit codes with a
  scale (and offset) per group (int4, Q4_0, Q4_1): the Pallas kernel ``pallas_kernels.qmatvec``. On
  an H200 it beat XLA's fusion below on all five of llama3-8b's matvecs (a layer's four in int8:
  86.8 against 104.9 us).
- One token on a GPU otherwise (Q8_0, the K-quants): a float32 row reduction ``sum(x *
  dequantize(W), -1)``, one loop fusion that reads only the codes and their scales. The kernel takes
  Q8_0 too (tests check it), but only the formats above were timed against this fusion.
- int8 and fp8 (one scale per output row): the dot runs on the codes (converted to the activations'
  dtype, or fp8 x fp8 with a dynamic per-token activation scale) and the row scales multiply its
  output, so no float copy of the weight is scaled.
- On CPU, 2-D int8, int4, Q8_0, Q4_0 and Q4_1 weights (any number of tokens): the native kernel
  ``cpu_kernel.qmatmul`` (an XLA custom call that decodes the codes in registers; XLA:CPU's dot
  would multiply a materialized float copy, see its docstring).
- Everything else: the weight decoded to the activations' dtype, then the dot.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.pallas_kernels.qmatvec import quantized_matvec
from jaxinfer.quant import cpu_kernel
from jaxinfer.quant.qarray import QArray, dequantize
from jaxinfer.quant.schemes import FP8_MAX

# Most tokens (rows of x) a step's quantized linear sends through the matvec kernel on a GPU. The
# kernel takes any number, but each token adds a multiply-add per weight to a kernel already bound by
# instructions per weight (int4's ``w_gate_up``: 3.03 SASS instructions a weight on sm_90), so more
# than one waits for a measurement against XLA's dot (``benchmarks/bench_qmatvec.py --tokens 8``).
KERNEL_MAX_TOKENS = 1
KERNEL_SCHEMES = ("int8", "int4", "q4_0", "q4_1")  # Q8_0 (8-bit, a scale per 32) waits for its own timing


def _precision(dtype):
    return jax.lax.Precision.HIGHEST if dtype == jnp.float32 and jax.default_backend() != "cpu" else None


def _scale_columns(x: jax.Array, w: QArray) -> jax.Array:
    if w.col_scale is None:
        return x
    return (x.astype(jnp.float32) * w.col_scale.astype(jnp.float32)).astype(x.dtype)


def fp8_activations(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``x [..., in]`` as float8 e4m3 codes and one float32 scale per row (dynamic, per token)."""
    xf = x.astype(jnp.float32)
    s = jnp.max(jnp.abs(xf), axis=-1, keepdims=True) / FP8_MAX
    s = jnp.where(s == 0, 1.0, s)
    return (xf / s).astype(jnp.float8_e4m3fn), s


def kernel_matvec(x: jax.Array, w: QArray, out_dtype, **blocks) -> jax.Array:
    """``qlinear`` through the Pallas matvec kernel (a 2-D ``w`` of ``KERNEL_SCHEMES``), the format's
    description passed as static parameters. ``blocks``: the kernel's block sizes (default: its own
    choice), for benchmarks."""
    f = w.format
    y = quantized_matvec(_scale_columns(x, w), w.values, w.scales, w.offsets, bits=f.bits, group_size=w.group_size, zero=f.zero,
                         signed=f.signed, **blocks)
    return y.astype(out_dtype)


def rowsum_matvec(x: jax.Array, w: QArray, out_dtype) -> jax.Array:
    """One token as a float32 row reduction ``sum(x * dequantize(W), -1)`` (XLA's loop fusion)."""
    x = _scale_columns(x, w)
    return jnp.sum(x.astype(jnp.float32) * dequantize(w, jnp.float32), axis=-1)[None].astype(out_dtype)


def qlinear(x: jax.Array, w: QArray, out_dtype) -> jax.Array:
    """``x [T, in]`` times the quantized ``w [out, in]`` transposed, accumulated in float32."""
    if jax.default_backend() == "cpu" and cpu_kernel.supported(w):
        return cpu_kernel.qmatmul(_scale_columns(x, w), w).astype(out_dtype)
    gpu = jax.default_backend() == "gpu"
    if gpu and x.shape[0] <= KERNEL_MAX_TOKENS and w.scheme in KERNEL_SCHEMES and w.shape[-1] % 32 == 0:
        return kernel_matvec(x, w, out_dtype)
    if gpu and x.shape[0] == 1 and w.scheme != "fp8":
        return rowsum_matvec(x, w, out_dtype)
    x = _scale_columns(x, w)
    per_row = w.group_size == w.shape[-1] and w.scheme in ("int8", "fp8")
    dims = (((1,), (1,)), ((), ()))
    if w.scheme == "fp8":
        xq, xs = fp8_activations(x)
        if jax.default_backend() == "cpu":  # emulated: the same fp8 values, multiplied in float32
            y = jax.lax.dot_general(xq.astype(jnp.float32), w.values.astype(jnp.float32), dims,
                                    preferred_element_type=jnp.float32)
        else:
            # The dot's output in the activations' dtype: a float32 one (235 MB at 2,048 tokens of
            # llama3-8b's gate/up) was read twice by the scale, activation and requantization fusions
            # after it; the H200's mixed step went 38.0 -> 35.8 ms.
            # Its partial sums are then rounded to that dtype too: up to 2^-11.6 of sum |x * w| at
            # in = 320 on an H100 (2^-13.5 at 4,096), well under the fp8 operands' own rounding.
            y = jax.lax.dot_general(xq, w.values, dims, preferred_element_type=out_dtype)
        return (y.astype(jnp.float32) * xs * w.scales[:, 0].astype(jnp.float32)).astype(out_dtype)
    if per_row:
        y = jax.lax.dot_general(x, w.values.astype(x.dtype), dims, precision=_precision(x.dtype),
                                preferred_element_type=jnp.float32)
        return (y * w.scales[:, 0]).astype(out_dtype)
    return jax.lax.dot_general(x, dequantize(w, x.dtype), dims, precision=_precision(x.dtype),
                               preferred_element_type=out_dtype)


def to_dense(w, dtype) -> jax.Array:
    """A weight as float ``dtype`` with its ``col_scale`` folded in, for the einsums that take no
    ``QArray`` (the MoE experts: a gathered slice per token at decode, the whole stack for grouped
    matmuls; the embedding's gathered rows). A plain array is just cast."""
    if not isinstance(w, QArray):
        return w.astype(dtype)
    d = dequantize(w, jnp.float32)
    if w.col_scale is not None:
        d = d * w.col_scale.astype(jnp.float32)[..., None, :]
    return d.astype(dtype)
