"""The int8 / fp8 KV cache (``kv_cache_dtype``): the quantizer's error bounds, the reference attention
against a float cache, quality on the embedded model, the pool it buys, exactness of batching,
swap preemption and prefix caching over it, and bad input. The Pallas kernels over quantized
caches: tests/test_pallas_kernels.py."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import LLM
from jaxinfer.batching.config import EngineConfig
from jaxinfer.paged.attention import ragged_paged_attention as reference
from jaxinfer.paged.kv_cache import KVCache, dequantize, kv_storage_dtype, pack_codes, quantize, unpack_codes
from jaxinfer.batching.backend import backend_for
from test_batching import BASE, assert_no_leak, drive, greedy, make_prompts


def test_fp8_cache_holds_its_codes_as_words():
    """An fp8 cache stores its codes as uint32 words ``[..., D / 4]`` whose bytes are the codes' bytes
    in order (byte j of word c is code 4c + j: the GPU kernels' layout), and ``unpack_codes`` gives the
    codes back; int8 codes are stored as they are; a head_dim the words cannot hold is refused."""
    rng = np.random.default_rng(3)
    codes = jnp.asarray(rng.standard_normal((3, 5, 64)) * 100, jnp.float32).astype(jnp.float8_e4m3fn)
    words = pack_codes(codes)
    assert words.dtype == jnp.uint32 and words.shape == (3, 5, 16)
    as_bytes = np.asarray(codes).view(np.uint8)
    assert (np.asarray(words).astype("<u4").view(np.uint8) == as_bytes).all()
    assert (np.asarray(unpack_codes(words)).view(np.uint8) == as_bytes).all()
    ints = jnp.asarray(rng.integers(-127, 128, (2, 8)), jnp.int8)
    assert pack_codes(ints) is ints and unpack_codes(ints) is ints
    cache = KVCache.zeros(2, 3, 4, 2, 64, jnp.float8_e4m3fn)
    assert cache.k.dtype == jnp.uint32 and cache.k.shape == (2, 3, 4, 2, 16) and cache.head_dim == 64
    assert cache.k_scale.shape == (2, 3, 4, 2)
    with pytest.raises(ValueError, match="fp8 KV cache needs head_dim divisible by 4, got 30"):
        KVCache.zeros(1, 1, 4, 1, 30, jnp.float8_e4m3fn)


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_quantize_error_bounds(kv_cache_dtype):
    """Round to nearest on a per-row grid: int8 within half a step (scale = amax / 127) of every
    value; e4m3 within half its relative step (2**-4 of the value, or of its subnormal step near
    0); the row's amax is a code's extreme (nothing clips); a zero row stays zero, not NaN."""
    dtype = kv_storage_dtype(kv_cache_dtype, jnp.float32)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 4, 128)) * rng.uniform(1e-3, 30, (64, 4, 1))
    x[0, 0] = 0.0
    codes, scale = quantize(jnp.asarray(x, jnp.float32), dtype)
    assert codes.dtype == dtype and scale.shape == x.shape[:-1]
    err = np.abs(np.asarray(dequantize(codes, scale)) - x)
    s = np.asarray(scale)[..., None]
    bound = s / 2 if kv_cache_dtype == "int8" else np.abs(x) * 2.0 ** -4 + s * 2.0 ** -10
    assert (err <= bound * 1.0001 + 1e-7).all()
    assert not err[0, 0].any() and np.isfinite(np.asarray(scale)).all()
    qmax = 127 if kv_cache_dtype == "int8" else 448
    assert np.allclose(np.abs(np.asarray(codes.astype(jnp.float32))).max(-1)[1:], qmax)


@pytest.mark.parametrize("kv_cache_dtype,bound", [("int8", 0.015), ("fp8", 0.05)])
def test_reference_attention_quantized_against_float_cache(kv_cache_dtype, bound):
    """The reference attention over the quantized cache against the same over the float values it
    came from, for Gaussian K/V (head_dim 128). The bounds are about twice the expected error: int8's
    rounding error is uniform within half a step of amax / 127 (amax ~3 sigma at 128 values): rms
    ~0.7% of a value; e4m3 keeps 3 mantissa bits: rms ~2.5%; attention's averaging does not add."""
    rng = np.random.default_rng(1)
    layers, pages, ps, kvh, d, group = 1, 12, 16, 2, 128, 4
    shape = (layers, pages, ps, kvh, d)
    kc, vc = (jnp.asarray(rng.standard_normal(shape), jnp.float32) for _ in range(2))
    from jaxinfer.paged.kv_cache import BatchMetadata
    q_lens, ctx = np.array([1, 1, 9]), np.array([60, 100, 40])
    qs = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    md = BatchMetadata(slot_mapping=jnp.zeros(int(qs[-1]), jnp.int32),
                       page_table=jnp.asarray(rng.permutation(pages)[:12].reshape(3, 4), jnp.int32),
                       seq_lens=jnp.asarray(ctx, jnp.int32), query_start=jnp.asarray(qs),
                       logits_indices=jnp.zeros(3, jnp.int32))
    q = jnp.asarray(rng.standard_normal((int(qs[-1]), kvh * group, d)), jnp.float32)
    dtype = kv_storage_dtype(kv_cache_dtype, jnp.float32)
    (kq, ks), (vq, vs) = quantize(kc, dtype), quantize(vc, dtype)
    with jax.default_matmul_precision("float32"):
        want = np.asarray(reference(q, kc, vc, 0, md, scale=d ** -0.5))
        got = np.asarray(reference(q, kq, vq, 0, md, scale=d ** -0.5, k_scale=ks, v_scale=vs))
    err = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert 1e-4 < err < bound, err  # quantized for real, and within the bound


def test_bad_kv_cache_dtype_names_the_allowed_values():
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of \('auto', 'int8', 'fp8'\), got 'int4'"):
        EngineConfig(kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="not supported by the interpret attention backend.*kv_cache_dtype='auto'"):
        backend_for("cpu").ops("interpret", 64, kv_quantized=True)
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        LLM("tiny-llama3", load_format="dummy", kv_cache_dtype="float16")


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU's pool bound (cpu_kv_cache_gib) is the "
                    "subject; an accelerator's pool is sized by the free memory earlier tests' engines still hold")
def test_quantized_pool_holds_about_twice_bf16s_pages():
    """Bytes per page: codes plus a 4-byte scale per token and kv head, 0.52x of bf16's at head_dim
    128 (llama3-8b's), so a pool of the same bytes holds 1.94x the pages; the engine's default pool
    (here the CPU bound ``cpu_kv_cache_gib``) is sized by the bytes the cache really takes."""
    bf16 = KVCache.bytes_per_page(32, 16, 8, 128, jnp.bfloat16)
    for dtype in (jnp.int8, jnp.float8_e4m3fn):
        assert KVCache.bytes_per_page(32, 16, 8, 128, dtype) / bf16 == pytest.approx(132 / 256)
    opts = dict(load_format="dummy", max_num_seqs=64, max_model_len=256, cpu_kv_cache_gib=2 ** -10)
    per_page, pages = {}, {}
    for d in ("auto", "int8"):  # auto: float32 on CPU
        cache = LLM("tiny-llama3", kv_cache_dtype=d, **opts).engine.runner.cache
        per_page[d] = sum(x.nbytes for x in jax.tree.leaves(cache)) // cache.num_pages
        pages[d] = cache.num_pages
        assert pages[d] == 2 ** 20 // per_page[d] < 64 * 16  # the bound, not the sequences, sized it
    # tiny-llama3's head_dim 16: 16 code bytes + 4 scale bytes against 64 float32 bytes per head
    assert per_page["auto"] / per_page["int8"] == pytest.approx(64 / 20)


@pytest.mark.parametrize("kv_cache_dtype,path", [("int8", "preempt-swap"), ("fp8", "prefix-cache")])
def test_batched_preempted_and_prefix_cached_runs_match_alone(kv_cache_dtype, path):
    """Greedy tokens of each request in a batch (swapped out to host and back with its scales, or
    reusing another request's cached prefix pages and their scales) equal the same request run alone
    on the same quantized cache: quantization is per token, so nothing depends on the batch."""
    opts = {**BASE, "kv_cache_dtype": kv_cache_dtype}
    alone = LLM("tiny-llama3", **opts)
    if path == "preempt-swap":
        llm = LLM("tiny-llama3", **{**opts, "num_pages": 24, "preemption_mode": "swap"})
        prompts, gap = make_prompts(0, 10), 1
    else:
        llm = LLM("tiny-llama3", **opts)
        prompts, gap = make_prompts(2, 6, 1, 20, prefix=make_prompts(1, 1, 70, 71)[0]), 2
    done = drive(llm.engine, [(gap * i, p) for i, p in enumerate(prompts)])
    for i, p in enumerate(prompts):
        assert done[f"r{i}"].token_ids == alone.generate([p], greedy())[0].outputs[0].token_ids, f"request {i} diverged"
    stats = llm.engine.stats()
    assert stats["preemptions" if path == "preempt-swap" else "prefix_cache_hits"] > 0
    assert_no_leak(llm.engine)


def test_embedded_model_quality_with_quantized_kv(smollm2_tokenizer):
    """The embedded SmolLM2 on the first 192 tokens of the held text, float32 weights, KV cache
    float32 / int8 / fp8 (``benchmarks/perplexity.py`` scores the whole text):
    perplexity within 1% (int8) and 3% (fp8), greedy next tokens agreeing at >= 95% / 90%."""
    from jaxinfer.models.perplexity import score
    from jaxinfer.models.weights import load_model

    with open(os.path.join(os.path.dirname(__file__), "data", "held_text.txt")) as f:
        ids = smollm2_tokenizer.encode(f.read())[:192]
    config, weights = load_model("smollm2-135m", quantization="none")
    runs = {kv: score(weights, config, ids, chunk=96, kv_cache_dtype=kv) for kv in ("auto", "int8", "fp8")}
    ref = runs["auto"]
    assert 1.0 < ref.perplexity < 100.0
    for kv, (ppl_bound, agree_bound) in {"int8": (0.01, 0.95), "fp8": (0.03, 0.90)}.items():
        assert abs(runs[kv].perplexity / ref.perplexity - 1) < ppl_bound, (kv, runs[kv].perplexity, ref.perplexity)
        assert (runs[kv].greedy == ref.greedy).mean() >= agree_bound, kv
