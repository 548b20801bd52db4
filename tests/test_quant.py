"""Quantized weights (jaxinfer.quant): the machinery against its oracles, the embedded model's quality.

- each scheme's ``linear`` equals dequantize-then-matmul within float32 rounding (odd group counts,
  one token on the GPU's row-reduction path, the CPU's native kernel, the MoE experts' stacked layout);
- the CPU kernel is built once into the user cache, and a missing compiler says what to do;
- each GGUF block type decodes bit-exactly like ``gguf.quants.dequantize``;
- bad input is a clear error naming the choices.
"""

import dataclasses
import os
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from jaxinfer import native
from jaxinfer.models import layers
from jaxinfer.models.config import ModelConfig
from jaxinfer.quant import QArray, check_device_supports, concat, dequantize, quantize, to_device
from jaxinfer.quant import gguf_blocks
from jaxinfer.pallas_kernels import qmatvec
from jaxinfer.quant import cpu_kernel, matmul
from jaxinfer.quant.matmul import fp8_activations

GGUF_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")


def gguf_tensor(rng, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """Raw blocks of a ``name`` tensor ``[..., out, in]``: gguf's own quantizer where it has one, else
    random bytes (every code and 6-bit scale pattern) with small finite float16 super-block scales."""
    w = (rng.standard_normal(shape) * 0.05).astype(np.float32)
    try:
        return gguf_quantize(w, GGMLQuantizationType[name])
    except NotImplementedError:
        pass
    size = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}[name]
    blocks = rng.integers(0, 256, (*shape[:-1], shape[-1] // 256, size), dtype=np.uint8)
    f16 = (rng.standard_normal((*blocks.shape[:-1], 2)) * 1e-3).astype(np.float16).view(np.uint8)
    if name == "Q6_K":
        blocks[..., 208:210] = f16[..., :2]
    else:
        blocks[..., 0:4] = f16
    return blocks.reshape(*shape[:-1], -1)


@pytest.mark.parametrize("name", GGUF_TYPES)
def test_gguf_blocks_decode_bit_exactly(name):
    rng = np.random.default_rng(GGUF_TYPES.index(name))
    data = gguf_tensor(rng, name, (3, 5, 768))  # a stacked [E, out, in] tensor, three K super-blocks per row
    want = gguf_dequantize(data, GGMLQuantizationType[name])
    got = np.asarray(jax.jit(dequantize)(to_device(gguf_blocks.from_gguf(data, name))))
    assert got.dtype == np.float32 and got.shape == want.shape
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("names,scheme", [(("Q5_0", "Q5_0", "Q8_0"), "q8_0"), (("Q4_K", "Q4_K", "Q6_K"), "mixed8"),
                                          (("Q4_1", "Q8_0", "Q6_K", "Q5_K"), "mixed8")])
def test_gguf_blocks_of_different_formats_fuse_losslessly(names, scheme):
    """Fused leaves (q|k|v, gate|up) whose parts llama.cpp stored in different formats (Q4_K_M: some
    layers' attn_v in Q6_K, or Q8_0 beside Q5_0 where rows are not whole super-blocks) become one
    8-bit leaf that decodes every weight to the float32 its own format gave."""
    rng = np.random.default_rng(len(names))
    raw = [gguf_tensor(rng, name, (4 + i, 512)) for i, name in enumerate(names)]
    fused = to_device(concat([gguf_blocks.from_gguf(r, n) for r, n in zip(raw, names)]))
    assert fused.scheme == scheme and fused.values.dtype == np.int8
    want = np.concatenate([gguf_dequantize(r, GGMLQuantizationType[n]) for r, n in zip(raw, names)])
    np.testing.assert_array_equal(np.asarray(jax.jit(dequantize)(fused)), want)  # equal as numbers (+0 for -0)
    for tokens in (1, 3):
        _check_linear(jnp.asarray(rng.standard_normal((tokens, 512)), jnp.float32), fused)


def test_a_gguf_mixing_block_types_like_q4_k_m_runs_in_its_blocks(tmp_path):
    """A Llama GGUF whose tensors mix formats within a layer the way llama.cpp's Q4_K_M does (Q4_K
    queries and keys beside a Q6_K ``attn_v``; Q5_0 beside Q8_0 where a row is not whole
    super-blocks) loads in its own blocks and gives the logits of its float32 dequantization."""
    from gguf import GGUFWriter

    from helpers import all_position_logits
    from jaxinfer.models.weights import load_model

    rng = np.random.default_rng(3)
    d, f, vocab, heads, kv_heads = 256, 512, 64, 4, 2
    w = GGUFWriter(str(tmp_path / "mixed.gguf"), "llama")
    for add, value in [("vocab_size", vocab), ("context_length", 128), ("embedding_length", d),
                       ("feed_forward_length", f), ("block_count", 2), ("head_count", heads),
                       ("head_count_kv", kv_heads), ("layer_norm_rms_eps", 1e-5), ("rope_freq_base", 10000.0)]:
        getattr(w, f"add_{add}")(value)
    types = [dict(attn_q="Q5_0", attn_k="Q5_0", attn_v="Q8_0", attn_output="Q5_1", ffn_gate="Q4_0", ffn_up="Q4_1",
                  ffn_down="Q6_K"),
             dict(attn_q="Q4_K", attn_k="Q4_K", attn_v="Q6_K", attn_output="Q5_K", ffn_gate="Q4_K", ffn_up="Q4_K",
                  ffn_down="Q4_K")]
    shapes = dict(attn_q=(d, d), attn_k=(d // 2, d), attn_v=(d // 2, d), attn_output=(d, d), ffn_gate=(f, d),
                  ffn_up=(f, d), ffn_down=(d, f))

    def add(name, type_name, shape):
        w.add_tensor(name, gguf_tensor(rng, type_name, shape), raw_dtype=GGMLQuantizationType[type_name])

    add("token_embd.weight", "Q8_0", (vocab, d))
    for i, layer in enumerate(types):
        for part, type_name in layer.items():
            add(f"blk.{i}.{part}.weight", type_name, shapes[part])
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{norm}.weight", rng.uniform(0.5, 1.5, d).astype(np.float32))
    w.add_tensor("output_norm.weight", np.ones(d, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    config, blocks = load_model(str(tmp_path / "mixed.gguf"), quantization="gguf")
    assert [lw["wqkv"].scheme for lw in blocks.layers] == ["q8_0", "mixed8"]  # unrolled: the layers differ
    assert blocks.layers[0]["w_gate_up"].scheme == "mixed8" and blocks.layers[1]["w_gate_up"].scheme == "q4_k"
    _, floats = load_model(str(tmp_path / "mixed.gguf"), quantization="none", layer_loop="unroll")
    tokens = rng.integers(0, vocab, 24).tolist()
    want = all_position_logits(config, floats, tokens)
    # the same weights, float32 sums in other orders through two layers (the CPU kernel's decode is
    # one rounding where dequantize's is two): measured 1.7e-5 of the largest logit
    np.testing.assert_allclose(all_position_logits(config, blocks, tokens), want, rtol=1e-4,
                               atol=1e-4 * np.abs(want).max())


def _check_linear(x, w: QArray, out_dtype=None):
    """``linear(x, w)`` against float64 ``x @ (dequantize(w) * col_scale).T`` (fp8: of the
    per-token fp8 activations it multiplies). Operands are exact in float32; the error is float32
    accumulation, the output cast and, for bfloat16 activations, the decoded weight's rounding to
    bfloat16 and the gain-scaled activations' rounding to bfloat16. XLA may skip the latter (excess
    precision: a float32 product feeding the dot directly; the GPU did for fp8, whose activation
    codes then differ, and on the H200 for the interpreted kernel), so the output must match the
    reference built either way."""
    y = jax.jit(layers.linear, static_argnums=2)(x, w, out_dtype)
    out = jnp.dtype(out_dtype or x.dtype)
    assert y.dtype == out and y.shape == (x.shape[0], w.shape[-2])
    candidates = [x]
    if w.col_scale is not None:
        scaled = x.astype(jnp.float32) * w.col_scale
        candidates = [scaled.astype(x.dtype), scaled]
    wd = np.asarray(dequantize(w, jnp.float32), np.float64)
    ulp = 2.0 ** -8 if out == jnp.bfloat16 else 2.0 ** -20
    rounded = w.scheme not in ("int8", "fp8") or w.col_scale is not None
    decoded = 2.0 ** -8 if x.dtype == jnp.bfloat16 and rounded else 1e-5
    if w.scheme == "fp8" and out != jnp.float32 and jax.default_backend() != "cpu":
        # fp8's dot writes its output in the activations' dtype (``qlinear``: faster), and the GEMM
        # XLA emits for it (a Triton fusion) then rounds partial sums to that dtype too: beyond the
        # output's own rounding, up to 2^-11.6 of ``scale`` on random operands at in = 320 on an
        # H100 (float32 out: 2^-26.5)
        decoded = max(decoded, 2.0 ** -10)
    got = np.asarray(y.astype(jnp.float32), np.float64)
    checks = []
    for xs in candidates:
        if w.scheme == "fp8":
            xq, s = fp8_activations(xs)
            xs = np.asarray(xq.astype(jnp.float32), np.float64) * np.asarray(s, np.float64)
        xs = np.asarray(xs, np.float64)
        want, scale = xs @ wd.T, np.abs(xs) @ np.abs(wd).T
        checks.append((np.abs(got - want), ulp * np.abs(want) + decoded * scale + 1e-30))
    err, bound = min(checks, key=lambda c: int(np.sum(c[0] >= c[1])))
    np.testing.assert_array_less(err, bound)


@pytest.mark.parametrize("scheme,din", [("int8", 320), ("int4-g32", 96), ("int4-g64", 576), ("int4-g128", 384),
                                        ("fp8", 320)])
@pytest.mark.parametrize("backend,tokens,dtype", [("native", 1, "float32"), ("native", 5, "bfloat16"),
                                                  ("gpu", 1, "bfloat16")])
def test_quantized_linear_matches_dequantize_then_matmul(monkeypatch, pretend_gpu, backend, scheme, din, tokens,
                                                         dtype):
    """Odd group counts (576 / 64 = 9, 384 / 128 = 3, 96 / 32 = 3); "gpu" sends one token down the
    matvec kernel, interpreted (fp8's fp8 x fp8 dot is the GPU's own: on this CPU it runs emulated)."""
    if backend == "gpu" and scheme != "fp8":
        _gpu_with_interpreted_kernel(monkeypatch, pretend_gpu)
    rng = np.random.default_rng(tokens + din)
    x = jnp.asarray(rng.standard_normal((tokens, din)), dtype)
    w = quantize(jnp.asarray(rng.standard_normal((200, din)) / np.sqrt(din), jnp.float32), scheme)
    _check_linear(x, w)
    _check_linear(x, layers.fold_norm(rng.uniform(0.2, 3.0, din), w), "float32")  # an explicit norm gain


def _gpu_with_interpreted_kernel(monkeypatch, pretend_gpu, every_format=True, **blocks) -> list:
    """``jax.default_backend()`` says "gpu" and ``qlinear``'s matvec kernel runs in Pallas interpret
    mode (with ``blocks``) for up to 4 tokens and (``every_format``) for every format the kernel takes,
    8-bit codes included, which the engine keeps on XLA's fusion (measured faster); returns the list
    of the kernel's calls, to see where ``qlinear`` went."""
    calls = []

    def kernel(*args, **kw):
        calls.append(kw)
        return qmatvec.quantized_matvec(*args, **kw, **blocks, interpret=True)

    pretend_gpu()
    monkeypatch.setattr(matmul, "quantized_matvec", kernel)
    monkeypatch.setattr(matmul, "KERNEL_MAX_TOKENS", 4)  # the kernel takes several tokens; test them too
    if every_format:
        monkeypatch.setattr(matmul, "KERNEL_SCHEMES", ("int8", "int4", "q8_0", "q4_0", "q4_1"))
    return calls


def _kernel_weight(rng, scheme: str, out: int, din: int) -> QArray:
    """GGUF blocks from gguf's quantizer; int4 as random codes, scales and offsets (every code, without
    compiling the int4 search per shape); int8 quantized."""
    if scheme.startswith("Q"):
        return to_device(gguf_blocks.from_gguf(gguf_tensor(rng, scheme, (out, din)), scheme))
    if scheme.startswith("int4"):
        group = int(scheme.split("-g")[1])
        f16 = lambda scale: jnp.asarray(rng.standard_normal((out, din // group)) * scale, jnp.float16)  # noqa: E731
        return QArray(jnp.asarray(rng.integers(0, 256, (out, din // 2)), jnp.uint8), f16(0.1 / np.sqrt(din)),
                      f16(0.5 / np.sqrt(din)), None, None, "int4", group)
    return quantize(jnp.asarray(rng.standard_normal((out, din)) / np.sqrt(din), jnp.float32), scheme)


@pytest.mark.parametrize("scheme,din", [("int8", 320), ("int4-g32", 96), ("int4-g64", 576), ("int4-g128", 384),
                                        ("Q8_0", 160), ("Q4_0", 96), ("Q4_1", 224)])
@pytest.mark.parametrize("tokens,dtype,gain", [(1, "bfloat16", True), (3, "float32", False)])
def test_matvec_kernel_matches_dequantize_then_matmul(monkeypatch, pretend_gpu, scheme, din, tokens, dtype, gain):
    """``qlinear`` of a few tokens on a GPU goes to the Pallas kernel (interpreted here) for every
    format it takes, and equals dequantize-then-matmul: 45 rows (not a multiple of the 16-row blocks),
    odd group counts (3, 5, 7, 9), tiles of 2 16-byte chunks (a partial last tile) split in two along ``in``
    (each split's partial summed after), an explicit norm gain or none, bf16 and float32 activations."""
    calls = _gpu_with_interpreted_kernel(monkeypatch, pretend_gpu, block_rows=16, block_chunks=2, split_k=2)
    rng = np.random.default_rng(din + tokens)
    w = _kernel_weight(rng, scheme, 45, din)
    if gain:
        w = layers.fold_norm(rng.uniform(0.2, 3.0, din), w)
    _check_linear(jnp.asarray(rng.standard_normal((tokens, din)), dtype), w, "float32")
    assert len(calls) == 1 and calls[0]["bits"] == w.format.bits


def _random_codes(rng, bits, out, din, group, zero, offsets):
    """Codes over their whole range (int8 -128..127; nibbles 0..15 in GGUF's order: byte j of each
    32 columns holds column j low, j + 16 high), float16 scales (and offsets) per group, and the
    float64 weight they decode to, written out here."""
    if bits == 8:
        q = rng.integers(-128, 128, (out, din))
        values, cols = jnp.asarray(q, jnp.int8), q
    else:
        packed = rng.integers(0, 256, (out, din // 2))
        values = jnp.asarray(packed, jnp.uint8)
        b = packed.reshape(out, -1, 16)
        cols = np.concatenate([b & 15, b >> 4], axis=-1).reshape(out, din)
    scales = jnp.asarray(rng.uniform(0.5, 2.0, (out, din // group)) / 64, jnp.float16)
    offs = jnp.asarray(rng.standard_normal((out, din // group)) / 64, jnp.float16) if offsets else None
    wd = (cols - zero) * np.repeat(np.asarray(scales, np.float64), group, axis=1)
    if offsets:
        wd = wd + np.repeat(np.asarray(offs, np.float64), group, axis=1)
    return values, scales, offs, wd


@pytest.mark.parametrize("bits,group,zero,offsets,din", [(8, None, 0, False, 240), (8, 32, 0, False, 224),
                                                        (4, 32, 8, False, 224), (4, 64, 0, True, 256)])
@pytest.mark.parametrize("prefetch", [1, 2])
def test_matvec_kernel_every_code_few_rows_many_tiles(bits, group, zero, offsets, din, prefetch):
    """The kernel alone (interpreted) on codes covering their whole range, against their float64
    decode (``_random_codes``): 5 rows (fewer than a block: clamped row indices), 2 tokens, and
    one chunk per tile without splits (7-15 tiles: the loop runs many times), prefetching 1 or 2 tiles
    ahead (2: two tiles per iteration, odd tile counts leave one step after the loop)."""
    rng = np.random.default_rng(bits + zero)
    out, tokens = 5, 2
    group = group or din
    values, scales, offs, wd = _random_codes(rng, bits, out, din, group, zero, offsets)
    x = rng.standard_normal((tokens, din)).astype(np.float32)
    y = qmatvec.quantized_matvec(jnp.asarray(x), values, scales, offs, bits=bits, group_size=group, zero=zero,
                                 signed=bits == 8, block_rows=16, block_chunks=1, split_k=1, prefetch=prefetch,
                                 interpret=True)
    want = x.astype(np.float64) @ wd.T
    np.testing.assert_array_less(np.abs(np.asarray(y, np.float64) - want), 1e-6 * (np.abs(x) @ np.abs(wd).T))


@pytest.mark.parametrize("zero,offsets", [(8, False), (0, True)])
def test_matvec_kernel_half_pairs(zero, offsets):
    """4-bit codes with bfloat16 ``x`` are multiplied in float16 pairs by default (interpreted: the
    same arithmetic in jnp as the kernel's inline PTX): random codes (every nibble value in every
    place of a word), ``x`` with 1% of its entries 3,000x the rest (each chunk's power of two keeps
    float16 finite), 3 tokens, a partial last row block. Within 2^-9 of ``sum |x w|`` (float16 products
    round at 2^-11, four chained per half), and not the float32 path's result (1e-6)."""
    rng = np.random.default_rng(zero)
    out, din, group, tokens = 24, 512, 64, 3
    values, scales, offs, wd = _random_codes(rng, 4, out, din, group, zero, offsets)
    x = jnp.asarray(rng.standard_normal((tokens, din)) * np.where(rng.random(din) < 0.01, 3000.0, 1.0), jnp.bfloat16)
    xs = np.asarray(x, np.float64)
    want, scale = xs @ wd.T, np.abs(xs) @ np.abs(wd).T

    def run(half):
        return np.asarray(qmatvec.quantized_matvec(x, values, scales, offs, bits=4, group_size=group, zero=zero,
                                                   half=half, interpret=True), np.float64)

    pairs, full = run(None), run(False)
    assert np.all(np.isfinite(pairs))
    np.testing.assert_array_less(np.abs(pairs - want), 2.0 ** -9 * scale)
    np.testing.assert_array_less(np.abs(full - want), 1e-6 * scale)
    assert np.max(np.abs(pairs - full) / scale) > 1e-6


def test_matvec_kernel_default_blocks_and_routing(monkeypatch, pretend_gpu):
    """The kernel's own block choice (``default_blocks``: K split into several programs) on an
    int4 weight of 64 x 4096 with several tokens; int8 goes to it too; formats it does not take by
    default (Q8_0, not yet timed against XLA; the K-quants) and more tokens than ``KERNEL_MAX_TOKENS``
    keep XLA's paths."""
    calls = _gpu_with_interpreted_kernel(monkeypatch, pretend_gpu, every_format=False)
    rng = np.random.default_rng(0)
    w = _kernel_weight(rng, "int4-g128", 64, 4096)
    assert qmatvec.default_blocks(64, 4096, 4)["split_k"] > 1
    _check_linear(jnp.asarray(rng.standard_normal((2, 4096)), jnp.float32), w)
    assert len(calls) == 1
    _check_linear(jnp.asarray(rng.standard_normal((1, 512)), jnp.float32), _kernel_weight(rng, "Q4_K", 8, 512))
    _check_linear(jnp.asarray(rng.standard_normal((matmul.KERNEL_MAX_TOKENS + 1, 4096)), jnp.float32), w)
    for scheme in ("int8", "Q8_0"):
        _check_linear(jnp.asarray(rng.standard_normal((1, 512)), jnp.float32), _kernel_weight(rng, scheme, 8, 512))
    assert [(c["bits"], c["group_size"]) for c in calls] == [(4, 128), (8, 512)]  # int4, int8; not Q8_0


@pytest.mark.parametrize("scheme", ["int8", "int4-g128", "Q8_0", "Q4_0", "Q4_1"])
def test_matvec_kernel_lowers_to_triton(scheme):
    """The kernel as the GPU compiles it (Pallas -> Triton IR, which runs on this CPU: interpret mode
    above does not go through it), at 1 and 8 tokens."""
    w = _kernel_weight(np.random.default_rng(0), scheme, 64, 256)
    for tokens in (1, 8):
        lowered = jax.jit(matmul.kernel_matvec, static_argnums=2).trace(
            jnp.ones((tokens, 256), jnp.bfloat16), w, jnp.bfloat16).lower(lowering_platforms=("cuda",))
        assert "xla.gpu.triton" in lowered.as_text()


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the native kernel is the CPU backend's matmul")
@pytest.mark.parametrize("scheme,din", [("Q4_0", 96), ("Q4_1", 224), ("Q8_0", 160), ("int4-g32", 96),
                                        ("int4-g64", 576), ("int4-g128", 384), ("int8", 320), ("Q5_0", 160),
                                        ("Q5_1", 224), ("Q4_K", 256), ("Q5_K", 512), ("Q6_K", 768),
                                        ("Q4_K+Q6_K", 256), ("Q6_K+Q8_0", 256)])
@pytest.mark.parametrize("gain", [False, True])
def test_cpu_kernel_matches_dequantize_then_matmul(scheme, din, gain):
    """On CPU ``qlinear`` runs the native kernel (the custom call is in the compiled step) and equals
    float64 dequantize-then-matmul within float32 rounding: 45 rows (tiles of 4 rows and a partial
    one, chunks of 16 shared by the threads), odd group counts (3, 5, 7, 9), 1-33 tokens (tiles of 4
    tokens and partial ones), with and without an explicit norm gain on the columns; the 5- and
    6-bit GGUF formats (their upper bits from ``high``, Q6_K's groups of 16) and fused leaves of two
    formats (``mixed8``: groups of 16 with and without offsets)."""
    rng = np.random.default_rng(din)
    if "+" in scheme:
        a, b = scheme.split("+")
        w = to_device(concat([gguf_blocks.from_gguf(gguf_tensor(rng, n, (rows, din)), n)
                              for n, rows in ((a, 20), (b, 25))]))
        assert w.scheme == "mixed8" and w.group_size == 16 and (w.offsets is None) == (a == "Q6_K")
    else:
        w = _kernel_weight(rng, scheme, 45, din)
    if gain:
        w = layers.fold_norm(rng.uniform(0.2, 3.0, din), w)
    for tokens in (1, 3, 8, 33):
        x = jnp.asarray(rng.standard_normal((tokens, din)), jnp.float32)
        assert cpu_kernel.TARGET in jax.jit(layers.linear).lower(x, w).as_text()
        _check_linear(x, w)


def test_cpu_kernel_is_built_once_into_the_user_cache(monkeypatch, tmp_path, caplog):
    """The first use compiles into ``$XDG_CACHE_HOME/jaxinfer/kernels`` (logged); later uses find it."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with caplog.at_level("INFO", logger="jaxinfer.native"):
        path = native.library_path(cpu_kernel.SOURCE)
    assert path.startswith(str(tmp_path / "jaxinfer" / "kernels")) and os.path.exists(path)
    assert any("building the CPU kernel cpu_qmatmul.cc" in r.getMessage() for r in caplog.records)
    assert os.listdir(os.path.dirname(path)) == [os.path.basename(path)]  # the temporary file renamed

    def no_compile(*args):
        raise AssertionError("compiled again")

    monkeypatch.setattr(native, "_compile", no_compile)
    assert native.library_path(cpu_kernel.SOURCE) == path


def test_native_kernels_build_in_the_background_once(monkeypatch, tmp_path):
    """``native.prebuild`` compiles in a thread; a caller needing the library meanwhile waits for that
    build instead of compiling it again."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    started, calls = threading.Event(), []

    def slow_compile(cxx, path, source):  # a stand-in build: the test above compiles for real (~30 s)
        calls.append(source)
        started.set()
        time.sleep(0.5)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb"):
            pass

    monkeypatch.setattr(native, "_compile", slow_compile)
    native.prebuild(cpu_kernel.SOURCE)
    assert started.wait(60)
    path = native.library_path(cpu_kernel.SOURCE)
    assert os.path.exists(path) and calls == [cpu_kernel.SOURCE]


def test_cpu_kernel_compiler_from_the_environment_or_a_clear_error(monkeypatch):
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    with pytest.raises(RuntimeError, match=r"\$CXX='/nonexistent/c\+\+' was not found.*quantization='none'"):
        native.library_path(cpu_kernel.SOURCE)
    monkeypatch.setenv("CXX", "nice -n 19 c++")  # a launcher and its arguments: the command, in order
    assert native.compiler()[1:] == ["-n", "19", "c++"] and native.compiler()[0].endswith("/nice")
    monkeypatch.delenv("CXX")
    monkeypatch.setenv("PATH", "")
    with pytest.raises(RuntimeError, match=r"none \(c\+\+, g\+\+\) is on the PATH.*apt-get install g\+\+"):
        native.library_path(cpu_kernel.SOURCE)


def test_int4_reproduces_a_q4_1_grid_and_beats_min_max_rounding():
    """int4's search (schemes._GRID_STEPS): weights already on llama.cpp's Q4_1 grid come back bit
    for bit at group 32 (the min/max codes fit them with zero error), and on Gaussian weights each
    group size's squared error is below plain min/max round-to-nearest's."""
    rng = np.random.default_rng(7)
    w = rng.standard_normal((64, 512)).astype(np.float32) * 0.02
    on_grid = gguf_dequantize(gguf_quantize(w, GGMLQuantizationType.Q4_1), GGMLQuantizationType.Q4_1)
    np.testing.assert_array_equal(np.asarray(dequantize(quantize(jnp.asarray(on_grid), "int4-g32"))), on_grid)
    for group in (32, 64, 128):
        g = w.reshape(64, -1, group)
        lo, hi = g.min(-1, keepdims=True), g.max(-1, keepdims=True)
        s = (hi - lo) / 15
        min_max = np.sum((np.clip(np.round((g - lo) / s), 0, 15) * s + lo - g) ** 2)
        err = np.sum((np.asarray(dequantize(quantize(jnp.asarray(w), f"int4-g{group}"))) - w) ** 2)
        assert err < 0.93 * min_max, (group, err / min_max)


def test_int4_importance_weighs_the_grid_search():
    """``quantize(..., importance=)``: a Q4_1 grid still comes back bit for bit whatever the
    importance; a heavily weighted column (the attention sink's massive dimension, ``models.weights``)
    gets a small fraction of its unweighted error, the weighted error is not above the unweighted
    search's, and the others' error grows only a little."""
    rng = np.random.default_rng(3)
    w = rng.standard_normal((64, 512)).astype(np.float32) * 0.02
    on_grid = gguf_dequantize(gguf_quantize(w, GGMLQuantizationType.Q4_1), GGMLQuantizationType.Q4_1)
    for importance in (rng.uniform(0.1, 100.0, (64, 512)), np.where(rng.uniform(size=512) < 0.02, 1e3, 1.0)):
        got = dequantize(quantize(jnp.asarray(on_grid), "int4-g32", jnp.asarray(importance, jnp.float32)))
        np.testing.assert_array_equal(np.asarray(got), on_grid)  # 1e3: models.weights.assemble.SINK_WEIGHT_MAX
    c = np.ones(512, np.float32)
    c[5::64] = 500.0  # one column in each group of 64
    plain = np.asarray(dequantize(quantize(jnp.asarray(w), "int4-g64"))) - w
    weighted = np.asarray(dequantize(quantize(jnp.asarray(w), "int4-g64", jnp.asarray(c)))) - w
    assert np.sum(weighted[:, 5::64] ** 2) < 0.1 * np.sum(plain[:, 5::64] ** 2)
    assert np.sum(c * weighted ** 2) < np.sum(c * plain ** 2)
    assert np.sum(weighted ** 2) < 1.2 * np.sum(plain ** 2)  # measured 1.12
    with pytest.raises(ValueError, match="importance weighs the int4 grid search; quantization='int8'"):
        quantize(jnp.asarray(w), "int8", jnp.asarray(c))


@pytest.mark.parametrize("name", GGUF_TYPES)
def test_gguf_linear_matches_dequantize_then_matmul(name):
    rng = np.random.default_rng(7)
    w = to_device(gguf_blocks.from_gguf(gguf_tensor(rng, name, (48, 512)), name))
    for tokens in (1, 4):
        _check_linear(jnp.asarray(rng.standard_normal((tokens, 512)), jnp.float32), w)


MOE = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=0, num_layers=1, num_heads=2, num_kv_heads=1,
                  head_dim=32, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=96)


@pytest.mark.parametrize("scheme", ["int4-g32", "Q4_K"])
# 2 * 2 <= 6 experts: gathered matvecs ("gpu": as row reductions); 9 * 2: grouped matmuls ("gpu": dense)
@pytest.mark.parametrize("tokens,backend", [(2, "native"), (9, "native"), (2, "gpu"), (9, "gpu")])
def test_moe_with_quantized_experts_equals_dequantized(pretend_gpu, scheme, tokens, backend):
    """fp8 experts run weight-only (decoded to the activations' dtype) like the others. The
    reference is the dense experts on this backend's own path."""
    rng = np.random.default_rng(tokens)

    def stacked(shape):
        if scheme == "Q4_K":
            return to_device(gguf_blocks.from_gguf(gguf_tensor(rng, scheme, shape), scheme))
        return quantize(jnp.asarray(rng.standard_normal(shape) / np.sqrt(shape[-1]), jnp.float32), scheme)

    # K-quant rows are whole 256-column super-blocks
    cfg = MOE if scheme != "Q4_K" else dataclasses.replace(MOE, hidden_size=256, moe_intermediate_size=256)
    e, f, d = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    gain = rng.uniform(0.5, 2.0, d)
    gate_up = layers.fold_norm(gain, stacked((e, 2 * f, d)))
    down = stacked((e, d, f))
    lw = {"router": jnp.asarray(rng.standard_normal((e, d)), jnp.float32), "experts_gate_up": gate_up,
          "experts_down": down}
    dense = dict(lw, experts_gate_up=jnp.asarray(np.asarray(dequantize(gate_up)) * gain.astype(np.float32)),
                 experts_down=dequantize(down))
    x = jnp.asarray(rng.standard_normal((tokens, d)), jnp.float32)
    r = layers.rms_scale(x, 1e-5)
    want = jax.jit(layers.moe, static_argnums=3)(x, r, dense, cfg)
    if backend == "gpu":
        pretend_gpu()
    got = jax.jit(layers.moe, static_argnums=3)(x, r, lw, cfg)
    # float32 sums in other orders (the "gpu" path reduces rows one by one, or runs every expert
    # densely): errors go with the magnitudes summed, i.e. the largest outputs (Q4_K's reach ~2,000):
    # 2^-24 x sqrt(256 terms) x 2 matmuls ~ 2e-6 of the largest (measured: 4.9e-7)
    want = np.asarray(want)
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=max(2e-5, 2e-6 * np.abs(want).max()))


# ------------------------------------------------------------------------------------ bad input

def test_unknown_scheme_names_the_choices():
    with pytest.raises(ValueError, match="quantization must be one of .*int8.*int4-g64.*fp8"):
        quantize(jnp.ones((4, 64)), "int3")
    from jaxinfer.batching.config import EngineConfig
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(quantization="nf4")


def test_a_quantized_leaf_split_along_its_input_needs_whole_blocks_and_groups():
    """Over a mesh a quantized leaf is split field by field (its scales with its codes); along its
    input only in whole 32-column blocks and whole groups, else a clear error. (Sharded runs:
    tests/test_sharding.py.)"""
    from jax.sharding import PartitionSpec as P

    from jaxinfer.batching.config import EngineConfig
    from jaxinfer.models.sharding import TP, leaf_specs
    EngineConfig(quantization="int8", tensor_parallel=2)
    w = quantize(jnp.ones((8, 192)), "int4-g64")  # 3 groups, 6 blocks
    assert leaf_specs(w, (TP, None), 2) == dataclasses.replace(w, values=P(TP, None), scales=P(TP, None),
                                                                offsets=P(TP, None))
    assert leaf_specs(w, (None, TP), 3).scales == P(None, TP)
    with pytest.raises(ValueError, match=r"\(8, 192\) \(int4, groups of 64\) cannot be split 2 ways along its input"):
        leaf_specs(w, (None, TP), 2)


def test_group_size_that_does_not_divide_the_dimension():
    with pytest.raises(ValueError, match=r"group size 128 does not divide .* 576 .*\(32, 64\)"):
        quantize(jnp.ones((8, 576)), "int4-g128")


def test_int4_takes_the_largest_group_that_divides_the_model(caplog):
    """Plain int4 takes the largest of 128, 64, 32 dividing every quantized matrix's input dimension
    (SmolLM2's hidden size 576: 64; a Llama 3.2 1B's: 128), logged and resolved before any weight is
    read; an explicit group that does not divide is refused, naming the matrices and the groups that do."""
    import logging

    from jaxinfer.batching.config import EngineConfig
    from jaxinfer.batching.resolve import DeviceFacts, ModelFacts, resolve
    from jaxinfer.models.config import PRESETS
    from jaxinfer.models.weights import load_config, load_model, model_quantization, resolve_model

    smollm2 = load_config(resolve_model("smollm2-135m"))
    with caplog.at_level(logging.INFO, logger="jaxinfer.quant.schemes"):
        assert model_quantization("int4", smollm2) == "int4-g64"
    assert "group size 64" in caplog.text
    assert model_quantization("int4", PRESETS["llama3.2-1b"]) == "int4-g128"
    assert [model_quantization(q, smollm2) for q in ("int4-g32", "int8", "gguf", "none")] == \
        ["int4-g32", "int8", "gguf", "none"]
    facts = ModelFacts("smollm2-135m", smollm2, "gguf", "none")
    assert resolve(EngineConfig(quantization="int4"), facts, DeviceFacts("cpu")).quantization == "int4-g64"
    with pytest.raises(ValueError, match=r"'int4-g128': group size 128 does not divide the input dimension of "
                                         r"wqkv \(576\), wo \(576\), w_gate_up \(576\); use 'int4-g64' or 'int4-g32'"):
        load_model("smollm2-135m", quantization="int4-g128")


def test_fp8_on_a_device_without_fp8_is_refused():
    @dataclasses.dataclass
    class FakeDevice:
        platform: str
        device_kind: str
        compute_capability: str | None = None

    check_device_supports("fp8", FakeDevice("cpu", "cpu"))  # emulated, for tests
    check_device_supports("fp8", FakeDevice("gpu", "NVIDIA H200", "9.0"))
    check_device_supports("int8", FakeDevice("gpu", "Tesla V100", "7.0"))
    with pytest.raises(ValueError, match="fp8 tensor cores.*A100.*int8"):
        check_device_supports("fp8", FakeDevice("gpu", "NVIDIA A100", "8.0"))
    with pytest.raises(ValueError, match="fp8 tensor cores"):
        check_device_supports("fp8", FakeDevice("tpu", "TPU v4"))


def test_unsupported_gguf_type_names_the_supported_ones():
    with pytest.raises(ValueError, match="blk.0.ffn_down.weight.*Q2_K.*Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K"):
        gguf_blocks.from_gguf(np.zeros((4, 84), np.uint8), "Q2_K", "blk.0.ffn_down.weight")


def test_gguf_quantization_needs_a_gguf_file():
    from jaxinfer.models.weights import load_model
    with pytest.raises(ValueError, match="quantization='gguf'.*dummy"):
        load_model("tiny-llama3", load_format="dummy", quantization="gguf")


# ------------------------------------------------------------------------- the embedded model

DENSE = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=3, num_heads=2, num_kv_heads=1,
                    head_dim=32, qkv_bias=True, post_norms=True, sliding_window=8, sliding_layers=(True, False, True),
                    layer_loop="unroll")


@pytest.mark.parametrize("config", [DENSE, dataclasses.replace(MOE, layer_loop="unroll")], ids=["dense", "moe"])
def test_first_token_layer_matches_forward(config):
    """``decoder.first_token_layer`` layer after layer (what the int4 loaders follow) ends where the
    step's ``forward`` of a one-token sequence does: the same logits; it names the input of each
    dense matrix it recorded (MoE experts: none)."""
    from jaxinfer.models.decoder import first_token_layer, forward
    from jaxinfer.models.spec import init_dummy_weights
    from jaxinfer.paged.kv_cache import BatchMetadata, KVCache

    weights = init_dummy_weights(config, jax.random.key(1))
    x = weights.embed[5]
    for i, lw in enumerate(weights.layers):
        x, inputs = first_token_layer(config, lw, i, x)
        assert {k: (v.shape[-1],) for k, v in lw.items() if k in inputs} == {k: v.shape for k, v in inputs.items()}
        assert sorted(inputs) == (["w_down", "w_gate_up", "wo"] if not config.num_experts else ["wo"])
    head = weights.embed if weights.lm_head is None else weights.lm_head
    got = layers.linear(layers.rms_norm(x[None], weights.final_norm, config.rms_norm_eps), head, jnp.float32)
    cache = KVCache.zeros(config.num_layers, 1, 4, config.num_kv_heads, config.head_dim)
    zero = jnp.zeros((1,), jnp.int32)
    md = BatchMetadata(slot_mapping=zero, page_table=zero[None], seq_lens=zero + 1,
                       query_start=jnp.asarray([0, 1], jnp.int32), logits_indices=zero)
    want, _ = forward(weights, jnp.asarray([5], jnp.int32), zero, cache, md, config)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_int4_loader_follows_the_first_token_in_layer_order():
    """Under int4 the loader builds layers in order once the embedding is known, whatever order
    the file gives them (Hugging Face shards sort ``layers.10`` before ``layers.2``); the first
    token's attention input reaches the key/value rows' grid search (they differ from an
    unweighted search's), and the result is the same for any arrival order."""
    from jaxinfer.models.weights.assemble import Assembler

    config = dataclasses.replace(DENSE, qkv_bias=False, post_norms=False, sliding_window=None, sliding_layers=None,
                                 tie_word_embeddings=True)
    rng = np.random.default_rng(0)
    d, f, hd = config.hidden_size, config.intermediate_size, config.head_dim
    shapes = dict(q=(config.num_heads * hd, d), k=(config.num_kv_heads * hd, d), v=(config.num_kv_heads * hd, d),
                  o=(d, config.num_heads * hd), gate=(f, d), up=(f, d), down=(d, f), attn_norm=(d,), mlp_norm=(d,))
    parts = [{k: (rng.standard_normal(s) / (s[-1] ** 0.5 if len(s) == 2 else 1)).astype(np.float32)
              for k, s in shapes.items()} for _ in range(config.num_layers)]
    glob = {"embed": rng.standard_normal((config.vocab_size, d)).astype(np.float32),
            "final_norm": np.ones(d, np.float32)}

    def load(order, embed_first):
        out = Assembler(config, np.float32, scheme="int4-g32")
        if embed_first:
            out.put_global("embed", glob["embed"])
        for i in order:
            for k, v in parts[i].items():
                out.put_layer(i, k, v)
        if not embed_first:
            out.put_global("embed", glob["embed"])
        out.put_global("final_norm", glob["final_norm"])
        return out.finish()

    a, b = load(range(config.num_layers), True), load(reversed(range(config.num_layers)), False)
    for la, lb in zip(a.layers, b.layers):
        for x, y in zip(jax.tree.leaves(la), jax.tree.leaves(lb)):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    w = np.concatenate([parts[1]["q"], parts[1]["k"], parts[1]["v"]])
    plain = quantize(jnp.asarray(w), "int4-g32")
    q_rows = config.num_heads * hd
    got = a.layers[1]["wqkv"]
    np.testing.assert_array_equal(np.asarray(got.values)[:q_rows], np.asarray(plain.values)[:q_rows])
    assert not np.array_equal(np.asarray(got.scales)[q_rows:], np.asarray(plain.scales)[q_rows:])


def test_embedded_model_quality_and_memory_per_scheme(smollm2_tokenizer):
    """Perplexity on the first 512 tokens of the held text (``benchmarks/perplexity.py`` scores the whole
    text): int8 within 1% of float32, int4-g32, int4-g64 and the GGUF blocks run
    natively within 10%; native GGUF resident bytes about the file's size, not 4x it."""
    import os

    from jaxinfer.models.perplexity import perplexity
    from jaxinfer.models.weights import load_model, resolve_model

    with open(os.path.join(os.path.dirname(__file__), "data", "held_text.txt")) as f:
        ids = smollm2_tokenizer.encode(f.read())[:512]  # int4-g64 on the first 192: +10.3%, a short text scatters
    ppl, size = {}, {}
    for scheme in ("none", "gguf", "int8", "int4-g32", "int4-g64"):
        config, weights = load_model("smollm2-135m", quantization=scheme)
        ppl[scheme] = perplexity(weights, config, ids, chunk=128)
        size[scheme] = sum(x.nbytes for x in jax.tree.leaves(weights))
        del weights
    assert 1.0 < ppl["none"] < 100.0
    assert abs(ppl["int8"] / ppl["none"] - 1) < 0.01, ppl
    assert abs(ppl["int4-g32"] / ppl["none"] - 1) < 0.10, ppl
    assert abs(ppl["int4-g64"] / ppl["none"] - 1) < 0.10, ppl  # 512: +13.1% before the sink importance
    assert abs(ppl["gguf"] / ppl["none"] - 1) < 0.10, ppl
    file_bytes = os.path.getsize(resolve_model("smollm2-135m").path)
    assert 0.9 < size["gguf"] / file_bytes < 1.05, (size, file_bytes)
    # the tied embedding stays float32 (113 MB) under int8/int4
    assert size["int8"] < size["none"] / 2 and size["int4-g64"] < size["int4-g32"] < size["int8"], size


@pytest.mark.parametrize("scheme,loop", [("int8", "scan"), ("int4-g32", "indexed")])
def test_engine_runs_dummy_weights_quantized_at_load(scheme, loop):
    """The benchmarks' path (random weights quantized on the device), both layer loops: it decodes,
    and logits stay close to full precision's (the same random weights)."""
    from jaxinfer import LLM, SamplingParams

    opts = dict(load_format="dummy", max_num_seqs=2, max_num_batched_tokens=32, max_model_len=64,
                seq_buckets=(2,), page_buckets=(4,), token_buckets=(8, 32), layer_loop=loop, max_logprobs=1,
                num_pages=8)  # 2 x 64 tokens; by default a GPU's pool takes most free memory, none left for the second
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=1)
    full = LLM("tiny-llama3", quantization="none", **opts)
    quant = LLM("tiny-llama3", quantization=scheme, **opts)
    leaves = lambda llm: jax.tree.leaves(llm.engine.runner.weights, is_leaf=lambda x: isinstance(x, QArray))
    assert sum(isinstance(x, QArray) for x in leaves(quant)) >= 4 and not any(
        isinstance(x, QArray) for x in leaves(full))
    a, b = full.generate([[5, 6, 7, 8]], params)[0].outputs[0], quant.generate([[5, 6, 7, 8]], params)[0].outputs[0]
    assert len(b.token_ids) == 4
    assert max(b.logprobs[0].values()) == pytest.approx(max(a.logprobs[0].values()), abs=0.2)


def test_dummy_weights_are_quantized_leaf_by_leaf(monkeypatch):
    """``load_format="dummy"`` with a scheme quantizes each leaf as it is made (so the device never
    holds the whole float model next to the quantized one: the allocator hole that left the KV pool
    no contiguous room on the H200), and gets exactly what quantizing the finished float weights gives."""
    from jaxinfer.models.spec import init_dummy_weights
    from jaxinfer.models.weights import load_model
    from jaxinfer.models.weights.converted import quantize_weights

    config, got = load_model("tiny-llama3", load_format="dummy", quantization="int8", seed=3, layer_loop="unroll")
    want = quantize_weights(init_dummy_weights(config, jax.random.key(3), jnp.float32), config, "int8")
    is_q = lambda x: isinstance(x, QArray)
    assert jax.tree.structure(got, is_leaf=is_q) == jax.tree.structure(want, is_leaf=is_q)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


    import jaxinfer.models.weights as weights_module
    def float_matrices():  # alive anywhere (the embedding and other tests' arrays are the baseline)
        return sum(a.ndim == 2 and min(a.shape) > 1 and a.dtype == jnp.float32 for a in jax.live_arrays())

    seen = []

    def counting_quantize(x, scheme):
        seen.append(float_matrices())
        return quantize(x, scheme)

    monkeypatch.setattr(weights_module, "quantize", counting_quantize)
    del want
    base = float_matrices() + 1  # and the embedding made first
    load_model("tiny-llama3", load_format="dummy", quantization="int8", seed=3, layer_loop="unroll")
    # one call per layer leaf and the lm_head, with at most one float matrix alive (quantizing the
    # finished float weights had all of them alive: 8 here)
    assert len(seen) == 4 * config.num_layers + 1 and max(seen) - base <= 1, (base, seen)
