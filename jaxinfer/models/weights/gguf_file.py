"""The GGUF file format: header, key/value metadata, tensor index, the tensors' bytes memory-mapped,
and the ModelConfig its metadata describes (by its family, ``families.config_from_gguf``).

One reader for every part of jaxinfer that opens a .gguf: the config (``gguf_config``), the weight
loader (``weights.gguf``, whose blocks ``quant.gguf_blocks`` repacks) and the tokenizer (its
vocabulary, merges, special tokens and chat template: ``jaxinfer.gguf_tokenizer``). Parsed here,
not by gguf's ``GGUFReader``, which makes a numpy view of every part of every field: 2.2 s for
SmolLM2 (its 49,152-token vocabulary and 48,900 merges), over a quarter of the server's restart;
this takes a few hundredths of a second, its string arrays decoded in bulk. A file cut
short or corrupt is a ``ModelFileError`` naming the file and what is wrong, checked before any
byte past the end is read.
"""

from __future__ import annotations

import dataclasses
import functools
import struct

import numpy as np

from jaxinfer.models.config import ModelConfig
from jaxinfer.models.families import config_from_gguf
from jaxinfer.models.weights.source import ModelFileError, blamed_on

# Llama-3.1 scaling as per-frequency factors: config, not weights. Phi-3's LongRoPE factors likewise.
ROPE_FREQS = "rope_freqs.weight"
CONFIG_TENSORS = (ROPE_FREQS, "rope_factors_long.weight", "rope_factors_short.weight")
# GGUF value types (the spec's numbering) -> struct format; 8 is a string, 9 an array.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_HEADER = struct.Struct("<4sIQQ")  # magic, version, tensor count, key/value count
_LENGTH = struct.Struct("<Q")  # a string's length, before its UTF-8 bytes
_ELEMENTS = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16,
             "I32": np.int32, "I64": np.int64}


@dataclasses.dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: object  # gguf.GGMLQuantizationType
    data: np.ndarray  # memory-mapped, as gguf's GGUFReader gives it: elements, or [..., bytes per row] of blocks


@dataclasses.dataclass(frozen=True)
class GGUFFile:
    path: str
    metadata: dict  # key -> Python scalar, string or list
    tensors: list[GGUFTensor]


class _PastTheEnd(Exception):
    """A header field that would be read past the end of the file (its message says which)."""


class _Header:
    """Reads the header's fields in order from ``buf``, each checked against the file's size first."""

    def __init__(self, buf: memoryview, mm: np.memmap):
        self.buf, self.mm, self.off, self.what = buf, mm, _HEADER.size, "the header"

    def take(self, n: int) -> int:
        """The offset of the next ``n`` bytes, which are then consumed."""
        at = self.off
        if n < 0 or at + n > len(self.buf):
            raise _PastTheEnd(f"{self.what} ({n} bytes at byte {at})")
        self.off += n
        return at

    def unpack(self, fmt: str) -> tuple:
        return struct.unpack_from(fmt, self.buf, self.take(struct.calcsize(fmt)))

    def string(self) -> str:
        (n,) = self.unpack("<Q")
        at = self.take(n)
        return bytes(self.buf[at:at + n]).decode("utf-8", errors="replace")

    def strings(self, count: int) -> list[str]:
        """An array of ``count`` strings, each decoded as ``string`` would (a vocabulary of 49,152
        tokens in a few milliseconds). Only the walk from one length to the next is a Python loop;
        the bytes are gathered and decoded in one go, and cut at each string's first character."""
        buf, start, end = self.buf, self.off, len(self.buf)
        lengths, off, length_at = [], start, _LENGTH.unpack_from  # grown as read: a corrupt count stops at the end
        for _ in range(count):
            if off + 8 > end:
                raise _PastTheEnd(f"{self.what} (8 bytes at byte {off})")
            (n,) = length_at(buf, off)
            if n > end - off - 8:
                raise _PastTheEnd(f"{self.what} ({n} bytes at byte {off + 8})")
            lengths.append(n)
            off += 8 + n
        self.off = off
        if not count:
            return []
        lengths = np.asarray(lengths, np.int64)
        ends = np.cumsum(lengths)  # in the strings' bytes laid end to end
        starts = ends - lengths
        region = self.mm[start:off]
        keep = np.ones(len(region), bool)  # drop each string's 8-byte length
        keep[(starts + 8 * np.arange(count))[:, None] + np.arange(8)] = False
        data = np.asarray(region[keep])
        try:
            text = data.tobytes().decode("utf-8")
        except UnicodeDecodeError:
            text = None
        leads = (data & 0xC0) != 0x80  # a character's first byte: valid UTF-8 has one per character
        inner = starts[starts < len(data)]
        if text is None or not leads[inner].all():
            # Invalid UTF-8 somewhere, or a character split between two strings: one at a time, as
            # ``string`` decodes them (U+FFFD for what is not UTF-8).
            raw = data.tobytes()
            return [raw[a:b].decode("utf-8", errors="replace") for a, b in zip(starts.tolist(), ends.tolist())]
        chars = np.concatenate([[0], np.cumsum(leads)])
        return [text[a:b] for a, b in zip(chars[starts].tolist(), chars[ends].tolist())]

    def value(self, vtype: int):
        if vtype == 8:
            return self.string()
        if vtype == 9:
            elem, count = self.unpack("<IQ")
            if elem == 8:
                return self.strings(count)
            if elem in _SCALARS:
                dtype = np.dtype(_SCALARS[elem]).newbyteorder("<")
                return np.frombuffer(self.mm, dtype, count, self.take(dtype.itemsize * count)).tolist()
            return [self.value(elem) for _ in range(count)]
        if vtype not in _SCALARS:
            raise ValueError(f"{self.what} has unknown GGUF value type {vtype} (at byte {self.off - 4})")
        return self.unpack("<" + _SCALARS[vtype])[0]


@functools.lru_cache(maxsize=1)
def gguf_file(path: str) -> GGUFFile:
    """A GGUF file's key/values decoded and its tensors memory-mapped, cached: config, weights and
    tokenizer loading all need it. The tensors' layout follows ``GGUFReader`` (what
    ``gguf.quants.dequantize`` and ``quant.gguf_blocks.from_gguf`` take)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quant_shape_to_byte_shape

    try:
        with open(path, "rb") as f:
            head = f.read(_HEADER.size)
    except OSError as e:
        raise ModelFileError(path, f"unreadable ({e.strerror or e})") from None
    if head[:4] != b"GGUF":
        raise ModelFileError(path, f"not a GGUF file (it starts with {head[:4]!r}, not b'GGUF')" if head
                             else "not a GGUF file (it is empty)")
    if len(head) < _HEADER.size:
        raise ModelFileError(path, f"truncated: {len(head)} bytes, shorter than GGUF's {_HEADER.size}-byte header")
    _, version, n_tensors, n_kv = _HEADER.unpack(head)
    if version not in (2, 3):
        raise ModelFileError(path, f"GGUF version {version} is not supported (versions 2 and 3 are, written "
                             "little-endian)")
    mm = np.memmap(path, mode="r")
    header = _Header(memoryview(mm), mm)
    metadata, infos = {}, []
    try:
        for i in range(n_kv):
            header.what = f"the name of key {i}"
            key = header.string()
            header.what = f"the value of {key!r}"
            (vtype,) = header.unpack("<I")
            metadata[key] = header.value(vtype)
        for i in range(n_tensors):
            header.what = f"the name of tensor {i}"
            name = header.string()
            header.what = f"tensor {name!r}'s entry"
            (n_dims,) = header.unpack("<I")
            dims = header.unpack(f"<{n_dims}Q")
            ttype, start = header.unpack("<IQ")
            try:
                ttype = GGMLQuantizationType(ttype)
            except ValueError:
                raise ValueError(f"tensor {name!r} has unknown GGML type {ttype}") from None
            infos.append((name, dims, ttype, start))
    except _PastTheEnd as e:  # a count or length pointing past the end
        raise ModelFileError(path, f"truncated or corrupt GGUF header: {e} runs past the end of the file "
                             f"({len(mm)} bytes)") from None
    except ValueError as e:
        raise ModelFileError(path, f"corrupt GGUF header: {e}") from None
    align = metadata.get("general.alignment", 32)
    if not isinstance(align, int) or align <= 0 or align & (align - 1):
        raise ModelFileError(path, f"general.alignment must be a power of two, got {align!r}")
    data_start = -(-header.off // align) * align
    placed = []
    for name, dims, ttype, start in infos:
        shape = tuple(reversed(dims))  # numpy order: GGUF lists the fastest dimension first
        n = int(np.prod(dims))
        if ttype.name in _ELEMENTS:
            dtype = np.dtype(_ELEMENTS[ttype.name])
            nbytes = n * dtype.itemsize
        else:
            block, size = GGML_QUANT_SIZES[ttype]
            if not shape or shape[-1] % block:
                raise ModelFileError(path, f"corrupt tensor {name!r}: its shape {shape} is not whole {ttype.name} "
                                     f"blocks of {block} values a row")
            dtype, nbytes, shape = np.dtype(np.uint8), n // block * size, quant_shape_to_byte_shape(shape, ttype)
        placed.append((data_start + start, nbytes, name, ttype, dtype, shape))
    cut = [p for p in placed if p[0] + p[1] > len(mm)]
    if cut:
        at, nbytes, name, *_ = min(cut, key=lambda p: p[0])
        raise ModelFileError(path, f"truncated: the file ends at byte {len(mm)} of {max(a + b for a, b, *_ in cut)} "
                             f"expected; tensor {name!r} ({nbytes} bytes at byte {at}) runs past the end of the file")
    tensors = [GGUFTensor(name, ttype, mm[at:at + nbytes].view(dtype).reshape(shape))
               for at, nbytes, name, ttype, dtype, shape in placed]
    return GGUFFile(path, metadata, tensors)


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
        raise ModelFileError(gguf.path, "GGUF files with LongRoPE factors (Phi-3 128k) are not supported; "
                             "load the Hugging Face checkpoint instead")
    with blamed_on(gguf.path):  # a key missing, a value of the wrong kind, an unknown architecture
        return config_from_gguf(md)
