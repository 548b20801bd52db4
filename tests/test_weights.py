"""Loaded weights must reproduce transformers' logits at every position of a prompt."""

import json
import os
import re

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from helpers import all_position_logits  # noqa: E402
from jaxinfer.models.config import PRESETS  # noqa: E402
from jaxinfer.models.families import config_to_hf  # noqa: E402
from jaxinfer.models.weights import (ModelFileError, load_model, resolve_model, save_converted,  # noqa: E402
                                     saved_quantization)
from jaxinfer.models.weights.source import CONVERTED_CONFIG  # noqa: E402

def rel_err(got, ref) -> float:
    return float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))


def save_random_hf_llama(preset: str, path, **save_kwargs):
    """A transformers Llama with O(1)-scaled random weights (the default 0.02 init makes attention
    nearly uniform, which would hide RoPE / head-layout bugs)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**config_to_hf(PRESETS[preset]))).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.normal_(0.0, p.shape[1] ** -0.5)
            else:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path, safe_serialization=True, **save_kwargs)
    return model


def hf_logits(model, tokens) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float().numpy()


@pytest.mark.parametrize("preset,save_kwargs", [
    ("tiny-llama3", {"max_shard_size": "40KB"}),  # sharded, with index.json; Llama-3.1 rope scaling
    ("tiny-llama-tied", {}),
])
def test_hf_safetensors_matches_transformers(tmp_path, preset, save_kwargs):
    model = save_random_hf_llama(preset, tmp_path, **save_kwargs)
    if save_kwargs:
        assert (tmp_path / "model.safetensors.index.json").exists()
    tokens = np.random.default_rng(0).integers(0, PRESETS[preset].vocab_size, 80).tolist()
    ref = hf_logits(model, tokens)
    for loop in ("scan", "unroll"):
        config, weights = load_model(str(tmp_path), layer_loop=loop)
        assert config == PRESETS[preset].replace(layer_loop=loop)  # incl. rope_theta / rope scaling
        assert (weights.lm_head is None) == PRESETS[preset].tie_word_embeddings
        err = rel_err(all_position_logits(config, weights, tokens), ref)
        print(f"{preset} {loop}: rel err {err:.2e}")
        assert err < 1e-4


def test_smollm2_gguf_matches_transformers(smollm2_tokenizer, smollm2_hf):
    from jaxinfer.tokenizer import apply_chat_template

    source = resolve_model("smollm2-135m")
    assert source.kind == "gguf" and source.path.endswith(".gguf")
    tokens = apply_chat_template(smollm2_tokenizer, [{"role": "user", "content": "What is the capital of France?"}])
    config, weights = load_model("smollm2-135m")
    assert config.tie_word_embeddings and weights.lm_head is None
    got = all_position_logits(config, weights, tokens)
    err = rel_err(got, hf_logits(smollm2_hf, tokens))
    print(f"smollm2 gguf: rel err {err:.2e}")
    assert err < 1e-4


def _llama_cpp_rope_factors(config) -> np.ndarray:
    """What llama.cpp's converter writes as ``rope_freqs`` for Llama-3.1 scaling, computed here
    from its published formula rather than from our rope code."""
    rs, d = config.rope_scaling, config.head_dim
    factors = []
    for freq in 1.0 / config.rope_theta ** (np.arange(0, d, 2) / d):
        wavelen = 2 * np.pi / freq
        if wavelen < rs.original_max_position_embeddings / rs.high_freq_factor:
            factors.append(1.0)
        elif wavelen > rs.original_max_position_embeddings / rs.low_freq_factor:
            factors.append(rs.factor)
        else:
            smooth = ((rs.original_max_position_embeddings / wavelen - rs.low_freq_factor)
                      / (rs.high_freq_factor - rs.low_freq_factor))
            factors.append(1 / ((1 - smooth) / rs.factor + smooth))
    return np.asarray(factors, np.float32)


def _write_gguf(writer) -> None:
    """A ``gguf.GGUFWriter``'s header, key/values and tensors written out, in the order it requires."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _reader_metadata(reader) -> dict:
    """gguf's own ``GGUFReader`` fields decoded to Python values: the oracle for ``gguf_file``."""
    from gguf import GGUFValueType

    def scalar(part, vtype):
        return bytes(part).decode("utf-8", errors="replace") if vtype == GGUFValueType.STRING else part.item()

    md = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        if field.types[0] == GGUFValueType.ARRAY:
            md[key] = [scalar(field.parts[i], field.types[1]) for i in field.data]
        else:
            md[key] = scalar(field.parts[field.data[0]], field.types[0])
    return md


def _check_gguf_file_equals_reader(path):
    from gguf import GGUFReader

    from jaxinfer.models.weights.gguf_file import gguf_file

    gguf_file.cache_clear()
    ours, reader = gguf_file(str(path)), GGUFReader(str(path))
    assert ours.metadata == _reader_metadata(reader)
    assert [t.name for t in ours.tensors] == [t.name for t in reader.tensors]
    for a, b in zip(ours.tensors, reader.tensors):
        assert a.tensor_type == b.tensor_type and a.data.dtype == b.data.dtype and a.data.shape == b.data.shape
        np.testing.assert_array_equal(a.data, b.data)
    gguf_file.cache_clear()
    return ours


def test_gguf_file_reads_what_gguf_reader_reads(tmp_path):
    """``gguf_file`` (our header parser) gives the same key/values and the same memory-mapped tensors
    as gguf's ``GGUFReader``: on the embedded model (its vocabulary and merges, Q4_1, Q8_0 and F32
    tensors) and on a file written with every value type, float and block tensors, and a non-default
    alignment; a file that is not GGUF is a clear error."""
    import struct

    from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter
    from gguf.quants import quantize

    from jaxinfer.models.weights import resolve_model

    md = _check_gguf_file_equals_reader(resolve_model("smollm2-135m").path).metadata
    assert len(md["tokenizer.ggml.tokens"]) == 49152 and md["general.architecture"] == "llama"
    path = tmp_path / "every.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_custom_alignment(64)
    writer.add_bool("t.bool", True)
    writer.add_int8("t.i8", -3)
    writer.add_uint16("t.u16", 65535)
    writer.add_int64("t.i64", -2 ** 40)
    writer.add_float32("t.f32", 0.1)
    writer.add_float64("t.f64", 1e-300)
    writer.add_string("t.str", "héllo")
    writer.add_array("t.strs", ["a", "", "ünïcode"])
    # Decoded in bulk, string by string alike: a character split between two strings, bytes that are
    # not UTF-8, empty strings first and last.
    raw = [b"", b"\xc3", b"\xa9", "é😀".encode(), b"\xff", "😀".encode()[:3], b"x\x00y", b""]
    writer.add_key_value("t.raw", raw, GGUFValueType.ARRAY, sub_type=GGUFValueType.STRING)
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.floats", [0.5, 1.5])
    rng = np.random.default_rng(0)
    writer.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    writer.add_tensor("f16", rng.standard_normal((2, 4, 6)).astype(np.float16))
    q8 = quantize(rng.standard_normal((4, 64)).astype(np.float32), GGMLQuantizationType.Q8_0)
    writer.add_tensor("q8", q8, raw_shape=q8.shape, raw_dtype=GGMLQuantizationType.Q8_0)
    _write_gguf(writer)
    md = _check_gguf_file_equals_reader(path).metadata
    assert md["t.strs"] == ["a", "", "ünïcode"] and md["t.i64"] == -2 ** 40 and md["t.bool"] is True
    assert md["t.raw"] == [b.decode("utf-8", errors="replace") for b in raw]
    from jaxinfer.models.weights.gguf_file import gguf_file
    data = path.read_bytes()
    in_array = data.index(b"t.ints") + len("t.ints") + 4 + 12 + 4  # key, its type, element type and count, one int
    in_strings = data.index("é😀".encode()) + 2  # in the middle of a string of an array
    raw_header = b"t.raw" + struct.pack("<IIQ", 9, 8, len(raw))  # the key, array of strings, its count
    assert data.count(raw_header) == 1
    for name, content, error in [("not.gguf", b"GGML" + bytes(60), "not a GGUF file"),
                                 ("header.gguf", data[:200], "truncated or corrupt GGUF header"),
                                 ("array.gguf", data[:in_array], "truncated or corrupt GGUF header"),
                                 ("strings.gguf", data[:in_strings], r"the value of 't\.raw' \(6 bytes at byte "),
                                 ("length.gguf", data[:in_strings - 6], r"the value of 't\.raw' \(8 bytes at byte "),
                                 ("count.gguf", data.replace(raw_header, raw_header[:-8] + struct.pack("<Q", 2 ** 60)),
                                  r"the value of 't\.raw' \(\d+ bytes at byte \d+\) runs past the end"),
                                 ("data.gguf", data[:-200], "runs past the end of the file")]:
        (tmp_path / name).write_bytes(content)
        with pytest.raises(ValueError, match=error):
            gguf_file(str(tmp_path / name))


def test_llama31_gguf_with_rope_freqs_matches_transformers(tmp_path):
    """A Llama-3.1 GGUF as llama.cpp writes it (rope scaling as a ``rope_freqs`` tensor, Q/K rows
    permuted, F32 tensors) reproduces transformers' logits for the same weights."""
    from gguf import GGUFWriter

    preset = PRESETS["tiny-llama3"]
    model = save_random_hf_llama("tiny-llama3", tmp_path / "hf")
    sd = {k: v.numpy() for k, v in model.state_dict().items()}

    def permute(w, heads):  # llama.cpp's Q/K row order: the two rotary halves interleaved
        return w.reshape(heads, 2, w.shape[0] // heads // 2, w.shape[1]).swapaxes(1, 2).reshape(w.shape)

    path = str(tmp_path / "tiny-llama31.gguf")
    writer = GGUFWriter(path, "llama")
    writer.add_vocab_size(preset.vocab_size)
    writer.add_context_length(preset.max_position_embeddings)
    writer.add_embedding_length(preset.hidden_size)
    writer.add_feed_forward_length(preset.intermediate_size)
    writer.add_block_count(preset.num_layers)
    writer.add_head_count(preset.num_heads)
    writer.add_head_count_kv(preset.num_kv_heads)
    writer.add_layer_norm_rms_eps(preset.rms_norm_eps)
    writer.add_rope_freq_base(preset.rope_theta)
    writer.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    writer.add_tensor("output_norm.weight", sd["model.norm.weight"])
    writer.add_tensor("output.weight", sd["lm_head.weight"])
    writer.add_tensor("rope_freqs.weight", _llama_cpp_rope_factors(preset))
    names = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
             "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
    for i in range(preset.num_layers):
        for gguf_name, hf_name in names.items():
            w = sd[f"model.layers.{i}.{hf_name}.weight"]
            if gguf_name in ("attn_q", "attn_k"):
                w = permute(w, preset.num_heads if gguf_name == "attn_q" else preset.num_kv_heads)
            writer.add_tensor(f"blk.{i}.{gguf_name}.weight", w)
    _write_gguf(writer)

    config, weights = load_model(path)
    assert config.rope_scaling is None and config.rope_freq_factors is not None
    tokens = np.random.default_rng(1).integers(0, preset.vocab_size, 200).tolist()  # past the 64-token original context
    err = rel_err(all_position_logits(config, weights, tokens), hf_logits(model, tokens))
    print(f"llama-3.1 gguf: rel err {err:.2e}")
    assert err < 1e-4
    with pytest.raises(ValueError, match="rope_freq_factors has 3 entries"):
        config.replace(rope_freq_factors=(1.0, 2.0, 3.0))


def test_dummy_weights_from_preset_and_from_files(tmp_path):
    config, weights = load_model("tiny-llama3", load_format="dummy", dtype="bfloat16")
    assert config == PRESETS["tiny-llama3"] and weights.embed.dtype == jnp.bfloat16
    assert weights.layers["wqkv"].shape == (config.num_layers, config.q_size + 2 * config.kv_size, config.hidden_size)
    save_random_hf_llama("tiny-llama-tied", tmp_path)
    config, weights = load_model(str(tmp_path), load_format="dummy", layer_loop="unroll")
    assert config.hidden_size == PRESETS["tiny-llama-tied"].hidden_size and len(weights.layers) == config.num_layers


@pytest.mark.parametrize("saved_loop,loaded_loop", [("scan", "scan"), ("scan", "unroll"), ("unroll", "scan")])
def test_orbax_roundtrip(tmp_path, saved_loop, loaded_loop):
    config, weights = load_model("tiny-llama3", load_format="dummy", seed=3, layer_loop=saved_loop)
    save_converted(weights, config, str(tmp_path / "ckpt"))
    assert resolve_model(str(tmp_path / "ckpt")).kind == "orbax"
    config2, restored = load_model(str(tmp_path / "ckpt"), layer_loop=loaded_loop)
    assert config2 == config.replace(layer_loop=loaded_loop)
    _, expected = load_model("tiny-llama3", load_format="dummy", seed=3, layer_loop=loaded_loop)
    assert jax.tree.structure(restored) == jax.tree.structure(expected)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(expected)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _assert_same_weights(got, want):
    """Same tree (``QArray`` schemes and group sizes included) and every leaf bit for bit."""
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


@pytest.mark.parametrize("quantization", ["int4-g32", "fp8"])
def test_quantized_orbax_roundtrip(tmp_path, quantization):
    """Saved quantized, restored as saved (no quantizing again) in either layer layout; loading it
    as anything else is refused, naming what it holds."""
    config, weights = load_model("tiny-llama3", load_format="dummy", seed=5, quantization=quantization,
                                 layer_loop="scan")
    save_converted(weights, config, str(tmp_path))
    assert saved_quantization(resolve_model(str(tmp_path))) == quantization
    for loop in ("scan", "unroll"):
        _, restored = load_model(str(tmp_path), quantization=quantization, layer_loop=loop)
        _, want = load_model("tiny-llama3", load_format="dummy", seed=5, quantization=quantization, layer_loop=loop)
        _assert_same_weights(restored, want)
    for other in ("none", "int8"):
        with pytest.raises(ValueError, match=f"holds weights quantized as '{quantization}'.*"
                                             f"quantization='{quantization}'"):
            load_model(str(tmp_path), quantization=other)


def test_gguf_blocks_orbax_roundtrip(tmp_path):
    """The embedded model's own blocks (the embedding and norm gains, ``col_scale``, included) saved
    and restored bit for bit; the engine's ``quantization="auto"`` then asks for ``"gguf"``."""
    config, weights = load_model("smollm2-135m", quantization="gguf", layer_loop="scan")
    save_converted(weights, config, str(tmp_path))
    assert saved_quantization(resolve_model(str(tmp_path))) == "gguf"
    _, restored = load_model(str(tmp_path), quantization="gguf", layer_loop="scan")
    _assert_same_weights(restored, weights)


def test_orbax_checkpoint_of_an_older_layout_is_refused(tmp_path):
    config, weights = load_model("tiny-llama3", load_format="dummy")
    save_converted(weights, config, str(tmp_path))
    meta_file = tmp_path / CONVERTED_CONFIG
    meta = json.loads(meta_file.read_text())
    del meta["layout"]  # as written before the norm weights were folded
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="converted by an older jaxinfer .*convert the checkpoint again"):
        load_model(str(tmp_path))


def test_errors(tmp_path):
    with pytest.raises(ValueError, match=r"unknown model 'no-such-model'.*tiny-llama3"):
        load_model("no-such-model")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"has no \*\.safetensors weights"):
        resolve_model(str(tmp_path))
    with pytest.raises(ValueError, match=r"load_format must be one of .*'bogus'"):
        load_model("tiny-llama3", load_format="bogus")
    with pytest.raises(ValueError, match=r"preset 'llama3-8b' has no weights.*load_format='dummy'"):
        load_model("llama3-8b")
    with pytest.raises(TypeError, match=r"dtype must be a floating dtype"):
        load_model("tiny-llama3", load_format="dummy", dtype="int32")


def _model_file_error(model, message: str, load=None):
    """Loading ``model`` fails with one ``ModelFileError`` whose one-line message is ``message``
    (a regex) after the bad file's path; returns that message."""
    with pytest.raises(ModelFileError) as e:
        (load or load_model)(str(model))
    assert "\n" not in str(e.value), str(e.value)
    assert re.fullmatch(message, e.value.cause), str(e.value)
    assert str(e.value) == f"{e.value.path}: {e.value.cause}"
    return e.value


def test_a_truncated_gguf_is_named_with_its_cause(tmp_path, monkeypatch):
    """The embedded GGUF cut short, in its tensor data or its header, or below its fixed header:
    the weights and the tokenizer (whose transformers reader gave a bare ``struct.error``) name it."""
    from jaxinfer.tokenizer import load_tokenizer

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    data = open(resolve_model("smollm2-135m").path, "rb").read()
    for size, message in [(len(data) // 2, rf"truncated: the file ends at byte {len(data) // 2} of {len(data)} "
                                            r"expected; tensor 'blk\.\d+\.\w+\.weight' \(\d+ bytes at byte \d+\) "
                                            r"runs past the end of the file"),
                          (1000, r"truncated or corrupt GGUF header: the name of key \d+ \(\d+ bytes at byte \d+\) "
                                 r"runs past the end of the file \(1000 bytes\)"),
                          (10, r"truncated: 10 bytes, shorter than GGUF's 24-byte header")]:
        path = tmp_path / f"cut{size}.gguf"
        path.write_bytes(data[:size])
        assert _model_file_error(path, message).path == str(path)
        _model_file_error(path, message, lambda p: load_tokenizer(resolve_model(p)))


def test_a_gguf_of_an_unknown_architecture_is_named(tmp_path):
    from gguf import GGUFWriter

    path = tmp_path / "mamba.gguf"
    writer = GGUFWriter(str(path), "mamba")
    writer.add_block_count(2)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    _write_gguf(writer)
    assert _model_file_error(path, r"unsupported GGUF architecture 'mamba'; supported: llama, .*").path == str(path)


def test_a_bad_safetensors_checkpoint_is_named_with_its_cause(tmp_path):
    """Garbage for a shard, a shard cut short, config.json missing, not JSON or lacking a field, and
    an index naming a shard that is not there: each one line naming the file."""
    good = tmp_path / "good"
    save_random_hf_llama("tiny-llama-tied", good)
    weights = (good / "model.safetensors").read_bytes()
    config = (good / "config.json").read_text()

    def model(name, files):
        path = tmp_path / name
        path.mkdir()
        for file, content in files.items():
            (path / file).write_bytes(content.encode() if isinstance(content, str) else content)
        return path

    garbage = model("garbage", {"config.json": config, "model.safetensors": bytes(range(256)) * 4})
    e = _model_file_error(garbage, r"not a safetensors file \(header length 0x[0-9a-f]+ exceeds the file size, "
                                   r"1024 bytes\)")
    assert e.path == str(garbage / "model.safetensors")
    cut = model("cut", {"config.json": config, "model.safetensors": weights[:len(weights) - 100]})
    e = _model_file_error(cut, rf"truncated: the tensor data ends at byte {len(weights) - 100} of {len(weights)} "
                               r"expected \(tensor '.+' runs past the end of the file\)")
    assert e.path == str(cut / "model.safetensors")
    no_config = model("no_config", {"model.safetensors": weights})
    e = _model_file_error(no_config, r"missing: a Hugging Face model directory needs it beside its \*\.safetensors")
    assert e.path == str(no_config / "config.json")
    e = _model_file_error(model("empty", {}), r"not a model directory: no config\.json and \*\.safetensors "
                                             r"\(Hugging Face\), no jaxinfer_config\.json .*")
    assert e.path == str(tmp_path / "empty")
    not_json = model("not_json", {"config.json": config[:-20], "model.safetensors": weights})
    e = _model_file_error(not_json, r"not valid JSON \(.*\)")
    assert e.path == str(not_json / "config.json")
    no_heads = {k: v for k, v in json.loads(config).items() if k != "num_attention_heads"}
    e = _model_file_error(model("no_heads", {"config.json": json.dumps(no_heads), "model.safetensors": weights}),
                          r"'num_attention_heads' is missing")
    assert e.path.endswith("no_heads/config.json")

    sharded = tmp_path / "sharded"
    save_random_hf_llama("tiny-llama3", sharded, max_shard_size="40KB")
    shards = sorted(sharded.glob("model-*.safetensors"))
    shards[-1].unlink()
    e = _model_file_error(sharded, rf"its weight_map names 1 shard\(s\) that are missing: {shards[-1].name}")
    assert e.path == str(sharded / "model.safetensors.index.json")


def test_a_bad_converted_checkpoint_is_named(tmp_path):
    config, weights = load_model("tiny-llama3", load_format="dummy")
    save_converted(weights, config, str(tmp_path))
    (tmp_path / CONVERTED_CONFIG).write_text("{")
    e = _model_file_error(tmp_path, r"not valid JSON \(.*\)")
    assert e.path == str(tmp_path / CONVERTED_CONFIG)


def test_config_that_disagrees_with_tensors(tmp_path):
    save_random_hf_llama("tiny-llama-tied", tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(dict(cfg, intermediate_size=cfg["intermediate_size"] * 2)))
    with pytest.raises(ValueError, match=r"do not match the model config: .*w_gate_up"):
        load_model(str(tmp_path))


def test_gguf_float32_weights_and_config_come_back_from_the_user_cache(tmp_path, monkeypatch):
    """A GGUF dequantized once is kept (config and float32 arrays) and read back identically, without
    parsing the file again."""
    from jaxinfer.models.weights import gguf as weights_module
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    config, first = load_model("smollm2-135m", layer_loop="indexed")
    assert list(tmp_path.glob("jaxinfer/gguf/*/float32/0.npy")) and list(tmp_path.glob("jaxinfer/gguf/*/config.json"))
    weights_module.gguf_file.cache_clear()
    monkeypatch.setattr(weights_module, "gguf_file", lambda path: pytest.fail("the GGUF was parsed again"))
    config2, second = load_model("smollm2-135m", layer_loop="indexed")
    assert config2 == config
    assert jax.tree.structure(second) == jax.tree.structure(first)
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(second)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_user_cache_is_keyed_by_content(tmp_path, monkeypatch):
    """The same file reinstalled (a fresh virtualenv: another path and modification time) finds what
    was derived from it; a file whose content changed, even at the same size, derives again."""
    from jaxinfer.user_cache import derived_from
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    first, second = tmp_path / "a" / "model.gguf", tmp_path / "b" / "model.gguf"
    for p in (first, second):
        p.parent.mkdir()
        p.write_bytes(b"GGUF" + bytes(range(256)) * 64)
    os.utime(second, ns=(1, 1))
    assert derived_from(str(first), "gguf") == derived_from(str(second), "gguf")
    before = derived_from(str(first), "gguf")
    data = bytearray(first.read_bytes())
    data[-1] ^= 1
    first.write_bytes(bytes(data))
    assert derived_from(str(first), "gguf") != before
    assert derived_from(str(second), "gguf") == before
