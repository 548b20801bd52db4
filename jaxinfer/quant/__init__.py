"""Quantized weights: one pytree (``QArray``) for every scheme, read by the one ``linear``.

- ``qarray``: the pytree (codes, scales, optional zero points / offsets / high bits, the scheme and
  group size as static metadata) and its bit-exact decode;
- ``schemes``: int8, int4 (grouped) and fp8, quantized at load from float weights;
- ``gguf_blocks``: llama.cpp's blocks (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K) repacked into ``QArray``s
  without dequantizing, so a GGUF file runs in its own format;
- ``matmul``: the quantized matmul, the decode fused into the compiled step by XLA, or for a few tokens
  on a GPU the Pallas matvec kernel (``jaxinfer.pallas_kernels.qmatvec``), or on CPU the native
  kernel ``cpu_kernel`` (``cpu_qmatmul.cc``, an XLA custom call built on first use).

Why not ``qwix`` or ``aqtp`` (both evaluated from PyPI, qwix 0.1.8 and aqtp 0.9.0): both are built on
Flax (``flax.struct`` pytrees; qwix rewrites Flax/NNX modules' ``dot_general`` by interception,
aqtp injects its ``dot_general`` into Flax layers), while our models are pure functions over a
weights pytree, and Flax is not a dependency. Neither reads GGUF: qwix's ``QArray`` is
``(qvalue - zero_point) * scale`` with the codes in a logical ``int4`` dtype, which has no place for
Q4_1 / K-quant offsets, Q6_K's constant zero or llama.cpp's nibble order, so GGUF would need a
second representation beside it; aqtp targets quantized training (gradients, calibration) that an
inference engine does not use. What we need from them (symmetric/asymmetric round-to-nearest,
per-channel and per-group scales) is a few lines (``schemes.py``), so one representation of our
own covers both the schemes quantized at load and the GGUF blocks.
"""

from jaxinfer.quant.matmul import qlinear, to_dense
from jaxinfer.quant.qarray import FORMATS, QArray, concat, dequantize, map_rows, take, to_device, with_col_scale
from jaxinfer.quant.schemes import SCHEMES, check_device_supports, parse_scheme, quantize, scheme_for_inputs

__all__ = ["FORMATS", "QArray", "SCHEMES", "check_device_supports", "concat", "dequantize", "map_rows", "parse_scheme",
           "qlinear", "quantize", "scheme_for_inputs", "take", "to_dense", "to_device", "with_col_scale"]
