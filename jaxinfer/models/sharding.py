"""A model over a device mesh: the one place where the spec's logical axes meet mesh axes.

The mesh has two axes, ``dp`` (replicas) and ``tp`` (tensor parallel). ``RULES`` maps logical axes
(``models.spec``) to mesh axes: attention heads, the MLP hidden dimension, experts and the vocabulary
go over ``tp``; everything else is replicated. A leaf takes the rule of its first axis that has one
and whose size ``tp`` divides (an expert stack ``[experts, mlp, embed]`` is split by expert; a
vocabulary that ``tp`` does not divide stays whole). Layers are then Megatron-style: Q/K/V and
gate/up column-parallel, the output and down projections row-parallel (one all-reduce each, which
GSPMD inserts for ``wo`` and the per-device blocks below do with ``psum``).

Fused tensors are laid out per device (``shard_layout``): device i's rows of ``wqkv`` are its own
query heads, then its KV heads, then their values (and gate/up likewise), so a device holds whole
heads and the per-device code sees the same fused contract as one device, only with fewer heads.
Where ``tp`` exceeds the KV heads, each device stores a copy of the one KV head its query heads use,
as vLLM does: the cache then has ``tp`` KV heads (``kv_heads``), one per device.

Attention (reference or Pallas kernels) and the feed-forward blocks run per device under
``shard_map`` (``sharded_ops``): the same functions on each device's heads, experts or hidden slice,
nothing re-implemented. The rest of the step (embedding, norms, ``wo``, logits and sampling) is left to
GSPMD from the weights' shardings.

Quantized leaves (``QArray``) are split like the plain leaf they stand for, field by field
(``leaf_specs``): codes, scales and offsets along the same rows, and along the input axis in whole
32-column blocks and whole groups, so each shard keeps its own scales; ``col_scale`` (a norm gain)
follows the input axis. A per-row scale split along the input is stored once per shard
(``_split_rows_scale``). Every quantized matmul runs per device on its shards (the MLP and expert
blocks, and ``wqkv``, ``wo`` and the logits through ``Ops.project``): GSPMD cannot split our kernels'
custom calls and would gather the codes around them on every step. A quantized KV cache's scales are
split with their KV heads.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxinfer.models.config import ModelConfig
from jaxinfer.models.layers import LayerChoice, Ops, moe_partial
from jaxinfer.models.spec import ModelSpec, ParamSpec, Weights, arrange_layers, init_dummy_weights, param_spec
from jaxinfer.paged.kv_cache import KVCache, is_quantized
from jaxinfer.quant import QArray, map_rows

log = logging.getLogger(__name__)

DP, TP = "dp", "tp"
# Logical axis -> mesh axis (the only such table). Unlisted axes are replicated.
RULES = {"vocab": TP, "qkv": TP, "q_heads": TP, "mlp": TP, "experts": TP}
# Leaves every device needs whole: the router's logits are a softmax over all experts (and it is
# small: experts x hidden).
REPLICATED = ("router",)
_KV_SPEC = P(None, None, None, TP, None)  # [layers, pages, page_size, kv_heads, head_dim]
_KV_SCALE_SPEC = P(None, None, None, TP)  # a quantized cache's scales: [layers, pages, page_size, kv_heads]


def _cache_spec(quantized: bool) -> KVCache:
    """The KV pool's ``PartitionSpec`` per field: pages split by KV head, and a quantized pool's
    scales with their heads."""
    return KVCache(_KV_SPEC, _KV_SPEC, *((_KV_SCALE_SPEC, _KV_SCALE_SPEC) if quantized else ()))


# ------------------------------------------------------------------------------------- the mesh

def tensor_parallel_problem(config: ModelConfig, tp: int) -> str | None:
    """Why ``config`` cannot be split ``tp`` ways (None: it can)."""
    h, kvh = config.num_heads, config.num_kv_heads
    if h % tp:
        return f"num_heads={h} is not divisible by {tp}"
    if kvh % tp and tp % kvh:
        return f"num_kv_heads={kvh} neither divides nor is divisible by {tp}"
    if config.num_experts:
        if config.num_experts % tp:
            return f"num_experts={config.num_experts} is not divisible by {tp}"
        if config.shared_expert_intermediate_size % tp:
            return f"shared_expert_intermediate_size={config.shared_expert_intermediate_size} is not divisible by {tp}"
    elif config.intermediate_size % tp:
        return f"intermediate_size={config.intermediate_size} is not divisible by {tp}"
    return None


def make_mesh(config: ModelConfig, tensor_parallel: int = 1, data_parallel: int = 1, devices=None) -> Mesh | None:
    """The ``(dp, tp)`` mesh over the first ``data_parallel * tensor_parallel`` of ``devices`` (default:
    all of them, every process's, in ``jax.devices()`` order), or None for one device (``1 x 1``: the
    single-device step, unchanged). More devices than the product are left unused (logged); fewer are
    an error, as is a ``tensor_parallel`` that does not split the model. The errors name the sizes
    that would work."""
    devices = jax.devices() if devices is None else list(devices)
    n = len(devices)
    for name, v in (("tensor_parallel", tensor_parallel), ("data_parallel", data_parallel)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    valid_tp = [tp for tp in range(1, n + 1) if tensor_parallel_problem(config, tp) is None]
    if tensor_parallel > n:
        raise ValueError(f"tensor_parallel={tensor_parallel} exceeds the {n} devices; valid tensor_parallel "
                         f"sizes for this model here: {valid_tp}")
    problem = tensor_parallel_problem(config, tensor_parallel)
    if problem:
        raise ValueError(f"tensor_parallel={tensor_parallel} does not split the model ({problem}); valid "
                         f"tensor_parallel sizes for this model on {n} devices: {valid_tp}")
    if tensor_parallel * data_parallel == 1:
        return None
    need = tensor_parallel * data_parallel
    if need > n:
        raise ValueError(f"data_parallel * tensor_parallel ({data_parallel} * {tensor_parallel} = {need}) exceeds "
                         f"the {n} devices; at most data_parallel={n // tensor_parallel} with "
                         f"tensor_parallel={tensor_parallel}")
    if need < n:
        used = devices[:need]
        processes = {getattr(d, "process_index", 0) for d in devices}
        if {getattr(d, "process_index", 0) for d in used} != processes:
            raise ValueError(f"data_parallel * tensor_parallel ({data_parallel} * {tensor_parallel} = {need}) "
                             f"leaves a process without a device of its {n} (every process runs the step); "
                             f"use all {n} devices over several processes")
        log.info("data_parallel x tensor_parallel %d x %d: using the first %d of the %d devices: %s",
                 data_parallel, tensor_parallel, need, n, ", ".join(map(str, used)))
        devices = used
    return Mesh(np.asarray(devices, dtype=object).reshape(data_parallel, tensor_parallel), (DP, TP))


def replica_mesh(config: ModelConfig, tensor_parallel: int, data_parallel: int, replica: int = 0,
                 devices=None) -> Mesh | None:
    """Row ``replica`` of ``make_mesh``'s mesh: the ``1 x tensor_parallel`` devices one model replica
    runs on (None for ``1 x 1``: one device, the unchanged single-device step)."""
    mesh = make_mesh(config, tensor_parallel, data_parallel, devices)
    if not 0 <= replica < data_parallel:
        raise ValueError(f"replica must be in [0, data_parallel={data_parallel}), got {replica}")
    return None if mesh is None else Mesh(mesh.devices[replica:replica + 1], (DP, TP))


def tp_size(mesh: Mesh | None) -> int:
    return 1 if mesh is None else mesh.shape[TP]


def kv_heads(config: ModelConfig, tp: int) -> int:
    """KV heads the cache stores: the model's, or one per device where ``tp`` exceeds them."""
    return max(config.num_kv_heads, tp)


# ------------------------------------------------------------------------------ weight layout

def _fused_rows(config: ModelConfig, s: ParamSpec, tp: int) -> np.ndarray:
    """Source rows along a fused leaf's fused axis, in per-device order (KV heads repeated where
    ``tp`` exceeds them)."""
    parts = dict(s.fused)
    if "q" in parts:
        hd, h, kvh = config.head_dim, config.num_heads, config.num_kv_heads
        heads = np.arange(h * hd).reshape(tp, -1)
        kv_of = (np.arange(kv_heads(config, tp)) * kvh // kv_heads(config, tp)).reshape(tp, -1)
        k = (h + kv_of[..., None]) * hd + np.arange(hd)
        v = k + kvh * hd
        return np.concatenate([heads, k.reshape(tp, -1), v.reshape(tp, -1)], axis=1).ravel()
    f = parts["gate"]
    gate = np.arange(f).reshape(tp, -1)
    return np.concatenate([gate, gate + f], axis=1).ravel()


def _mesh_axes(name: str, s: ParamSpec, shape: tuple[int, ...], tp: int) -> tuple[str | None, ...]:
    """The spec's axes mapped by ``RULES``: the first mappable axis that ``tp`` divides."""
    out: list[str | None] = [None] * len(shape)
    if name in REPLICATED or tp == 1:
        return tuple(out)
    for i, axis in enumerate(s.axes):
        if RULES.get(axis) == TP and shape[i] % tp == 0:
            out[i] = TP
            break
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class Layout:
    """How each leaf of ``Weights`` is laid out over a ``tp``-way mesh: the rows a fused leaf takes
    from the checkpoint's tensor (None: as is), its stored shape and its mesh axes."""

    rows: np.ndarray | None
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    fused_axis: int | None = None  # the axis ``rows`` index


@functools.lru_cache(maxsize=8)
def layouts(config: ModelConfig, tp: int) -> tuple[dict[str, Layout], dict[str, Layout]]:
    """(globals, one layer's leaves) -> their ``Layout`` (shapes without the stacked layers axis)."""
    spec: ModelSpec = param_spec(config)

    def one(name: str, s: ParamSpec) -> Layout:
        axes = _mesh_axes(name, s, s.shape, tp)
        if s.fused is None or tp == 1 or axes[_fused_axis(s)] != TP:
            return Layout(None, s.shape, axes)
        i, rows = _fused_axis(s), _fused_rows(config, s, tp)
        return Layout(rows, s.shape[:i] + (len(rows),) + s.shape[i + 1:], axes, i)

    return ({n: one(n, s) for n, s in spec.globals.items()}, {n: one(n, s) for n, s in spec.layer.items()})


def _map_leaves(weights: Weights, fn_global, fn_layer) -> Weights:
    """``weights`` with each global replaced by ``fn_global(name, leaf)`` and each layer leaf by
    ``fn_layer(name, leaf, stacked)``."""
    stacked = not isinstance(weights.layers, list)
    layers = ({n: fn_layer(n, a, True) for n, a in weights.layers.items()} if stacked
              else [{n: fn_layer(n, a, False) for n, a in lw.items()} for lw in weights.layers])
    return Weights(embed=fn_global("embed", weights.embed), layers=layers,
                   final_norm=fn_global("final_norm", weights.final_norm),
                   lm_head=None if weights.lm_head is None else fn_global("lm_head", weights.lm_head))


def _fused_axis(s: ParamSpec) -> int:
    """The axis a fused leaf's parts lie along (an expert stack's gate|up is along ``mlp``, after
    ``experts``)."""
    return next(i for i, a in enumerate(s.axes) if a in ("qkv", "mlp"))


def shard_layout(weights: Weights, config: ModelConfig, tp: int) -> Weights:
    """``weights`` (checkpoint layout; numpy or jax leaves) with fused leaves reordered per device."""
    if tp == 1:
        return weights
    glob, lay = layouts(config, tp)
    return _map_leaves(weights, lambda n, a: _laid_out(a, glob[n], tp),
                       lambda n, a, stacked: _laid_out(a, lay[n], tp, stacked))


def _laid_out(a, lo: Layout, tp: int, stacked: bool = False):
    """One leaf (numpy or jax; a ``QArray`` field by field) in its per-device layout: a fused leaf's
    rows reordered, and a per-row scale split along the input stored per shard."""
    if lo.rows is not None:
        a = map_rows(a, lambda x: (np if isinstance(x, np.ndarray) else jnp).take(
            x, lo.rows, axis=lo.fused_axis + int(stacked)))
    return _split_rows_scale(a, lo.axes, tp)


def _split_rows_scale(w, axes: tuple, tp: int):
    """A ``QArray`` with one scale per row (int8, fp8) whose input axis is split: its scale stored
    once per shard (groups of ``in / tp`` columns), so each device's shard is per-row on its own."""
    if not isinstance(w, QArray) or axes[-1] != TP or w.group_size != w.shape[-1]:
        return w
    xp = np if isinstance(w.scales, np.ndarray) else jnp
    return dataclasses.replace(w, scales=xp.repeat(w.scales, tp, axis=-1), group_size=w.shape[-1] // tp)


def leaf_specs(w, axes: tuple, tp: int):
    """The ``PartitionSpec`` of a leaf whose logical axes map to mesh ``axes`` (plain array), or a
    ``QArray`` of them, one per field: rows as the leaf's, the input axis split only in whole
    32-column blocks and whole groups (an error names the leaf's sizes otherwise)."""
    if not isinstance(w, QArray):
        return P(*axes)
    lead, rows, cols = axes[:-2], axes[-2], axes[-1]
    n, g = w.shape[-1], w.group_size
    if cols == TP and (n % (32 * tp) or (n // g) % tp):
        raise ValueError(f"a quantized weight {tuple(w.shape)} ({w.scheme}, groups of {g}) cannot be split "
                         f"{tp} ways along its input: each shard must hold whole 32-column blocks and groups")
    spec = lambda a, last: None if a is None else P(*lead, rows, last)  # noqa: E731
    return dataclasses.replace(w, values=spec(w.values, cols), scales=spec(w.scales, cols),
                               offsets=spec(w.offsets, cols), high=spec(w.high, cols),
                               col_scale=None if w.col_scale is None else P(*lead, cols))


def shardings_of(weights: Weights, config: ModelConfig, mesh: Mesh) -> Weights:
    """``NamedSharding`` of every leaf of ``weights`` (arrays or shapes, per-device layout), a
    ``QArray``'s per field (``leaf_specs``)."""
    tp = mesh.shape[TP]
    glob, lay = layouts(config, tp)
    named = lambda spec: NamedSharding(mesh, spec)  # noqa: E731

    def sh(w, axes):
        return jax.tree.map(named, leaf_specs(w, axes, tp), is_leaf=lambda x: isinstance(x, P))

    return _map_leaves(weights, lambda n, a: sh(a, glob[n].axes),
                       lambda n, a, stacked: sh(a, ((None,) if stacked else ()) + lay[n].axes))


def weight_shardings(config: ModelConfig, mesh: Mesh, stacked: bool) -> Weights:
    """``NamedSharding`` of every leaf (a ``Weights`` of shardings) for ``layer_loop`` scan
    (``stacked``) or unroll."""
    glob, lay = layouts(config, mesh.shape[TP])
    ns = lambda axes: NamedSharding(mesh, P(*axes))  # noqa: E731
    layer = {n: ns(((None,) if stacked else ()) + l.axes) for n, l in lay.items()}
    return Weights(embed=ns(glob["embed"].axes), layers=layer if stacked else [layer] * config.num_layers,
                   final_norm=ns(glob["final_norm"].axes),
                   lm_head=ns(glob["lm_head"].axes) if "lm_head" in glob else None)


def abstract_sharded_weights(config: ModelConfig, mesh: Mesh, dtype) -> Weights:
    """The sharded weights as ``jax.ShapeDtypeStruct`` leaves: nothing allocated (planning)."""
    glob, lay = layouts(config, mesh.shape[TP])
    stacked = config.layer_loop == "scan"
    sh = weight_shardings(config, mesh, stacked)
    lead = (config.num_layers,) if stacked else ()

    def sds(shape, sharding):
        return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=sharding)

    layer_sh = sh.layers if stacked else sh.layers[0]
    layer = {n: sds(lead + l.shape, layer_sh[n]) for n, l in lay.items()}
    return Weights(embed=sds(glob["embed"].shape, sh.embed),
                   layers=layer if stacked else [layer] * config.num_layers,
                   final_norm=sds(glob["final_norm"].shape, sh.final_norm),
                   lm_head=sds(glob["lm_head"].shape, sh.lm_head) if "lm_head" in glob else None)


def place_weights(weights: Weights, config: ModelConfig, mesh: Mesh) -> Weights:
    """Checkpoint-layout weights laid out per device and placed in their shards. Weights held by one
    device (quantized ones, made or restored whole) are laid out there, then scattered."""
    layout = jax.jit(lambda w: shard_layout(w, config, mesh.shape[TP]))
    sh = shardings_of(jax.eval_shape(layout, weights), config, mesh)
    if len({d for a in jax.tree.leaves(weights) for d in a.devices()}) == 1 < mesh.size:
        return jax.device_put(layout(weights), sh)
    return jax.jit(layout, out_shardings=sh)(weights)


def place_host_leaf(name: str, array: np.ndarray, config: ModelConfig, mesh: Mesh, is_global: bool) -> jax.Array:
    """One leaf (a global, or one layer's) from host memory straight into its shards: each device
    receives only its slice (``jax.make_array_from_callback``), laid out per device."""
    tp = mesh.shape[TP]
    glob, lay = layouts(config, tp)
    lo = (glob if is_global else lay)[name]
    array = _laid_out(jax.tree.map(np.asarray, array), lo, tp)  # a QArray field by field
    return jax.tree.map(lambda a, spec: jax.make_array_from_callback(a.shape, NamedSharding(mesh, spec),
                                                                   lambda idx: a[idx]),
                        array, leaf_specs(array, lo.axes, tp))


def stack_layers(weights: Weights, config: ModelConfig, mesh: Mesh) -> Weights:
    """Placed per-layer weights stacked for the scanned loop, staying in their shards (layers whose
    quantized formats differ stay a list: ``arrange_layers``)."""
    stack = lambda w: arrange_layers(w, config)  # noqa: E731
    return jax.jit(stack, out_shardings=shardings_of(jax.eval_shape(stack, weights), config, mesh))(weights)


def checkpoint_shardings(config: ModelConfig, mesh: Mesh, stacked: bool) -> Weights:
    """Shardings of the checkpoint's own (not per-device) layout, for restoring a saved checkpoint
    split over the mesh before ``place_weights`` lays it out (fused leaves split where they divide)."""
    tp = mesh.shape[TP]
    spec = param_spec(config)
    ns = lambda name, s: NamedSharding(mesh, P(*(((None,) if stacked and name in spec.layer else ())  # noqa: E731
                                                + _mesh_axes(name, s, s.shape, tp))))
    layer = {n: ns(n, s) for n, s in spec.layer.items()}
    return Weights(embed=ns("embed", spec.globals["embed"]), layers=layer if stacked else [layer] * config.num_layers,
                   final_norm=ns("final_norm", spec.globals["final_norm"]),
                   lm_head=ns("lm_head", spec.globals["lm_head"]) if "lm_head" in spec.globals else None)


def dummy_weights(config: ModelConfig, key: jax.Array, dtype, mesh: Mesh) -> Weights:
    """``spec.init_dummy_weights`` (the same values) made directly in their shards."""
    sh = weight_shardings(config, mesh, config.layer_loop == "scan")
    make = lambda k: shard_layout(init_dummy_weights(config, k, dtype), config, mesh.shape[TP])  # noqa: E731
    return jax.jit(make, out_shardings=sh)(key)


def cache_sharding(mesh: Mesh, quantized: bool = False) -> KVCache:
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), _cache_spec(quantized),
                        is_leaf=lambda x: isinstance(x, P))


def zeros_cache(config: ModelConfig, mesh: Mesh, num_pages: int, page_size: int, dtype) -> KVCache:
    """The KV pool made in its shards (never whole on one device)."""
    make = functools.partial(KVCache.zeros, config.num_layers, num_pages, page_size,
                             kv_heads(config, mesh.shape[TP]), config.head_dim, dtype)
    return jax.jit(make, out_shardings=cache_sharding(mesh, is_quantized(dtype)))()


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def per_device_bytes(tree) -> dict:
    """Bytes of ``tree``'s arrays held by each device (from the arrays' own shards)."""
    out: dict = {}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            out[shard.device] = out.get(shard.device, 0) + shard.data.nbytes
    return out


# ------------------------------------------------------------------------------ per-device ops

# Per-argument partition specs of the ops' contracts (``layers.Ops``); any other array is replicated.
# ``cache`` (a ``KVCache``) takes ``_cache_spec``'s.
_ARG_SPECS = {"qkv": P(None, TP), "q": P(None, TP, None), "qkv_bias": P(TP), "k_cache": _KV_SPEC, "v_cache": _KV_SPEC,
              "k_scale": _KV_SCALE_SPEC, "v_scale": _KV_SCALE_SPEC}


def _per_device(mesh: Mesh, fn, names: tuple[str, ...], out_specs, args: tuple, kwargs: dict):
    """``fn(*args, **kwargs)`` under ``shard_map``: arrays (and pytrees of them) split by
    ``_ARG_SPECS`` (positional ones named by ``names``); Python values and None closed over."""
    bound = dict(zip(names, args)) | kwargs
    traced = {k: v for k, v in bound.items() if v is not None and jax.tree.leaves(v)
              and not isinstance(v, (bool, int, float))}
    static = {k: v for k, v in bound.items() if k not in traced}
    specs = {k: _cache_spec(v.quantized) if isinstance(v, KVCache) else _ARG_SPECS.get(k, P())
             for k, v in traced.items()}

    def local(traced):
        return fn(**static, **traced)

    return jax.shard_map(local, mesh=mesh, in_specs=(specs,), out_specs=out_specs, check_vma=False)(traced)


def _cache_out(names: tuple[str, ...], args: tuple, kwargs: dict) -> KVCache:
    """The out spec of the cache an op returns: that of the ``cache`` it was given."""
    return _cache_spec((dict(zip(names, args)) | kwargs)["cache"].quantized)


@functools.cache
def sharded_ops(ops: Ops, config: ModelConfig, mesh: Mesh) -> Ops:
    """``ops`` run per device on its heads (attention), hidden slice (MLP) or experts (MoE). Made once
    per (ops, config, mesh): the same object, so engines over one mesh share their compiled steps
    (``batching.model_runner.StepSpec``)."""
    tp = mesh.shape[TP]
    h_local, kv_local = config.num_heads // tp, kv_heads(config, tp) // tp
    out_heads = P(None, TP, None)

    def rope_write_kv(*args, num_heads, num_kv_heads, **kw):
        names = ("qkv", "x", "positions", "inv_freq", "cache", "layer", "slot_mapping")
        return _per_device(mesh, functools.partial(ops.rope_write_kv, num_heads=h_local, num_kv_heads=kv_local),
                           names, (out_heads, _cache_out(names, args, kw)), args, kw)

    def attention(*args, **kw):
        return _per_device(mesh, ops.attention, ("q", "k_cache", "v_cache", "layer", "md"), out_heads, args, kw)

    def fused_decode(*args, num_heads, **kw):
        names = ("qkv", "x", "positions", "inv_freq", "cache", "layer", "md")
        return _per_device(mesh, functools.partial(ops.decode_attention, num_heads=h_local), names,
                           (out_heads, _cache_out(names, args, kw)), args, kw)
    decode_attention = fused_decode if ops.decode_attention is not None else None

    def mlp(x, w_gate_up, w_down, r, act):
        def local(x, w_gate_up, w_down, r):
            y = ops.mlp(x, w_gate_up, w_down, r, act)
            return jax.lax.psum(y.astype(jnp.float32), TP).astype(x.dtype)
        specs = (P(), leaf_specs(w_gate_up, (TP, None), tp), leaf_specs(w_down, (None, TP), tp), P())
        return jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=P(), check_vma=False)(x, w_gate_up, w_down, r)

    glob, lay = layouts(config, tp)

    def project(x, w, name, out_dtype=None):
        """A quantized projection on each device's shard: column-parallel (``wqkv``, the logits) gives
        each device its rows' outputs, row-parallel (``wo``) sums the partial products. GSPMD would
        instead gather the codes around our kernels' custom calls, every step. Plain weights are left
        to GSPMD, which splits their dots itself."""
        if isinstance(w, LayerChoice):
            return jax.lax.switch(w.index, [functools.partial(project, w=wi, name=name, out_dtype=out_dtype)
                                            for wi in w.weights], x)
        if not isinstance(w, QArray):
            return ops.project(x, w, name, out_dtype)
        axes = (glob if name in glob else lay)[name].axes
        spec, out_dtype = leaf_specs(w, axes, tp), out_dtype or x.dtype
        if axes[-1] == TP:
            def local(x, w):
                return jax.lax.psum(ops.project(x, w, name, jnp.float32), TP).astype(out_dtype)
            return jax.shard_map(local, mesh=mesh, in_specs=(P(None, TP), spec), out_specs=P(), check_vma=False)(x, w)
        if axes[-2] == TP:
            local = functools.partial(ops.project, name=name, out_dtype=out_dtype)
            return jax.shard_map(local, mesh=mesh, in_specs=(P(), spec), out_specs=P(None, TP),
                                 check_vma=False)(x, w)
        return ops.project(x, w, name, out_dtype)

    def moe(x, r, lw, config_):
        specs = {n: leaf_specs(a, lay[n].axes, tp) for n, a in lw.items()}

        def local(x, r, lw):
            first = jax.lax.axis_index(TP) * (config_.num_experts // tp)
            return jax.lax.psum(moe_partial(x, r, lw, config_, first), TP).astype(x.dtype)
        return jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), specs), out_specs=P(), check_vma=False)(x, r, lw)

    # The reference path's deferred cache write (``Ops.defer_kv_write``) is an XLA:CPU one-device
    # fix; per device the K/V would need their own shard_map specs, so a mesh writes per layer.
    return dataclasses.replace(ops, rope_write_kv=rope_write_kv, attention=attention,
                               decode_attention=decode_attention, mlp=mlp, moe=moe, project=project,
                               defer_kv_write=False)
