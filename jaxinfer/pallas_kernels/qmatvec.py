"""Quantized matrix-vector products for decode on NVIDIA GPUs (Pallas, Triton backend; see gpu.py
for why Triton): ``y [T, out] = x [T, in] @ dequantize(W) [out, in].T`` for a few tokens ``T``.

A decode step at batch 1 reads every weight once and does two flops per weight read, so its speed is
the weight bytes over the memory bandwidth; quantized codes only help if the kernel streams them at
the bandwidth. XLA's fusion of ``sum(x * dequantize(W), -1)`` does not: through it llama3-8b batch 1
ran int4-g128 at 0.83x bf16's speed on an H200. This kernel:

- Grid ``(row blocks, K splits)``: each program owns ``block_rows`` output rows and streams their
  codes over its share of the ``in`` columns in tiles of ``block_chunks`` 16-byte chunks per row,
  each row's tile one contiguous run of bytes (a ``[rows, chunks, 16]`` view of the codes, free). A
  weight with few rows (``w_down``: 4,096 x 14,336) also splits the columns (``split_k``), so the
  grid still has several programs per SM; the splits' float32 partials are summed by XLA after.
- Decode is bound by instructions per weight, not only bytes (the first version, which reduced each
  tile across threads, ran the int4-g128 lm_head at 1.5 TB/s and int8 at 3.2 TB/s on an H200, both
  well under the 4.4 TB/s the same run read at; 132 SMs x 4 schedulers x 1 warp instruction per
  cycle at 1.98 GHz is ~33 T thread instructions a second: at 4.4 TB/s, ~7.6 per int8 weight and
  ~3.8 per int4 weight). So: one thread owns a 16-byte chunk of a row (one vector load; a chunk lies
  in one group) and reduces it in registers; the only cross-thread reduction is once, after the loop.
- ``x`` never moves between threads. It is prepared outside the kernel (a few KB): reordered to the
  codes' places in a 32-bit word (one ``[in / 16, 4]`` slab per place), scaled by the power of two
  the decode leaves each code at, zero-padded to whole tiles; each place's slab is loaded as
  ``[1, chunks, 4]``, which Triton lays out like the codes' ``[rows, chunks, 4]`` words, broadcast
  over rows in registers. (The version before loaded ``x`` as ``[chunks, 16]`` and broadcast it over
  rows: Triton converted layouts through shared memory, 4 ``BAR.SYNC`` per iteration for int8 and 8
  for int4, on top of 5.5 / 7.4 instructions per weight.)
- Codes become float32 without an int-to-float conversion (a quarter-rate instruction): a code ``q``
  masked in place in its word (codes in the low 20 bits; the rest from the word shifted right by 12,
  one shift per word) and ORed into the mantissa of 2^23 is the float ``2^23 + q * 2^offset``; one
  exact subtraction of ``2^23 + zero * 2^offset`` gives ``(q - zero) * 2^offset``, and ``x`` carries
  the ``2^-offset``. Mask, OR and int8's sign-bit flip (``q ^ 128``, then 128 more subtracted) are
  one ``LOP3``, so a code costs ``LOP3`` + ``FADD`` + the ``FFMA`` that multiplies it into a chain of
  fused multiply-adds (float32 needs the exact subtraction before the multiply: ``(2^23 + q) * x``
  has lost ``q``'s bits), plus a shift per 4-8 codes.
- 4-bit codes with bfloat16 or float16 ``x`` (the engine's) go two at a time instead (``half``):
  a word's 8 nibbles become 4 float16 pairs ``1024 + q`` (or ``1024 + 16 q``) with 4 ``LOP3`` and a
  shift, lose ``1024 + zero`` in 4 exact ``HADD2``, and multiply ``x``'s float16 pairs in 4 ``HFMA2``;
  the pair's halves are added in float32 per word (4 products chained in float16, each rounding at
  2^-11). ``x`` is scaled per chunk by a power of two that keeps float16 finite (its inverse joins
  the group's scale). Inline PTX, since Pallas' Triton lowering cannot bitcast a word into two
  halves. 3.06 instructions a weight for llama3-8b's ``w_gate_up`` against 4.19 in float32 (offline
  SASS, as below); llama3-8b batch 1 on an H200, int4-g128: matvecs 1.85 -> 1.52 ms a step, 431 ->
  477 tok/s (H100: 1.99 -> 1.83 ms, 1.01x tok/s, where the glue that builds the pairs costs more
  of the gain).
- 4-bit codes are read as packed bytes; GGUF's order (byte ``j`` of each 32 columns holds column
  ``j`` in its low nibble and ``j + 16`` in its high one) is undone on ``x``'s reordering instead.
- Per chunk: ``sum((q - zero) * x)``, times its group's scale, plus the group's offset times
  ``sum(x)`` over the chunk's columns (precomputed with ``x``), added into an elementwise ``[rows,
  chunks]`` accumulator. A per-row scale (int8) multiplies the row's sum once at the end, and its
  products chain straight into an elementwise ``[rows, chunks, 4]`` accumulator (no per-chunk sum).
- Accumulation in float32 throughout; each token's sums stay in registers (``T`` is a static
  loop over one load of the codes, so extra tokens cost flops, not bytes).

What the SASS shows (Triton 3.9, ``ptxas`` for sm_90, 4 warps, default blocks; XLA compiles the same
Triton IR with its own Triton, so close, not exact): the main loop is 3.61 instructions per weight for
int8 (``LOP3``, ``FADD``, ``FFMA`` one per weight, a shift per word, 20 for addresses, loads and the
loop: 231 per 64 weights per thread; the version before 5.50) and 3.83 for int4-g128 (3.0 per weight
plus the per-chunk sum, scale, offset, their fp16 loads and conversions, addresses; before 7.39;
measured with 8 tiles a program, before ``default_blocks`` capped 4-bit programs at 2 tiles, which
have no loop and run 4.19 a weight whole at 78-80 registers), no barrier, 71 and 96 registers
(before 94 and 156), no spills. Exact float32 products cost three
instructions per weight on the CUDA cores (decode, exact subtraction, FMA), so this is near the
floor; int4 stays issue-bound near 4.4 TB/s at best. Tensor cores (``pl.dot`` of codes decoded to
fp16) measured worse in the SASS: Pallas' Triton lowering cannot bitcast a 32-bit word into two
halves, so the decode runs per 16-bit element (6.5 instructions per weight, 2 barriers per tile).

Formats (static): ``bits`` 8 (``signed`` int8 codes: int8, Q8_0) or 4 (packed nibbles: int4, Q4_0,
Q4_1), a float16/float32 scale per group of ``group_size`` columns (``group_size == in``: per row),
optional float offsets per group, a constant ``zero``. A last row block moves back to end at the last
row (rows it shares with the block before are not stored; fewer rows than a block are clamped and
masked) and chunks past ``in`` meet ``x``'s zero padding, so any number of rows runs; ``in`` and the
group must be multiples of a chunk's columns (16 for 8 bits, 32 for 4 bits).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxinfer.pallas_kernels._blocks import cdiv, next_pow2, words_of_bytes

_MAGIC = 0x4B000000  # the bits of float32 2^23: ORing an integer below 2^23 into it gives 2^23 + q
_CHUNK = 16  # bytes of a row's codes one thread reduces in registers (one 16-byte load)
_WORDS = _CHUNK // 4  # the chunk as 32-bit words
# Programs to aim for when choosing an 8-bit ``split_k`` by default: a few per SM of an H200 (132 SMs).
_TARGET_PROGRAMS = 512


def _fields(bits: int) -> list[tuple[int, int]]:
    """Where ``decode`` finds code ``p`` of a 32-bit word (bits ``[bits*p, bits*p + bits)``): the word
    shifted right by ``shift``, the code at bit ``offset`` of that. Codes in the low 20 bits stay in
    place (inside 2^23's mantissa); the rest come from the word shifted right by 12, one shift shared
    by its upper codes, which land at bits 4-19: never at bit 0, where ptxas turns shift-and-mask into
    a byte or bit-field extract and then needs a second instruction for the magic (measured in the SASS:
    a shift by 16 cost int8 6 integer instructions per word, this 5)."""
    out = []
    for p in range(32 // bits):
        lo = bits * p
        shift = 0 if lo + bits <= 20 else 12
        out.append((shift, lo - shift))
    return out


def _kernel(magic_ref, *refs, tokens, has_offsets, per_row, bits, zero, signed, chunks, chunks_per_group, tiles,
            block_rows, block_chunks, prefetch, half, emulate):
    x_ref, *refs = refs
    if has_offsets:
        xsum_ref, *refs = refs
    codes_ref, scales_ref, *refs = refs
    if has_offsets:
        off_ref, *refs = refs
    (o_ref,) = refs
    num_rows = codes_ref.shape[0]
    i, s = pl.program_id(0), pl.program_id(1)
    iota = jax.lax.broadcasted_iota(jnp.int32, (block_rows,), 0)
    if num_rows >= block_rows:
        # the last block moves back to end at the last row (rows it shares with the block before are
        # not stored twice): row indices stay affine, so the loads' addresses are one base plus
        # immediate offsets (clamped indices cost address arithmetic per load)
        r0 = jnp.minimum(i * block_rows, num_rows - block_rows)
        r, row_ok = r0 + iota, r0 + iota >= i * block_rows
        rows = r[:, None, None]
    else:
        r = i * block_rows + iota
        row_ok = r < num_rows
        # rows past the end re-read the last one; their store is masked
        rows = jnp.minimum(r, num_rows - 1)[:, None, None]
    word = jax.lax.broadcasted_iota(jnp.int32, (1, 1, _WORDS), 2)
    col = jax.lax.broadcasted_iota(jnp.int32, (1, 1, _CHUNK), 2)
    shape = (block_rows, block_chunks, _WORDS)

    def chunk_index(t):
        """Tile ``t``'s chunk indices ``[1, BC, 1]``: as they are (x, zero-padded past ``chunks``)
        and clamped (the codes: chunks past the end re-read the last one, and meet x's zeros)."""
        k = (s * tiles + t) * block_chunks + jax.lax.broadcasted_iota(jnp.int32, (1, block_chunks, 1), 1)
        return k, jnp.minimum(k, chunks - 1)

    def load(t):
        """Tile ``t``'s code words ``[R, BC, 4]`` and its chunks' scales and offsets ``[R, BC, 1]``,
        as stored. The codes are read as bytes, one 16-byte load per chunk, and assembled into
        little-endian 32-bit words, which LLVM folds back into the loaded registers (the SASS has no
        instruction for it). Not ``bitcast_convert_type`` outside: XLA (on CPU at least) expands a bitcast
        that changes the element size into a copy of the whole weight, every call."""
        _, kc = chunk_index(t)
        b = plgpu.load(codes_ref.at[rows, kc, col])
        if b.dtype != jnp.uint8:
            b = jax.lax.bitcast_convert_type(b, jnp.uint8)
        c = words_of_bytes(b.reshape(block_rows, block_chunks, _WORDS, 4))
        if per_row:
            return (c,)
        g = kc // chunks_per_group  # a chunk lies in one group
        return (c, *(plgpu.load(ref.at[rows, g]) for ref in ((scales_ref, off_ref) if has_offsets else (scales_ref,))))

    fields = _fields(bits)
    offsets = sorted({off for _, off in fields})
    sign = 1 << (bits - 1) if signed else 0
    # the constants ORed into the codes, read from memory: as literals ptxas re-materializes the
    # second constant of each AND-OR with a move per code (measured in the SASS: +1 per weight)
    magic = [magic_ref[j] for j in range(magic_ref.shape[0])]

    def decode(c):
        """The word's codes as exact floats ``(q - zero) * 2^offset``: masked in place and ORed
        (XORed: int8 codes' sign bit is flipped, making them unsigned) into 2^23's mantissa, then one
        exact subtraction; x is prescaled by ``2^-offset`` to match."""
        shifted = {sh: c >> sh if sh else c for sh in {sh for sh, _ in fields}}
        out = []
        for sh, off in fields:
            f = (shifted[sh] & (((1 << bits) - 1) << off)) ^ magic[offsets.index(off) if signed else 0]
            out.append(jax.lax.bitcast_convert_type(f, jnp.float32) - float(2 ** 23 + (sign + zero) * 2 ** off))
        return out

    def dot_half(c, xs):
        """``sum((q - zero) * x)`` over a word's 8 nibbles in float16 pairs, one float32 per word:
        ``(c & 0x000F000F) | 0x64006400`` is the pair ``1024 + q`` of bits 0-3 and 16-19,
        ``0x00F000F0`` gives ``1024 + 16 q`` of bits 4-7 and 20-23, the word shifted by 8 the other
        four; an exact f16x2 subtraction of ``magic`` (``1024 + zero``, ``1024 + 16 zero``) each,
        then one multiply and three f16x2 FMAs with ``xs`` (``x``'s float16 pairs) and the pair's two
        halves added in float32. Inline PTX (Pallas' Triton lowering cannot bitcast a word into two
        halves; it takes one result per asm). ``emulate``: the same arithmetic in jnp, for interpret
        mode, which cannot run PTX."""
        if emulate:
            h = None
            for j, src in enumerate((c, c, c >> 8, c >> 8)):
                mask = (0x000F000F, 0x00F000F0)[j % 2]
                f16 = [jax.lax.bitcast_convert_type(v, jnp.float16) for v in ((src & mask) | 0x64006400, magic[j % 2])]
                wp = f16[0] - f16[1]
                h = wp * xs[j] if h is None else h + wp * xs[j]
            return jnp.sum(h.astype(jnp.float32), axis=-1)
        asm = """{ .reg .b32 s, a, b, c, d, h; .reg .f16 lo, hi; .reg .f32 fl, fh;
            shr.u32 s, $1, 8;
            lop3.b32 a, $1, 0x000F000F, 0x64006400, 0xEA;
            lop3.b32 b, $1, 0x00F000F0, 0x64006400, 0xEA;
            lop3.b32 c, s, 0x000F000F, 0x64006400, 0xEA;
            lop3.b32 d, s, 0x00F000F0, 0x64006400, 0xEA;
            sub.f16x2 a, a, $2; sub.f16x2 b, b, $3; sub.f16x2 c, c, $2; sub.f16x2 d, d, $3;
            mul.rn.f16x2 h, a, $4;
            fma.rn.f16x2 h, b, $5, h;
            fma.rn.f16x2 h, c, $6, h;
            fma.rn.f16x2 h, d, $7, h;
            mov.b32 {lo, hi}, h;
            cvt.f32.f16 fl, lo; cvt.f32.f16 fh, hi;
            add.f32 $0, fl, fh; }"""
        args = [c, *(jnp.broadcast_to(v, c.shape) for v in (*magic, *xs))]
        (y,) = plgpu.elementwise_inline_asm(asm, args=args, constraints="=f,r,r,r,r,r,r,r", pack=1,
                                            result_shape_dtypes=[jax.ShapeDtypeStruct(c.shape, jnp.float32)])
        return y

    def compute(t, acc, tile):
        k, _ = chunk_index(t)
        w = None if half else decode(tile[0])
        sc, off = [a.astype(jnp.float32) for a in tile[1:]] + [None] * (3 - len(tile))
        new = []
        for tok in range(tokens):
            # a chunk's pairs carry x times a power of two; its inverse (pair slot 4) joins the group's scale
            sc_tok = sc
            if half:
                sc_tok = sc * jax.lax.bitcast_convert_type(plgpu.load(x_ref.at[tok, 4, k, 0]), jnp.float32)
            # x is read as [1, BC, 4], the codes' layout broadcast over rows: no shuffle between threads
            if half:
                xs = [plgpu.load(x_ref.at[tok, j, k, word]) for j in range(4)]
                if emulate:
                    xs = [jax.lax.bitcast_convert_type(xp, jnp.float16) for xp in xs]
                part = dot_half(tile[0], xs)
            else:
                part = acc[tok] if per_row else None
                for p, wp in enumerate(w):
                    xp = plgpu.load(x_ref.at[tok, p, k, word])
                    part = wp * xp if part is None else part + wp * xp  # a chain of fused multiply-adds
            if not per_row:
                part = acc[tok] + jnp.sum(part, axis=2, keepdims=True) * sc_tok
                if has_offsets:
                    part = part + off * plgpu.load(xsum_ref.at[tok, k])
            new.append(part)  # elementwise: one cross-thread reduction, after the loop
        return tuple(new)

    def step(t, carry):
        acc, *tiles_ahead = carry
        nxt = load(t + depth)
        return compute(t, acc, tiles_ahead[0]), *tiles_ahead[1:], nxt

    def steps(j, carry):
        # ``depth`` steps per iteration: each prefetch lands in the registers of the tile it replaces,
        # so the loop carries no register copies (with one step, ``depth`` 2 cost a move per register)
        for k in range(depth):
            carry = step(j * depth + k, carry)
        return carry

    # ``depth`` tiles in flight: ptxas issues a prefetch only once the registers of the tile it
    # replaces are free, i.e. at the end of the iteration before its use (measured in the SASS); loads
    # ``depth`` tiles ahead still have ``depth - 1`` iterations of math to land behind. The last
    # ``depth`` tiles run after the loop: no prefetch past the end, so no loads to mask (a masked
    # load zero-fills its registers, an instruction per two).
    depth = min(prefetch, tiles)
    init = tuple(jnp.zeros(shape if per_row else shape[:2] + (1,), jnp.float32) for _ in range(tokens))
    carry = jax.lax.fori_loop(0, (tiles - depth) // depth, steps, (init, *(load(t) for t in range(depth))))
    for t in range((tiles - depth) // depth * depth, tiles - depth):
        carry = step(t, carry)
    acc, *ahead = carry
    for j, tile in enumerate(ahead):
        acc = compute(tiles - len(ahead) + j, acc, tile)
    acc = [jnp.sum(a, axis=(1, 2)) for a in acc]
    rows = rows[:, 0, 0]
    if per_row:
        row_scale = scales_ref[rows, 0].astype(jnp.float32)
        acc = [a * row_scale for a in acc]
    idx = jnp.where(row_ok, r, num_rows + jax.lax.broadcasted_iota(jnp.int32, (block_rows,), 0))
    for tok in range(tokens):
        # masked lanes get indices past the end: interpret mode emulates a masked scatter by
        # read-modify-write, so they must not alias a real row (as gpu._row_index)
        plgpu.store(o_ref.at[s, tok, idx], acc[tok], mask=row_ok)


def default_blocks(out: int, n_in: int, bits: int) -> dict:
    """Block sizes for a weight ``[out, n_in]``: ``block_rows`` 32 (16 under 4,096 rows), tiles of
    256 bytes of codes per row, and ``prefetch`` 2. 8-bit codes split K until the grid has
    ~``_TARGET_PROGRAMS`` programs; 4-bit codes split it until a program has at most 2 tiles, both
    loaded before the first is decoded (78-80 registers a thread: 6 programs an SM, against 5 at 96).
    In llama3-8b's batch-1 step on an H200, 4-bit at most 2 tiles, against the ~512-program grid with
    prefetch 1 beyond 4 tiles, took the matvecs from 1.96 to 1.84 ms; the same grid for 8-bit codes
    ran at 0.96x the tok/s."""
    chunks = n_in * bits // 8 // _CHUNK
    block_rows = 32 if out >= 4096 else 16
    block_chunks = min(next_pow2(chunks), 16)
    n_tiles = cdiv(chunks, block_chunks)
    if bits == 4:
        split_k = cdiv(n_tiles, 2)
    else:
        split_k = max(1, min(n_tiles, _TARGET_PROGRAMS // cdiv(out, block_rows)))
    return dict(block_rows=block_rows, block_chunks=block_chunks, split_k=split_k, prefetch=2)


def quantized_matvec(x: jax.Array, values: jax.Array, scales: jax.Array, offsets: jax.Array | None = None, *,
                     bits: int, group_size: int, zero: int = 0, signed: bool = False,
                     block_rows: int | None = None, block_chunks: int | None = None, split_k: int | None = None,
                     prefetch: int | None = None, num_warps: int = 4, num_stages: int = 3,
                     interpret: bool = False, half: bool | None = None) -> jax.Array:
    """``x [T, in] @ W.T`` as float32 ``[T, out]``, ``W`` decoded per group as ``(q - zero) * scale
    (+ offset)``: ``values`` int8 ``[out, in]`` (``bits=8``; ``signed``: int8 codes, else uint8) or
    packed nibbles uint8 ``[out, in / 2]`` (``bits=4``, GGUF order), ``scales`` (and ``offsets``)
    ``[out, in / group_size]``. Block sizes default to ``default_blocks``; ``prefetch``: tiles loaded
    ahead of the one being decoded (2 holds a second tile's registers: int8 71 -> 127 per thread, int4
    96 -> 254, where ptxas starts re-materializing constants). ``half``: 4-bit codes multiplied in
    float16 pairs (default for bfloat16 and float16 ``x``: a float16 product rounds at 2^-11, under
    the 2^-9 a bfloat16 ``x`` already carries; float32 ``x`` keeps float32 products)."""
    if bits not in (4, 8):
        raise ValueError(f"quantized_matvec: bits must be 4 or 8, got {bits}")
    if x.ndim != 2 or values.ndim != 2:
        raise ValueError(f"quantized_matvec takes x [T, in] and 2-D codes, got {x.shape} and {values.shape}")
    tokens, n_in = x.shape
    out = values.shape[0]
    cols = _CHUNK * 8 // bits  # columns per 16-byte chunk: 16 (8-bit), 32 (4-bit)
    if values.shape[1] * 8 // bits != n_in or n_in % group_size or n_in % cols or (
            group_size != n_in and group_size % cols):
        raise ValueError(f"quantized_matvec: codes {values.shape} ({bits}-bit) and group_size {group_size} do not "
                         f"fit x's {n_in} columns (in and groups must be multiples of {cols} columns)")
    per_row = group_size == n_in and offsets is None and bits == 8
    blocks = default_blocks(out, n_in, bits)
    block_rows = block_rows or blocks["block_rows"]
    block_chunks = block_chunks or blocks["block_chunks"]
    chunks = n_in // cols
    split_k = min(split_k or blocks["split_k"], cdiv(chunks, block_chunks))
    tiles = cdiv(cdiv(chunks, block_chunks), split_k)
    prefetch = prefetch or blocks["prefetch"]

    if half is None:
        half = x.dtype in (jnp.bfloat16, jnp.float16)
    half = half and bits == 4
    xf = x.astype(jnp.float32)
    # x in the decoded codes' order, [T, field p, chunk, word]: column 4 * word + p of 8-bit codes;
    # GGUF nibbles: byte p // 2 of the word, its low (column 4 * word + p // 2) or high (+ 16) nibble.
    # Scaled by 2^-offset to undo where the decode leaves each code, and zero-padded to whole tiles
    if bits == 4:  # [T, chunk, high, word, byte] -> [T, (byte, high), chunk, word]
        xw = xf.reshape(tokens, chunks, 2, _WORDS, 4).transpose(0, 4, 2, 1, 3)
    else:  # [T, chunk, word, byte] -> [T, byte, chunk, word]
        xw = xf.reshape(tokens, chunks, _WORDS, 4).transpose(0, 3, 1, 2)
    fields = _fields(bits)
    xw = xw.reshape(tokens, len(fields), chunks, _WORDS)
    pad = split_k * tiles * block_chunks - chunks
    if half:
        # each chunk's x times the power of two that brings its largest entry to [256, 512): four
        # products of codes up to 15 stay below float16's 65,504, and its smallest entries far above
        # float16's underflow. One elementwise kernel builds the pairs and, in a fifth slot, the
        # inverse: the largest entry is a chain of maximums, not a reduce, and the inverse is not an
        # array of its own (each was a launch of its own, and the glue ate the kernel's gain: with a
        # per-token scale int4 llama3-8b batch 1 ran at 0.93x the float32 decode's tok/s on an H100)
        a = jnp.abs(xw)
        amax = functools.reduce(jnp.maximum, [a[:, p, :, j] for p in range(len(fields)) for j in range(_WORDS)])
        e = jnp.clip(jax.lax.shift_right_logical(jax.lax.bitcast_convert_type(amax, jnp.int32), 23), 9, 254)
        pow2 = jax.lax.bitcast_convert_type((262 - e) << 23, jnp.float32)  # 2^(8 - exponent of amax)
        xinv = jax.lax.bitcast_convert_type((e - 8) << 23, jnp.float32)  # its inverse, exact
        # fields p and p + 4 (bits 4p and 4p + 16) share a float16 pair, [T, pair, chunk, word], the
        # first in the low half; a byte's high nibble decodes as 16 q, so its x carries 1/16
        place = jnp.asarray([1.0, 1 / 16, 1.0, 1 / 16], jnp.float32)[:, None, None]
        halves = [jax.lax.bitcast_convert_type((h * pow2[:, None, :, None] * place).astype(jnp.float16),
                                               jnp.uint16).astype(jnp.uint32) for h in (xw[:, :4], xw[:, 4:])]
        inv_slot = jnp.broadcast_to(jax.lax.bitcast_convert_type(xinv, jnp.uint32)[:, None, :, None],
                                    (tokens, 1, chunks, _WORDS))
        xw = jnp.concatenate([halves[0] | (halves[1] << 16), inv_slot], axis=1)
        magic = [(m << 16) | m for m in (0x6400 + zero, 0x6400 + 16 * zero)]  # float16 1024 + zero (x 16)
    else:
        xw = xw * jnp.asarray([2.0 ** -off for _, off in fields], jnp.float32)[:, None, None]
        sign = 1 << (bits - 1) if signed else 0
        magic = [_MAGIC | (sign << off) for off in (sorted({off for _, off in fields}) if signed else (0,))]
    operands = [jnp.asarray(magic, jnp.uint32), jnp.pad(xw, ((0, 0), (0, 0), (0, pad), (0, 0)))]
    if offsets is not None:
        operands.append(jnp.pad(jnp.sum(xf.reshape(tokens, chunks, cols), axis=-1), ((0, 0), (0, pad))))
    operands += [values.reshape(out, chunks, _CHUNK), scales]
    if offsets is not None:
        operands.append(offsets)
    kernel = functools.partial(_kernel, tokens=tokens, has_offsets=offsets is not None, per_row=per_row, bits=bits,
                               zero=zero, signed=signed, chunks=chunks, chunks_per_group=group_size // cols,
                               tiles=tiles, block_rows=block_rows, block_chunks=block_chunks, prefetch=prefetch,
                               half=half, emulate=half and interpret)
    y = pl.pallas_call(
        kernel, grid=(cdiv(out, block_rows), split_k),
        out_shape=jax.ShapeDtypeStruct((split_k, tokens, out), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret, name=f"qmatvec_{bits}bit_gpu",
    )(*operands)
    return y[0] if split_k == 1 else jnp.sum(y, axis=0)
