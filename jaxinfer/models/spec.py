"""One parameter spec per model: every weight leaf's shape, logical axes and how it is made.

The spec is derived from the static ``ModelConfig`` (whose fields say which blocks a family's layers
have), and it is the one description that drives dummy initialization, the loaders' shape checks and
parameter counts. Logical axis names (``vocab``, ``embed``, ``qkv``, ``q_heads``, ``head_dim``,
``mlp``, ``experts``, ``layers``) are what a sharding rule maps to mesh axes; ``fused`` records the
parts of a fused tensor along its first named axis (q|k|v, gate|up) so that they can be split per
head; ``quantizable`` marks the matmul weights a quantization scheme may replace.

Weights are a ``Weights`` pytree: the global leaves, and the layers as a list of dicts of arrays
(unrolled loop) or one dict of arrays stacked on a leading ``layers`` axis (scanned loop).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from jaxinfer.models.config import ModelConfig
from jaxinfer.quant import QArray


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    shape: tuple[int, ...]
    axes: tuple[str, ...]
    init: str = "normal"  # "normal" (scaled by fan_in), "ones" (norm gains), "zeros" (biases)
    fan_in: int = 1
    fused: tuple[tuple[str, int], ...] | None = None  # (part, rows) along the first axis
    quantizable: bool = False

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def active_size(self, config: ModelConfig) -> int:
        """Elements one token reads: for a leaf with an ``experts`` axis, its routed experts only."""
        if "experts" in self.axes and self.axes[0] == "experts" and len(self.shape) == 3:
            return self.size * config.num_experts_per_tok // config.num_experts
        return self.size


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    globals: dict[str, ParamSpec]
    layer: dict[str, ParamSpec]  # one layer's leaves (without the leading ``layers`` axis)
    num_layers: int

    def leaves(self) -> list[ParamSpec]:
        return list(self.globals.values()) + list(self.layer.values()) * self.num_layers


def param_spec(config: ModelConfig) -> ModelSpec:
    d, v, hd = config.hidden_size, config.vocab_size, config.head_dim
    q, kv = config.q_size, config.kv_size
    qkv_parts = (("q", q), ("k", kv), ("v", kv))
    layer = {"wqkv": ParamSpec((q + 2 * kv, d), ("qkv", "embed"), fan_in=d, fused=qkv_parts, quantizable=True)}
    if config.qkv_bias:
        layer["qkv_bias"] = ParamSpec((q + 2 * kv,), ("qkv",), "zeros", fused=qkv_parts)
    if config.qk_norm:
        layer["q_norm"] = ParamSpec((hd,), ("head_dim",), "ones")
        layer["k_norm"] = ParamSpec((hd,), ("head_dim",), "ones")
    layer["wo"] = ParamSpec((d, q), ("embed", "q_heads"), fan_in=q, quantizable=True)
    if config.num_experts:
        e, f = config.num_experts, config.moe_intermediate_size
        layer["router"] = ParamSpec((e, d), ("experts", "embed"), fan_in=d)
        layer["experts_gate_up"] = ParamSpec((e, 2 * f, d), ("experts", "mlp", "embed"), fan_in=d,
                                             fused=(("gate", f), ("up", f)), quantizable=True)
        layer["experts_down"] = ParamSpec((e, d, f), ("experts", "embed", "mlp"), fan_in=f, quantizable=True)
        if config.shared_expert_intermediate_size:
            fs = config.shared_expert_intermediate_size
            layer["shared_gate_up"] = ParamSpec((2 * fs, d), ("mlp", "embed"), fan_in=d,
                                                fused=(("gate", fs), ("up", fs)), quantizable=True)
            layer["shared_down"] = ParamSpec((d, fs), ("embed", "mlp"), fan_in=fs, quantizable=True)
            layer["shared_gate"] = ParamSpec((1, d), (None, "embed"), fan_in=d)
    else:
        f = config.intermediate_size
        layer["w_gate_up"] = ParamSpec((2 * f, d), ("mlp", "embed"), fan_in=d, fused=(("gate", f), ("up", f)),
                                       quantizable=True)
        layer["w_down"] = ParamSpec((d, f), ("embed", "mlp"), fan_in=f, quantizable=True)
    if config.post_norms:
        layer["post_attn_norm"] = ParamSpec((d,), ("embed",), "ones")
        layer["post_mlp_norm"] = ParamSpec((d,), ("embed",), "ones")
    glob = {"embed": ParamSpec((v, d), ("vocab", "embed")), "final_norm": ParamSpec((d,), ("embed",), "ones")}
    if not config.tie_word_embeddings:
        glob["lm_head"] = ParamSpec((v, d), ("vocab", "embed"), fan_in=d, quantizable=True)
    return ModelSpec(glob, layer, config.num_layers)


def num_params(config: ModelConfig) -> int:
    return sum(s.size for s in param_spec(config).leaves())


def num_active_params(config: ModelConfig) -> int:
    """Parameters one token reads: with experts, only its ``num_experts_per_tok`` routed ones."""
    return sum(s.active_size(config) for s in param_spec(config).leaves())


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class InOut:
    """A dense matmul weight ``[..., out, in]`` stored transposed, ``t [..., in, out]``: how the CPU
    path keeps its matrices (``cpu_matmul_layout``); ``layers.linear`` and ``layers.embed`` take it.

    XLA:CPU hands dots of two or more rows to YNNPACK, whose right operand is ``[in, out]``; a
    ``[out, in]`` weight was repacked on every call: SmolLM2 float32's 8-sequence decode step took
    68.5 ms that way against 48.2 ms on 2 cores. The one-row dot is not YNNPACK's, and reads
    ``[in, out]`` as fast."""

    t: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Weights:
    embed: jax.Array | QArray  # [V, D]; quantizable leaves may be ``QArray``s (jaxinfer.quant)
    # A list of per-layer dicts (unrolled loop) or one dict of arrays stacked on a leading layer
    # axis (scanned loop); see `arrange_layers`. Keys and shapes: ``param_spec(config).layer``.
    layers: list[dict[str, jax.Array]] | dict[str, jax.Array]
    final_norm: jax.Array  # [D]
    lm_head: jax.Array | None  # [V, D]; None when tied to the embedding


def arrange_layers(weights: Weights, config: ModelConfig) -> Weights:
    """Stack per-layer weights for ``layer_loop == "scan"``, or split stacked ones for ``"unroll"`` and
    ``"indexed"``."""
    layers = weights.layers
    if config.layer_loop == "scan" and isinstance(layers, list):
        if len({jax.tree.structure(lw) for lw in layers}) > 1:
            # GGUF files mix block types across layers (Q4_K_M: some layers' ffn_down in Q6_K);
            # such layers cannot be stacked, and the decoder runs the list unrolled.
            return weights
        layers = jax.tree.map(lambda *xs: jnp.stack(xs), *layers)
    elif config.layer_loop in ("unroll", "indexed") and not isinstance(layers, list):
        layers = [jax.tree.map(lambda x, i=i: x[i], layers) for i in range(config.num_layers)]
    return dataclasses.replace(weights, layers=layers)


def cpu_matmul_layout(weights: Weights, config: ModelConfig) -> Weights:
    """``weights`` with every dense matmul weight as ``InOut`` (the spec's quantizable 2-D leaves, the
    lm_head, and the embedding when the lm_head is tied to it: its rows are then gathered as columns
    of the transposed table). Quantized leaves (``QArray``) and expert stacks stay as they are. For
    one CPU device: a mesh's shardings name the ``[out, in]`` axes."""
    spec = param_spec(config)
    transpose = jax.jit(lambda x: InOut(jnp.swapaxes(x, -1, -2)))

    def layer(lw: dict) -> dict:
        return {k: transpose(v) if spec.layer[k].quantizable and len(spec.layer[k].shape) == 2
                and not isinstance(v, QArray) else v for k, v in lw.items()}

    layers = [layer(lw) for lw in weights.layers] if isinstance(weights.layers, list) else layer(weights.layers)
    dense = lambda x: x is not None and not isinstance(x, QArray)
    tied = weights.lm_head is None
    return dataclasses.replace(weights, layers=layers,
                               embed=transpose(weights.embed) if tied and dense(weights.embed) else weights.embed,
                               lm_head=transpose(weights.lm_head) if dense(weights.lm_head) else weights.lm_head)


def init_dummy_weights(config: ModelConfig, key: jax.Array, dtype=jnp.float32, finish=None) -> Weights:
    """Random weights of the spec's shapes (``load_format="dummy"``), scaled so activations stay O(1);
    norm gains are ones and biases zeros, so nothing is folded.

    ``finish(spec, leaf)``, if given, replaces each leaf as soon as it is made (quantization at load):
    only one float leaf is alive at a time. Quantizing the finished float weights instead left a
    hole of their size below the quantized ones in the device allocator, and the KV pool sized to
    the free bytes then found no contiguous room for its second array (llama3-8b int8 on an H200:
    out of memory at the first decode step)."""
    spec = param_spec(config)
    keys = iter(jax.random.split(key, len(spec.globals) + len(spec.layer) * config.num_layers))

    def make(s: ParamSpec):
        k = next(keys)
        if s.init == "ones":
            x = jnp.ones(s.shape, dtype)
        elif s.init == "zeros":
            x = jnp.zeros(s.shape, dtype)
        else:
            x = (jax.random.normal(k, s.shape, jnp.float32) / math.sqrt(s.fan_in)).astype(dtype)
        return x if finish is None else finish(s, x)

    glob = {name: make(s) for name, s in spec.globals.items()}
    layers = [{name: make(s) for name, s in spec.layer.items()} for _ in range(config.num_layers)]
    weights = Weights(embed=glob["embed"], layers=layers, final_norm=glob["final_norm"], lm_head=glob.get("lm_head"))
    return arrange_layers(weights, config)


def abstract_weights(config: ModelConfig, dtype=jnp.float32) -> Weights:
    """The weights' shapes and dtypes (``jax.ShapeDtypeStruct`` leaves), nothing allocated."""
    return jax.eval_shape(lambda k: init_dummy_weights(config, k, dtype), jax.random.key(0))


def check_shapes(weights: Weights, config: ModelConfig) -> None:
    """A clear error where loaded tensors disagree with the config (heads, sizes), which would
    otherwise fail deep inside jit."""
    expected = abstract_weights(config.replace(layer_loop="unroll" if isinstance(weights.layers, list) else "scan"))
    if jax.tree.structure(weights, is_leaf=_is_q) != jax.tree.structure(expected):
        raise ValueError(f"checkpoint weights do not match the model config: leaves "
                         f"{sorted(_names(weights) ^ _names(expected))[:6]} differ")
    pairs = zip(jax.tree_util.tree_leaves_with_path(weights, is_leaf=_is_q), jax.tree.leaves(expected))
    bad = [f"{jax.tree_util.keystr(path)}: {got.shape} != {want.shape}"
           for (path, got), want in pairs if got.shape != want.shape]
    if bad:
        raise ValueError(f"checkpoint tensors do not match the model config: {', '.join(bad[:4])}")


def _is_q(x) -> bool:
    return isinstance(x, QArray)


def _names(weights: Weights) -> set[str]:
    return {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(weights, is_leaf=_is_q)}
