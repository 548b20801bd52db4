"""llama.cpp's GGUF blocks repacked into ``QArray``s at load, never dequantized to full precision.

Each block type's fields are read the way ``gguf.quants`` reads them and kept as they are where
``QArray``'s decode, ``(q - zero) * scale (+ offset)``, uses them in the same float32 operations:

- Q8_0 (32 int8, f16 ``d``): ``q * d``; Q4_0 (32 nibbles, ``d``): ``(q - 8) * d``;
  Q4_1 (``d``, ``m``): ``q * d + m``. Codes and f16 scales are stored as in the file: the same bytes.
- Q5_0 / Q5_1 (Q4_0 / Q4_1 plus a fifth bit per code): ``(q - 16) * d``, ``q * d + m``; what
  llama.cpp's Q4_K_M / Q5_K_M files hold where a row is not whole 256-column super-blocks (a hidden
  size of 576, 896 or 960: small models);
- Q4_K / Q5_K (super-blocks of 256: f16 ``d``, ``dmin``, eight 6-bit scales and mins): ``q * (d *
  sc) - dmin * m`` per 32, the two products computed at load exactly as gguf computes them and kept
  in float32 (0.25 bytes per weight more than the file: ~6.5 / 7.5 bits per weight instead of 4.5 / 5.5);
- Q6_K (16 int8 scales, f16 ``d`` per 256): ``(q - 32) * (d * sc)`` per 16, ``d * sc`` in float32.

so every decoded weight is bit-identical to ``gguf.quants.dequantize``'s (tests/test_quant.py).

Only the block encodings live here, the quantization layer's part; the file they come in (header,
metadata, tensor index) is ``models/weights/gguf_file.py``, hence the name: not ``gguf``, which is
also the PyPI package both modules import.
"""

from __future__ import annotations

import numpy as np

from jaxinfer.quant.qarray import FORMATS, QArray

QK_K = 256


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16)[..., 0]


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    """Codes ``[..., n]`` (< 16) packed two per byte in QArray's order (per 32: ``j | j + 16``)."""
    *lead, n = q.shape
    q = q.reshape(*lead, n // 32, 2, 16).astype(np.uint8)
    return (q[..., 0, :] | (q[..., 1, :] << 4)).reshape(*lead, n // 2)


def _pack_high(h: np.ndarray, bits: int) -> np.ndarray:
    """Upper code bits ``[..., n]`` (``bits`` each) as bit planes: per 32 columns ``bits`` little-endian
    32-bit words, bit ``c`` of word ``p`` holding bit ``p`` of column ``c`` (Q5_0's own ``qh``)."""
    *lead, n = h.shape
    planes = (h.reshape(*lead, n // 32, 1, 32) >> np.arange(bits, dtype=np.uint8).reshape(bits, 1)) & 1
    return np.packbits(planes.astype(np.uint8), axis=-1, bitorder="little").reshape(*lead, n // 8 * bits)


def _nibbles(qs: np.ndarray, width: int) -> np.ndarray:
    """gguf's 4-bit unpacking: per ``width`` bytes, the low nibbles then the high ones."""
    *lead, n = qs.shape
    q = qs.reshape(*lead, n // width, 1, width) >> np.array([0, 4], np.uint8).reshape(2, 1)
    return (q & 0x0F).reshape(*lead, n * 2)


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's eight 6-bit scales and mins from their 12 bytes (as ``gguf.quants.Q4_K``)."""
    *lead, _ = scales.shape
    s = scales.reshape(*lead, 3, 4)
    d, m, m_d = s[..., 0, :], s[..., 1, :], s[..., 2, :]
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _q8_0(b):
    return dict(values=np.ascontiguousarray(b[..., 2:]).view(np.int8).reshape(*b.shape[:-2], -1),
                scales=_f16(b[..., 0:2]))


def _q4_0(b):
    return dict(values=b[..., 2:].reshape(*b.shape[:-2], -1).copy(), scales=_f16(b[..., 0:2]))


def _q4_1(b):
    return dict(values=b[..., 4:].reshape(*b.shape[:-2], -1).copy(), scales=_f16(b[..., 0:2]),
                offsets=_f16(b[..., 2:4]))


def _q5(b, offsets: bool):
    """Q5_0 (``d``, 32 high bits, 16 bytes of nibbles: ``(q - 16) * d``) and Q5_1 (``d``, ``m``, then
    the same: ``q * d + m``): the nibbles as Q4_0's, the fifth bits (bit ``i`` of the little-endian
    word: column ``i``) repacked into ``high``."""
    lead, at = b.shape[:-2], 4 if offsets else 2
    h = np.unpackbits(b[..., at:at + 4], axis=-1, bitorder="little")  # [..., nb, 32]: column i's bit
    out = dict(values=b[..., at + 4:].reshape(*lead, -1).copy(), scales=_f16(b[..., 0:2]),
               high=_pack_high(h.reshape(*lead, -1), 1))
    if offsets:
        out["offsets"] = _f16(b[..., 2:4])
    return out


def _k_scales(b):
    d = _f16(b[..., 0:2]).astype(np.float32)[..., None]
    dmin = _f16(b[..., 2:4]).astype(np.float32)[..., None]
    sc, mn = _k_scale_min(b[..., 4:16])
    lead = b.shape[:-2]
    return (d * sc.astype(np.float32)).reshape(*lead, -1), (-(dmin * mn.astype(np.float32))).reshape(*lead, -1)


def _q4_k(b):
    scales, offsets = _k_scales(b)
    q = _nibbles(b[..., 16:], 32).reshape(*b.shape[:-2], -1)
    return dict(values=_pack_nibbles(q), scales=scales, offsets=offsets)


def _q5_k(b):
    scales, offsets = _k_scales(b)
    lead = b.shape[:-2]
    qh, qs = b[..., 16:48], b[..., 48:]
    ql = _nibbles(qs, 32)  # [..., nb, 256]
    h = (qh.reshape(*qh.shape[:-1], 1, 32) >> np.arange(8, dtype=np.uint8).reshape(8, 1)) & 1
    h = h.reshape(*qh.shape[:-1], 256)
    return dict(values=_pack_nibbles(ql.reshape(*lead, -1)), high=_pack_high(h.reshape(*lead, -1), 1),
                scales=scales, offsets=offsets)


def _q6_k(b):
    lead = b.shape[:-2]
    ql, qh, sc, d = b[..., :128], b[..., 128:192], b[..., 192:208], b[..., 208:210]
    scales = (_f16(d).astype(np.float32)[..., None] * np.ascontiguousarray(sc).view(np.int8).astype(np.float32))
    low = _nibbles(ql, 64)  # [..., nb, 256]
    h = (qh.reshape(*qh.shape[:-1], 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)) & 3
    h = h.reshape(*qh.shape[:-1], 256)
    return dict(values=_pack_nibbles(low.reshape(*lead, -1)), high=_pack_high(h.reshape(*lead, -1), 2),
                scales=scales.reshape(*lead, -1))


# GGML type name -> (QArray scheme, bytes per block of its elements, elements per block, parser)
_TYPES = {"Q8_0": ("q8_0", 34, 32, _q8_0), "Q4_0": ("q4_0", 18, 32, _q4_0), "Q4_1": ("q4_1", 20, 32, _q4_1),
          "Q5_0": ("q5_0", 22, 32, lambda b: _q5(b, False)), "Q5_1": ("q5_1", 24, 32, lambda b: _q5(b, True)),
          "Q4_K": ("q4_k", 144, QK_K, _q4_k), "Q5_K": ("q5_k", 176, QK_K, _q5_k),
          "Q6_K": ("q6_k", 210, QK_K, _q6_k)}
SUPPORTED = tuple(_TYPES)
NATIVE = frozenset({scheme for scheme, *_ in _TYPES.values()} | {"mixed8"})  # QArray schemes a GGUF load makes


def is_quantized(type_name: str) -> bool:
    """Whether a GGML tensor type is a block format (F32/F16/BF16 are not)."""
    return type_name not in ("F32", "F16", "BF16", "F64", "I8", "I16", "I32", "I64")


def from_gguf(data: np.ndarray, type_name: str, name: str = "") -> QArray:
    """A GGUF tensor's raw blocks ``[..., out, bytes per row]`` (``GGUFReader``'s ``data``) as a
    ``QArray`` of numpy fields (``[..., out, in]`` logically, the orientation of the file)."""
    if type_name not in _TYPES:
        raise ValueError(f"GGUF tensor {name!r} has type {type_name}, which does not run natively yet; supported: "
                         f"{', '.join(SUPPORTED)} (or load it in full precision: quantization='none')")
    scheme, type_size, block, parse = _TYPES[type_name]
    data = np.asarray(data, np.uint8)
    *lead, row_bytes = data.shape
    if row_bytes % type_size:
        raise ValueError(f"GGUF tensor {name!r}: rows of {row_bytes} bytes are not whole {type_name} blocks")
    blocks = data.reshape(*lead, row_bytes // type_size, type_size)
    fields = {**dict(offsets=None, high=None, col_scale=None), **parse(blocks)}
    return QArray(**fields, scheme=scheme, group_size=FORMATS[scheme].group_size)
