"""``QArray``: one quantized weight pytree for every scheme, and the matmul that reads it.

A quantized ``[..., out, in]`` weight (2-D, or the MoE experts' stack ``[E, out, in]``, or either with
a leading ``layers`` axis) is integer codes plus per-group float parameters, dequantized as

    w = (q - zero) * scale (+ offset)      per group of ``group_size`` consecutive input columns

(``zero`` a constant of the format; ``offset`` a float zero point, ``-zero * scale`` in other terms)

which is, operation for operation, how llama.cpp's formats decode (so GGUF blocks decode bit-exactly
like ``gguf.quants.dequantize``) and how the schemes quantized at load (``schemes.py``) are defined.
Every array field keeps the ``out`` rows on axis -2 and the input (groups, packed bytes) on axis -1,
so slicing, stacking (``layers``) and sharding a leaf along either axis keeps each row's and each
group's parameters with it, as long as a shard boundary falls on a group boundary.

Packing: 4-bit codes two per byte, within each run of 32 columns byte ``j`` holding column ``j``
(low nibble) and ``j + 16`` (high nibble), GGUF Q4_0/Q4_1's own order; Q5_0/Q5_1/Q5_K/Q6_K's fifth
(and sixth) bits in ``high`` as bit planes: per 32 columns one little-endian 32-bit word per upper
bit, bit ``c`` for column ``c`` (Q5_0's own ``qh``; the CPU kernel adds 16 or 32 under each word as
a lane mask). int8 and fp8 codes are stored as they are.

``col_scale`` ``[..., in]`` multiplies the activations' columns before the matmul: it is how an
RMSNorm gain stays explicit for weights whose blocks cannot absorb it (GGUF loaded natively: a
block's scale is shared across columns, the gain differs per column). ``linear(x, W)`` is then
``x @ (W * col_scale).T``, what ``fold_norm`` gives float weights. Schemes quantized at load fold
the gain into the float weights before quantizing and have no ``col_scale``.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Format:
    """The static description of a scheme's codes: how they are stored and decoded."""

    name: str
    bits: int  # bits per code (8: int8 or fp8 stored as is; 4-6: nibbles plus ``high`` bits)
    group_size: int | None  # fixed by the format (GGUF); None: chosen per array (``QArray.group_size``)
    zero: int = 0  # a constant zero point (Q4_0: 8, Q6_K: 32)
    offsets: bool = False  # a per-group offset added after scaling (int4's and Q4_1's min, K-quants' -dmin * m)
    signed: bool = False  # int8 codes
    fp8: bool = False  # e4m3 codes with dynamic per-token activation scales (w8a8)


FORMATS = {f.name: f for f in (
    Format("int8", 8, None, signed=True),
    Format("int4", 4, None, offsets=True),
    Format("fp8", 8, None, fp8=True),
    Format("q8_0", 8, 32, signed=True),
    Format("q4_0", 4, 32, zero=8),
    Format("q4_1", 4, 32, offsets=True),
    Format("q5_0", 5, 32, zero=16),
    Format("q5_1", 5, 32, offsets=True),
    Format("q4_k", 4, 32, offsets=True),
    Format("q5_k", 5, 32, offsets=True),
    Format("q6_k", 6, 16, zero=32),
    # GGUF tensors of different formats fused into one leaf (``concat``): int8 codes ``q - zero`` at
    # the finest part's group size, each part's scales (and offsets, zero where it has none, if any
    # part has them) repeated to it, so every weight decodes as its own format decoded it.
    Format("mixed8", 8, None, signed=True, offsets=True),
)}


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["values", "scales", "offsets", "high", "col_scale"],
                   meta_fields=["scheme", "group_size"])
@dataclasses.dataclass
class QArray:
    values: jax.Array  # codes: int8 / float8_e4m3fn [..., out, in], or packed nibbles uint8 [..., out, in / 2]
    scales: jax.Array  # [..., out, in / group_size] (float16: int4's and GGUF's own d; float32)
    offsets: jax.Array | None  # [..., out, in / group_size]: added after scaling (float16: int4, Q4_1; float32)
    high: jax.Array | None  # uint8 [..., out, in * (bits - 4) / 8]: Q5_K / Q6_K's upper bits
    col_scale: jax.Array | None  # [..., in]: an explicit norm gain on the activations' columns
    scheme: str  # a key of FORMATS
    group_size: int

    @property
    def format(self) -> Format:
        return FORMATS[self.scheme]

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical ``[..., out, in]`` shape of the weight this stands for."""
        *lead, n = self.values.shape
        return (*lead, n * 2 if self.format.bits < 8 else n)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in jax.tree.leaves(self))

    def codes(self) -> jax.Array:
        """The unpacked integer codes ``[..., out, in]`` (int32; fp8: its float32 values)."""
        f = self.format
        if f.fp8:
            return self.values.astype(jnp.float32)
        if f.bits == 8:
            return self.values.astype(jnp.int32)
        *lead, n = self.values.shape
        v = self.values.reshape(*lead, n // 16, 1, 16)
        q = (v >> jnp.array([0, 4], jnp.uint8)[:, None]) & jnp.uint8(15)
        q = q.reshape(*lead, n * 2)
        if f.bits > 4:  # bit planes: per 32 columns a 32-bit word per upper bit, bit c for column c
            hb = f.bits - 4
            h = self.high.reshape(*lead, n // 16, hb, 4, 1)
            bits = ((h >> jnp.arange(8, dtype=jnp.uint8)) & jnp.uint8(1)).reshape(*lead, n // 16, hb, 32)
            high = functools.reduce(jnp.bitwise_or, [bits[..., p, :] << jnp.uint8(p) for p in range(hb)])
            q = q | (high.reshape(*lead, n * 2) << jnp.uint8(4))
        return q.astype(jnp.int32)


def dequantize(w, dtype=jnp.float32) -> jax.Array:
    """The float weight ``[..., out, in]`` a ``QArray`` stands for (computed in float32, then cast;
    ``col_scale`` is not applied: it belongs to the activations). A plain array is just cast."""
    if not isinstance(w, QArray):
        return w.astype(dtype)
    f, g = w.format, w.group_size
    q = w.codes()
    *lead, n = q.shape
    q = q.reshape(*lead, n // g, g)
    if f.zero:
        q = q - f.zero
    out = q.astype(jnp.float32) * w.scales.astype(jnp.float32)[..., None]
    if w.offsets is not None:  # mixed8's are optional
        out = out + w.offsets.astype(jnp.float32)[..., None]
    return out.reshape(*lead, n).astype(dtype)


def take(w, idx: jax.Array, axis: int = 0):
    """``w`` indexed by ``idx`` along a leading axis: the experts of a stacked leaf (``axis=0`` of
    ``[E, out, in]``), or the rows of a 2-D table (``axis=0`` of ``[V, D]``, the embedding), where
    ``col_scale`` (one per column, not per row) is kept."""
    if not isinstance(w, QArray):
        return jnp.take(w, idx, axis=axis)
    rows = len(w.values.shape) - 2 == axis  # indexing the out rows: col_scale has no such axis
    parts = {k: (None if a is None else a if (k == "col_scale" and rows) else jnp.take(a, idx, axis=axis))
             for k, a in _fields(w).items()}
    return dataclasses.replace(w, **parts)


def _fields(w: QArray) -> dict:
    return {k: getattr(w, k) for k in ("values", "scales", "offsets", "high", "col_scale")}


def concat(parts: list, axis: int = -2):
    """Weights concatenated along their ``out`` rows (``axis=-2``; fused q|k|v, gate|up): plain
    arrays with numpy, ``QArray``s field by field (same scheme, group size and ``col_scale``)."""
    if not isinstance(parts[0], QArray):
        return np.concatenate(parts, axis=axis)
    if axis != -2:
        raise ValueError("quantized weights concatenate along their out rows (axis=-2) only")
    if len({(p.scheme, p.group_size) for p in parts}) > 1:
        parts = [_widened(p, parts) for p in parts]
    merged = {k: None if a is None else (a if k == "col_scale" else np.concatenate(
        [np.asarray(getattr(p, k)) for p in parts], axis=-2)) for k, a in _fields(parts[0]).items()}
    return dataclasses.replace(parts[0], **merged)


def _widened(w: QArray, parts: list[QArray]) -> QArray:
    """``w``, one of ``parts`` (row blocks of different formats to fuse: llama.cpp's Q4_K_M puts some
    layers' ``attn_v`` in Q6_K or Q8_0 beside Q4_K or Q5_0 queries and keys), as the 8-bit format
    all of them fit: Q8_0 where none has offsets and every group is 32 columns with float16 scales
    (Q4_0 / Q5_0 beside Q8_0), else ``mixed8``. Lossless: each weight decodes to the same float32."""
    group = math.gcd(*(p.group_size for p in parts))
    no_offsets = all(p.offsets is None for p in parts)
    q8_0 = group == 32 and no_offsets and all(p.scales.dtype == np.float16 for p in parts)
    codes = (np.asarray(w.codes()) - w.format.zero).astype(np.int8)
    rep = lambda a: np.repeat(np.asarray(a, np.float16 if q8_0 else np.float32), w.group_size // group, axis=-1)  # noqa: E731
    offsets = None if no_offsets else rep(w.offsets if w.offsets is not None else np.zeros(w.scales.shape))
    return QArray(codes, rep(w.scales), offsets, None, w.col_scale, "q8_0" if q8_0 else "mixed8", group)


def map_rows(w, fn):
    """``fn`` applied to every per-row field (all but ``col_scale``): a row permutation or split."""
    if not isinstance(w, QArray):
        return fn(w)
    return dataclasses.replace(w, **{k: a if a is None or k == "col_scale" else fn(a) for k, a in _fields(w).items()})


def with_col_scale(w: QArray, gain) -> QArray:
    """``w`` with the activations' columns scaled by ``gain [in]`` first (``fold_norm`` for blocks)."""
    gain = np.asarray(gain, np.float32)
    if w.col_scale is not None:
        gain = gain * np.asarray(w.col_scale, np.float32)
    lead = w.values.shape[:-2]
    return dataclasses.replace(w, col_scale=np.ascontiguousarray(np.broadcast_to(gain, (*lead, gain.shape[-1]))))


def to_device(w):
    """A ``QArray`` of numpy fields (as the loaders build it) as device arrays."""
    return jax.tree.map(jnp.asarray, w)
