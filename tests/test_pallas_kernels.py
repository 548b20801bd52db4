"""Pallas attention kernels against the reference (jaxinfer.paged.attention).

On CPU the TPU kernel and the GPU (Triton) kernel both run in Pallas interpret mode; on a GPU the
GPU kernel runs natively (same cases); the native TPU case skips unless a TPU is present. Shapes are
small because interpret mode is slow, but cover: decodes and (chunked) prefill in one batch, context
lengths 1, page_size-1, page_size, page_size+1 and several pages, GQA 1/2/3/7/8, head_dim 64/128/256,
page sizes 16..128, f32/bf16, pages scattered in the pool, soft-cap, sliding windows shorter than
the context and across page boundaries (static and traced), Q/K/V biases and per-head q/k norms in
the RoPE kernels, padding sequences and padding tokens (which must come out as zeros), int8 and fp8
caches (the GPU kernels read and write codes plus per-token scales); and the decoder of a family with
all of these through the kernels against the same decoder on the reference. The reference itself
is checked against float64 attention one query at a time.
"""

from __future__ import annotations

import dataclasses
import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.paged import cpu_attention
from jaxinfer.paged.attention import ragged_paged_attention as reference
from jaxinfer.paged.kv_cache import BatchMetadata
from jaxinfer.models.config import PRESETS
from jaxinfer.models.layers import Ops, rope_frequencies, rope_write_kv
from jaxinfer.paged.kv_cache import KVCache, dequantize, kv_storage_dtype, pack_codes, quantize, unpack_codes
from jaxinfer.batching.backend import ATTENTION_BACKENDS, backend_for
from jaxinfer.pallas_kernels import gpu, rope_kv, tpu

ON_GPU = jax.default_backend() == "gpu"
ON_TPU = jax.default_backend() == "tpu"

KERNELS = [
    pytest.param(functools.partial(tpu.ragged_paged_attention, interpret=True), id="tpu_interpret"),
    # Natively on a GPU; in interpret mode elsewhere (same kernel code, so CPU CI checks it too).
    pytest.param(functools.partial(gpu.ragged_paged_attention, interpret=not ON_GPU),
                 id="gpu" if ON_GPU else "gpu_interpret"),
    pytest.param(tpu.ragged_paged_attention, id="tpu",
                 marks=pytest.mark.skipif(not ON_TPU, reason="pallas_tpu needs a TPU (jax.default_backend() != 'tpu')")),
]


def make_batch(rng, seqs, *, page_size, num_kv_heads, head_dim, group, dtype, num_layers=2, pad_tokens=3,
               pad_seqs=1):
    """Random cache and queries for ``seqs`` = [(q_len, seq_len)], pages scattered over the pool."""
    seqs = list(seqs) + [(0, 0)] * pad_seqs
    pages_needed = [-(-ctx // page_size) for _, ctx in seqs]
    pages_per_seq = max(pages_needed) + 1  # one spare column: page-table padding must be ignored
    num_pages = sum(pages_needed) + 5
    perm = rng.permutation(num_pages)
    # Padding entries point at real (other sequences') pages, as a reused bucket would.
    page_table = rng.integers(0, num_pages, (len(seqs), pages_per_seq)).astype(np.int32)
    k = 0
    for s, n in enumerate(pages_needed):
        page_table[s, :n] = perm[k:k + n]
        k += n
    q_lens = np.array([ql for ql, _ in seqs], np.int32)
    query_start = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    num_tokens = int(query_start[-1]) + pad_tokens
    md = BatchMetadata(
        slot_mapping=jnp.zeros((num_tokens,), jnp.int32),
        page_table=jnp.asarray(page_table),
        seq_lens=jnp.asarray([ctx for _, ctx in seqs], jnp.int32),
        query_start=jnp.asarray(query_start),
        logits_indices=jnp.zeros((len(seqs),), jnp.int32),
    )
    shape = (num_layers, num_pages, page_size, num_kv_heads, head_dim)
    kc = jnp.asarray(rng.standard_normal(shape), dtype)
    vc = jnp.asarray(rng.standard_normal(shape), dtype)
    q = jnp.asarray(rng.standard_normal((num_tokens, num_kv_heads * group, head_dim)), dtype)
    return q, kc, vc, md


def rel_err(out, ref):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return np.linalg.norm(out - ref) / np.linalg.norm(ref)


def quantized_cache(kc, vc, kv_cache_dtype: str) -> KVCache:
    """Float caches' values as an int8/fp8 cache (codes and per-token-per-head scales)."""
    dtype = kv_storage_dtype(kv_cache_dtype, jnp.float32)
    (kq, ks), (vq, vs) = quantize(kc, dtype), quantize(vc, dtype)
    return KVCache(pack_codes(kq), pack_codes(vq), ks, vs)


def assert_quantized_caches_close(got: KVCache, want: KVCache, written: np.ndarray | None = None):
    """Two quantized caches agree: every dequantized value within one quantization step (a kernel's
    float rounding of a value before quantizing, e.g. its RMS scale summed in another order, may tip
    a code across a rounding boundary or move a scale by an ulp), and at least 99% of codes equal.
    ``written``: flat slots that must have changed from zero scales (the write happened)."""
    for (c, x), (wc, wx) in (((got.k, got.k_scale), (want.k, want.k_scale)),
                             ((got.v, got.v_scale), (want.v, want.v_scale))):
        assert c.dtype == wc.dtype and x.dtype == wx.dtype == jnp.float32
        a, b = np.asarray(dequantize(unpack_codes(c), x)), np.asarray(dequantize(unpack_codes(wc), wx))
        scale = np.asarray(wx)[..., None]
        # One code step: int8's is the scale; e4m3's (3 mantissa bits) at most an eighth of the value,
        # and 2**-9 (its subnormal step) of the scale near zero.
        step = (scale if wc.dtype == jnp.int8 else np.abs(b) / 8 + scale * 2.0 ** -9) * 1.001 + 1e-6
        assert (np.abs(a - b) <= step).all()
        codes = [np.asarray(unpack_codes(y).astype(jnp.float32)) for y in (c, wc)]
        assert (codes[0] == codes[1]).mean() >= 0.99
        if written is not None:
            assert (np.asarray(x)[1].reshape(-1, x.shape[-1])[written] > 0).all()


CASES = {
    # name: (seqs [(q_len, seq_len)], page_size, kv_heads, head_dim, group, dtype, soft_cap, window)
    "mixed_f32_gqa3_d64": ([(1, 1), (1, 15), (1, 16), (1, 17), (1, 70), (5, 5), (9, 40)],
                           16, 2, 64, 3, jnp.float32, None, None),
    "mixed_bf16_gqa8_d128": ([(1, 31), (1, 33), (1, 130), (12, 12), (20, 64)],
                             32, 1, 128, 8, jnp.bfloat16, None, None),
    "gqa1_f32_d128_softcap_window": ([(1, 63), (1, 65), (2, 100), (17, 33)],
                                     64, 2, 128, 1, jnp.float32, 3.0, 20),
    "bf16_gqa3_page128_window": ([(1, 127), (1, 129), (40, 300)],
                                 128, 1, 64, 3, jnp.bfloat16, 20.0, 50),
    # Gemma 2's head_dim 256, GQA 2 and soft cap 50 (scores scaled up so the cap bites); in float32
    # the GPU kernel's prefill key blocks are half a page (shared memory, gpu._fit).
    "gemma2_f32_gqa2_d256_softcap_window": ([(1, 150), (1, 40), (1, 7), (11, 90)],
                                            64, 1, 256, 2, jnp.float32, 50.0, 40),
    # Qwen2.5-7B's GQA 7 (28/4 heads): rows of a block are not a power of two of tokens.
    "qwen_bf16_gqa7_d128": ([(1, 33), (1, 90), (6, 6), (13, 50)], 16, 1, 128, 7, jnp.bfloat16, None, None),
}


def dense_attention(q, kc, vc, layer, md, *, scale, soft_cap, sliding_window):
    """Each sequence's queries over its own context in float64 numpy, one query at a time."""
    q, kc, vc = (np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (q, kc, vc))
    qs, lens, table = (np.asarray(x) for x in (md.query_start, md.seq_lens, md.page_table))
    kvh = kc.shape[3]
    out = np.zeros_like(q)
    for s in range(len(lens)):
        keys = kc[layer][table[s]].reshape(-1, kvh, q.shape[-1])
        vals = vc[layer][table[s]].reshape(-1, kvh, q.shape[-1])
        for i, t in enumerate(range(qs[s], qs[s + 1])):
            p = lens[s] - (qs[s + 1] - qs[s]) + i
            lo = 0 if sliding_window is None else max(0, p - sliding_window + 1)
            for h in range(q.shape[1]):
                g = h // (q.shape[1] // kvh)
                sc = keys[lo:p + 1, g] @ q[t, h] * scale
                if soft_cap is not None:
                    sc = soft_cap * np.tanh(sc / soft_cap)
                w = np.exp(sc - sc.max())
                out[t, h] = w @ vals[lo:p + 1, g] / w.sum()
    return out


REFERENCE_CASES = {
    "long_chunk_among_decodes": ([(1, 20), (1, 3), (37, 50), (1, 9), (20, 20)], 16, 3, 64, 3, jnp.float32, None, None),
    # Contexts over several of the reference's 256-token key blocks (its loop stops at the longest).
    "contexts_over_key_blocks": ([(1, 700), (1, 256), (1, 257), (30, 540), (1, 5)], 16, 2, 64, 3, jnp.float32, None,
                                 None),
    "one_long_sequence_window_softcap": ([(40, 1000)], 16, 2, 64, 2, jnp.float32, 5.0, 300),
    "batch1_decode_over_key_blocks": ([(1, 700)], 16, 2, 64, 3, jnp.float32, None, None),  # one query: no dot
    # Decode steps: each query its own sequence's, in order, read as a slice of the contexts, not a
    # per-query copy; with padding queries past the sequences, and (20 decodes: blocks of 16) a
    # second block that runs past the sequences and takes the copy.
    "decodes_in_order_over_key_blocks": ([(1, 20), (1, 300), (1, 5), (1, 260)], 16, 2, 64, 3, jnp.float32, None,
                                         None),
    "twenty_decodes": ([(1, 3 + 29 * i % 300) for i in range(20)], 16, 1, 64, 2, jnp.float32, None, None),
}


@pytest.mark.parametrize("case", list(CASES) + list(REFERENCE_CASES))
def test_reference_matches_dense_attention(case):
    """The reference itself against one-query-at-a-time float64 attention: its query blocks of several
    sequences read one context where a block is one sequence's (a prefill chunk) and each query's
    own otherwise; a 37-token chunk between decodes has blocks of both kinds and one that straddles;
    contexts longer than one key block (an online softmax over a loop as long as the longest)."""
    seqs, page_size, kvh, head_dim, group, dtype, soft_cap, window = {**CASES, **REFERENCE_CASES}[case]
    rng = np.random.default_rng(zlib.crc32(case.encode()))
    q, kc, vc, md = make_batch(rng, seqs, page_size=page_size, num_kv_heads=kvh, head_dim=head_dim,
                               group=group, dtype=dtype)
    kw = dict(scale=head_dim ** -0.5 * (1.0 if soft_cap is None else soft_cap / 2), soft_cap=soft_cap,
              sliding_window=window)
    out = np.asarray(jax.jit(functools.partial(reference, **kw))(q, kc, vc, jnp.int32(1), md).astype(jnp.float32))
    want = dense_attention(q, kc, vc, 1, md, **kw)
    n_real = int(md.query_start[-1])
    assert not out[n_real:].any(), "padding tokens must produce zeros"
    assert rel_err(out[:n_real], want[:n_real]) < (1e-5 if dtype == jnp.float32 else 1e-2)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("kernel", KERNELS)
def test_matches_reference(kernel, case):
    seqs, page_size, kvh, head_dim, group, dtype, soft_cap, window = CASES[case]
    rng = np.random.default_rng(zlib.crc32(case.encode()))
    q, kc, vc, md = make_batch(rng, seqs, page_size=page_size, num_kv_heads=kvh, head_dim=head_dim,
                               group=group, dtype=dtype)
    # With a soft cap, scores scaled to a standard deviation of cap / 2, so the cap bites (one
    # score in twenty is past it before capping).
    kw = dict(scale=head_dim ** -0.5 * (1.0 if soft_cap is None else soft_cap / 2), soft_cap=soft_cap,
              sliding_window=window)
    layer = jnp.int32(1)  # traced, as inside the model's lax.scan over layers
    with jax.default_matmul_precision("float32"):  # no TF32 in the oracle on GPU
        ref = jax.jit(functools.partial(reference, **kw))(q, kc, vc, layer, md)
    out = jax.jit(functools.partial(kernel, **kw))(q, kc, vc, layer, md)
    assert out.shape == q.shape and out.dtype == q.dtype
    out = np.asarray(out.astype(jnp.float32))
    assert np.isfinite(out).all()
    n_real = int(md.query_start[-1])
    assert not out[n_real:].any(), "padding tokens must produce zeros"
    tol = 1e-5 if dtype == jnp.float32 else 1e-2
    assert rel_err(out[:n_real], np.asarray(ref.astype(jnp.float32))[:n_real]) < tol


@pytest.mark.parametrize("case,kv_cache_dtype", [("gqa1_f32_d128_softcap_window", "fp8"),
                                                 ("mixed_bf16_gqa8_d128", "int8"), ("mixed_bf16_gqa8_d128", "fp8")])
def test_gpu_quantized_cache_matches_reference(case, kv_cache_dtype):
    """The GPU kernels over an int8/fp8 cache against the reference over the same codes and scales
    (which dequantizes the gathered context before attending): the float cases' tolerance, since the
    kernel's in-register dequantization (codes cast for the dot, scales on the scores and on the
    probabilities) is the reference's up to float rounding. Pages of 32 (key blocks gathered over
    several pages) and of 64 (one-page slices), soft cap and window, float32 and bf16 queries."""
    seqs, page_size, kvh, head_dim, group, dtype, soft_cap, window = CASES[case]
    rng = np.random.default_rng(zlib.crc32(case.encode()))
    q, kc, vc, md = make_batch(rng, seqs, page_size=page_size, num_kv_heads=kvh, head_dim=head_dim,
                               group=group, dtype=jnp.float32)
    q, cache = q.astype(dtype), quantized_cache(kc, vc, kv_cache_dtype)
    kw = dict(scale=head_dim ** -0.5 * (1.0 if soft_cap is None else soft_cap / 2), soft_cap=soft_cap,
              sliding_window=window)
    layer = jnp.int32(1)
    with jax.default_matmul_precision("float32"):
        ref = reference(q, cache.k, cache.v, layer, md, **kw, **cache.scales())
    kernel = functools.partial(gpu.ragged_paged_attention, interpret=not ON_GPU, **kw)
    out = jax.jit(kernel)(q, cache.k, cache.v, layer, md, **cache.scales())
    n_real = int(md.query_start[-1])
    out = np.asarray(out.astype(jnp.float32))
    assert out.dtype == np.float32 and not out[n_real:].any()
    tol = 1e-5 if dtype == jnp.float32 else 1e-2
    assert rel_err(out[:n_real], np.asarray(ref.astype(jnp.float32))[:n_real]) < tol


@pytest.mark.parametrize("kernel", KERNELS)
def test_static_layer_and_decode_only(kernel):
    """A Python-int layer (the unrolled loop) and a pure decode batch of long sequences."""
    rng = np.random.default_rng(7)
    q, kc, vc, md = make_batch(rng, [(1, 200), (1, 257), (1, 3)], page_size=16, num_kv_heads=2, head_dim=64,
                               group=4, dtype=jnp.float32, pad_tokens=0)
    with jax.default_matmul_precision("float32"):
        ref = reference(q, kc, vc, 0, md, scale=0.125)
    out = jax.jit(lambda q, k, v, md: kernel(q, k, v, 0, md, scale=0.125))(q, kc, vc, md)
    assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("kernel", KERNELS[:2] + [pytest.param(
    functools.partial(gpu.ragged_paged_attention, interpret=not ON_GPU, num_splits=4, decode_block_k=16),
    id="gpu_splits4")])
def test_traced_sliding_window(kernel):
    """The window as a traced scalar, as the scanned layer loop passes it (each layer's, global
    layers ``decoder.GLOBAL_WINDOW``): one compiled kernel, run with a window shorter than the context
    (starting mid-page) and with the global one, against the reference with a static window and with
    none. Decodes, a chunked prefill and a context shorter than the window; with four KV splits over
    the window's key blocks, some of them empty. Pages wholly before the window hold NaN in the
    short window's run: a kernel that loaded them (even masked: 0 * NaN) would return NaN."""
    from jaxinfer.models.decoder import GLOBAL_WINDOW

    rng = np.random.default_rng(11)
    seqs, ps = [(1, 100), (1, 16), (1, 1), (9, 50)], 16
    q, kc, vc, md = make_batch(rng, seqs, page_size=ps, num_kv_heads=2, head_dim=64, group=2, dtype=jnp.float32)
    pt = np.array(md.page_table)
    # Pages wholly before position 100 - 23 + 1 = 78 (seq 0) and 41 - 23 + 1 = 19 (seq 3), the first visible.
    outside = list(pt[0, :78 // ps]) + list(pt[3, :19 // ps])
    for s, (_, ctx) in enumerate(seqs):  # page-table padding must not point at them either
        pad = pt[s, -(-ctx // ps):]
        pad[np.isin(pad, outside)] = pt[0, 99 // ps]
    md = dataclasses.replace(md, page_table=jnp.asarray(pt))
    poisoned = [c.at[1, np.asarray(outside)].set(np.nan) for c in (kc, vc)]
    traces = []

    @jax.jit
    def f(q, kc, vc, md, w):
        traces.append(w)
        return kernel(q, kc, vc, jnp.int32(1), md, scale=0.125, sliding_window=w)

    n_real = int(md.query_start[-1])
    for window, static, cache in ((23, 23, poisoned), (GLOBAL_WINDOW, None, (kc, vc))):
        with jax.default_matmul_precision("float32"):
            ref = reference(q, kc, vc, 1, md, scale=0.125, sliding_window=static)
        out = np.asarray(f(q, *cache, md, jnp.int32(window)))
        assert not out[n_real:].any()
        assert rel_err(out[:n_real], np.asarray(ref)[:n_real]) < 1e-5
    assert len(traces) == 1


def test_gpu_shared_memory_plans():
    """What ``gpu._fit`` gives each shape: the tuned bf16 plans up to head_dim 128 unchanged (so the
    Llama path compiles the same kernels), fewer stages for head_dim 256, and in float32 at head_dim
    256 key blocks of half a 64-slot page; every plan within the budget."""
    fit = gpu._fit
    assert fit(64, 3, rows=16, head_dim=128, itemsize=2) == (64, 3)  # decode, Llama 8B
    assert fit(64, 2, rows=128, head_dim=128, itemsize=2) == (64, 2)  # prefill
    assert fit(64, 3, rows=16, head_dim=256, itemsize=2) == (64, 2)  # decode, Gemma 2
    assert fit(64, 2, rows=64, head_dim=256, itemsize=2) == (64, 2)  # prefill
    assert fit(64, 2, rows=64, head_dim=256, itemsize=4) == (32, 2)
    assert fit(128, 3, rows=16, head_dim=256, itemsize=4) == (64, 1)
    with pytest.raises(ValueError, match="head_dim 96 .* allowed: \\(16, 32, 64, 128, 256\\)"):
        rope_kv.check_head_dim(96)


@pytest.mark.parametrize("case,splits", [("mixed_f32_gqa3_d64", 1), ("mixed_bf16_gqa8_d128", 3)])
def test_gpu_multi_page_key_blocks(case, splits):
    """The GPU kernel's key blocks spanning several pages (rows gathered via the page table) and
    explicit KV splits: one (the decode kernel writes the output itself) and three (rounded up to a
    power of two, merged by the combine kernel)."""
    seqs, page_size, kvh, head_dim, group, dtype, soft_cap, window = CASES[case]
    rng = np.random.default_rng(3)
    q, kc, vc, md = make_batch(rng, seqs, page_size=page_size, num_kv_heads=kvh, head_dim=head_dim,
                               group=group, dtype=dtype)
    kw = dict(scale=head_dim ** -0.5, soft_cap=soft_cap, sliding_window=window)
    with jax.default_matmul_precision("float32"):
        ref = reference(q, kc, vc, 1, md, **kw)
    kernel = functools.partial(gpu.ragged_paged_attention, interpret=not ON_GPU, num_splits=splits,
                               decode_block_k=4 * page_size, prefill_block_k=2 * page_size, **kw)
    out = jax.jit(kernel)(q, kc, vc, jnp.int32(1), md)
    tol = 1e-5 if dtype == jnp.float32 else 1e-2
    assert rel_err(out.astype(jnp.float32), ref.astype(jnp.float32)) < tol


def test_backends_choose_their_kernels():
    cpu, gpu_, tpu_ = (backend_for(p) for p in ("cpu", "gpu", "tpu"))
    # The reference step reads the cache and writes every layer's K/V after the loop (Ops.defer_kv_write).
    assert cpu.ops("reference", 64, False) == Ops(attention=reference, defer_kv_write=True)
    for name in ATTENTION_BACKENDS[1:]:
        assert callable(cpu.ops(name, 64, False).attention)
    kernels = gpu_.ops("pallas_gpu", 64, False)
    assert kernels.rope_write_kv is rope_kv.rope_write_kv and kernels.decode_attention is gpu.rope_decode_attention
    # "auto": the platform's own; the CPU's is the reference with few-token steps through the native kernel
    assert cpu.attention_backend("auto", 96) == "cpu" and tpu_.attention_backend("auto", 64) == "pallas_tpu"
    assert cpu.ops("cpu", 64, False) == Ops(attention=cpu_attention.ragged_paged_attention, defer_kv_write=True)
    with pytest.raises(ValueError, match="pallas_gpu"):
        cpu.attention_backend("cuda", 64)
    # Phi-3's head_dim 96: "auto" on a GPU falls back to the reference; asking for the GPU kernels is an error.
    assert gpu_.attention_backend("auto", 96) == "reference" and gpu_.attention_backend("auto", 128) == "pallas_gpu"
    assert gpu_.ops("pallas_gpu", 256, False).rope_write_kv is rope_kv.rope_write_kv
    with pytest.raises(ValueError, match="head_dim 96 is not supported by the pallas_gpu kernels"):
        gpu_.ops("pallas_gpu", 96, False)


def attention_extras(rng, extras, heads, kv_heads, head_dim, dtype):
    """Random Q/K/V biases (Qwen2) and q/k norm gains (Qwen3, Gemma 3), as ``extras`` names them."""
    out = {}
    if "bias" in extras:
        out["qkv_bias"] = jnp.asarray(rng.standard_normal((heads + 2 * kv_heads) * head_dim), dtype)
    if "norm" in extras:
        out.update({name: jnp.asarray(1 + 0.5 * rng.standard_normal(head_dim), dtype) for name in ("q_norm", "k_norm")})
    return out


@pytest.mark.parametrize("heads,kv_heads,head_dim,dtype,kv_per_program,extras", [
    (9, 3, 64, jnp.float32, None, ""), (9, 3, 64, jnp.float32, 3, ""), (32, 8, 128, jnp.bfloat16, None, ""),
    (32, 8, 128, jnp.bfloat16, 2, ""), (14, 2, 128, jnp.bfloat16, None, "bias"), (8, 4, 256, jnp.float32, 4, "norm"),
    (6, 6, 64, jnp.float32, 2, "bias+norm")])
def test_gpu_rope_write_kv_matches_reference(heads, kv_heads, head_dim, dtype, kv_per_program, extras):
    """The fused norm scale + RoPE + K/V write kernel against the jnp path: q, and both caches (written
    slots scattered over the pool, padding tokens' out-of-pool slots dropped, other slots untouched).
    Head counts that are not powers of two (SmolLM2's 9/3) exercise the masked rows, its hidden size
    576 the masked residual row; programs of one kv head (the default here) and of several. Q/K/V
    biases with GQA 7 (Qwen2.5-7B's ratio), q/k head norms at head_dim 256 (Gemma 3), both with GQA 1."""
    rng = np.random.default_rng(heads)
    num_layers, num_pages, page_size, t, hidden = 2, 6, 16, 7, heads * head_dim
    cache = KVCache(*(jnp.asarray(rng.standard_normal((num_layers, num_pages, page_size, kv_heads, head_dim)), dtype)
                      for _ in range(2)))
    qkv = jnp.asarray(rng.standard_normal((t, (heads + 2 * kv_heads) * head_dim)), dtype)
    x = jnp.asarray(rng.standard_normal((t, hidden)) * rng.uniform(0.2, 5.0, (t, 1)), dtype)  # the residual stream
    positions = jnp.asarray(rng.integers(0, 5000, t), jnp.int32)
    slots = rng.permutation(num_pages * page_size)[:t]
    slots[-2:] = num_pages * page_size  # padding tokens
    inv_freq = rope_frequencies(dataclasses.replace(PRESETS["smollm2-135m"], head_dim=head_dim))
    kw = dict(num_heads=heads, num_kv_heads=kv_heads, eps=1e-5,
              **attention_extras(rng, extras, heads, kv_heads, head_dim, dtype))
    layer = jnp.int32(1)
    with jax.default_matmul_precision("float32"):
        q_ref, c_ref = jax.jit(functools.partial(rope_write_kv, **kw))(qkv, x, positions, inv_freq, cache,
                                                                        layer, jnp.asarray(slots))
    kernel = functools.partial(rope_kv.rope_write_kv, interpret=not ON_GPU, kv_per_program=kv_per_program, **kw)
    q, c = jax.jit(kernel, donate_argnums=(4,))(qkv, x, positions, inv_freq, cache, layer, jnp.asarray(slots))
    tol = 1e-5 if dtype == jnp.float32 else 1e-2
    assert q.shape == q_ref.shape and q.dtype == dtype
    assert rel_err(q, q_ref) < tol
    for got, want in ((c.k, c_ref.k), (c.v, c_ref.v)):
        assert got.dtype == dtype and rel_err(got, want) < tol
        np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))  # other layer untouched
    with pytest.raises(ValueError, match="kv_per_program=2 must divide num_kv_heads=3"):
        rope_kv.rope_write_kv(qkv, x, positions, inv_freq, cache, layer, jnp.asarray(slots), num_heads=9,
                              num_kv_heads=3, eps=1e-5, kv_per_program=2)
    with pytest.raises(ValueError, match="q_norm and k_norm"):
        rope_kv.rope_write_kv(qkv, x, positions, inv_freq, cache, layer, jnp.asarray(slots), num_heads=heads,
                              num_kv_heads=kv_heads, eps=1e-5, q_norm=jnp.ones(head_dim))


@pytest.mark.parametrize("heads,kv_heads,head_dim,dtype,kv_per_program,kv_cache_dtype", [
    (9, 3, 64, jnp.float32, None, "int8"), (32, 8, 128, jnp.bfloat16, 2, "fp8")])
def test_gpu_rope_write_kv_quantized_cache(heads, kv_heads, head_dim, dtype, kv_per_program, kv_cache_dtype):
    """The RoPE + K/V write kernel into an int8/fp8 cache against the jnp write (``kv_cache.write_kv``
    quantizing rope_qkv's float k/v): codes and scales of the written slots, the rest untouched
    (SmolLM2's 9/3 heads: masked rows; programs of one and of two kv heads)."""
    rng = np.random.default_rng(heads)
    num_layers, num_pages, page_size, t = 2, 6, 16, 7
    shape = (num_layers, num_pages, page_size, kv_heads, head_dim)
    cache = quantized_cache(*(jnp.asarray(rng.standard_normal(shape), jnp.float32) for _ in range(2)), kv_cache_dtype)
    cache = dataclasses.replace(cache, k_scale=cache.k_scale.at[1].set(0.0), v_scale=cache.v_scale.at[1].set(0.0))
    qkv = jnp.asarray(rng.standard_normal((t, (heads + 2 * kv_heads) * head_dim)), dtype)
    x = jnp.asarray(rng.standard_normal((t, heads * head_dim)) * rng.uniform(0.2, 5.0, (t, 1)), dtype)
    positions = jnp.asarray(rng.integers(0, 5000, t), jnp.int32)
    slots = rng.permutation(num_pages * page_size)[:t]
    slots[-2:] = num_pages * page_size  # padding tokens
    inv_freq = rope_frequencies(dataclasses.replace(PRESETS["smollm2-135m"], head_dim=head_dim))
    kw = dict(num_heads=heads, num_kv_heads=kv_heads, eps=1e-5)
    layer = jnp.int32(1)
    with jax.default_matmul_precision("float32"):
        q_ref, c_ref = jax.jit(functools.partial(rope_write_kv, **kw))(qkv, x, positions, inv_freq, cache, layer,
                                                                        jnp.asarray(slots))
    kernel = functools.partial(rope_kv.rope_write_kv, interpret=not ON_GPU, kv_per_program=kv_per_program, **kw)
    q, c = jax.jit(kernel)(qkv, x, positions, inv_freq, cache, layer, jnp.asarray(slots))
    assert rel_err(q, q_ref) < (1e-5 if dtype == jnp.float32 else 1e-2)
    assert_quantized_caches_close(c, c_ref, written=slots[:-2])
    for got, want in zip(jax.tree.leaves(c), jax.tree.leaves(cache)):  # layer 0 untouched
        np.testing.assert_array_equal(np.asarray(got[0].astype(jnp.float32)), np.asarray(want[0].astype(jnp.float32)))


@pytest.mark.parametrize("seq_lens,page_size,kv_heads,group,head_dim,dtype,splits,block_k,soft_cap,window,extras", [
    ((1, 15, 16, 17, 70), 16, 3, 3, 64, jnp.float32, None, None, None, None, ""),
    ((33, 130, 2), 16, 2, 4, 128, jnp.bfloat16, 8, 64, None, None, ""),
    ((63, 65, 100), 16, 2, 1, 64, jnp.float32, 2, 32, 3.0, 20, ""),
    ((300,), 16, 8, 4, 128, jnp.bfloat16, 1, 64, None, None, ""),
    ((1, 40, 90), 16, 1, 2, 256, jnp.float32, 4, 16, 50.0, 24, "norm+traced"),
    ((33, 64, 65), 16, 1, 7, 128, jnp.bfloat16, None, 64, None, None, "bias"),
    # Quantized caches: the new token is coded as the reference's write stores it and attended to so.
    ((1, 15, 16, 17, 70), 16, 3, 3, 64, jnp.float32, None, None, None, None, "int8"),
    ((33, 130, 2), 16, 2, 4, 128, jnp.bfloat16, 8, 64, None, None, "fp8")])
def test_gpu_rope_decode_attention_matches_reference(seq_lens, page_size, kv_heads, group, head_dim, dtype, splits,
                                                     block_k, soft_cap, window, extras):
    """The decode-only kernel (norm scale, RoPE, K/V write and attention in one) against the jnp
    rope_write_kv followed by the reference attention: the output and both caches. Covers a sequence
    whose only key is its new token, new tokens at a page's first and last slot, a padding sequence
    and padding tokens (zeros out, no cache write), SmolLM2's 9/3 heads and 576-wide residual rows,
    one KV split (rows written directly) and several (combined), multi-page key blocks, soft-cap and
    a sliding window (static; traced, with Gemma's head_dim 256, soft cap 50 and q/k norms), Q/K/V
    biases with GQA 7."""
    rng = np.random.default_rng(sum(seq_lens))
    _, kc, vc, md = make_batch(rng, [(1, n) for n in seq_lens], page_size=page_size, num_kv_heads=kv_heads,
                               head_dim=head_dim, group=group, dtype=dtype, pad_tokens=2)
    heads, t, n = kv_heads * group, md.slot_mapping.shape[0], len(seq_lens)
    pos = np.asarray(seq_lens) - 1
    pages = np.asarray(md.page_table)[np.arange(n), pos // page_size]
    slots = np.full(t, kc.shape[1] * page_size, np.int32)  # padding tokens: past the pool
    slots[:n] = pages * page_size + pos % page_size
    positions = np.zeros(t, np.int32)
    positions[:n] = pos
    md = dataclasses.replace(md, slot_mapping=jnp.asarray(slots), decode_only=True)
    qkv = jnp.asarray(rng.standard_normal((t, (heads + 2 * kv_heads) * head_dim)), dtype)
    x = jnp.asarray(rng.standard_normal((t, heads * head_dim)) * rng.uniform(0.2, 5.0, (t, 1)), dtype)
    inv_freq = rope_frequencies(dataclasses.replace(PRESETS["smollm2-135m"], head_dim=head_dim))
    kv_quant = extras if extras in ("int8", "fp8") else None
    cache = KVCache(kc, vc) if kv_quant is None else quantized_cache(kc.astype(jnp.float32), vc.astype(jnp.float32),
                                                                     kv_quant)
    layer = jnp.int32(1)
    kw = dict(scale=head_dim ** -0.5 * (1.0 if soft_cap is None else soft_cap / 2), soft_cap=soft_cap)
    ex = attention_extras(rng, extras, heads, kv_heads, head_dim, dtype)
    with jax.default_matmul_precision("float32"):
        q, c_ref = rope_write_kv(qkv, x, jnp.asarray(positions), inv_freq, cache, layer, md.slot_mapping,
                                 num_heads=heads, num_kv_heads=kv_heads, eps=1e-5, **ex)
        ref = reference(q, c_ref.k, c_ref.v, layer, md, sliding_window=window, **kw, **c_ref.scales())
    kernel = functools.partial(gpu.rope_decode_attention, interpret=not ON_GPU, num_splits=splits,
                               decode_block_k=block_k, num_heads=heads, eps=1e-5, **kw, **ex)
    if "traced" in extras:
        out, c = jax.jit(lambda *a, w: kernel(*a, sliding_window=w), donate_argnums=(4,))(
            qkv, x, jnp.asarray(positions), inv_freq, cache, layer, md, w=jnp.int32(window))
    else:
        out, c = jax.jit(functools.partial(kernel, sliding_window=window), donate_argnums=(4,))(
            qkv, x, jnp.asarray(positions), inv_freq, cache, layer, md)
    assert out.shape == q.shape and out.dtype == dtype
    out = np.asarray(out.astype(jnp.float32))
    assert not out[n:].any(), "padding tokens must produce zeros"
    tol = 1e-5 if dtype == jnp.float32 else 1e-2
    assert rel_err(out[:n], np.asarray(ref.astype(jnp.float32))[:n]) < tol
    if kv_quant:
        assert_quantized_caches_close(c, c_ref)
        for got, want in zip(jax.tree.leaves(c), jax.tree.leaves(c_ref)):  # other layer untouched
            np.testing.assert_array_equal(np.asarray(got[0].astype(jnp.float32)),
                                          np.asarray(want[0].astype(jnp.float32)))
        return
    for got, want in ((c.k, c_ref.k), (c.v, c_ref.v)):
        assert rel_err(got, want) < tol
        np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))  # other layer untouched


@pytest.mark.parametrize("backend", ["interpret", "pallas_gpu"])
def test_engine_greedy_with_interpreted_kernels_equals_reference(backend, monkeypatch):
    """End to end: the engine with a backend's kernels in Pallas interpret mode generates the
    reference's tokens, through mixed prefill-chunk + decode steps and a scanned layer loop (traced
    layer index). ``interpret`` is the TPU kernel; ``pallas_gpu`` is patched to its kernels
    (attention; norm scale + RoPE + K/V write; both in one for decode-only steps) interpreted: the
    GPU path's wiring, checked on CPU. Float32 on every platform: a GPU's default bf16 would part the
    two runs at near-ties, which says nothing about the kernels."""
    from jaxinfer import LLM, SamplingParams
    from jaxinfer.batching.backend import CpuBackend

    opts = dict(load_format="dummy", dtype="float32", max_num_seqs=4, max_num_batched_tokens=32, num_pages=64,
                max_model_len=128, token_buckets=(8, 32), seq_buckets=(4,), page_buckets=(8,))
    prompts = [list(range(3, 3 + n)) for n in (5, 21, 40)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    ref = LLM("tiny-llama3", attention_backend="reference", **opts).generate(prompts, params)
    if backend == "pallas_gpu":
        interpreted = interpreted_gpu_ops()
        monkeypatch.setattr(CpuBackend, "ops", lambda *_: interpreted)
    got = LLM("tiny-llama3", attention_backend=backend, **opts).generate(prompts, params)
    assert [g.outputs[0].token_ids for g in got] == [r.outputs[0].token_ids for r in ref]


@pytest.mark.parametrize("greedy_only,batch", [(True, "mixed"), (False, "mixed"), (True, "decode_only")])
def test_gpu_step_has_no_host_synced_loops(greedy_only, batch):
    """The whole engine step with the GPU kernels, lowered for CUDA (works on CPU: Pallas emits the
    Triton IR here), holds no ``while`` loop: XLA:GPU reads a loop's predicate on the host every
    iteration, which stalls the stream and the host's dispatch of the next step (``jnp.searchsorted``
    did this). A mixed step (prefill chunk + decodes) and a decode-only one (the fused decode kernel)."""
    from jaxinfer import LLM, SamplingParams
    from jaxinfer.batching.inputs import pack_inputs
    from jaxinfer.batching.step_io import SchedulerOutput

    llm = LLM("tiny-llama3", load_format="dummy", attention_backend="pallas_gpu", layer_loop="unroll",
              max_num_seqs=4, max_num_batched_tokens=32, num_pages=64, max_model_len=128,
              token_buckets=(32,), seq_buckets=(4,), page_buckets=(8,))
    runner = llm.engine.runner
    work = [(20, 0), (40, 39), (9, 8)] if batch == "mixed" else [(40, 39), (9, 8)]  # (tokens, computed)
    params = SamplingParams(temperature=0.0 if greedy_only else 0.8)
    pages = iter(range(64))
    tables = [[next(pages) for _ in range(-(-n // 16))] for n, _ in work]
    out = SchedulerOutput(
        request_ids=[f"s{i}" for i in range(len(work))], num_tokens=[n - c for n, c in work], starts=[c for _, c in work],
        token_ids=[t for n, c in work for t in range(3 + c, 3 + n)], page_tables=tables, params=[params] * len(work),
        seeds=list(range(len(work))), output_index=[0] * len(work), logit_terms={}, proposals=[[]] * len(work))
    x = runner.inputs.build(out)
    assert x.flags["greedy_only"] == greedy_only and x.md.decode_only == (batch == "decode_only")
    inputs, packing = pack_inputs((x.tokens, x.positions, x.md, x.sb))
    lowered = runner._step.trace(runner.weights, runner.cache, runner.last_tokens, inputs, spec=runner.compiler.spec,
                                 packing=packing, **x.flags).lower(lowering_platforms=("cuda",))
    text = lowered.as_text()
    assert "__gpu$xla.gpu.triton" in text  # the Pallas GPU kernels are in the step
    assert ("rope_paged_decode_gpu" in text) == (batch == "decode_only")
    assert "stablehlo.while" not in text


def interpreted_gpu_ops() -> Ops:
    """The GPU backend's kernels in Pallas interpret mode (they run on CPU)."""
    ops = backend_for("gpu").ops("pallas_gpu", 64, False)
    return dataclasses.replace(ops, **{f: functools.partial(getattr(ops, f), interpret=True)
                                       for f in ("attention", "rope_write_kv", "decode_attention")})


def decoder_steps(page_size=8):
    """Three steps of two sequences, as the scheduler would pack them: prefills (13 and 5 tokens),
    then a chunked prefill (seq 0's next 7) with a decode (seq 1), then a decode-only step; one
    padding token each. Returns [(tokens, positions, md)]."""
    pages = [[3, 0, 5], [1, 4, 2]]  # scattered over the pool
    steps, done = [], [0, 0]
    for counts, decode_only in (((13, 5), False), ((7, 1), False), ((1, 1), True)):
        toks, pos, slots, starts, lens = [], [], [], [0], []
        for s, n in enumerate(counts):
            p = np.arange(done[s], done[s] + n)
            done[s] += n
            toks += list((7 * p + 11 * s + 3) % 97)
            pos += list(p)
            slots += [pages[s][i // page_size] * page_size + i % page_size for i in p]
            starts.append(starts[-1] + n)
            lens.append(done[s])
        toks, pos, slots = toks + [0], pos + [0], slots + [6 * page_size]  # a padding token
        md = BatchMetadata(slot_mapping=jnp.asarray(slots, jnp.int32), page_table=jnp.asarray(pages, jnp.int32),
                           seq_lens=jnp.asarray(lens, jnp.int32), query_start=jnp.asarray(starts, jnp.int32),
                           logits_indices=jnp.asarray(starts[1:], jnp.int32) - 1, decode_only=decode_only)
        steps.append((jnp.asarray(toks, jnp.int32), jnp.asarray(pos, jnp.int32), md))
    return steps


def family_config(**changes):
    """A tiny config with every option the kernels take: Q/K/V biases, q/k head norms, a soft cap,
    interleaved sliding-window (6) and global layers with their own RoPE bases, GQA 2."""
    fields = dict(num_heads=4, num_kv_heads=2, head_dim=16, qkv_bias=True, qk_norm=True, post_norms=True,
                  hidden_act="gelu_tanh", attn_soft_cap=0.5, sliding_window=6, sliding_layers=(True, False),
                  rope_local_theta=1000.0, rope_scaling=None, vocab_size=97)
    return dataclasses.replace(PRESETS["tiny-llama3"], **{**fields, **changes})


def test_decoder_family_through_gpu_kernels():
    """The generic decoder (jaxinfer.models.decoder) of a family with every option the kernels take:
    Q/K/V biases, q/k head norms, soft cap (0.5: scores of order one pass it), interleaved
    sliding-window (6, shorter than the context, across page boundaries) and global layers with their
    own RoPE bases, GQA 2; through the GPU path's kernels (interpreted off-GPU: RoPE + K/V write,
    attention, the fused decode) against the same decoder on the jnp reference, step by step: logits
    and the cache. The scanned loop, so each layer's window and RoPE frequencies reach the kernels
    traced (static windows: the kernel tests above)."""
    from jaxinfer.models.decoder import forward
    from jaxinfer.models.spec import init_dummy_weights

    config = family_config(layer_loop="scan")
    weights = init_dummy_weights(config, jax.random.key(0))
    rng = np.random.default_rng(0)
    # Non-trivial biases and norm gains (dummy weights have zeros and ones).
    randomize = {"qkv_bias": 1.0, "q_norm": 0.5, "k_norm": 0.5}
    layers = jax.tree_util.tree_map_with_path(
        lambda path, a: a + randomize.get(path[-1].key, 0.0) * jnp.asarray(rng.standard_normal(a.shape), a.dtype),
        weights.layers)
    weights = dataclasses.replace(weights, layers=layers)
    ops = {"reference": Ops(), "kernels": backend_for("gpu").ops("pallas_gpu", 16, False) if ON_GPU
           else interpreted_gpu_ops()}
    caches = {name: KVCache.zeros(config.num_layers, 7, 8, config.num_kv_heads, config.head_dim) for name in ops}
    step = jax.jit(forward, static_argnames=("config", "ops"))
    for tokens, positions, md in decoder_steps():
        logits = {}
        with jax.default_matmul_precision("float32"):
            for name, o in ops.items():
                logits[name], caches[name] = step(weights, tokens, positions, caches[name], md, config=config, ops=o)
        assert rel_err(logits["kernels"], logits["reference"]) < 1e-5
        for got, want in zip(jax.tree.leaves(caches["kernels"]), jax.tree.leaves(caches["reference"])):
            assert rel_err(got, want) < 1e-5


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "fp8"])
def test_gpu_family_step_lowers_for_cuda(kv_cache_dtype):
    """The family's steps with the GPU kernels (head_dim 256, Gemma 2's; static windows: the unrolled
    loop), lowered for CUDA (on CPU too: Pallas emits the Triton IR here, so an operation Triton
    cannot lower fails here, not first on the H200): per layer the RoPE + K/V write, decode and
    prefill kernels in mixed steps, the fused decode kernel alone in the decode-only one; and no
    ``while`` loop (see test_gpu_step_has_no_host_synced_loops). Over bf16, int8 and fp8 caches."""
    from jaxinfer.models.decoder import forward
    from jaxinfer.models.spec import abstract_weights

    config = family_config(head_dim=256, layer_loop="unroll")
    weights = abstract_weights(config, jnp.bfloat16)
    kv_dtype = kv_storage_dtype(kv_cache_dtype, jnp.bfloat16)
    cache = jax.eval_shape(lambda: KVCache.zeros(config.num_layers, 7, 8, config.num_kv_heads, 256, kv_dtype))
    step = jax.jit(forward, static_argnames=("config", "ops"))
    for tokens, positions, md in decoder_steps():
        text = step.trace(weights, tokens, positions, cache, md, config=config, ops=backend_for("gpu").ops("pallas_gpu", 256, False)
                          ).lower(lowering_platforms=("cuda",)).as_text()
        names = ["rope_paged_decode_gpu"] if md.decode_only else ["rope_write_kv_gpu", "paged_decode_gpu",
                                                                  "paged_prefill_gpu"]
        assert text.count("__gpu$xla.gpu.triton") == len(names) * config.num_layers
        assert all(name in text for name in names)
        assert "stablehlo.while" not in text
