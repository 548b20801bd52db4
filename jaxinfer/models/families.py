"""The model families and their registry, keyed by the checkpoint's architecture.

A family is what differs between checkpoints of the same decoder: how its Hugging Face
``config.json`` and its GGUF metadata map to ``ModelConfig`` (refusing fields it cannot honour), and
the names of its tensors in both formats (mapped to the canonical parts the loaders assemble, see
``weights/assemble.py``). The layers themselves are shared (``decoder.py``), chosen by the config's fields.

Registry keys are HF ``architectures[0]`` (or ``model_type``) and GGUF ``general.architecture``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

from jaxinfer.models.config import ModelConfig, RopeScaling

# Canonical per-layer part names (weights/assemble.py assembles them into the spec's leaves):
#   q k v qkv q_bias k_bias v_bias q_norm k_norm o attn_norm mlp_norm post_attn_norm post_mlp_norm
#   gate up gate_up down router expert{e}_gate expert{e}_up expert{e}_down experts_gate experts_up
#   experts_down shared_gate shared_up shared_down shared_expert_gate
_HF_ATTENTION = {
    "self_attn.q_proj.weight": "q", "self_attn.k_proj.weight": "k", "self_attn.v_proj.weight": "v",
    "self_attn.o_proj.weight": "o", "self_attn.q_proj.bias": "q_bias", "self_attn.k_proj.bias": "k_bias",
    "self_attn.v_proj.bias": "v_bias", "self_attn.q_norm.weight": "q_norm", "self_attn.k_norm.weight": "k_norm",
    "input_layernorm.weight": "attn_norm",
}
_HF_DENSE = {"mlp.gate_proj.weight": "gate", "mlp.up_proj.weight": "up", "mlp.down_proj.weight": "down",
             "post_attention_layernorm.weight": "mlp_norm"}
_HF_GEMMA = {"post_attention_layernorm.weight": "post_attn_norm", "pre_feedforward_layernorm.weight": "mlp_norm",
             "post_feedforward_layernorm.weight": "post_mlp_norm", "mlp.gate_proj.weight": "gate",
             "mlp.up_proj.weight": "up", "mlp.down_proj.weight": "down"}
_HF_QWEN_MOE = {"mlp.gate.weight": "router", "mlp.experts.{e}.gate_proj.weight": "expert{e}_gate",
                "mlp.experts.{e}.up_proj.weight": "expert{e}_up", "mlp.experts.{e}.down_proj.weight": "expert{e}_down",
                "mlp.shared_expert.gate_proj.weight": "shared_gate", "mlp.shared_expert.up_proj.weight": "shared_up",
                "mlp.shared_expert.down_proj.weight": "shared_down",
                "mlp.shared_expert_gate.weight": "shared_expert_gate",
                "post_attention_layernorm.weight": "mlp_norm"}

# llama.cpp's names (``blk.N.<name>``), as its converter writes them.
GGUF_LAYER = {
    "attn_q.weight": "q", "attn_k.weight": "k", "attn_v.weight": "v", "attn_qkv.weight": "qkv",
    "attn_output.weight": "o", "attn_q.bias": "q_bias", "attn_k.bias": "k_bias", "attn_v.bias": "v_bias",
    "attn_q_norm.weight": "q_norm", "attn_k_norm.weight": "k_norm", "attn_norm.weight": "attn_norm",
    "ffn_norm.weight": "mlp_norm", "post_attention_norm.weight": "post_attn_norm",
    "post_ffw_norm.weight": "post_mlp_norm", "ffn_gate.weight": "gate", "ffn_up.weight": "up",
    "ffn_down.weight": "down", "ffn_gate_inp.weight": "router", "ffn_gate_exps.weight": "experts_gate",
    "ffn_up_exps.weight": "experts_up", "ffn_down_exps.weight": "experts_down",
    "ffn_gate_shexp.weight": "shared_gate", "ffn_up_shexp.weight": "shared_up",
    "ffn_down_shexp.weight": "shared_down", "ffn_gate_inp_shexp.weight": "shared_expert_gate",
}
HF_GLOBALS = {"model.embed_tokens.weight": "embed", "model.norm.weight": "final_norm", "lm_head.weight": "lm_head"}
GGUF_GLOBALS = {"token_embd.weight": "embed", "output_norm.weight": "final_norm", "output.weight": "lm_head"}


@dataclasses.dataclass(frozen=True)
class Family:
    name: str  # ModelConfig.architecture
    hf_architectures: tuple[str, ...]  # config.json ``architectures`` (and ``model_type`` values)
    hf_layer: dict[str, str]  # tensor suffix after ``model.layers.N.`` -> part ({e}: expert index)
    gguf_arch: str | None  # GGUF ``general.architecture``
    parse_hf: Callable[[dict], dict]  # family-specific ModelConfig fields from config.json
    parse_gguf: Callable[[dict, str], dict] = lambda md, p: {}
    hf_norm_offset: float = 0.0  # added to every norm gain read from HF (Gemma stores w for 1 + w)
    gguf_permute_qk: bool = False  # llama.cpp interleaves Q/K rotary halves for its llama arch
    hf_extra: Callable[[ModelConfig], dict] = lambda c: {}  # config_to_hf's family fields
    gguf_layer: dict[str, str] = dataclasses.field(default_factory=lambda: GGUF_LAYER)  # ``blk.N.<name>`` -> part

    # ------------------------------------------------------------------------------ config.json

    def config_from_hf(self, cfg: dict) -> ModelConfig:
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        eos = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
        rope = _hf_rope(cfg)
        common = dict(
            vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
            intermediate_size=cfg.get("intermediate_size") or 0, num_layers=cfg["num_hidden_layers"],
            num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads, rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=float(rope.get("rope_theta", 10000.0)), rope_scaling=_rope_scaling(rope, cfg),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False), bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos, architecture=self.name)
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
        if act not in _ACTS:
            raise ValueError(f"unsupported activation {act!r} for {self.name}; supported: {', '.join(_ACTS)}")
        common["hidden_act"] = _ACTS[act]
        fields = self.parse_hf(cfg)
        if (cfg.get("attention_bias") and not fields.get("qkv_bias")) or cfg.get("mlp_bias"):
            raise ValueError(f"{self.name} config asks for attention_bias/mlp_bias, which this family does not have")
        return ModelConfig(**{**common, **fields})

    def config_to_hf(self, c: ModelConfig) -> dict:
        cfg = {
            "architectures": [self.hf_architectures[0]], "model_type": self.hf_architectures[-1],
            "vocab_size": c.vocab_size, "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
            "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_heads,
            "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps,
            "rope_theta": c.rope_theta, "max_position_embeddings": c.max_position_embeddings,
            "tie_word_embeddings": c.tie_word_embeddings, "hidden_act": "silu", "attention_bias": False,
            "mlp_bias": False,
        }
        if c.bos_token_id is not None:
            cfg["bos_token_id"] = c.bos_token_id
        if c.eos_token_ids:
            cfg["eos_token_id"] = list(c.eos_token_ids)
        if c.rope_scaling is not None:
            if c.rope_scaling.kind != "llama3":
                raise ValueError(f"rope scaling {c.rope_scaling.kind!r} has no config_to_hf mapping")
            rs = c.rope_scaling
            cfg["rope_scaling"] = {"rope_type": "llama3", "factor": rs.factor, "low_freq_factor": rs.low_freq_factor,
                                   "high_freq_factor": rs.high_freq_factor,
                                   "original_max_position_embeddings": rs.original_max_position_embeddings}
        if c.rope_freq_factors is not None:
            raise ValueError("rope_freq_factors (a GGUF rope_freqs tensor) has no transformers config equivalent")
        return {**cfg, **self.hf_extra(c)}

    # ----------------------------------------------------------------------------------- GGUF

    def config_from_gguf(self, md: dict) -> ModelConfig:
        p = f"{md['general.architecture']}."
        heads = int(md[p + "attention.head_count"])
        hidden = int(md[p + "embedding_length"])
        vocab = md.get(p + "vocab_size") or len(md["tokenizer.ggml.tokens"])
        eos = md.get("tokenizer.ggml.eos_token_id")
        return ModelConfig(
            vocab_size=int(vocab), hidden_size=hidden, intermediate_size=int(md.get(p + "feed_forward_length", 0)),
            num_layers=int(md[p + "block_count"]), num_heads=heads,
            num_kv_heads=int(md.get(p + "attention.head_count_kv", heads)),
            head_dim=int(md.get(p + "attention.key_length", hidden // heads)),
            rms_norm_eps=float(md.get(p + "attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(md.get(p + "rope.freq_base", 10000.0)), rope_freq_factors=md.get("_rope_freq_factors"),
            max_position_embeddings=int(md.get(p + "context_length", 2048)),
            tie_word_embeddings=bool(md.get("_tied_embeddings", False)),
            bos_token_id=md.get("tokenizer.ggml.bos_token_id"), eos_token_ids=() if eos is None else (int(eos),),
            architecture=self.name, **self.parse_gguf(md, p))


_ACTS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


def _hf_rope(cfg: dict, layer_type: str | None = None) -> dict:
    """RoPE parameters, wherever the config keeps them: top-level ``rope_theta`` + ``rope_scaling``
    (transformers < 5 and most checkpoints), or ``rope_parameters`` (transformers >= 5), which Gemma 3
    nests per layer type."""
    rope = cfg.get("rope_parameters") or {}
    if layer_type is not None or "full_attention" in rope:
        rope = rope.get(layer_type or "full_attention", {})
    out = dict(cfg.get("rope_scaling") or {}) if layer_type is None else {}
    out.update(rope)
    if "rope_theta" in cfg and layer_type is None:
        out.setdefault("rope_theta", cfg["rope_theta"])
    return out


def _rope_scaling(rope: dict, cfg: dict) -> RopeScaling | None:
    kind = rope.get("rope_type", rope.get("type"))
    if kind in (None, "default"):
        return None
    if kind == "llama3":
        return RopeScaling(float(rope["factor"]), float(rope.get("low_freq_factor", 1.0)),
                           float(rope.get("high_freq_factor", 4.0)),
                           int(rope.get("original_max_position_embeddings", 8192)))
    if kind == "linear":
        return RopeScaling(factor=float(rope["factor"]), kind="linear")
    if kind in ("longrope", "su"):
        if float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))) != 1.0:
            raise ValueError("partial rotary embeddings are not supported")
        orig = int(rope.get("original_max_position_embeddings") or cfg["original_max_position_embeddings"])
        factor = cfg.get("max_position_embeddings", orig) / orig
        af = rope.get("attention_factor")
        if af is None:
            af = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
        return RopeScaling(factor=factor, original_max_position_embeddings=orig, kind="longrope",
                           short_factor=tuple(map(float, rope["short_factor"])),
                           long_factor=tuple(map(float, rope["long_factor"])), attention_factor=float(af))
    raise ValueError(f"unsupported rope scaling type {kind!r}; supported: llama3, linear, longrope")


def _window(cfg: dict) -> dict:
    """Sliding windows from ``sliding_window`` and ``layer_types`` (or Qwen's use_sliding_window)."""
    w = cfg.get("sliding_window")
    if cfg.get("use_sliding_window") is False or not w:
        return {}
    types = cfg.get("layer_types")
    if types is None:
        return {"sliding_window": int(w)}
    sliding = tuple(t == "sliding_attention" for t in types)
    if not any(sliding):
        return {}
    return {"sliding_window": int(w), "sliding_layers": None if all(sliding) else sliding}


def _moe_hf(cfg: dict, default_norm: bool) -> dict:
    if cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1:
        raise ValueError("MoE configs whose layers are not all sparse (mlp_only_layers, decoder_sparse_step) "
                         "are not supported")
    return dict(num_experts=cfg.get("num_experts") or cfg["num_local_experts"],
                num_experts_per_tok=cfg["num_experts_per_tok"],
                moe_intermediate_size=cfg.get("moe_intermediate_size") or cfg["intermediate_size"],
                norm_topk_prob=bool(cfg.get("norm_topk_prob", default_norm)),
                shared_expert_intermediate_size=cfg.get("shared_expert_intermediate_size") or 0)


def _moe_gguf(md: dict, p: str, norm: bool) -> dict:
    if not md.get(p + "expert_count"):
        return {}
    return dict(num_experts=int(md[p + "expert_count"]), num_experts_per_tok=int(md[p + "expert_used_count"]),
                moe_intermediate_size=int(md.get(p + "expert_feed_forward_length") or md[p + "feed_forward_length"]),
                norm_topk_prob=norm,
                shared_expert_intermediate_size=int(md.get(p + "expert_shared_feed_forward_length", 0)))


def _gemma_hf(cfg: dict, gemma3: bool) -> dict:
    out = dict(post_norms=True, embed_scale=True, query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar")
                                                                              or cfg["head_dim"]),
               attn_soft_cap=cfg.get("attn_logit_softcapping"), final_soft_cap=cfg.get("final_logit_softcapping"),
               **_window(cfg))
    if "layer_types" not in cfg and cfg.get("sliding_window"):  # older configs: the pattern is implied
        period = cfg.get("sliding_window_pattern", 6) if gemma3 else 2
        out["sliding_layers"] = tuple(i % period != period - 1 for i in range(cfg["num_hidden_layers"]))
    if gemma3:
        local = _hf_rope(cfg, "sliding_attention") if "sliding_attention" in (cfg.get("rope_parameters") or {}) \
            else {"rope_theta": cfg.get("rope_local_base_freq", 10000.0)}
        if local.get("rope_type", "default") != "default":
            raise ValueError("Gemma 3's sliding layers must use default RoPE")
        out.update(qk_norm=True, rope_local_theta=float(local["rope_theta"]))
    return out


def _gemma_gguf(md: dict, p: str, gemma3: bool) -> dict:
    n = int(md[p + "block_count"])
    period = 6 if gemma3 else 2
    w = md.get(p + "attention.sliding_window")
    out = dict(post_norms=True, hidden_act="gelu_tanh", embed_scale=True,
               query_pre_attn_scalar=float(md.get(p + "attention.query_pre_attn_scalar",
                                                  md.get(p + "attention.key_length", 256))),
               attn_soft_cap=md.get(p + "attn_logit_softcapping"), final_soft_cap=md.get(p + "final_logit_softcapping"))
    if w:
        out.update(sliding_window=int(w), sliding_layers=tuple(i % period != period - 1 for i in range(n)))
    if gemma3:
        out.update(qk_norm=True, rope_local_theta=10000.0)  # llama.cpp fixes the local base at 10,000
        if md.get(p + "rope.scaling.type") == "linear":
            out["rope_scaling"] = RopeScaling(factor=float(md[p + "rope.scaling.factor"]), kind="linear")
    return out


def _gemma_extra(c: ModelConfig, gemma3: bool) -> dict:
    out = {"hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": c.query_pre_attn_scalar,
           "attn_logit_softcapping": c.attn_soft_cap, "final_logit_softcapping": c.final_soft_cap,
           "sliding_window": c.sliding_window,
           "layer_types": ["sliding_attention" if c.layer_window(i) else "full_attention" for i in range(c.num_layers)]}
    if gemma3:
        out["rope_local_base_freq"] = c.rope_local_theta
    return out


def _window_extra(c: ModelConfig) -> dict:
    return {"sliding_window": c.sliding_window}


def _moe_extra(c: ModelConfig, experts_key: str) -> dict:
    return {experts_key: c.num_experts, "num_experts_per_tok": c.num_experts_per_tok,
            "moe_intermediate_size": c.moe_intermediate_size, "norm_topk_prob": c.norm_topk_prob,
            "shared_expert_intermediate_size": c.shared_expert_intermediate_size}


_MIXTRAL_HF = {"block_sparse_moe.gate.weight": "router", "block_sparse_moe.experts.{e}.w1.weight": "expert{e}_gate",
               "block_sparse_moe.experts.{e}.w3.weight": "expert{e}_up",
               "block_sparse_moe.experts.{e}.w2.weight": "expert{e}_down",
               "post_attention_layernorm.weight": "mlp_norm"}

FAMILIES: dict[str, Family] = {f.name: f for f in [
    Family("llama", ("LlamaForCausalLM", "llama"), {**_HF_ATTENTION, **_HF_DENSE}, "llama", lambda c: {},
           gguf_permute_qk=True),
    Family("mistral", ("MistralForCausalLM", "mistral"), {**_HF_ATTENTION, **_HF_DENSE}, None, _window,
           hf_extra=_window_extra),
    Family("qwen2", ("Qwen2ForCausalLM", "qwen2"), {**_HF_ATTENTION, **_HF_DENSE}, "qwen2",
           lambda c: dict(qkv_bias=True, **_window(c)), lambda md, p: dict(qkv_bias=True)),
    Family("qwen3", ("Qwen3ForCausalLM", "qwen3"), {**_HF_ATTENTION, **_HF_DENSE}, "qwen3",
           lambda c: dict(qk_norm=True, **_window(c)), lambda md, p: dict(qk_norm=True)),
    Family("gemma2", ("Gemma2ForCausalLM", "gemma2"), {**_HF_ATTENTION, **_HF_GEMMA}, "gemma2",
           lambda c: _gemma_hf(c, False), lambda md, p: _gemma_gguf(md, p, False), hf_norm_offset=1.0,
           hf_extra=lambda c: _gemma_extra(c, False)),
    Family("gemma3", ("Gemma3ForCausalLM", "gemma3_text"), {**_HF_ATTENTION, **_HF_GEMMA}, "gemma3",
           lambda c: _gemma_hf(c, True), lambda md, p: _gemma_gguf(md, p, True), hf_norm_offset=1.0,
           hf_extra=lambda c: _gemma_extra(c, True)),
    Family("phi3", ("Phi3ForCausalLM", "phi3"),
           {**_HF_ATTENTION, **_HF_DENSE, "self_attn.qkv_proj.weight": "qkv", "mlp.gate_up_proj.weight": "gate_up"},
           "phi3", _window, gguf_layer={**GGUF_LAYER, "ffn_up.weight": "gate_up"}),  # llama.cpp's fused gate|up
    # llama.cpp writes Mixtral as its llama architecture with experts (family_for_gguf).
    Family("mixtral", ("MixtralForCausalLM", "mixtral"), {**_HF_ATTENTION, **_MIXTRAL_HF}, None,
           lambda c: dict(**_moe_hf(c, True), **_window(c)), lambda md, p: _moe_gguf(md, p, True),
           gguf_permute_qk=True, hf_extra=lambda c: {
               "num_local_experts": c.num_experts, "num_experts_per_tok": c.num_experts_per_tok,
               "intermediate_size": c.moe_intermediate_size}),
    Family("qwen2_moe", ("Qwen2MoeForCausalLM", "qwen2_moe"), {**_HF_ATTENTION, **_HF_QWEN_MOE}, "qwen2moe",
           lambda c: dict(qkv_bias=True, **_moe_hf(c, False), **_window(c)),
           lambda md, p: dict(qkv_bias=True, **_moe_gguf(md, p, False)),
           hf_extra=lambda c: {"qkv_bias": True, **_moe_extra(c, "num_experts")}),
    Family("qwen3_moe", ("Qwen3MoeForCausalLM", "qwen3_moe"), {**_HF_ATTENTION, **_HF_QWEN_MOE}, "qwen3moe",
           lambda c: dict(qk_norm=True, **_moe_hf(c, False), **_window(c)),
           lambda md, p: dict(qk_norm=True, **_moe_gguf(md, p, True)),
           hf_extra=lambda c: _moe_extra(c, "num_experts")),
]}


def _supported() -> str:
    return ", ".join(a for f in FAMILIES.values() for a in f.hf_architectures[:1])


def family_for_hf(cfg: dict) -> Family:
    archs = cfg.get("architectures") or []
    keys = list(archs[:1]) + [cfg.get("model_type")]
    for f in FAMILIES.values():
        if any(k in f.hf_architectures for k in keys if k):
            return f
    raise ValueError(f"unsupported architecture {(archs or [cfg.get('model_type')])[0]!r}; "
                     f"supported: {_supported()}")


def family_for_gguf(md: dict) -> Family:
    arch = md.get("general.architecture", "llama")
    if arch == "llama" and md.get("llama.expert_count"):
        return FAMILIES["mixtral"]
    for f in FAMILIES.values():
        if f.gguf_arch == arch:
            return f
    raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: "
                     f"{', '.join(f.gguf_arch for f in FAMILIES.values() if f.gguf_arch)}")


def config_from_hf(cfg: dict) -> ModelConfig:
    """The ModelConfig of a Hugging Face ``config.json`` (decoded), by its family."""
    return family_for_hf(cfg).config_from_hf(cfg)


def config_to_hf(config: ModelConfig) -> dict:
    """The equivalent Hugging Face config dict (what builds the transformers oracle of a config)."""
    return FAMILIES[config.architecture].config_to_hf(config)


def config_from_gguf(md: dict) -> ModelConfig:
    """The ModelConfig of GGUF key/value metadata (decoded to Python values), by its family."""
    return family_for_gguf(md).config_from_gguf(md)
