"""Tensors into the parameter tree: the ``Assembler`` that both file-format loaders (``hf.py``,
``gguf.py``) feed, so fusing, norm folding, quantizing (int4's first-token weighting included) and
placing on the device or a mesh are written once. Each layer leaves the host as soon as its last
part arrives: a llama3-8b file in layer order holds one 0.44 GB bfloat16 layer on the host at a
time, not the 16 GB model.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxinfer.models import sharding
from jaxinfer.models.config import ModelConfig
from jaxinfer.models.decoder import first_token_layer
from jaxinfer.models.layers import fold_norm, rms_norm
from jaxinfer.models.spec import Weights, check_shapes, param_spec
from jaxinfer.models.weights.source import ModelFileError
from jaxinfer.quant import QArray, concat, parse_scheme, quantize, to_device, with_col_scale

# How much the first token's activations weigh the int4 grid search (``Assembler._sink_importance``):
# with it SmolLM2 int4-g64 is +5.2% perplexity over float32 on the first 1,024 held tokens, +11.5% without.
SINK_WEIGHT = 100.0
# ... and at most: the search's one-pass float32 sums cancel at 1e4 : 1 already (SmolLM2 int4-g32
# then stopped reproducing its Q4_1 grid exactly; at 1e3 it is bit for bit), and the key/value rows
# weighed by 10, 100 or 1000 x measured alike.
SINK_WEIGHT_MAX = 1e3


def _float32(x) -> np.ndarray:
    return np.asarray(x, np.float32)


class Assembler:
    """Collects a checkpoint's tensors by canonical part (``families.py``), in HF orientation
    (``[out, in]``), and builds `Weights` (unrolled layout) as the spec lays them out.

    A layer's parts are cast, fused (q|k|v, gate|up, per-expert stacks), their norm gains folded into
    the projections after them, and moved to the device as soon as all of them have arrived, so host
    copies exist only for layers still incomplete (one, for files in layer order).

    Under an int4 scheme, layers are built in order once the embedding is known: the first token of
    a sequence (``bos_token_id`` at position 0) is followed through each layer's float weights before
    they are quantized (``decoder.first_token_layer``), and what it feeds each matrix weighs that
    matrix's grid search (``_sink_importance``). The host then holds the complete layers that wait
    for an earlier one (none for files in layer order)."""

    _NORMS = ("attn_norm", "mlp_norm", "post_attn_norm", "post_mlp_norm", "q_norm", "k_norm")

    def __init__(self, config: ModelConfig, dtype: np.dtype, norm_offset: float = 0.0, mesh: Mesh | None = None,
                 scheme: str | None = None, source: str = "checkpoint"):
        self.config, self.dtype, self.norm_offset, self.mesh, self.scheme = config, dtype, norm_offset, mesh, scheme
        self.source = source  # the file or directory the tensors come from, for errors
        self.pending: list[dict[str, np.ndarray]] = [{} for _ in range(config.num_layers)]
        self.layers: list[dict | None] = [None] * config.num_layers
        self.globals: dict[str, jax.Array] = {}
        # int4: the first token's residual stream (None until the embedding arrives), the next layer
        # it enters, and the complete layers waiting for it
        self.follow_sink = scheme is not None and parse_scheme(scheme)[0] == "int4"
        self.sink: np.ndarray | jax.Array | None = None
        self.next_layer = 0
        self.complete: dict[int, dict[str, np.ndarray]] = {}

    def _mat(self, w, norm=None, importance=None):
        """A quantizable leaf, its norm gain (if any) folded in; with a ``scheme``, quantized first
        and the gain kept explicit (``col_scale``): folded per-column gains stretch every group's
        range, and int4-g64 on SmolLM2 had +51% perplexity quantizing folded weights against +15%
        this way."""
        if self.scheme is None or isinstance(w, QArray):
            return self._cast(w if norm is None else fold_norm(norm, w))
        q = quantize(np.asarray(w, np.float32), self.scheme, importance)
        return q if norm is None else with_col_scale(q, norm)

    @staticmethod
    def _float_mat(w, norm=None, importance=None):
        """A leaf as the float model has it (norm folded, float32): what the first token runs through."""
        del importance
        return np.asarray(w if norm is None else fold_norm(norm, w), np.float32)

    def _cast(self, x):
        """A float leaf in the load dtype on the host; a ``QArray`` (blocks) as it is."""
        if isinstance(x, QArray):
            return x
        return np.asarray(x).astype(self.dtype, copy=False)

    def _place(self, name: str, x, is_global: bool):
        """Onto the device, or straight into its shards over a mesh (no whole copy on any device)."""
        if isinstance(x, QArray) and self.mesh is None:
            return to_device(x)
        if self.mesh is None:
            return jnp.asarray(x)
        spec = param_spec(self.config)
        want = (spec.globals if is_global else spec.layer)[name].shape
        if x.shape != want:
            raise ModelFileError(self.source, f"checkpoint tensors do not match the model config: {name}: "
                                 f"{x.shape} != {want}")
        return sharding.place_host_leaf(name, x, self.config, self.mesh, is_global)

    def put_global(self, name: str, array: np.ndarray) -> None:
        if name == "final_norm":
            array = np.asarray(array, np.float32) + self.norm_offset
        self.globals[name] = self._place(name, self._mat(array) if name == "lm_head" else self._cast(array), True)
        if name == "embed" and self.follow_sink:
            c = self.config
            x = np.asarray(array[c.bos_token_id or 0], np.float32)
            self.sink = x * np.float32(c.hidden_size ** 0.5) if c.embed_scale else x
            self._drain()

    def put_layer(self, layer: int, part: str, array: np.ndarray) -> None:
        if not 0 <= layer < self.config.num_layers:
            raise ModelFileError(self.source, f"a tensor for layer {layer}, but the config has "
                                 f"{self.config.num_layers} layers")
        if part in self._NORMS:
            array = np.asarray(array, np.float32) + self.norm_offset
        self.pending[layer][part] = array if isinstance(array, QArray) else np.asarray(array)
        if not self._missing(self.pending[layer]):
            if self.follow_sink:
                self.complete[layer] = self.pending[layer]
                self._drain()
            else:
                self.layers[layer] = self._build(self.pending[layer])
            self.pending[layer] = {}

    def _drain(self) -> None:
        """Builds the complete layers the first token has reached, in order (``follow_sink``). The
        first token runs on the host's CPU: one token is little work, and a float32 copy of each
        layer on the accelerator would come and go between the quantized leaves there."""
        while self.sink is not None and self.next_layer in self.complete:
            i = self.next_layer
            p = self.complete.pop(i)
            with jax.default_device(jax.devices("cpu")[0]):
                lw = {k: jnp.asarray(v) for k, v in self._leaves(p, self._float_mat, _float32).items()}
                x = rms_norm(jnp.asarray(self.sink), jnp.asarray(p["attn_norm"], jnp.float32),
                             self.config.rms_norm_eps)
                self.sink, inputs = first_token_layer(self.config, lw, i, self.sink)
                if "w_gate_up" in inputs:  # the norm's gain, kept out of the quantized weights, is in their input
                    inputs["w_gate_up"] = inputs["w_gate_up"] * jnp.asarray(p["mlp_norm"], jnp.float32)
                importance = self._sink_importance(dict(inputs, wqkv=x))
            del lw
            self.layers[i] = self._build(p, importance)
            self.next_layer += 1

    def _sink_importance(self, inputs: dict) -> dict[str, np.ndarray]:
        """Per-column importance ``1 + SINK_WEIGHT * x^2 / mean(x^2)`` (at most ``SINK_WEIGHT_MAX``) of
        each matrix the first token fed ``x`` (``inputs``, by leaf; ``wqkv``: its key and value rows
        only, query rows 1).
        Nearly every position attends to that token (the attention sink), whose residual stream
        carries massive activations in a few fixed dimensions (SmolLM2: dimension 507, ~500 times the
        mean square from the sixth layer on, whatever the first token), so a key or value row's
        error in those columns shifts every position's attention, while a token's own error averages
        out; and the sink's own state, which every later layer's keys and values read, runs through
        ``wo`` and the MLP. Its query rows do not matter: a lone token's attention output is its
        value. This weighting took SmolLM2 int4-g64 from +27.2% to +14.2% perplexity over float32 on
        the whole held text (3,267 tokens); the activations' mean square over ordinary tokens, which
        dilutes the sink's, did not help."""
        c = self.config
        out = {}
        for name, x in inputs.items():
            x = np.asarray(x, np.float64)
            out[name] = np.minimum(1.0 + SINK_WEIGHT * x * x / np.mean(x * x), SINK_WEIGHT_MAX).astype(np.float32)
        q_rows = c.num_heads * c.head_dim
        qkv = np.ones((q_rows + 2 * c.num_kv_heads * c.head_dim, len(out["wqkv"])), np.float32)
        qkv[q_rows:] = out["wqkv"]
        out["wqkv"] = qkv
        return out

    def _missing(self, p: dict) -> list[str]:
        c = self.config
        need = ["o", "attn_norm", "mlp_norm"] + (["qkv"] if "qkv" in p else ["q", "k", "v"])
        if c.qkv_bias:
            need += ["q_bias", "k_bias", "v_bias"]
        if c.qk_norm:
            need += ["q_norm", "k_norm"]
        if c.post_norms:
            need += ["post_attn_norm", "post_mlp_norm"]
        if c.num_experts:
            need.append("router")
            if any(k.startswith("experts_") for k in p):  # GGUF: stacked [E, out, in]
                need += ["experts_gate", "experts_up", "experts_down"]
            else:
                need += [f"expert{e}_{w}" for e in range(c.num_experts) for w in ("gate", "up", "down")]
            if c.shared_expert_intermediate_size:
                need += ["shared_gate", "shared_up", "shared_down", "shared_expert_gate"]
        else:
            need += (["gate_up"] if "gate_up" in p else ["gate", "up"]) + ["down"]
        return [n for n in need if n not in p]

    def _build(self, p: dict, importance: dict | None = None) -> dict:
        """One layer's leaves (``spec.param_spec(config).layer``) on the device."""
        out = self._leaves(p, self._mat, self._cast, importance)
        return {name: self._place(name, a, False) for name, a in out.items()}

    def _leaves(self, p: dict, mat, put, importance: dict | None = None) -> dict:
        """One layer's leaves on the host: matrices through ``mat`` (``_mat``: cast or quantized, with
        ``importance`` by leaf name where given; ``_float_mat``), the rest through ``put`` (a cast).
        Norms are folded in float32 from the checkpoint's values, then cast once."""
        importance = importance or {}
        c = self.config
        mlp_norm = p["mlp_norm"]
        out = {"wqkv": mat(p["qkv"] if "qkv" in p else concat([p["q"], p["k"], p["v"]]), p["attn_norm"],
                           importance.get("wqkv"))}
        if c.qkv_bias:
            out["qkv_bias"] = put(np.concatenate([p["q_bias"], p["k_bias"], p["v_bias"]]))
        if c.qk_norm:
            out["q_norm"], out["k_norm"] = put(p["q_norm"]), put(p["k_norm"])
        out["wo"] = mat(p["o"], None, importance.get("wo"))
        if c.num_experts:
            out["router"] = put(fold_norm(mlp_norm, p["router"]))
            if "experts_gate" in p:
                gate, up, down = p["experts_gate"], p["experts_up"], p["experts_down"]
            else:
                gate, up, down = (np.stack([p[f"expert{e}_{w}"] for e in range(c.num_experts)])
                                  for w in ("gate", "up", "down"))
            out["experts_gate_up"] = mat(concat([gate, up]), mlp_norm)
            out["experts_down"] = mat(down)
            if c.shared_expert_intermediate_size:
                out["shared_gate_up"] = mat(concat([p["shared_gate"], p["shared_up"]]), mlp_norm)
                out["shared_down"] = mat(p["shared_down"])
                out["shared_gate"] = put(fold_norm(mlp_norm, np.reshape(p["shared_expert_gate"], (1, -1))))
        else:
            gate_up = p["gate_up"] if "gate_up" in p else concat([p["gate"], p["up"]])
            out["w_gate_up"] = mat(gate_up, mlp_norm, importance.get("w_gate_up"))
            out["w_down"] = mat(p["down"], None, importance.get("w_down"))
        if c.post_norms:
            out["post_attn_norm"], out["post_mlp_norm"] = put(p["post_attn_norm"]), put(p["post_mlp_norm"])
        return out

    def finish(self) -> Weights:
        missing = [f"layer {i}: {self._missing(p)[:6]}" for i, p in enumerate(self.pending) if self.layers[i] is None]
        needed = ["embed", "final_norm"] + ([] if self.config.tie_word_embeddings else ["lm_head"])
        missing += [g for g in needed if g not in self.globals]
        if missing:
            raise ModelFileError(self.source, f"checkpoint is missing weights: {', '.join(missing[:8])}")
        weights = Weights(embed=self.globals["embed"], layers=self.layers, final_norm=self.globals["final_norm"],
                          lm_head=None if self.config.tie_word_embeddings else self.globals["lm_head"])
        if self.mesh is None:  # over a mesh, each leaf was checked as it was placed (``_place``)
            try:
                check_shapes(weights, self.config)
            except ValueError as e:
                raise ModelFileError(self.source, str(e)) from None
        return weights

