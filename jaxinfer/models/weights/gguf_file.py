"""The GGUF file format: header, key/value metadata, tensor index, the tensors' bytes memory-mapped,
and the ModelConfig its metadata describes (by its family, ``families.config_from_gguf``).

One reader for every part of jaxinfer that opens a .gguf: the config (``gguf_config``), the weight
loader (``weights.gguf``, whose blocks ``quant.gguf_blocks`` repacks) and the tokenizer (its chat
template; transformers converts the vocabulary). Parsed here, not by gguf's ``GGUFReader``, which
makes a numpy view of every part of every field: 2.2 s for SmolLM2 (its 49,152-token vocabulary and
48,900 merges), over a quarter of the server's restart; this takes a tenth of that.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from jaxinfer.models.config import ModelConfig
from jaxinfer.models.families import config_from_gguf

# Llama-3.1 scaling as per-frequency factors: config, not weights. Phi-3's LongRoPE factors likewise.
ROPE_FREQS = "rope_freqs.weight"
CONFIG_TENSORS = (ROPE_FREQS, "rope_factors_long.weight", "rope_factors_short.weight")
# GGUF value types (the spec's numbering) -> struct format; 8 is a string, 9 an array.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


@dataclasses.dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: object  # gguf.GGMLQuantizationType
    data: np.ndarray  # memory-mapped, as gguf's GGUFReader gives it: elements, or [..., bytes per row] of blocks


@dataclasses.dataclass(frozen=True)
class GGUFFile:
    metadata: dict  # key -> Python scalar, string or list
    tensors: list[GGUFTensor]


@functools.lru_cache(maxsize=1)
def gguf_file(path: str) -> GGUFFile:
    """A GGUF file's key/values decoded and its tensors memory-mapped, cached: config, weights and
    tokenizer loading all need it. The tensors' layout follows ``GGUFReader`` (what
    ``gguf.quants.dequantize`` and ``quant.gguf_blocks.from_gguf`` take)."""
    import struct

    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quant_shape_to_byte_shape

    mm = np.memmap(path, mode="r")
    buf = memoryview(mm)
    if bytes(buf[:4]) != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file (no GGUF magic)")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version} is not supported (versions 2 and 3 are, written "
                         f"little-endian)")
    off = 24

    def string():
        nonlocal off
        (n,) = struct.unpack_from("<Q", buf, off)
        off += 8 + n
        if off > len(buf):
            raise struct.error(f"a string of {n} bytes past the end")
        return bytes(buf[off - n:off]).decode("utf-8", errors="replace")

    def value(vtype):
        nonlocal off
        if vtype == 8:
            return string()
        if vtype == 9:
            elem, count = struct.unpack_from("<IQ", buf, off)
            off += 12
            if elem in _SCALARS:
                dtype = np.dtype(_SCALARS[elem]).newbyteorder("<")
                if off + dtype.itemsize * count > len(buf):
                    raise struct.error(f"an array of {count} values past the end")
                out = np.frombuffer(mm, dtype, count, off).tolist()
                off += dtype.itemsize * count
                return out
            return [value(elem) for _ in range(count)]
        if vtype not in _SCALARS:
            raise ValueError(f"{path}: unknown GGUF value type {vtype}")
        fmt = "<" + _SCALARS[vtype]
        (v,) = struct.unpack_from(fmt, buf, off)
        off += struct.calcsize(fmt)
        return v

    metadata, infos = {}, []
    try:
        for _ in range(n_kv):
            key = string()
            (vtype,) = struct.unpack_from("<I", buf, off)
            off += 4
            metadata[key] = value(vtype)
        for _ in range(n_tensors):
            name = string()
            (n_dims,) = struct.unpack_from("<I", buf, off)
            dims = struct.unpack_from(f"<{n_dims}Q", buf, off + 4)
            ttype, start = struct.unpack_from("<IQ", buf, off + 4 + 8 * n_dims)
            off += 4 + 8 * n_dims + 12
            infos.append((name, dims, GGMLQuantizationType(ttype), start))
    except struct.error as e:  # a count or length pointing past the end
        raise ValueError(f"{path}: truncated or corrupt GGUF header ({e})") from None
    align = metadata.get("general.alignment", 32)
    if not isinstance(align, int) or align <= 0 or align & (align - 1):
        raise ValueError(f"{path}: general.alignment must be a power of two, got {align!r}")
    data_start = -(-off // align) * align
    elements = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                "I32": np.int32, "I64": np.int64}
    tensors = []
    for name, dims, ttype, start in infos:
        shape = tuple(reversed(dims))  # numpy order: GGUF lists the fastest dimension first
        n = int(np.prod(dims))
        if ttype.name in elements:
            dtype = np.dtype(elements[ttype.name])
            nbytes = n * dtype.itemsize
        else:
            block, size = GGML_QUANT_SIZES[ttype]
            dtype, nbytes, shape = np.dtype(np.uint8), n // block * size, quant_shape_to_byte_shape(shape, ttype)
        at = data_start + start
        if at + nbytes > len(mm):
            raise ValueError(f"{path}: tensor {name!r} ({nbytes} bytes at {at}) runs past the end of the file "
                             f"({len(mm)} bytes): truncated?")
        tensors.append(GGUFTensor(name, ttype, mm[at:at + nbytes].view(dtype).reshape(shape)))
    return GGUFFile(metadata, tensors)


def gguf_config(gguf: GGUFFile) -> ModelConfig:
    """The ModelConfig the file's metadata describes, with what llama.cpp keeps in tensors instead
    (a ``rope_freqs`` tensor: Llama-3.1's scaling) and whether the embedding is tied (no ``output``)."""
    from gguf.quants import dequantize

    md = dict(gguf.metadata)
    tensors = {t.name: t for t in gguf.tensors}
    md["_tied_embeddings"] = "output.weight" not in tensors
    if ROPE_FREQS in tensors:
        t = tensors[ROPE_FREQS]
        md["_rope_freq_factors"] = tuple(float(f) for f in dequantize(t.data, t.tensor_type).reshape(-1))
    if "rope_factors_long.weight" in tensors:
        raise ValueError("GGUF files with LongRoPE factors (Phi-3 128k) are not supported; "
                         "load the Hugging Face checkpoint instead")
    return config_from_gguf(md)
