"""Quantized matrix-vector products for decode on NVIDIA GPUs (Pallas, Triton backend; see gpu.py
for why Triton): ``y [T, out] = x [T, in] @ dequantize(W) [out, in].T`` for a few tokens ``T``.

A decode step at batch 1 reads every weight once and does two flops per weight read, so its speed is
the weight bytes over the memory bandwidth; quantized codes only help if the kernel streams them at
the bandwidth. XLA's fusion of ``sum(x * dequantize(W), -1)`` does not (H200, llama3-8b batch 1:
int8 1.16x bf16, int4-g128 0.83x, issue 25). This kernel:

- Grid ``(row blocks, K splits)``: each program owns ``block_rows`` output rows and streams their
  codes over its share of the ``in`` columns in tiles of ``block_chunks`` 16-byte chunks per row,
  each row's tile one contiguous run of bytes (a ``[rows, chunks, 16]`` view of the codes, free). A
  weight with few rows (``w_down``: 4,096 x 14,336) also splits the columns (``split_k``), so the
  grid still has several programs per SM; the splits' float32 partials are summed by XLA after.
- Decode is bound by instructions per byte, not only bytes (the first version, which reduced each
  tile across threads, ran the int4-g128 lm_head at 1.5 TB/s and int8 at 3.2 TB/s on an H200, both
  well under the 4.4 TB/s the same run read at). So: one thread owns a 16-byte chunk of a row (one
  vector load; a chunk lies in one group), sums its codes times ``x`` in registers, scales the sum
  by its group's scale and adds it into an elementwise ``[rows, chunks]`` accumulator; the only
  cross-thread reduction is once, after the loop.
- Codes become float32 without an int-to-float conversion (a quarter-rate instruction): a byte or
  nibble ``q`` ORed into the mantissa of 2^23 is the float ``2^23 + q``, and one subtraction of
  ``2^23 + zero`` gives ``q - zero`` exactly (``zero``: 128 for int8 codes, whose sign bit is
  flipped first; the format's constant zero, Q4_0's 8).
- 4-bit codes are read as packed bytes; GGUF's order (byte ``j`` of each 32 columns holds column
  ``j`` in its low nibble and ``j + 16`` in its high one) is undone on the activations instead: ``x``
  is split, outside the kernel (a few KB), into the columns the low and the high nibbles meet.
- Per chunk: ``sum(codes * x)``, times its group's scale, plus the group's offset times ``sum(x)``
  over the chunk's columns (precomputed with the split of ``x``), so the inner loop is codes times
  ``x`` only. A per-row scale (int8) multiplies the row's sum once at the end.
- Accumulation in float32 throughout; each token's sums stay in registers (``T`` is a static
  loop over one load of the codes, so extra tokens cost flops, not bytes).

Formats (static): ``bits`` 8 (``signed`` int8 codes: int8, Q8_0) or 4 (packed nibbles: int4, Q4_0,
Q4_1), a float16/float32 scale per group of ``group_size`` columns (``group_size == in``: per row),
optional float offsets per group, a constant ``zero``. Rows past ``out`` and chunks past ``in`` are
masked, so any number of rows runs; ``in`` and the group must be multiples of a chunk's columns
(16 for 8 bits, 32 for 4 bits).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxinfer.pallas_kernels._blocks import cdiv, next_pow2

_MAGIC = 0x4B000000  # the bits of float32 2^23: ORing an integer below 2^23 into it gives 2^23 + q
_CHUNK = 16  # bytes of a row's codes one thread reduces in registers (one 16-byte load)
# Programs to aim for when choosing ``split_k`` by default: a few per SM of an H200 (132 SMs).
_TARGET_PROGRAMS = 512


def _kernel(*refs, tokens, has_offsets, per_row, bits, zero, signed, chunks, chunks_per_group, tiles,
            block_rows, block_chunks):
    if bits == 4:
        xlo_ref, xhi_ref, *refs = refs
        x_refs = (xlo_ref, xhi_ref)
    else:
        x_ref, *refs = refs
        x_refs = (x_ref,)
    if has_offsets:
        xsum_ref, *refs = refs
    codes_ref, scales_ref, *refs = refs
    if has_offsets:
        off_ref, *refs = refs
    (o_ref,) = refs
    num_rows = codes_ref.shape[0]
    i, s = pl.program_id(0), pl.program_id(1)
    r = i * block_rows + jax.lax.broadcasted_iota(jnp.int32, (block_rows,), 0)
    rows = jnp.minimum(r, num_rows - 1)  # rows past the end re-read the last one; their store is masked
    col = jax.lax.broadcasted_iota(jnp.int32, (1, _CHUNK), 1)

    def chunk_index(t):
        k = (s * tiles + t) * block_chunks + jax.lax.broadcasted_iota(jnp.int32, (block_chunks,), 0)
        return k < chunks, jnp.minimum(k, chunks - 1)

    def load(t):
        """Tile ``t``'s codes ``[R, BC, 16]`` and its chunks' scales and offsets ``[R, BC]``, as
        stored; nothing is read for ``t == tiles`` (the prefetch past the last tile)."""
        _, kc = chunk_index(t)
        live = t < tiles
        c = plgpu.load(codes_ref.at[rows[:, None, None], kc[None, :, None], col[None]],
                       mask=jnp.full((block_rows, block_chunks, _CHUNK), live), other=0)
        if per_row:
            return (c,)
        g = kc // chunks_per_group  # a chunk lies in one group
        live2 = jnp.full((block_rows, block_chunks), live)
        return (c, *(plgpu.load(ref.at[rows[:, None], g[None, :]], mask=live2, other=0)
                     for ref in ((scales_ref, off_ref) if has_offsets else (scales_ref,))))

    def step(t, carry):
        acc, tile = carry
        nxt = load(t + 1)  # issued before this tile's math, so its latency hides behind it
        k_ok, kc = chunk_index(t)
        c = tile[0]
        if c.dtype != jnp.uint8:  # int8 codes: the same bytes
            c = jax.lax.bitcast_convert_type(c, jnp.uint8)
        c = c.astype(jnp.uint32)
        if bits == 4:
            parts, sub = ((c & 15) | _MAGIC, (c >> 4) | _MAGIC), 8388608.0 + zero
        elif signed:
            parts, sub = (c ^ (128 | _MAGIC),), 8388608.0 + 128 + zero
        else:
            parts, sub = (c | _MAGIC,), 8388608.0 + zero
        w = [jax.lax.bitcast_convert_type(p, jnp.float32) - sub for p in parts]
        sc, off = [a.astype(jnp.float32) for a in tile[1:]] + [None] * (3 - len(tile))
        new = []
        for tok in range(tokens):
            # chunks past the end: x (and its sums) load as 0, so their clamped codes add nothing
            mask = jnp.broadcast_to(k_ok[:, None], (block_chunks, _CHUNK))
            xs = [plgpu.load(xr.at[tok, kc[:, None], col], mask=mask, other=0.0) for xr in x_refs]
            part = sum(jnp.sum(wp * xp[None], axis=2) for wp, xp in zip(w, xs))  # [R, BC], in-thread sums
            if not per_row:
                part = part * sc
                if has_offsets:
                    part = part + off * plgpu.load(xsum_ref.at[tok, kc], mask=k_ok, other=0.0)[None]
            new.append(acc[tok] + part)  # elementwise: one cross-thread reduction, after the loop
        return tuple(new), nxt

    init = tuple(jnp.zeros((block_rows, block_chunks), jnp.float32) for _ in range(tokens))
    acc, _ = jax.lax.fori_loop(0, tiles, step, (init, load(0)))
    acc = [jnp.sum(a, axis=1) for a in acc]
    if per_row:
        row_scale = scales_ref[rows, 0].astype(jnp.float32)
        acc = [a * row_scale for a in acc]
    row_ok = r < num_rows
    idx = jnp.where(row_ok, r, num_rows + jax.lax.broadcasted_iota(jnp.int32, (block_rows,), 0))
    for tok in range(tokens):
        # masked lanes get indices past the end: interpret mode emulates a masked scatter by
        # read-modify-write, so they must not alias a real row (as gpu._row_index)
        plgpu.store(o_ref.at[s, tok, idx], acc[tok], mask=row_ok)


def default_blocks(out: int, n_in: int, bits: int) -> dict:
    """Block sizes for a weight ``[out, n_in]``: ``block_rows`` 32 (16 under 4,096 rows), tiles of
    256 bytes of codes per row, and K splits until the grid has ~``_TARGET_PROGRAMS`` programs."""
    chunks = n_in * bits // 8 // _CHUNK
    block_rows = 32 if out >= 4096 else 16
    block_chunks = min(next_pow2(chunks), 16)
    split_k = max(1, min(cdiv(chunks, block_chunks), _TARGET_PROGRAMS // cdiv(out, block_rows)))
    return dict(block_rows=block_rows, block_chunks=block_chunks, split_k=split_k)


def quantized_matvec(x: jax.Array, values: jax.Array, scales: jax.Array, offsets: jax.Array | None = None, *,
                     bits: int, group_size: int, zero: int = 0, signed: bool = False,
                     block_rows: int | None = None, block_chunks: int | None = None, split_k: int | None = None,
                     num_warps: int = 4, num_stages: int = 3, interpret: bool = False) -> jax.Array:
    """``x [T, in] @ W.T`` as float32 ``[T, out]``, ``W`` decoded per group as ``(q - zero) * scale
    (+ offset)``: ``values`` int8 ``[out, in]`` (``bits=8``; ``signed``: int8 codes, else uint8) or
    packed nibbles uint8 ``[out, in / 2]`` (``bits=4``, GGUF order), ``scales`` (and ``offsets``)
    ``[out, in / group_size]``. Block sizes default to ``default_blocks``."""
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

    xf = x.astype(jnp.float32)
    if bits == 4:  # the columns each byte's low and high nibbles hold, byte for byte
        xr = xf.reshape(tokens, chunks, 2, _CHUNK)
        xs = [xr[:, :, 0], xr[:, :, 1]]
    else:
        xs = [xf.reshape(tokens, chunks, _CHUNK)]
    operands = list(xs)
    if offsets is not None:
        operands.append(jnp.sum(xf.reshape(tokens, chunks, cols), axis=-1))
    operands += [values.reshape(out, chunks, _CHUNK), scales]
    if offsets is not None:
        operands.append(offsets)
    kernel = functools.partial(_kernel, tokens=tokens, has_offsets=offsets is not None, per_row=per_row, bits=bits,
                               zero=zero, signed=signed, chunks=chunks, chunks_per_group=group_size // cols,
                               tiles=tiles, block_rows=block_rows, block_chunks=block_chunks)
    y = pl.pallas_call(
        kernel, grid=(cdiv(out, block_rows), split_k),
        out_shape=jax.ShapeDtypeStruct((split_k, tokens, out), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret, name=f"qmatvec_{bits}bit_gpu",
    )(*operands)
    return y[0] if split_k == 1 else jnp.sum(y, axis=0)
