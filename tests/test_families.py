"""Every family against transformers' own classes: tiny random configs saved as safetensors.

Each config is small but switches on what makes its family differ (biases, Q/K norms, sliding
windows shorter than the prompt, soft caps, GeGLU, fused checkpoint tensors, LongRoPE, top-k
experts with a shared expert), so a wrong layout or a missing block shows in the logits. Weights
are re-drawn at O(1) scale: transformers' 0.02 init makes attention nearly uniform and the logits
nearly flat, which would hide head-layout and RoPE bugs and make greedy decoding tie-prone.
"""

import numpy as np
import pytest
import torch

from helpers import all_position_logits
from jaxinfer import LLM, SamplingParams
from jaxinfer.models.weights import load_model

VOCAB = 263  # odd sizes wherever a family allows them; GQA everywhere
BASE = dict(vocab_size=VOCAB, hidden_size=63, intermediate_size=97, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6,
            tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
# transformers' grouped expert matmul wants 16-byte strides, Phi-3 derives head_dim from the hidden size
# and Gemma validates it against the heads: those keep even sizes.
EVEN = dict(hidden_size=64)
MOE = dict(EVEN, num_experts_per_tok=2, moe_intermediate_size=32)

# family -> (transformers config class name, fields over BASE)
FAMILIES = {
    "mistral": ("MistralConfig", dict(sliding_window=12)),
    "qwen2": ("Qwen2Config", dict(rope_theta=1e6)),  # Q/K/V biases (hidden sizes: odd unless validated)
    "qwen3": ("Qwen3Config", dict(head_dim=24)),  # Q/K norms; head_dim != hidden / heads
    "gemma2": ("Gemma2Config", dict(EVEN, num_hidden_layers=3, tie_word_embeddings=True, head_dim=32,
                                    sliding_window=12, query_pre_attn_scalar=24,
                                    attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
                                    hidden_activation="gelu_pytorch_tanh")),
    "gemma3": ("Gemma3TextConfig", dict(EVEN, num_hidden_layers=3, tie_word_embeddings=True, head_dim=32,
                                        sliding_window=12,
                                        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                        query_pre_attn_scalar=32)),
    "phi3": ("Phi3Config", dict(EVEN, original_max_position_embeddings=64,  # LongRoPE
                                rope_scaling={"type": "longrope", "short_factor": [1.0 + i / 8 for i in range(8)],
                                              "long_factor": [2.0 + i / 4 for i in range(8)]})),
    "mixtral": ("MixtralConfig", dict(EVEN, intermediate_size=96, num_local_experts=8, num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(num_experts=8, **MOE, shared_expert_intermediate_size=48,
                                         norm_topk_prob=False)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=8, **MOE, norm_topk_prob=True)),
}


def save_random_hf(family: str, path, spec: tuple[str, dict] | None = None) -> torch.nn.Module:
    """A random model of ``family`` (``spec``: its config class name and fields over BASE, if not in FAMILIES)
    saved as safetensors in ``path``."""
    import transformers

    cls, fields = spec or FAMILIES[family]
    config = getattr(transformers, cls)(**{**BASE, **fields})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                p.normal_(0.0, p.shape[-1] ** -0.5)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.5)
            else:  # norm gains (Gemma's are offsets from 1, so this also covers 1 + w far from 1)
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path, safe_serialization=True)
    return model


def hf_logits(model, tokens) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float().numpy()


def hf_greedy(model, ids, n) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def rel_err(got, ref) -> float:
    return float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))


def save_word_tokenizer(path) -> None:
    """A word-level tokenizer over the tiny vocabulary (the engine needs one to detokenize)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", bos_token="w1", eos_token="w2").save_pretrained(path)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_dir(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    model = save_random_hf(request.param, path)
    save_word_tokenizer(path)
    return request.param, path, model


def test_logits_match_transformers(family_dir):
    family, path, model = family_dir
    tokens = np.random.default_rng(1).integers(3, VOCAB, 40).tolist()  # longer than every sliding window
    ref = hf_logits(model, tokens)
    for loop in ("scan", "unroll", "indexed"):
        config, weights = load_model(str(path), layer_loop=loop)
        assert config.architecture == family
        err = rel_err(all_position_logits(config, weights, tokens), ref)
        print(f"{family} {loop}: rel err {err:.2e}")
        assert err < 1e-4
    if config.final_soft_cap:  # the caps are active: uncapped logits pass them, and each cap matters
        uncapped = all_position_logits(config.replace(final_soft_cap=None), weights, tokens)
        assert np.abs(uncapped).max() > config.final_soft_cap
        assert rel_err(all_position_logits(config.replace(attn_soft_cap=None), weights, tokens), ref) > 1e-2
    if config.sliding_window:  # the window is shorter than the prompt and changes the result
        assert config.sliding_window < len(tokens)
        assert rel_err(all_position_logits(config.replace(sliding_window=None), weights, tokens), ref) > 1e-2


def test_greedy_batched_matches_transformers(family_dir):
    """Four prompts of different lengths decoded together, one chunked, through the paged engine."""
    family, path, model = family_dir
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, VOCAB, n).tolist() for n in (5, 17, 30, 9)]
    llm = LLM(str(path), dtype="float32", max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64, prefill_chunk_size=16,
              token_buckets=(4, 32), seq_buckets=(4,), page_buckets=(4,), num_pages=32)
    outs = llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(model, prompt, 32), f"{family} diverged on a {len(prompt)}-token prompt"


# T * k <= E: gathered experts; more rows: grouped matmuls, or ("gpu") every expert densely
@pytest.mark.parametrize("tokens,backend", [(4, "native"), (40, "native"), (4, "gpu"), (40, "gpu")])
@pytest.mark.parametrize("shared", [False, True])
def test_moe_with_experts_that_get_no_tokens(pretend_gpu, tokens, backend, shared):
    """Experts 4-7 lose every routing (positive rows, router rows of opposite sign), so the grouped
    path sees empty groups; checked against a per-token loop over the chosen experts."""
    import jax.numpy as jnp

    from jaxinfer.models.config import PRESETS
    from jaxinfer.models.layers import moe

    e, k, d, f = 8, 2, 16, 12
    config = PRESETS["tiny-llama3"].replace(hidden_size=d, num_experts=e, num_experts_per_tok=k,
                                            moe_intermediate_size=f, norm_topk_prob=not shared,
                                            shared_expert_intermediate_size=10 if shared else 0)
    rng = np.random.default_rng(0)
    x = np.abs(rng.normal(size=(tokens, d))).astype(np.float32)
    router = np.abs(rng.normal(size=(e, d))).astype(np.float32)
    router[4:] *= -1
    lw = {"router": router, "experts_gate_up": rng.normal(size=(e, 2 * f, d)).astype(np.float32) / d ** 0.5,
          "experts_down": rng.normal(size=(e, d, f)).astype(np.float32) / f ** 0.5}
    if shared:
        lw |= {"shared_gate_up": rng.normal(size=(20, d)).astype(np.float32) / d ** 0.5,
               "shared_down": rng.normal(size=(d, 10)).astype(np.float32) / 10 ** 0.5,
               "shared_gate": rng.normal(size=(1, d)).astype(np.float32) / d ** 0.5}
    r = 1 / np.sqrt(np.mean(x ** 2, axis=-1, keepdims=True) + 1e-6)
    if backend == "gpu":
        pretend_gpu()
    got = np.asarray(moe(jnp.asarray(x), jnp.asarray(r), {n: jnp.asarray(a) for n, a in lw.items()}, config))

    silu = lambda a: a / (1 + np.exp(-a))  # noqa: E731
    xn = x * r
    ref = np.zeros_like(x)
    for i in range(tokens):
        logits = lw["router"] @ xn[i]
        p = np.exp(logits - logits.max())
        p /= p.sum()
        top = np.argsort(-p)[:k]
        assert (top < 4).all()
        w = p[top] / p[top].sum() if config.norm_topk_prob else p[top]
        for wj, j in zip(w, top):
            gate, up = np.split(lw["experts_gate_up"][j] @ xn[i], 2)
            ref[i] += wj * (lw["experts_down"][j] @ (silu(gate) * up))
        if shared:
            gate, up = np.split(lw["shared_gate_up"] @ xn[i], 2)
            ref[i] += (1 / (1 + np.exp(-(lw["shared_gate"] @ xn[i])))) * (lw["shared_down"] @ (silu(gate) * up))
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


def write_gguf(model, arch: str, path: str) -> None:
    """The GGUF llama.cpp's converter writes for ``model`` (F32 tensors): its tensor names, Gemma's
    norm gains stored as ``1 + w``, Mixtral as the llama architecture with stacked experts and Q/K
    rows interleaved per head."""
    import gguf

    cfg = model.config
    sd = {k: v.float().numpy() for k, v in model.state_dict().items()}
    gguf_arch = "llama" if arch == "mixtral" else arch
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[gguf_arch.upper()], cfg.num_hidden_layers)
    w = gguf.GGUFWriter(path, gguf_arch)
    w.add_vocab_size(cfg.vocab_size)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    if arch == "gemma2":
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
        w.add_sliding_window(cfg.sliding_window)
    if arch == "mixtral":
        w.add_expert_count(cfg.num_local_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)

    def permute(a, heads):  # llama.cpp's Q/K row order: the two rotary halves interleaved
        return a.reshape(heads, 2, a.shape[0] // heads // 2, a.shape[1]).swapaxes(1, 2).reshape(a.shape)

    for key, a in sd.items():
        if key == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if key.endswith("experts.gate_up_proj"):
            blk = key.split(".")[2]
            gate, up = np.split(a, 2, axis=1)
            w.add_tensor(f"blk.{blk}.ffn_gate_exps.weight", gate)
            w.add_tensor(f"blk.{blk}.ffn_up_exps.weight", up)
            continue
        if key.endswith("experts.down_proj"):
            w.add_tensor(f"blk.{key.split('.')[2]}.ffn_down_exps.weight", a)
            continue
        name = names.get_name(key, try_suffixes=(".weight", ".bias"))
        assert name is not None, key
        if arch == "gemma2" and name.endswith("norm.weight"):
            a = a + 1
        if arch == "mixtral" and name.endswith(("attn_q.weight", "attn_k.weight")):
            a = permute(a, cfg.num_attention_heads if "attn_q" in name else cfg.num_key_value_heads)
        w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("family", ["qwen2", "gemma2", "mixtral"])
def test_gguf_layouts_match_transformers(tmp_path, family, monkeypatch):
    if family == "gemma2":  # llama.cpp scales Gemma 2's queries by head_dim ** -0.5 (the 2B/9B value)
        cls, fields = FAMILIES["gemma2"]
        monkeypatch.setitem(FAMILIES, "gemma2", (cls, dict(fields, query_pre_attn_scalar=fields["head_dim"])))
    model = save_random_hf(family, tmp_path / "hf")
    path = str(tmp_path / f"{family}.gguf")
    write_gguf(model, family, path)
    config, weights = load_model(path)
    assert config.architecture == family
    tokens = np.random.default_rng(1).integers(3, VOCAB, 40).tolist()
    err = rel_err(all_position_logits(config, weights, tokens), hf_logits(model, tokens))
    print(f"{family} gguf: rel err {err:.2e}")
    assert err < 1e-4


def test_server_serves_a_qwen2_checkpoint_with_chat_and_streaming(tmp_path, smollm2_tokenizer):
    """``jaxinfer serve`` on a Qwen2 directory (SmolLM2's tokenizer and chat template, so the vocabulary
    is a real one): streamed and whole chat replies equal the offline engine's greedy chat."""
    import openai
    import transformers
    from test_server import Server

    config = transformers.Qwen2Config(**{**BASE, "vocab_size": len(smollm2_tokenizer)})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim >= 2:
                p.normal_(0.0, p.shape[-1] ** -0.5)
    model.save_pretrained(tmp_path, safe_serialization=True)
    smollm2_tokenizer.save_pretrained(tmp_path)
    opts = dict(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=128)
    buckets = dict(token_buckets="2,64", seq_buckets="2", page_buckets="8")
    messages = [{"role": "user", "content": "Name three colors."}]
    expected = LLM(str(tmp_path), dtype="float32", **opts, token_buckets=(2, 64), seq_buckets=(2,), page_buckets=(8,)).chat(
        messages, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[0].outputs[0].text
    assert expected

    srv = Server([f"--model={tmp_path}", "--dtype=float32", *(f"--{k}={v}" for k, v in {**opts, **buckets}.items())])
    try:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=120)
        kw = dict(model=str(tmp_path), messages=messages, max_tokens=16, temperature=0.0,
                  extra_body={"ignore_eos": True})
        whole = client.chat.completions.create(**kw)
        assert whole.choices[0].message.content == expected and whole.usage.completion_tokens == 16
        chunks = client.chat.completions.create(**kw, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    finally:
        srv.stop()


def test_unsupported_checkpoints_fail_at_load(tmp_path):
    import json

    save_random_hf("qwen2", tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    for bad, match in [(dict(architectures=["GPTNeoXForCausalLM"], model_type="gpt_neox"),
                        r"unsupported architecture 'GPTNeoXForCausalLM'; supported: LlamaForCausalLM, .*Qwen2"),
                       (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}),
                        r"unsupported rope scaling type 'yarn'; supported: llama3, linear, longrope"),
                       (dict(hidden_act="relu"), r"unsupported activation 'relu' for qwen2")]:
        (tmp_path / "config.json").write_text(json.dumps({**cfg, **bad}))
        with pytest.raises(ValueError, match=match):
            load_model(str(tmp_path))
