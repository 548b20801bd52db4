"""Converted checkpoints: weights as the loaders built them, saved with orbax (``save_converted``,
``jaxinfer convert``) and restored array by array, with no dequantizing, transposing,
fusing or norm folding to do again (int4's grid search alone takes minutes a billion parameters on
a CPU). Quantized weights are saved as their ``QArray`` fields and restored as saved, so such a
directory is loaded only with the quantization it holds (``saved_quantization``).
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxinfer.models import sharding
from jaxinfer.models.config import ModelConfig
from jaxinfer.models.spec import Weights, abstract_weights, param_spec
from jaxinfer.models.weights.source import CONVERTED_CONFIG, ModelFileError, blamed_on, read_json
from jaxinfer.quant import QArray, gguf_blocks, quantize

CONVERTED_LAYOUT = 4  # 2: RMSNorm weights folded into the projections after them; 3: [out, in]; 4: layers as dicts (spec.py)


def converted_config(path: str) -> ModelConfig:
    """The ModelConfig a converted directory was saved with."""
    meta_file = os.path.join(path, CONVERTED_CONFIG)
    meta = read_json(meta_file)
    with blamed_on(meta_file):
        return ModelConfig.from_dict(meta["config"])


def saved_quantization(source) -> str:
    """The ``quantization`` a directory written by ``save_converted`` holds its weights in (``"none"``
    for float weights and for every other ``ModelSource``)."""
    if source.kind != "orbax":
        return "none"
    return read_json(os.path.join(source.path, CONVERTED_CONFIG)).get("quantization", "none")


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
        json.dump({"config": saved.to_dict(), "dtype": str(weights.final_norm.dtype),
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


def restore_converted(path: str, dtype: np.dtype, mesh: Mesh | None) -> Weights:
    """The saved weights (checkpoint layout), each leaf restored on one device or, over ``mesh``,
    straight into its shards (orbax reads each device's slice)."""
    import orbax.checkpoint as ocp

    meta_file = os.path.join(path, CONVERTED_CONFIG)
    meta = read_json(meta_file)
    if meta.get("layout") != CONVERTED_LAYOUT:
        raise ModelFileError(meta_file, f"converted by an older jaxinfer (weight layout {meta.get('layout', 1)}, "
                             f"now {CONVERTED_LAYOUT}); convert the checkpoint again (jaxinfer convert)")
    saved = converted_config(path)
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

    with blamed_on(meta_file):  # its entries for the quantized leaves
        abstract = jax.tree_util.tree_map_with_path(leaf, abstract_weights(saved), shardings)
    weights_dir = os.path.join(path, "weights")
    try:
        with ocp.StandardCheckpointer() as ckpt:
            return ckpt.restore(weights_dir, abstract)
    except (OSError, ValueError) as e:  # missing or cut-short array files, a tree the JSON does not describe
        cause = str(e).strip().splitlines()
        raise ModelFileError(weights_dir, f"unreadable orbax checkpoint ({type(e).__name__}: "
                             f"{cause[0] if cause else 'no message'})") from None


def quantize_weights(weights: Weights, config: ModelConfig, scheme: str) -> Weights:
    """The spec's ``quantizable`` leaves of float ``weights`` (a float checkpoint just restored)
    quantized by ``scheme``, one at a time (each float leaf is freed as its quantized one is made)."""
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
