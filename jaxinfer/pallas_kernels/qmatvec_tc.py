"""Quantized matrix-vector products on the tensor cores (Pallas, Triton backend): ``y [T, out] = x [T,
in] @ dequantize(W).T`` for a few tokens of bfloat16/float16 activations, int8 codes with a scale per
row or 4-bit codes with a scale (and offset) per group of at least 64 columns (int4-g64/g128).

Why: ``qmatvec`` (CUDA cores) spends ~3 instructions per weight on exact float32 products (decode,
exact subtraction, FMA) and ~0.8 more on each chunk's scale, offset and addresses; at 4 bits that
is 3.8 instructions per weight, and on the H200 its 4-bit loops read at 1.6-2.5 TB/s of 4.4
(docs/benchmarks.md). Here the codes are decoded to float16 pairs (two codes per instruction) and
multiplied on the tensor cores; the SASS of the main loop (Triton 3.9, sm_90, 128 rows x 2 groups of
128 per tile, 4 warps) is 2.5 instructions per weight, a quarter of them the decode, and the codes
reach shared memory by ``cp.async`` a few tiles ahead (``num_stages``), not through registers.

Exactness: a 4-bit code minus its zero, or an int8 code, is a small integer, exact in float16; bf16
activations are exact in float16 once scaled per token by a power of two that puts their largest
magnitude in [2^14, 2^15) (values below ~2^-29 of it lose bits: they are below float32 rounding of
the sum); the tensor cores' products are exact and accumulate in float32; each group's sum times its
scale, plus its offset times the group's sum of activations, accumulates in float32 as in
``qmatvec``. float32 activations would round to float16: they stay on ``qmatvec``.

The decode (``_decode``): codes are read as uint16 words (a free view of the packed bytes: four
nibbles or two int8 codes each). Field ``j`` of a word (nibble ``j``, or byte ``j`` for int8) becomes a
float16 by masking it in place and ORing in 1024's exponent (``LOP3``: 1024 + q, or 1024 + 16 q for a
nibble in the upper half of a byte), then one float16x2 subtraction (or multiply-add by 1/16) leaves
``q - zero`` (int8: the sign bit flipped by the same ``LOP3``, 128 more subtracted). Inline PTX, two
words per instruction (``pack=2``: the float16 pairs the tensor cores take). Each field is its own
``[rows, words]`` operand against ``x`` reordered to that field's columns, so no code moves between
threads; GGUF's nibble order (byte ``j`` of each 32 columns: column ``j`` low, ``j + 16`` high) is undone on
``x``. In Pallas interpret mode (tests on CPU) the same decode runs as jnp ops.

Grid ``(row blocks, K splits)``; each program accumulates ``block_rows`` rows over its split's
groups in tiles of ``groups_per_tile`` groups (int8: ``tile_words`` words, one scale per row at the
end); a last row block moves back to end at the last row, as in ``qmatvec``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxinfer.pallas_kernels._blocks import cdiv

_N = 8  # token columns of the dot (the tensor cores' narrowest): up to 8 tokens
_TARGET_PROGRAMS = 512  # as qmatvec: a few programs per SM of an H200 (132 SMs)


def _f16_bits(v: float) -> int:
    b = int(np.asarray(v, np.float16).view(np.uint16))
    return b | b << 16


def _bf16_bits(v: float) -> int:
    b = int(np.asarray(v, np.float32).view(np.uint32)) >> 16
    return b | b << 16


def _decode_asm(bits: int, j: int, zero: int, bf16: bool = False) -> str:
    """PTX decoding field ``j`` of two uint16 words (one 32-bit register) into two float16 (``bf16``:
    bfloat16, 4-bit codes only) ``q - zero``."""
    if bf16:  # 128 + q needs the nibble at bit 0 (bfloat16 has 7 mantissa bits): a shift per field
        shift = f"shr.u32 t, $1, {4 * j}; " if j else ""
        return (f"{{.reg .b32 t, a, b; mov.b32 a, {_bf16_bits(1.0)}; mov.b32 b, {_bf16_bits(-128 - zero)}; {shift}"
                f"lop3.b32 $0, {'t' if j else '$1'}, 0x000F000F, 0x43004300, 0xEA; fma.rn.bf16x2 $0, $0, a, b;}}")
    t = "$1" if j < (2 if bits == 4 else 1) else "t"
    shift = "shr.u32 t, $1, 8; " if t == "t" else ""
    if bits == 8:  # byte j: (c & 0xFF) ^ 0x80 is q + 128; as 1024 + that, minus 1152
        return (f"{{.reg .b32 t, m; mov.b32 m, {_f16_bits(1024 + 128 + zero)}; {shift}"
                f"lop3.b32 $0, {t}, 0x00FF00FF, 0x64806480, 0x6A; sub.f16x2 $0, $0, m;}}")
    if j % 2 == 0:  # a low nibble: 1024 + q
        return (f"{{.reg .b32 t, m; mov.b32 m, {_f16_bits(1024 + zero)}; {shift}"
                f"lop3.b32 $0, {t}, 0x000F000F, 0x64006400, 0xEA; sub.f16x2 $0, $0, m;}}")
    return (f"{{.reg .b32 t, a, b; mov.b32 a, {_f16_bits(1 / 16)}; mov.b32 b, {_f16_bits(-64 - zero)}; {shift}"
            f"lop3.b32 $0, {t}, 0x00F000F0, 0x64006400, 0xEA; fma.rn.f16x2 $0, $0, a, b;}}")


def _decode(c, bits: int, j: int, zero: int, signed: bool, dtype, interpret: bool):
    """Field ``j`` of uint16 words ``c`` as ``dtype`` ``q - zero`` (int8: the signed code)."""
    if interpret:
        q = ((c >> (bits * j)) & ((1 << bits) - 1)).astype(jnp.int32)
        if signed:
            q = jnp.where(q >= 128, q - 256, q)
        return (q - zero).astype(dtype)
    return plgpu.elementwise_inline_asm(
        _decode_asm(bits, j, zero, dtype == jnp.bfloat16), args=[c], constraints="=r,r", pack=2,
        result_shape_dtypes=[jax.ShapeDtypeStruct(c.shape, dtype)])[0]


def _kernel(x_ref, *refs, bits, fields, zero, signed, has_offsets, per_row, tile_words, groups_per_tile, group_words,
            tiles, block_rows, interpret):
    dtype = x_ref.dtype
    if has_offsets:
        xsum_ref, codes_ref, scales_ref, off_ref, o_ref = refs
    else:
        codes_ref, scales_ref, o_ref = refs
    num_rows = codes_ref.shape[0]
    i, s = pl.program_id(0), pl.program_id(1)
    iota = jax.lax.broadcasted_iota(jnp.int32, (block_rows, 1), 0)
    if num_rows >= block_rows:  # the last block moves back to end at the last row (as qmatvec)
        r0 = jnp.minimum(i * block_rows, num_rows - block_rows)
        r, row_ok = r0 + iota, r0 + iota >= i * block_rows
        rows = r
    else:
        r = i * block_rows + iota
        row_ok = r < num_rows
        rows = jnp.minimum(r, num_rows - 1)
    ncol = jax.lax.broadcasted_iota(jnp.int32, (1, _N), 1)

    def group_sum(w0, words):
        kw = w0 + jax.lax.broadcasted_iota(jnp.int32, (1, words), 1)
        kx = w0 + jax.lax.broadcasted_iota(jnp.int32, (words, 1), 0)
        c = plgpu.load(codes_ref.at[rows, kw])
        part = None
        for j in range(fields):
            d = plgpu.dot(_decode(c, bits, j, zero, signed, dtype, interpret), plgpu.load(x_ref.at[j, kx, ncol]))
            part = d if part is None else part + d
        return part

    def step(t, acc):
        tile = s * tiles + t
        if per_row:
            return acc + group_sum(tile * tile_words, tile_words)
        for gi in range(groups_per_tile):
            g = tile * groups_per_tile + gi
            acc = acc + group_sum(g * group_words, group_words) * plgpu.load(scales_ref.at[rows, g]).astype(jnp.float32)
            if has_offsets:
                acc = acc + plgpu.load(off_ref.at[rows, g]).astype(jnp.float32) * plgpu.load(xsum_ref.at[g, ncol])
        return acc

    acc = jax.lax.fori_loop(0, tiles, step, jnp.zeros((block_rows, _N), jnp.float32))
    if per_row:
        acc = acc * plgpu.load(scales_ref.at[rows, 0]).astype(jnp.float32)
    # masked lanes get row indices past the end (interpret mode emulates a masked store by
    # read-modify-write: they must not alias a real row, as in qmatvec)
    idx = jnp.where(row_ok, r, num_rows + iota)
    plgpu.store(o_ref.at[s, idx, ncol], acc, mask=jnp.broadcast_to(row_ok, acc.shape))


def supported(x_dtype, bits: int, group_size: int, n_in: int, tokens: int, offsets: bool, signed: bool) -> bool:
    """Whether ``quantized_matvec_tc`` takes this case exactly (see the module docstring)."""
    if jnp.dtype(x_dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) or tokens > _N:
        return False
    if bits == 8:
        return signed and group_size == n_in and not offsets and n_in % 256 == 0
    return bits == 4 and group_size >= 64 and group_size % 64 == 0 and n_in % group_size == 0


def default_blocks(out: int, n_in: int, bits: int, group_size: int) -> dict:
    """``block_rows`` 128 (64 under 4,096 rows), tiles of 2 groups of 128 columns' codes (256
    columns; int8: 64 words, 128 columns), and K splits (a power of two dividing the tiles) until
    the grid has ~``_TARGET_PROGRAMS`` programs."""
    block_rows = 128 if out >= 4096 else 64
    fields = 16 // bits
    if bits == 8:
        tile_words, groups_per_tile = 64, 1
        n_tiles = cdiv(n_in // fields, tile_words)
    else:
        group_words = group_size // fields
        groups_per_tile = max(1, 64 // group_words)
        while (n_in // group_size) % groups_per_tile:
            groups_per_tile //= 2
        tile_words = groups_per_tile * group_words
        n_tiles = n_in // group_size // groups_per_tile
    split_k = 1
    while (split_k * 2 * cdiv(out, block_rows) <= _TARGET_PROGRAMS and n_tiles % (split_k * 2) == 0):
        split_k *= 2
    return dict(block_rows=block_rows, tile_words=tile_words, groups_per_tile=groups_per_tile, split_k=split_k)


def _x_fields(xh: jax.Array, bits: int) -> jax.Array:
    """``x [T, in]`` as ``[fields, in / fields, T]``: field ``j`` of code word ``k`` is column
    ``2k + j`` (int8), or (4-bit, GGUF order) byte ``2k + j // 2``'s low (``j`` even) or high nibble:
    ``32 a + 2 b + j // 2 + 16 (j % 2)`` for ``k = 8 a + b``."""
    t, n = xh.shape
    if bits == 8:
        return xh.reshape(t, n // 2, 2).transpose(2, 1, 0)
    # [T, a, high, b, byte] -> [byte, high, a, b, T]: field j = 2 * byte + high
    return xh.reshape(t, n // 32, 2, 8, 2).transpose(4, 2, 1, 3, 0).reshape(4, n // 4, t)


def quantized_matvec_tc(x: jax.Array, values: jax.Array, scales: jax.Array, offsets: jax.Array | None = None, *,
                        bits: int, group_size: int, zero: int = 0, signed: bool = False,
                        block_rows: int | None = None, tile_words: int | None = None,
                        groups_per_tile: int | None = None, split_k: int | None = None, num_warps: int = 4,
                        num_stages: int = 3, bf16: bool = False, interpret: bool = False) -> jax.Array:
    """``x [T, in] @ W.T`` as float32 ``[T, out]`` (arguments as ``qmatvec.quantized_matvec``; the case
    must be ``supported``). Block sizes default to ``default_blocks``."""
    tokens, n_in = x.shape
    out = values.shape[0]
    if not supported(x.dtype, bits, group_size, n_in, tokens, offsets is not None, signed):
        raise ValueError(f"quantized_matvec_tc: {bits}-bit codes, group {group_size}, {tokens} tokens of "
                         f"{x.dtype} x [{n_in}] are not taken here (see supported())")
    fields = 16 // bits
    blocks = default_blocks(out, n_in, bits, group_size)
    block_rows = block_rows or blocks["block_rows"]
    groups_per_tile = groups_per_tile or blocks["groups_per_tile"]
    group_words = group_size // fields
    tile_words = tile_words or (blocks["tile_words"] if bits == 8 else groups_per_tile * group_words)
    split_k = split_k or blocks["split_k"]
    n_tiles = n_in // fields // tile_words
    if n_tiles * tile_words * fields != n_in or n_tiles % split_k:
        raise ValueError(f"quantized_matvec_tc: {n_in} columns do not split into {split_k} x tiles of {tile_words} "
                         f"words")
    tiles = n_tiles // split_k
    # x scaled per token by a power of two putting its largest magnitude in [2^14, 2^15): exact in float16
    if bf16 and bits == 4 and x.dtype == jnp.bfloat16:
        xh, p = x, 1.0
    else:
        xf = x.astype(jnp.float32)
        _, e = jnp.frexp(jnp.max(jnp.abs(xf), axis=1, keepdims=True))
        p = jnp.exp2(15.0 - jnp.where(jnp.max(jnp.abs(xf), axis=1, keepdims=True) > 0, e, 0).astype(jnp.float32))
        xh = (xf * p).astype(jnp.float16)
    xw = jnp.pad(_x_fields(xh, bits), ((0, 0), (0, 0), (0, _N - tokens)))
    codes = jax.lax.bitcast_convert_type(values.reshape(out, n_in // fields, 2), jnp.uint16)
    operands = [xw]
    if offsets is not None:
        xsum = jnp.sum(xh.astype(jnp.float32).reshape(tokens, n_in // group_size, group_size), axis=-1)
        operands.append(jnp.pad(xsum.T, ((0, 0), (0, _N - tokens))))
    operands += [codes, scales]
    if offsets is not None:
        operands.append(offsets)
    kernel = functools.partial(
        _kernel, bits=bits, fields=fields, zero=zero, signed=signed, has_offsets=offsets is not None,
        per_row=bits == 8, tile_words=tile_words, groups_per_tile=groups_per_tile, group_words=group_words,
        tiles=tiles, block_rows=block_rows, interpret=interpret)
    y = pl.pallas_call(
        kernel, grid=(cdiv(out, block_rows), split_k),
        out_shape=jax.ShapeDtypeStruct((split_k, out, _N), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret, name=f"qmatvec_{bits}bit_tc",
    )(*operands)
    y = y[0] if split_k == 1 else jnp.sum(y, axis=0)
    return y[:, :tokens].T / p
