"""Static model configuration: a frozen dataclass, hashable, so it can be a `jit` static argument.

Built three ways: from a Hugging Face ``config.json``, from GGUF metadata, or from a named preset.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3.1 style frequency-dependent RoPE scaling (``rope_type == "llama3"``)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    # Per-frequency divisors of the inverse frequencies ``[head_dim // 2]``: how llama.cpp's GGUF files
    # carry Llama-3.1 scaling (the ``rope_freqs`` tensor) instead of the parameters above.
    rope_freq_factors: tuple[float, ...] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # How the layer loop is compiled: "scan" (stacked weights, compile time flat in depth) or
    # "unroll" (per-layer weights; faster on GPU where XLA copies a scanned layer's weight slice).
    layer_loop: str = "scan"

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.layer_loop not in ("scan", "unroll"):
            raise ValueError(f"layer_loop must be 'scan' or 'unroll', got {self.layer_loop!r}")
        if self.rope_freq_factors is not None and len(self.rope_freq_factors) != self.head_dim // 2:
            raise ValueError(f"rope_freq_factors has {len(self.rope_freq_factors)} entries; "
                             f"head_dim {self.head_dim} needs {self.head_dim // 2}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_params(self) -> int:
        d, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        per_layer = d * (self.q_size + 2 * self.kv_size) + self.q_size * d + 3 * d * f + 2 * d
        return self.num_layers * per_layer + v * d * (1 if self.tie_word_embeddings else 2) + d

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf_config(cls, cfg: dict | str | os.PathLike) -> "ModelConfig":
        """From a Hugging Face ``config.json`` (a dict, the file, or the directory holding it)."""
        if not isinstance(cfg, dict):
            path = os.fspath(cfg)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            with open(path) as f:
                cfg = json.load(f)
        rope = cfg.get("rope_parameters")  # transformers >= 5 nests theta and scaling here
        if rope:
            cfg = {**cfg, "rope_theta": cfg.get("rope_theta", rope.get("rope_theta", 10000.0))}
            if rope.get("rope_type", "default") != "default":
                cfg.setdefault("rope_scaling", {k: v for k, v in rope.items() if k != "rope_theta"})
        arch = (cfg.get("architectures") or ["LlamaForCausalLM"])[0]
        if cfg.get("model_type", "llama") != "llama" and arch != "LlamaForCausalLM":
            raise ValueError(f"unsupported architecture {arch!r} (model_type {cfg.get('model_type')!r}); "
                             "jaxinfer supports the Llama family")
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        eos = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=cfg.get("rope_theta", 10000.0),
            rope_scaling=_rope_scaling_from_hf(cfg.get("rope_scaling")),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos,
        )

    def to_hf_config(self) -> dict:
        """The equivalent Hugging Face ``LlamaConfig`` dict (used to build the transformers oracle)."""
        cfg = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
        }
        if self.bos_token_id is not None:
            cfg["bos_token_id"] = self.bos_token_id
        if self.eos_token_ids:
            cfg["eos_token_id"] = list(self.eos_token_ids)
        if self.rope_scaling is not None:
            cfg["rope_scaling"] = {"rope_type": "llama3", **dataclasses.asdict(self.rope_scaling)}
        if self.rope_freq_factors is not None:
            raise ValueError("rope_freq_factors (a GGUF rope_freqs tensor) has no transformers config equivalent")
        return cfg

    @classmethod
    def from_gguf_metadata(cls, md: dict) -> "ModelConfig":
        """From GGUF key/value metadata (already decoded to Python values) of a ``llama`` model."""
        arch = md.get("general.architecture", "llama")
        if arch != "llama":
            raise ValueError(f"unsupported GGUF architecture {arch!r}; jaxinfer supports 'llama'")
        p = f"{arch}."
        heads = int(md[p + "attention.head_count"])
        hidden = int(md[p + "embedding_length"])
        vocab = md.get(p + "vocab_size") or len(md["tokenizer.ggml.tokens"])
        eos = md.get("tokenizer.ggml.eos_token_id")
        return cls(
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(md[p + "feed_forward_length"]),
            num_layers=int(md[p + "block_count"]),
            num_heads=heads,
            num_kv_heads=int(md.get(p + "attention.head_count_kv", heads)),
            head_dim=int(md.get(p + "attention.key_length", hidden // heads)),
            rms_norm_eps=float(md.get(p + "attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(md.get(p + "rope.freq_base", 10000.0)),
            rope_freq_factors=md.get("_rope_freq_factors"),
            max_position_embeddings=int(md.get(p + "context_length", 2048)),
            tie_word_embeddings=bool(md.get("_tied_embeddings", False)),
            bos_token_id=md.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=() if eos is None else (int(eos),),
        )


def _rope_scaling_from_hf(rs: dict | None) -> RopeScaling | None:
    if not rs:
        return None
    kind = rs.get("rope_type", rs.get("type"))
    if kind in (None, "default"):
        return None
    if kind != "llama3":
        raise ValueError(f"unsupported rope_scaling type {kind!r}; supported: 'llama3'")
    return RopeScaling(
        factor=float(rs["factor"]),
        low_freq_factor=float(rs.get("low_freq_factor", 1.0)),
        high_freq_factor=float(rs.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(rs.get("original_max_position_embeddings", 8192)),
    )


_LLAMA3_EOS = (128001, 128008, 128009)

PRESETS: dict[str, ModelConfig] = {
    "smollm2-135m": ModelConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
        num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
        max_position_embeddings=8192, tie_word_embeddings=True, bos_token_id=1, eos_token_ids=(2,)),
    "llama3.2-1b": ModelConfig(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32,
        num_kv_heads=8, head_dim=64, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=RopeScaling(32.0, 1.0, 4.0, 8192), max_position_embeddings=131072,
        tie_word_embeddings=True, bos_token_id=128000, eos_token_ids=_LLAMA3_EOS),
    "llama3-8b": ModelConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
        num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=RopeScaling(8.0, 1.0, 4.0, 8192), max_position_embeddings=131072,
        bos_token_id=128000, eos_token_ids=_LLAMA3_EOS),
    "llama3-70b": ModelConfig(
        vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64,
        num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=RopeScaling(8.0, 1.0, 4.0, 8192), max_position_embeddings=131072,
        bos_token_id=128000, eos_token_ids=_LLAMA3_EOS),
    # Tiny random configs for fast unit tests: GQA, Llama-3.1 rope scaling, tied and untied embeddings.
    "tiny-llama3": ModelConfig(
        vocab_size=512, hidden_size=64, intermediate_size=160, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=RopeScaling(8.0, 1.0, 4.0, 64), max_position_embeddings=2048,
        bos_token_id=1, eos_token_ids=(2,)),
    "tiny-llama-tied": ModelConfig(
        vocab_size=384, hidden_size=48, intermediate_size=96, num_layers=3, num_heads=6,
        num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0,
        max_position_embeddings=512, tie_word_embeddings=True, bos_token_id=1, eos_token_ids=(2,)),
}
