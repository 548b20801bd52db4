"""Ragged paged attention for NVIDIA GPUs (Pallas, Triton backend), Hopper first.

Backend choice. JAX 0.11 deprecates Pallas' Triton backend in favour of Mosaic GPU. We still use
Triton here, deliberately:
- It works on jax 0.11.2 + CUDA 13 on the H200 (checked), uses the tensor cores for ``jnp.dot``, pipelines loads
  (``num_stages``) by itself; a decode kernel is memory-bound, so what matters is keeping many
  page loads in flight, which Triton's occupancy plus pipelining gives without hand-written
  barriers, while Mosaic GPU wants explicit TMA/mbarrier pipelines, warpgroup-shaped tiles
  (64-row wgmma, which a 1-token decode of 4 heads cannot fill) and its API moves between releases.
- It has an interpret mode on CPU, so this exact kernel is tested on the CPU-only CI machine.
The choice sits behind ``get_kernels("pallas_gpu")``; a Mosaic GPU kernel can replace it without
touching callers. Revisit when the Triton backend is removed.

Design, and why:
- Sequences whose query count fits one small block (decodes; ``q_len * group <= 16`` rows) go to
  a flash-decoding kernel: grid ``(seq, kv_head, kv_split)``, each program walking its split's pages
  with an online softmax. Splitting the KV length is what lets a few long sequences still fill all
  SMs; the split count aims at ~512 programs (a few per SM), so a large batch gets one split and the
  kernel writes normalized rows itself, while a small one writes partials (acc, m, l) that a combine
  kernel (one program per output row, one round of loads) merges.
- A decode-only step (every sequence one new token) of few sequences runs ``rope_decode_attention``:
  the same decode kernel also computes the attention norm's scale, RoPE and the K/V write (the work
  of ``rope_kv``), keeping the new token's key and value in registers; one kernel less per layer
  where each is mostly launch latency.
- Longer query runs (prefill chunks) go to a prefill kernel: grid ``(query block, kv_head)``, a block
  being up to ``rows // group`` tokens of one sequence against its pages, causal. Unused blocks
  return at once, and a step too small to hold a prefill run does not launch it at all.
- GQA: the rows of a program are (token, query head of the group); one K/V page load of a kv head
  serves all of them in one matmul. Query rows are gathered from ``q [T, H, D]`` in place, and every
  kernel scatters its output rows straight into one token-layout buffer that passes from kernel to
  kernel aliased: no transposed copy of q, no XLA select or combine around the kernels.
- No XLA op in here may hide a host sync (see ``kv_cache.segment_of``): the step must stay one
  stream of kernels the host can run ahead of.
- K/V are read in place from the stacked cache ``[layers, pages, page_size, kv_heads, D]`` at the
  (traced or static) layer index; each page of one kv head is ``page_size`` rows of ``D`` contiguous
  elements. No per-layer copy, no gather into a dense context.
- Model options (what the families of ``jaxinfer.models.families`` need) are static where they are
  static, so Llama's kernels compile as before: a soft cap (Gemma 2) is a tanh on the scores; Q/K/V
  biases (Qwen2) and per-head q/k norms (Qwen3, Gemma 3) are loaded and applied in the fused decode
  kernel only when given. A sliding window is an operand (``_layer_window``), since the scanned layer
  loop passes each layer's traced: key blocks wholly before it are never loaded (prefill blocks start
  at it; decode splits divide only the blocks it leaves), the rest are masked per row.
- head_dim 16 to 256 (``rope_kv.HEAD_DIMS``). Shared memory bounds the tiles (``_fit``, 200 of the
  227 KiB an H100/H200 block may take): at 256 the decode kernel runs 2 pipeline stages instead of 3,
  the prefill kernel 64 query rows in 8 warps (128 rows of float32 accumulator would spill registers),
  and in float32 key blocks of half a 64-slot page.
- A quantized cache (int8/fp8 codes, a float32 scale per token and kv head; ``paged.kv_cache``)
  passes each of K and V as a pair of refs (codes, scales). Only the codes and the scales of a
  key block are loaded (the bandwidth saving is real: about half of bf16's bytes); the codes are
  cast to the query's dtype in registers (exact: int8 and e4m3 values are bf16 values) and the
  scales applied to the scores (K) and to the probabilities (V), one multiply per key rather than
  per element. Kernels that write the cache quantize there (``kv_cache.quantize_rows``). fp8 codes
  come as uint32 words of four (``kv_cache.pack_codes``), turned into float16 two at a time
  (``_fp8_words``): the decode kernel then takes q, K, V and its output in 4 column parts ``4c + j``
  (byte j of the words against part j, no reordering); the prefill and fused decode kernels join
  the parts back into element order (128 query rows of 4 small dots each were slower).
Padding tokens (past ``query_start[S]``) produce zeros, like the reference. Page sizes must be
powers of two (Triton block shapes).

Where it stands (H200, jax 0.11.2, ``benchmarks/bench_kernels.py``): decoding 64 sequences x 4,096 tokens
at page_size 64, the whole call streams K/V at 3.86 TB/s, 87% of the read bandwidth measured in the
same run, where the deprecated Pallas paged_attention op reaches 1.88 TB/s.
"""

from __future__ import annotations

import functools
import numbers

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxinfer.paged.kv_cache import BatchMetadata, KVCache, code_dtype, head_dim_of, packed, quantize_rows
from jaxinfer.pallas_kernels import rope_kv
from jaxinfer.pallas_kernels._blocks import cdiv, next_pow2, query_blocks

_MASK = -1e30  # finite, so fully masked rows never produce inf - inf
# Decode programs (sequences x kv heads x KV splits) to aim for when choosing the split count:
# a few per SM on an H200 (132 SMs), so a few long sequences still fill the GPU.
_DECODE_PROGRAMS = 512
# Most sequences a decode-only step runs through the fused RoPE + attention kernel
# (``Ops.decode_attention_max_seqs``; see rope_decode_attention): measured better at 1, worse at 256,
# not measured in between.
FUSED_MAX_SEQS = 16
# Shared memory one program's operands may take (``_fit``): an H100/H200 block may have 227 KiB; the
# rest is left to what Triton adds (layout conversions, reductions).
_SMEM_BYTES = 200 * 1024


def _fp8_words(w, interpret, join):
    """The fp8 (e4m3fn) codes of an fp8 cache's uint32 words ``w [n, C]`` (``kv_cache.pack_codes``) as
    float16, exactly: 4 arrays ``[n, C]`` (part j: byte j of each word, element ``4c + j``), or with
    ``join`` one ``[n, 4C]`` in element order. Two codes an instruction: an inline-PTX ``prmt`` takes
    byte j of two words, ``cvt.rn.f16x2.e4m3x2`` (sm_89+) makes two float16 of them; a byte load and
    a conversion per code made the decode kernel over fp8 slower than over bf16 (179.0 against
    161.0 us, H200, 256 sequences x 640 tokens).
    ``interpret``: the same in jnp (interpret mode cannot run PTX)."""
    parts = []
    for j in range(4):
        if interpret:
            b = ((w >> (8 * j)) & 0xFF).astype(jnp.uint8)
            parts.append(jax.lax.bitcast_convert_type(b, jnp.float8_e4m3fn).astype(jnp.float16))
            continue
        asm = ("{ .reg .b32 t; .reg .b16 lo, hi; prmt.b32 t, $1, $2, " + hex(((4 + j) << 4) | j) + "; "
               "mov.b32 {lo, hi}, t; cvt.rn.f16x2.e4m3x2 $0, lo; }")
        (h,) = plgpu.elementwise_inline_asm(asm, args=[w], constraints="=r,r,r", pack=2,
                                            result_shape_dtypes=[jax.ShapeDtypeStruct(w.shape, jnp.float16)])
        parts.append(h)
    if not join:
        return parts
    # element 4c + 2a + b is part 2a + b's column c: Triton's join stacks along a new minor axis of 2
    p0, p1, p2, p3 = parts
    return jnp.stack([jnp.stack([p0, p2], axis=-1), jnp.stack([p1, p3], axis=-1)], axis=-1).reshape(
        w.shape[0], 4 * w.shape[1])


def _attend_pages(q, row_pos, k_ref, v_ref, layer, kv_head, pt_ref, seq, blk_lo, blk_hi, *,
                  kv_lo, kv_hi, window, page_size, block_k, scale, soft_cap, precision, evict_first=False,
                  interpret=False, q_parts=False):
    """Online softmax of the query rows over key blocks ``blk_lo..blk_hi-1`` of ``block_k`` positions.
    ``window``: the sliding window (a traced scalar read from the kernel's operands; None: none).

    ``q`` is ``[R, D]`` or a function returning it, called once the first block's K/V loads are
    issued: then the query's loads and math overlap the first page loads (the decode-only kernel's
    RoPE; measured 5.9 -> 5.5 us per 8B batch-1 layer on an H200, while peeling the plain decode
    kernel slowed its 256-sequence step 1%). ``k_ref``/``v_ref`` are the cache viewed
    as ``[layers, pages * page_size, kv_heads, D]`` (a free reshape). A block of one page or part of
    one (``_fit`` cuts pages when a page of K and V would not fit shared memory: head_dim 256 in
    float32) is a strided slice; a block of several pages gathers its rows through the page table,
    so the load size per step is independent of the page size.
    A quantized cache passes ``k_ref``/``v_ref`` as (codes, scales ``[layers, pages * page_size,
    kv_heads]``) pairs; fp8 codes as uint32 words ``[..., D / 4]``, where ``q`` may come as the list of
    its 4 column parts (``_query_rows``), and the output then does too.
    Returns (acc, m, l): unnormalized output, running max and running sum per row.
    """
    quantized = isinstance(k_ref, tuple)
    (k_ref, ks_ref), (v_ref, vs_ref) = (k_ref, v_ref) if quantized else ((k_ref, None), (v_ref, None))
    words = packed(k_ref)  # fp8 codes, 4 a word (kv_cache.pack_codes)
    rows, head_dim = row_pos.shape[0], head_dim_of(k_ref)
    # fp8 words: the dots run in float16 (float32 for float32 queries, the exact tests: precision HIGHEST),
    # q prescaled by 2**-qexp so that float16 holds it (|q| up to 2**24; scores scaled back).
    wdt = jnp.float32 if precision is not None else jnp.float16
    qexp = 8 if words and wdt == jnp.float16 else 0

    def prep(q):
        return jax.tree.map(lambda x: (x.astype(jnp.float32) * 2.0 ** -qexp).astype(wdt), q) if words else q
    pages_per_seq = pt_ref.shape[1]

    per_page = page_size // block_k  # key blocks per page (0: a block spans pages)

    def load(i):
        if per_page == 1:
            start = pt_ref[seq, jnp.minimum(i, pages_per_seq - 1)] * page_size
        elif per_page > 1:
            start = pt_ref[seq, jnp.minimum(i // per_page, pages_per_seq - 1)] * page_size + (i % per_page) * block_k
        if per_page:
            hint = dict(eviction_policy="evict_first") if evict_first else {}  # K/V are read once
            k = plgpu.load(k_ref.at[layer, pl.ds(start, block_k), kv_head, :], **hint)  # [block_k, D]
            v = plgpu.load(v_ref.at[layer, pl.ds(start, block_k), kv_head, :], **hint)
            if quantized:  # [block_k] each
                return ((k, plgpu.load(ks_ref.at[layer, pl.ds(start, block_k), kv_head], **hint)),
                        (v, plgpu.load(vs_ref.at[layer, pl.ds(start, block_k), kv_head], **hint)))
        else:
            t = i * block_k + jax.lax.broadcasted_iota(jnp.int32, (block_k,), 0)
            slot = pt_ref[seq, jnp.minimum(t // page_size, pages_per_seq - 1)] * page_size + t % page_size
            k = k_ref[layer, slot, kv_head, :]
            v = v_ref[layer, slot, kv_head, :]
            if quantized:
                return (k, ks_ref[layer, slot, kv_head]), (v, vs_ref[layer, slot, kv_head])
        return k, v

    def update(q, i, k, v, carry, live=True):
        acc, m, l, unit = carry
        if words:
            (k, k_scale), (v, v_scale) = k, v
            if parts:  # one dot per byte of the words
                s = 0.0
                for qj, kj in zip(q, _fp8_words(k, interpret, join=False)):
                    s = s + jnp.dot(qj, kj.astype(wdt).T, precision=precision, preferred_element_type=jnp.float32)
            else:
                k = _fp8_words(k, interpret, join=True).astype(wdt)
                s = jnp.dot(q, k.T, precision=precision, preferred_element_type=jnp.float32)
        else:
            if quantized:  # dequantized in registers: codes cast for the dot, scales on scores / probabilities
                (k, k_scale), (v, v_scale) = k, v
                k, v = k.astype(q.dtype), v.astype(q.dtype)
            s = jnp.dot(q, k.T, precision=precision, preferred_element_type=jnp.float32)
        # one multiply a score: the softmax scale, K's scales and the queries' prescale folded per key
        s = s * ((k_scale * (scale * 2.0 ** qexp))[None, :] if quantized else scale)
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        key_pos = i * block_k + jax.lax.broadcasted_iota(jnp.int32, (rows, block_k), 1)
        pos = jnp.broadcast_to(row_pos[:, None], (rows, block_k))
        mask = (key_pos <= pos) & (key_pos >= kv_lo) & (key_pos < kv_hi) & live
        if window is not None:
            mask &= key_pos > pos - window
        s = jnp.where(mask, s, _MASK)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)
        alpha = jnp.exp(m - m_new)
        l = alpha * l + jnp.sum(p, axis=1)
        if words:
            # p times V's scales over the block's largest one: p * scale itself would fall into
            # float16's subnormals for small values. acc is kept in units of that largest scale
            # (``unit``, put back once after the loop), so the block's product needs no multiply of
            # its own: an H200 prefill step spent 64 extra multiplies a thread a block on it.
            vmax = jnp.max(v_scale)
            vmax = jnp.where(vmax > 0, vmax, 1.0)
            pw, alpha = (p * (v_scale / vmax)[None, :]).astype(wdt), alpha * (unit / vmax)

            def mix(a, vj):
                return alpha[:, None] * a + jnp.dot(pw, vj.astype(wdt), precision=precision,
                                                    preferred_element_type=jnp.float32)
            vs = _fp8_words(v, interpret, join=not parts)
            return ([mix(a, vj) for a, vj in zip(acc, vs)] if parts else mix(acc, vs)), m_new, l, vmax
        pv = jnp.dot((p * v_scale[None, :] if quantized else p).astype(v.dtype), v, precision=precision,
                     preferred_element_type=jnp.float32)
        return alpha[:, None] * acc + pv, m_new, l, unit

    parts = isinstance(q, list)  # q (and so the output) in 4 column parts 4c + j: see _query_rows
    acc = jnp.zeros((rows, head_dim // 4 if parts else head_dim), jnp.float32)
    init = ([acc] * 4 if parts else acc, jnp.full((rows,), _MASK, jnp.float32), jnp.zeros((rows,), jnp.float32),
            jnp.float32(1.0))
    if callable(q):  # peel the first block (masked out when the range is empty)
        first = load(blk_lo)
        q = prep(q())
        init, blk_lo = update(q, blk_lo, *first, init, live=blk_lo < blk_hi), blk_lo + 1
    else:
        q = prep(q)
    acc, m, l, unit = jax.lax.fori_loop(blk_lo, blk_hi, lambda i, c: update(q, i, *load(i), c), init)
    if words:
        acc = [a * unit for a in acc] if parts else acc * unit
    return acc, m, l


def _row_index(tok0, ntok, h, rows, group, num_heads, num_rows):
    """A program's rows as flat indices into ``[T * H, D]``: row ``r`` is token ``tok0 + r // group``,
    query head ``h * group + r % group``. Returns (row mask, indices). Rows past ``ntok`` tokens are
    masked and get indices past ``num_rows``: interpret mode emulates a masked scatter by
    read-modify-write, so a masked lane must not alias a real row; out of bounds, its write is dropped."""
    r = jax.lax.broadcasted_iota(jnp.int32, (rows,), 0)
    row_ok = r // group < ntok
    return row_ok, jnp.where(row_ok, (tok0 + r // group) * num_heads + h * group + r % group, num_rows + r)


def _cols(head_dim, parts):
    """Column indices ``[1, D / parts]`` of each part of a head: ``parts * c + j`` for part ``j``."""
    c = jax.lax.broadcasted_iota(jnp.int32, (1, head_dim // parts), 1)
    return [c * parts + j for j in range(parts)]


def _query_rows(q_ref, tok0, ntok, h, rows, group, num_heads, parts=1):
    """A program's query rows, gathered in place from ``q`` viewed as ``[T * H, D]``; zero past ``ntok``.
    ``parts=4``: a list of 4 column parts (``_cols``), byte j of an fp8 cache's words against part j:
    the decode kernel's dots then take the codes as they convert, without reordering them (measured
    0.70x the bytes' time on an H200; as one dot over reordered codes, ~13% more instructions)."""
    num_rows, head_dim = q_ref.shape
    row_ok, idx = _row_index(tok0, ntok, h, rows, group, num_heads, num_rows)
    mask = jnp.broadcast_to(row_ok[:, None], (rows, head_dim // parts))
    got = [plgpu.load(q_ref.at[jnp.minimum(idx, num_rows - 1)[:, None], col], mask=mask, other=0)
           for col in _cols(head_dim, parts)]
    return got if parts > 1 else got[0]


def _store_rows(o_ref, acc, l, tok0, ntok, h, group, num_heads, num_rows):
    """Normalize a program's rows and scatter them into the token-layout output ``[T * H, D]``."""
    parts = acc if isinstance(acc, list) else [acc]  # column parts, as _query_rows
    rows, head_dim = parts[0].shape[0], o_ref.shape[1]
    row_ok, idx = _row_index(tok0, ntok, h, rows, group, num_heads, num_rows)
    l = jnp.where(l > 0, l, 1.0)[:, None]
    for a, col in zip(parts, _cols(head_dim, len(parts))):
        plgpu.store(o_ref.at[idx[:, None], col], (a / l).astype(o_ref.dtype),
                    mask=jnp.broadcast_to(row_ok[:, None], a.shape))


def _split_keys(split, blocks_per_split, first_pos, kv_hi, window, *, block_k, **_):
    """Key positions ``[kv_lo, kv_hi)`` a decode sequence's queries (the first at ``first_pos``) may
    see, and the key blocks ``[blk_lo, blk_hi)`` of them that KV split ``split`` covers.

    Without a window the splits cut the padded context statically (``blocks_per_split`` each). With
    one, they cut the blocks the window leaves, per sequence: blocks before it are never loaded, and
    a 4096 window in an 8192 context still keeps every split busy instead of half of them idle."""
    if window is None:
        blk_lo = split * blocks_per_split
        blk_hi = jnp.minimum((split + 1) * blocks_per_split, cdiv(kv_hi, block_k))
        return 0, blk_lo, blk_hi
    kv_lo = jnp.maximum(first_pos - window + 1, 0)
    lo, hi = kv_lo // block_k, cdiv(kv_hi, block_k)
    per_split = cdiv(jnp.maximum(hi - lo, 0), pl.num_programs(2))
    blk_lo = lo + split * per_split
    return kv_lo, blk_lo, jnp.minimum(blk_lo + per_split, hi)


def _decode_tokens(qs_ref, s, max_q):
    """First token and token count of sequence ``s`` if it is decode-shaped (else count 0)."""
    q0 = qs_ref[s]
    q_len = qs_ref[s + 1] - q0
    return q0, q_len, jnp.where((q_len > 0) & (q_len <= max_q), q_len, 0)


def _decode_kernel(lw_refs, pt_ref, lens_ref, qs_ref, q_ref, k_ref, v_ref, *out_refs, group, num_heads,
                   max_q, rows, blocks_per_split, windowed, **attend_kw):
    """One (sequence, kv head, KV split). With one split, ``out_refs = (out_init, out)`` (aliased) and
    the normalized rows go straight to the output; with several, ``(acc, m, l)`` partials."""
    s, h, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    q0, q_len, ntok = _decode_tokens(qs_ref, s, max_q)
    seq_len = lens_ref[s]
    parts = 4 if attend_kw["q_parts"] else 1
    q = _query_rows(q_ref, q0, ntok, h, rows, group, num_heads, parts)
    row_pos = seq_len - q_len + jax.lax.broadcasted_iota(jnp.int32, (rows,), 0) // group

    kv_hi = jnp.where(ntok > 0, seq_len, 0)
    window = _window(lw_refs, windowed)
    kv_lo, blk_lo, blk_hi = _split_keys(split, blocks_per_split, seq_len - q_len, kv_hi, window, **attend_kw)
    acc, m, l = _attend_pages(q, row_pos, k_ref, v_ref, lw_refs[0][0], h, pt_ref, s, blk_lo, blk_hi,
                              kv_lo=kv_lo, kv_hi=kv_hi, window=window, **attend_kw)
    if len(out_refs) == 2:
        _store_rows(out_refs[1], acc, l, q0, ntok, h, group, num_heads, q_ref.shape[0])
    else:
        acc_ref, m_ref, l_ref = out_refs
        if parts > 1:
            r = jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0)
            for a, col in zip(acc, _cols(acc_ref.shape[-1], parts)):
                plgpu.store(acc_ref.at[r, col], a)
        else:
            acc_ref[...] = acc
        m_ref[...] = m
        l_ref[...] = l


def _combine_kernel(qs_ref, acc_ref, m_ref, l_ref, _, o_ref, *, group, num_heads, max_q):
    """Merge the KV-split partials of one output row (sequence, kv head, row) and store it. A program
    per row keeps each one a single round of loads: it is latency, not bandwidth, that costs here."""
    s, h, r = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    q0, _, ntok = _decode_tokens(qs_ref, s, max_q)

    @pl.when(r // group < ntok)
    def _():
        m = m_ref[s, h, :, r]  # [splits]
        w = jnp.exp(m - jnp.max(m))
        l = jnp.sum(w * l_ref[s, h, :, r])
        acc = jnp.sum(w[:, None] * acc_ref[s, h, :, r, :], axis=0)  # [D]
        out = acc / jnp.where(l > 0, l, 1.0)
        o_ref[(q0 + r // group) * num_heads + h * group + r % group, :] = out.astype(o_ref.dtype)


def _rope_decode_kernel(lw_refs, pt_ref, lens_ref, qs_ref, slot_ref, freq_ref, x_ref, qkv_ref, *refs,
                        num_heads, num_kv_heads, hidden, eps, rows, blocks_per_split, has_bias, has_norm,
                        windowed, **attend_kw):
    """A decode-only step's (sequence, kv head, KV split): the attention norm's scale (plus the
    bias and the q/k head norms, where the family has them), RoPE and the K/V write of ``rope_kv``
    done here, so that kernel does not run. The new token's key and value stay in registers: the cache
    pages supply positions ``< pos`` and split 0 adds the new token (and writes it to the cache, which
    no program of this call reads at that slot). ``refs``: the bias ``[heads, D]`` if ``has_bias``,
    the q and k norm gains ``[1, D]`` if ``has_norm``, the aliased cache inputs, the outputs as
    ``_decode_kernel``'s, then the aliased caches (each a (codes, scales) pair if quantized: the new
    token is quantized, and attended to, as the reference's write stores it)."""
    refs = list(refs)
    bias_ref = refs.pop(0) if has_bias else None
    qn_ref, kn_ref = (refs.pop(0), refs.pop(0)) if has_norm else (None, None)
    _k, _v, *out_refs, k_refs, v_refs = refs
    quantized = isinstance(k_refs, tuple)
    k_ref, v_ref = (k_refs[0], v_refs[0]) if quantized else (k_refs, v_refs)
    s, h, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    group = num_heads // num_kv_heads
    heads = num_heads + 2 * num_kv_heads
    head_dim = qkv_ref.shape[1]
    half = head_dim // 2
    q0 = qs_ref[s]
    live = qs_ref[s + 1] - q0 == 1  # padding sequences have no token
    tok = jnp.where(live, q0, 0)
    pos = lens_ref[s] - 1

    kv_hi = jnp.where(live, pos, 0)  # the new token itself comes from registers, not the cache
    window = _window(lw_refs, windowed)
    kv_lo, blk_lo, blk_hi = _split_keys(split, blocks_per_split, pos, kv_hi, window, **attend_kw)
    new = {}  # what rope_q computes besides q, for after the attention loop

    def rope_q():  # called once the first K/V page loads are in flight
        col = jax.lax.broadcasted_iota(jnp.int32, (1, head_dim), 1)

        swapped = (col + half) % head_dim

        def head_rows(ref, row, mask):  # [n, D] and its halves swapped, float32
            mask = jnp.broadcast_to(mask, (row.shape[0], head_dim))
            return [plgpu.load(ref.at[row, c], mask=mask, other=0).astype(jnp.float32) for c in (col, swapped)]

        r = jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0)
        row_ok = (r < group) & live
        one = jnp.zeros((1, 1), jnp.int32)
        q_head = h * group + jnp.minimum(r, group - 1)
        k_head, v_head = one + num_heads + h, one + num_heads + num_kv_heads + h
        q_raw = head_rows(qkv_ref, tok * heads + q_head, row_ok)
        k_raw = head_rows(qkv_ref, tok * heads + k_head, live)
        v_raw = head_rows(qkv_ref, tok * heads + v_head, live)[0]
        if has_bias:
            q_bias, k_bias = head_rows(bias_ref, q_head, row_ok), head_rows(bias_ref, k_head, live)
            v_bias = head_rows(bias_ref, v_head, live)[0]
        norm = rope_kv.row_rms_scale(x_ref, tok, hidden, eps)  # its load joins those above before any use
        angle = pos.astype(jnp.float32) * freq_ref[col % half]
        cos, sin = jnp.cos(angle), jnp.where(col < half, -jnp.sin(angle), jnp.sin(angle))
        q_raw, k_raw, v_raw = [a * norm for a in q_raw], [a * norm for a in k_raw], v_raw * norm
        if has_bias:
            q_raw, k_raw = [a + b for a, b in zip(q_raw, q_bias)], [a + b for a, b in zip(k_raw, k_bias)]
            v_raw = v_raw + v_bias
        if has_norm:
            q_raw = _head_norm(q_raw, qn_ref, col, swapped, eps)
            k_raw = _head_norm(k_raw, kn_ref, col, swapped, eps)

        def rotate(a, b):  # rotate-half RoPE
            return a * cos + b * sin

        k_rot = rotate(*k_raw)
        if quantized:  # [1, D] codes and [1] scales
            (k_new, k_scale), (v_new, v_scale) = [quantize_rows(a, jnp.max(jnp.abs(a), axis=1), code_dtype(r))
                                                  for a, r in ((k_rot, k_ref), (v_raw, v_ref))]
            new.update(k=k_new, v=v_new, k_scale=k_scale, v_scale=v_scale,
                       k_deq=k_new.astype(jnp.float32) * k_scale[:, None],
                       v_deq=v_new.astype(jnp.float32) * v_scale[:, None])
        else:
            new.update(k=k_rot.astype(k_ref.dtype), v=v_raw.astype(v_ref.dtype))
            new.update(k_deq=new["k"].astype(jnp.float32), v_deq=new["v"].astype(jnp.float32))
        new.update(q=rotate(*q_raw).astype(qkv_ref.dtype), row_ok=row_ok[:, 0])
        return new["q"]

    row_pos = jnp.zeros((rows,), jnp.int32) + pos
    acc, m, l = _attend_pages(rope_q, row_pos, k_refs, v_refs, lw_refs[0][0], h, pt_ref, s, blk_lo, blk_hi,
                              kv_lo=kv_lo, kv_hi=kv_hi, window=window, **attend_kw)
    q, k_new, v_new, row_ok = new["q"], new["k"], new["v"], new["row_ok"]
    # The new token, as one more key of split 0's online softmax.
    s_new = jnp.sum(q.astype(jnp.float32) * new["k_deq"], axis=1) * attend_kw["scale"]
    if attend_kw["soft_cap"] is not None:
        s_new = attend_kw["soft_cap"] * jnp.tanh(s_new / attend_kw["soft_cap"])
    take = (split == 0) & row_ok
    m_new = jnp.where(take, jnp.maximum(m, s_new), m)
    alpha = jnp.exp(m - m_new)
    p = jnp.where(take, jnp.exp(s_new - m_new), 0.0)
    acc = alpha[:, None] * acc + p[:, None] * new["v_deq"]
    l, m = alpha * l + p, m_new

    slot = slot_ref[tok]

    @pl.when(live & (split == 0) & (slot < k_ref.shape[1]))
    def _():
        pack = rope_kv.pack_fp8_words if packed(k_ref) else (lambda c: c)
        plgpu.store(k_ref.at[lw_refs[0][0], slot, h, :], pack(k_new)[0])
        plgpu.store(v_ref.at[lw_refs[0][0], slot, h, :], pack(v_new)[0])
        if quantized:
            k_refs[1][lw_refs[0][0], slot, h] = new["k_scale"][0]
            v_refs[1][lw_refs[0][0], slot, h] = new["v_scale"][0]

    if len(out_refs) == 2:
        _store_rows(out_refs[1], acc, l, tok, live.astype(jnp.int32), h, group, num_heads, out_refs[1].shape[0])
    else:
        acc_ref, m_ref, l_ref = out_refs
        acc_ref[s, h, split] = acc
        m_ref[s, h, split] = m
        l_ref[s, h, split] = l


def _prefill_kernel(lw_refs, pt_ref, seq_ref, tok0_ref, ntok_ref, pos0_ref, lo_ref, hi_ref,
                    q_ref, k_ref, v_ref, _, o_ref, *, group, num_heads, rows, windowed, **attend_kw):
    b, h = pl.program_id(0), pl.program_id(1)
    block_k = attend_kw["block_k"]
    seq, tok0, ntok, pos0 = seq_ref[b], tok0_ref[b], ntok_ref[b], pos0_ref[b]
    kv_lo, kv_hi = lo_ref[b], hi_ref[b]

    @pl.when(ntok > 0)  # unused blocks (most of them in a decode-heavy step) return at once
    def _():
        q = _query_rows(q_ref, tok0, ntok, h, rows, group, num_heads)
        r = jax.lax.broadcasted_iota(jnp.int32, (rows,), 0)
        # kv_lo already starts past the window (query_blocks): blocks before it are never loaded.
        acc, _, l = _attend_pages(q, pos0 + r // group, k_ref, v_ref, lw_refs[0][0], h, pt_ref, seq,
                                  kv_lo // block_k, cdiv(kv_hi, block_k), kv_lo=kv_lo, kv_hi=kv_hi,
                                  window=_window(lw_refs, windowed), **attend_kw)
        _store_rows(o_ref, acc, l, tok0, ntok, h, group, num_heads, q_ref.shape[0])


def _key_block(requested, page_size, ctx):
    """Key positions per loop step: the page size, or a multiple of it (gathered through the table)."""
    bk = page_size if requested is None else max(requested, page_size)
    return min(bk, next_pow2(ctx)) if bk % page_size == 0 else page_size


def _fit(block_k, stages, *, rows, head_dim, itemsize):
    """(key block, pipeline stages) within ``_SMEM_BYTES`` of shared memory: the query rows and P
    (``rows x (D + block_k)``) once, a K and a V block per stage. Drops stages first, then halves the
    key block (a block smaller than a page is a slice of it) down to 16, a dot's minimum.

    The tuned bf16 defaults up to head_dim 128 fit as they are (decode: 102 KiB; prefill: 112 KiB).
    head_dim 256 in bf16 drops the decode kernel to 2 stages (138 KiB instead of 202 KiB); float32
    (the exact tests) also runs fewer stages, and at head_dim 256 smaller key blocks."""
    def need(bk, st):
        return (rows * (head_dim + bk) + st * 2 * bk * head_dim) * itemsize

    while True:
        for st in range(stages, 0, -1):
            if need(block_k, st) <= _SMEM_BYTES:
                return block_k, st
        if block_k <= 16:
            return block_k, 1
        block_k //= 2


def _decode_plan(md, page_size, num_kv_heads, num_splits, block_k, stages, sliding_window, *, rows, head_dim,
                 itemsize):
    """(key block, stages, KV splits, key blocks per split) of the decode kernels; ``num_splits=None``
    aims at ``_DECODE_PROGRAMS`` programs, but no more splits than key blocks a static window leaves
    (a traced one: the context's). A power of two: the combine loads the splits as one block."""
    num_seqs, pages_per_seq = md.page_table.shape
    ctx = pages_per_seq * page_size
    block_k, stages = _fit(_key_block(block_k, page_size, ctx), stages, rows=rows, head_dim=head_dim,
                           itemsize=itemsize)
    num_kv_blocks = cdiv(ctx, block_k)
    visible = num_kv_blocks
    if isinstance(sliding_window, numbers.Integral):  # its blocks, plus the one its start may straddle
        visible = min(num_kv_blocks, cdiv(int(sliding_window), block_k) + 1)
    if num_splits is None:
        num_splits = cdiv(_DECODE_PROGRAMS, num_seqs * num_kv_heads)
    num_splits = min(next_pow2(num_splits), next_pow2(visible))
    return block_k, stages, num_splits, cdiv(num_kv_blocks, num_splits)


def _layer_window(layer, sliding_window):
    """The kernels' first operand, a tuple of int32 ``[1]`` arrays: the layer, and the sliding window
    if there is one. The window is read in the kernel as a scalar, static or traced alike (the scanned
    layer loop passes each layer's), so one compiled kernel serves local and global layers. Two
    operands rather than one array of both: joining a traced layer and window would be one more
    XLA kernel per layer; a reshape is free. Without a window nothing of it is passed or computed."""
    def operand(v):
        return jnp.asarray(v, jnp.int32).reshape(1)
    return (operand(layer),) if sliding_window is None else (operand(layer), operand(sliding_window))


def _window(lw_refs, windowed):
    return lw_refs[1][0] if windowed else None


def _head_norm(x, w_ref, col, swapped, eps):
    """Per-head RMSNorm (Qwen3's, Gemma 3's q/k norm) of heads ``x = [rows, rows with halves swapped]``
    ``[n, D]`` each, float32, with the gain ``w_ref [D]``."""
    a, b = x
    r = jax.lax.rsqrt(jnp.sum(a * a, axis=1, keepdims=True) / a.shape[1] + eps)
    return [a * r * w_ref[col].astype(jnp.float32), b * r * w_ref[swapped].astype(jnp.float32)]


def _combine(md, acc, m, l, out, *, group, num_heads, interpret):
    """Merge the decode kernel's KV-split partials into the token-layout ``out`` (aliased)."""
    num_seqs, num_kv_heads, _, rows, _ = acc.shape
    return pl.pallas_call(
        functools.partial(_combine_kernel, group=group, num_heads=num_heads, max_q=rows // group),
        grid=(num_seqs, num_kv_heads, rows), out_shape=jax.ShapeDtypeStruct(out.shape, out.dtype),
        input_output_aliases={4: 0}, compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret, name="paged_decode_combine_gpu",
    )(md.query_start, acc, m, l, out)


def ragged_paged_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, layer, md: BatchMetadata, *,
                           scale: float, soft_cap: float | None = None, sliding_window=None,
                           num_splits: int | None = None, decode_block_k: int = 64,
                           decode_warps: int = 4, decode_stages: int = 3, decode_evict_first: bool = False,
                           prefill_rows: int | None = None, prefill_block_k: int | None = None,
                           prefill_warps: int | None = None, prefill_stages: int = 2,
                           k_scale: jax.Array | None = None, v_scale: jax.Array | None = None,
                           interpret: bool = False) -> jax.Array:
    """Same contract as ``jaxinfer.paged.attention.ragged_paged_attention``; see the module docstring.
    ``sliding_window``: None, an int or a traced int32 scalar. ``k_scale``/``v_scale``: a quantized
    cache's scales (``[layers, pages, page_size, kv_heads]``).

    Tuning knobs (defaults from benchmarks/bench_kernels.py on an H200): ``num_splits`` (KV splits per
    decode sequence; default: enough programs to fill the GPU), ``*_block_k`` (key positions per
    loop step, a multiple of the page size or the page size itself), warps and pipeline stages (both
    reduced by ``_fit`` where shared memory runs out). ``prefill_rows`` defaults to
    128 up to head_dim 128 and 64 at 256, where 128 rows of float32 accumulator would spill registers
    (256 per thread in 4 warps; the limit is 255); ``prefill_warps`` to 8, or 4 over an fp8 cache's
    words. At 128 rows and head_dim 128, 4 warps spill (255 registers, ~50 local loads and stores per
    key block; 8 warps: 181, none), and 8 warps measured 0.85x the kernel's time over a bf16 cache
    (H200, 8 sequences x 512 new tokens over 1,024); over fp8 words 4 warps
    spill too (843 SASS instructions a key block) and still measured 0.68x 8 warps' time (H100)."""
    num_tokens, num_heads, head_dim = q.shape
    rope_kv.check_head_dim(head_dim)
    _, num_pages, page_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    num_seqs, pages_per_seq = md.page_table.shape
    words = packed(k_cache)  # fp8 codes stored 4 a word (kv_cache.pack_codes)
    itemsize = max(jnp.dtype(q.dtype).itemsize, code_dtype(k_cache).itemsize)
    dec_rows = max(16, next_pow2(group))  # tl.dot wants >= 16 rows
    max_q_dec = dec_rows // group
    big = head_dim > 128
    pre_rows = max(prefill_rows or (64 if big else 128), next_pow2(group))
    prefill_warps = prefill_warps or (4 if words else 8)
    ctx = pages_per_seq * page_size

    dec_bk, decode_stages, num_splits, blocks_per_split = _decode_plan(
        md, page_size, num_kv_heads, num_splits, decode_block_k, decode_stages, sliding_window, rows=dec_rows,
        head_dim=head_dim, itemsize=itemsize)
    pre_bk, prefill_stages = _fit(_key_block(prefill_block_k, page_size, ctx), prefill_stages, rows=pre_rows,
                                  head_dim=head_dim, itemsize=itemsize)

    num_rows = num_tokens * num_heads
    q_rows = q.reshape(num_rows, head_dim)  # free; kernels gather their rows
    layer_arr = _layer_window(layer, sliding_window)
    page_table = jnp.clip(md.page_table, 0, num_pages - 1)
    precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    attend_kw = dict(page_size=page_size, scale=scale, soft_cap=soft_cap, windowed=sliding_window is not None,
                     precision=precision, interpret=interpret)
    # Token-addressed view of the stacked cache (a free reshape): [layers, pages * page_size, kv_heads, D].
    k_flat = k_cache.reshape(k_cache.shape[0], num_pages * page_size, num_kv_heads, k_cache.shape[-1])
    v_flat = v_cache.reshape(k_flat.shape)
    if k_scale is not None:  # (codes, scales) pairs; the kernels see a tuple of refs
        k_flat, v_flat = [(c, x.reshape(c.shape[:-1])) for c, x in ((k_flat, k_scale), (v_flat, v_scale))]

    # Every kernel scatters its normalized rows into one token-layout buffer, passed from kernel to
    # kernel in place (aliased); rows nobody writes (padding tokens) keep the zeros it starts with.
    out = jnp.zeros((num_rows, head_dim), q.dtype)
    out_shape = jax.ShapeDtypeStruct(out.shape, q.dtype)
    scalars = (layer_arr, page_table, md.seq_lens, md.query_start, q_rows, k_flat, v_flat)

    # Decode-shaped sequences: flash-decoding over (sequence, kv head, KV split).
    decode = functools.partial(
        pl.pallas_call, grid=(num_seqs, num_kv_heads, num_splits),
        compiler_params=plgpu.CompilerParams(num_warps=decode_warps, num_stages=decode_stages),
        interpret=interpret, name="paged_decode_gpu")
    decode_kw = dict(q_parts=words, group=group, num_heads=num_heads, max_q=max_q_dec, rows=dec_rows,
                     blocks_per_split=blocks_per_split, block_k=dec_bk, evict_first=decode_evict_first, **attend_kw)
    if num_splits == 1:
        out = decode(functools.partial(_decode_kernel, **decode_kw), out_shape=out_shape,
                     input_output_aliases={len(jax.tree.leaves(scalars)): 0})(*scalars, out)
    else:
        part = (num_seqs, num_kv_heads, num_splits, dec_rows)
        acc, m, l = decode(
            functools.partial(_decode_kernel, **decode_kw),
            out_specs=[pl.BlockSpec((pl.squeezed, pl.squeezed, pl.squeezed, dec_rows, head_dim),
                                    lambda s, h, k: (s, h, k, 0, 0)),
                       pl.BlockSpec((pl.squeezed, pl.squeezed, pl.squeezed, dec_rows), lambda s, h, k: (s, h, k, 0)),
                       pl.BlockSpec((pl.squeezed, pl.squeezed, pl.squeezed, dec_rows), lambda s, h, k: (s, h, k, 0))],
            out_shape=[jax.ShapeDtypeStruct(part + (head_dim,), jnp.float32),
                       jax.ShapeDtypeStruct(part, jnp.float32), jax.ShapeDtypeStruct(part, jnp.float32)],
        )(*scalars)
        out = _combine(md, acc, m, l, out, group=group, num_heads=num_heads, interpret=interpret)

    # Prefill-shaped sequences: query blocks against their pages. A step of T tokens holds at most
    # T // (max_q_dec + 1) of them (none in a pure decode step, which then skips this kernel).
    max_prefill_seqs = num_tokens // (max_q_dec + 1)
    if max_prefill_seqs:
        q_len = md.query_start[1:] - md.query_start[:-1]
        blk = query_blocks(md, num_tokens, pre_rows // group, include=q_len > max_q_dec,
                           sliding_window=sliding_window, max_seqs=max_prefill_seqs)
        args = (layer_arr, page_table, blk.seq, blk.tok0, blk.ntok, blk.pos0, blk.kv_lo, blk.kv_hi, q_rows, k_flat,
                v_flat)
        out = pl.pallas_call(
            functools.partial(_prefill_kernel, group=group, num_heads=num_heads, rows=pre_rows, block_k=pre_bk,
                              **attend_kw),
            grid=(blk.seq.shape[0], num_kv_heads), out_shape=out_shape,
            input_output_aliases={len(jax.tree.leaves(args)): 0},
            compiler_params=plgpu.CompilerParams(num_warps=prefill_warps, num_stages=prefill_stages),
            interpret=interpret,
            name="paged_prefill_gpu",
        )(*args, out)
    return out.reshape(num_tokens, num_heads, head_dim)


def rope_decode_attention(qkv: jax.Array, x: jax.Array, positions: jax.Array, inv_freq, cache: KVCache, layer,
                          md: BatchMetadata, *, num_heads: int, eps: float, scale: float,
                          soft_cap: float | None = None, sliding_window=None, qkv_bias: jax.Array | None = None,
                          q_norm: jax.Array | None = None, k_norm: jax.Array | None = None,
                          num_splits: int | None = None, decode_block_k: int = 64, decode_warps: int = 4,
                          decode_stages: int = 3, interpret: bool = False) -> tuple[jax.Array, KVCache]:
    """``rope_kv.rope_write_kv`` then ``ragged_paged_attention``, for a decode-only step (every
    sequence has one new token or none; ``positions`` are then ``seq_lens - 1``): one kernel (plus the
    split combine) instead of two. Returns (attention output ``[T, H, D]``, the cache).

    For steps of up to ``FUSED_MAX_SEQS`` sequences, where the step is launch latency (8B batch 1 on
    an H200: 4.10 -> 4.05 ms/token); larger steps run the two kernels: with 256 sequences the fused
    one was slower (175 vs 171 us per layer; every program reads its token's residual row and does
    its RoPE)."""
    num_tokens, hidden = x.shape
    nl, num_pages, page_size, num_kv_heads = cache.k.shape[:4]
    head_dim = cache.head_dim
    rope_kv.check_head_dim(head_dim)
    if (q_norm is None) != (k_norm is None):
        raise ValueError("q_norm and k_norm are given together or not at all")
    group = num_heads // num_kv_heads
    num_seqs = md.page_table.shape[0]
    rows = max(16, next_pow2(group))
    itemsize = max(jnp.dtype(qkv.dtype).itemsize, code_dtype(cache.k).itemsize)
    block_k, decode_stages, num_splits, blocks_per_split = _decode_plan(
        md, page_size, num_kv_heads, num_splits, decode_block_k, decode_stages, sliding_window, rows=rows,
        head_dim=head_dim, itemsize=itemsize)
    flat = (nl, num_pages * page_size, num_kv_heads, cache.k.shape[-1])
    caches = [cache.k.reshape(flat), cache.v.reshape(flat)]
    if cache.quantized:  # (codes, scales) pairs, aliased leaf by leaf
        caches = [(c, x.reshape(flat[:-1])) for c, x in zip(caches, (cache.k_scale, cache.v_scale))]
    cache_shapes = jax.tree.map(lambda c: jax.ShapeDtypeStruct(c.shape, c.dtype), caches)
    num_cache = len(jax.tree.leaves(caches))
    args = [_layer_window(layer, sliding_window), jnp.clip(md.page_table, 0, num_pages - 1), md.seq_lens,
            md.query_start, md.slot_mapping, jnp.asarray(inv_freq, jnp.float32), x.reshape(-1),
            qkv.reshape(-1, head_dim)]
    if qkv_bias is not None:
        args.append(qkv_bias.reshape(-1, head_dim))
    if q_norm is not None:
        args += [q_norm, k_norm]
    n = len(jax.tree.leaves(args))  # the caches follow, aliased to the last two outputs
    num_rows = num_tokens * num_heads
    out = jnp.zeros((num_rows, head_dim), qkv.dtype)
    if num_splits == 1:
        out_shape = [jax.ShapeDtypeStruct(out.shape, out.dtype)]
        extra, aliases = (out,), {n + num_cache: 0, **{n + i: 1 + i for i in range(num_cache)}}
    else:
        part = (num_seqs, num_kv_heads, num_splits, rows)
        out_shape = [jax.ShapeDtypeStruct(part + (head_dim,), jnp.float32), jax.ShapeDtypeStruct(part, jnp.float32),
                     jax.ShapeDtypeStruct(part, jnp.float32)]
        extra, aliases = (), {n + i: 3 + i for i in range(num_cache)}
    *res, k, v = pl.pallas_call(
        functools.partial(_rope_decode_kernel, num_heads=num_heads, num_kv_heads=num_kv_heads, hidden=hidden,
                          eps=eps, rows=rows, blocks_per_split=blocks_per_split, block_k=block_k,
                          page_size=page_size, scale=scale, soft_cap=soft_cap, windowed=sliding_window is not None,
                          has_bias=qkv_bias is not None, has_norm=q_norm is not None,
                          interpret=interpret, q_parts=False,
                          precision=jax.lax.Precision.HIGHEST if qkv.dtype == jnp.float32 else None),
        grid=(num_seqs, num_kv_heads, num_splits), out_shape=out_shape + cache_shapes,
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(num_warps=decode_warps, num_stages=decode_stages),
        interpret=interpret, name="rope_paged_decode_gpu",
    )(*args, *caches, *extra)
    if num_splits == 1:
        (out,) = res
    else:
        out = _combine(md, *res, out, group=group, num_heads=num_heads, interpret=interpret)
    return out.reshape(num_tokens, num_heads, head_dim), rope_kv.unflat_cache(cache, k, v)

