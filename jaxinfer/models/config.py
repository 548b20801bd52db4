"""Static model configuration: a frozen dataclass, hashable, so it can be a `jit` static argument.

One dataclass serves every family: the fields beyond Llama's say which building blocks of
``jaxinfer.models.layers`` a family's decoder layer uses (biases, Q/K norms, post-norms, soft caps,
sliding windows, experts). Each family (``jaxinfer.models.families``) parses its Hugging Face
``config.json`` and GGUF metadata into it and refuses fields it cannot honour.

This module is the bottom of ``models/``: it imports no other jaxinfer module, so the ones that
read a config (families: ``config_from_hf``, ``config_to_hf``, ``config_from_gguf``; spec:
``num_params``) build on it and nothing imports back up.
"""

from __future__ import annotations

import dataclasses
from typing import Any

ROPE_KINDS = ("llama3", "linear", "longrope")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. ``kind``:

    - ``"llama3"``: Llama-3.1's frequency-dependent scaling (``factor``, the two frequency factors and
      ``original_max_position_embeddings``).
    - ``"linear"``: positions divided by ``factor`` (Gemma 3's global layers).
    - ``"longrope"``: Phi-3's per-frequency divisors, ``short_factor`` within
      ``original_max_position_embeddings`` and ``long_factor`` past it (chosen once per engine by
      its context length, ``ModelConfig.for_context``), and the ``attention_factor`` that scales cos
      and sin (folded into the attention scale as its square).
    """

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    kind: str = "llama3"
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None
    attention_factor: float = 1.0
    use_long: bool = False

    def __post_init__(self):
        if self.kind not in ROPE_KINDS:
            raise ValueError(f"unsupported rope scaling type {self.kind!r}; supported: {', '.join(ROPE_KINDS)}")


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
    # How the layer loop is compiled: "scan" (stacked weights, compile time flat in depth),
    # "unroll" (per-layer weights; faster on GPU where XLA copies a scanned layer's weight slice) or
    # "indexed" (per-layer weights, one loop body: see ``decoder.forward``; the CPU default).
    layer_loop: str = "scan"
    # The family (a key of ``families.FAMILIES``): its checkpoint names and config parsing.
    architecture: str = "llama"
    # ---- what the decoder layer is made of (defaults: Llama)
    qkv_bias: bool = False  # Qwen2: biases on q, k and v
    qk_norm: bool = False  # Qwen3, Gemma 3: per-head RMSNorm on q and k before RoPE
    post_norms: bool = False  # Gemma 2/3: RMSNorm on the attention and MLP outputs before the residual add
    hidden_act: str = "silu"  # of the gated MLP: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    embed_scale: bool = False  # Gemma: embeddings times sqrt(hidden_size)
    query_pre_attn_scalar: float | None = None  # Gemma: attention scale is its rsqrt, not head_dim's
    attn_soft_cap: float | None = None  # Gemma 2: cap * tanh(scores / cap)
    final_soft_cap: float | None = None  # Gemma 2: the same on the logits
    sliding_window: int | None = None  # keys within this many positions (Mistral, Gemma's local layers)
    # Which layers use ``sliding_window`` (Gemma: interleaved local and global layers); None: all.
    sliding_layers: tuple[bool, ...] | None = None
    rope_local_theta: float | None = None  # Gemma 3: the RoPE base of sliding layers (unscaled)
    # ---- mixture of experts (num_experts == 0: a dense MLP)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # renormalize the top-k routing weights (Mixtral, Qwen3-MoE)
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: a dense expert gated by sigmoid(x . w)

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.layer_loop not in ("scan", "unroll", "indexed"):
            raise ValueError(f"layer_loop must be 'scan', 'unroll' or 'indexed', got {self.layer_loop!r}")
        if self.rope_freq_factors is not None and len(self.rope_freq_factors) != self.head_dim // 2:
            raise ValueError(f"rope_freq_factors has {len(self.rope_freq_factors)} entries; "
                             f"head_dim {self.head_dim} needs {self.head_dim // 2}")
        if self.hidden_act not in ("silu", "gelu_tanh"):
            raise ValueError(f"hidden_act must be 'silu' or 'gelu_tanh', got {self.hidden_act!r}")
        if self.sliding_layers is not None and len(self.sliding_layers) != self.num_layers:
            raise ValueError(f"sliding_layers has {len(self.sliding_layers)} entries for {self.num_layers} layers")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, num_experts={self.num_experts}], "
                             f"got {self.num_experts_per_tok}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def attention_scale(self) -> float:
        base = self.query_pre_attn_scalar if self.query_pre_attn_scalar is not None else self.head_dim
        mscale = self.rope_scaling.attention_factor if self.rope_scaling is not None else 1.0
        return base ** -0.5 * mscale * mscale

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of ``layer`` (None: global attention)."""
        if self.sliding_window is None or (self.sliding_layers is not None and not self.sliding_layers[layer]):
            return None
        return self.sliding_window

    def for_context(self, max_model_len: int) -> "ModelConfig":
        """This config for an engine whose sequences reach ``max_model_len`` tokens: LongRoPE takes
        its long factors when that passes the original context, as Phi-3 does for such sequences."""
        rs = self.rope_scaling
        if rs is None or rs.kind != "longrope":
            return self
        return self.replace(rope_scaling=dataclasses.replace(
            rs, use_long=max_model_len > rs.original_max_position_embeddings))

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        """The config as JSON values (the user cache's ``config.json``, a converted checkpoint's)."""
        d = dataclasses.asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        """The config ``to_dict`` wrote: JSON lists back to the (hashable) tuples the fields hold."""
        def tuples(x):
            return {k: tuple(v) if isinstance(v, list) else v for k, v in x.items()}

        d = tuples(d)
        if d["rope_scaling"] is not None:
            d["rope_scaling"] = RopeScaling(**tuples(d["rope_scaling"]))
        return cls(**d)


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
    # Other families' shapes (dummy weights for benchmarks), as their config.json files give them.
    "qwen2.5-7b": ModelConfig(
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28, num_heads=28,
        num_kv_heads=4, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=32768,
        bos_token_id=151643, eos_token_ids=(151645, 151643), architecture="qwen2", qkv_bias=True),
    "gemma2-9b": ModelConfig(
        vocab_size=256000, hidden_size=3584, intermediate_size=14336, num_layers=42, num_heads=16,
        num_kv_heads=8, head_dim=256, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=8192,
        tie_word_embeddings=True, bos_token_id=2, eos_token_ids=(1, 107), architecture="gemma2",
        post_norms=True, hidden_act="gelu_tanh", embed_scale=True, query_pre_attn_scalar=256.0,
        attn_soft_cap=50.0, final_soft_cap=30.0, sliding_window=4096,
        sliding_layers=tuple(i % 2 == 0 for i in range(42))),
    "mixtral-8x7b": ModelConfig(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
        num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=1000000.0, max_position_embeddings=32768,
        bos_token_id=1, eos_token_ids=(2,), architecture="mixtral", num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=14336),
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
    # Gemma 2's blocks at tiny size: a sliding window shorter than most prompts (crossing pages) on
    # alternate layers, soft caps, post-norms, GeGLU, scaled embeddings; the batching tests' second family.
    # Untied (unlike Gemma): random tied embeddings make greedy decoding repeat the last token.
    "tiny-gemma2": ModelConfig(
        vocab_size=512, hidden_size=64, intermediate_size=96, num_layers=3, num_heads=4, num_kv_heads=2,
        head_dim=32, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=2048,
        bos_token_id=2, eos_token_ids=(1,), architecture="gemma2", post_norms=True,
        hidden_act="gelu_tanh", embed_scale=True, query_pre_attn_scalar=24.0, attn_soft_cap=2.0,
        final_soft_cap=3.0, sliding_window=24, sliding_layers=(True, False, True)),
    # Eight query heads over two KV heads: tensor parallel 2 splits both, 4 and 8 repeat KV heads.
    "tiny-gqa8": ModelConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=8, num_kv_heads=2,
        head_dim=8, max_position_embeddings=512, bos_token_id=1, eos_token_ids=(2,)),
    "tiny-qwen2": ModelConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=8, num_kv_heads=2,
        head_dim=8, rms_norm_eps=1e-6, max_position_embeddings=512, bos_token_id=1, eos_token_ids=(2,),
        architecture="qwen2", qkv_bias=True),
    "tiny-qwen2-moe": ModelConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=8, num_kv_heads=2,
        head_dim=8, rms_norm_eps=1e-6, max_position_embeddings=512, bos_token_id=1, eos_token_ids=(2,),
        architecture="qwen2_moe", qkv_bias=True, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        norm_topk_prob=False, shared_expert_intermediate_size=64),
}
