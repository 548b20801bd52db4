"""The weight schemes quantized at load from float weights, by name (the ``quantization`` option).

- ``int8``: symmetric per output channel (one float32 scale per row), bf16/f32 activations (w8a16);
- ``int4-g32`` / ``int4-g64`` / ``int4-g128`` (``int4``: the largest group dividing the model's
  matrices, ``scheme_for_inputs``; g128 for one matrix alone): asymmetric round-to-nearest per
  group of input columns, a float16 scale and float zero point per group (w4a16), the grid the best
  of 21 least-squares fits, each weight's error optionally weighted by an ``importance``;
- ``fp8``: float8 e4m3 with one float32 scale per output channel; activations get a dynamic scale
  per token and the matmul runs in fp8 (w8a8) on GPUs with fp8 tensor cores, emulated in float32
  on CPU (for tests).

Quantization runs on the device, one leaf at a time (jit-compiled per shape), so a dummy 8B model
quantizes in seconds and a load never holds a second full-precision copy.
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp

from jaxinfer.formats import INT4_GROUPS, SCHEMES
from jaxinfer.quant.qarray import QArray

log = logging.getLogger(__name__)

# The quantizers run once over every weight at load, so their run time is what counts, not their
# compile time: they are compiled at XLA's full optimization (its default) even in a process whose
# XLA_FLAGS ask for fast compiles. Under the test suite's -O0 the int4 grid search ran 10-17x slower
# (a 1536 x 576 matrix: 0.9-1.6 s against 0.08-0.10 s), 60-90 s per SmolLM2 load.
_load_time_jit = functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 3})

FP8_MAX = 448.0  # the largest finite float8_e4m3fn


def parse_scheme(scheme: str) -> tuple[str, int | None]:
    """``(format, group size)`` of a scheme name (group None: per output channel)."""
    if scheme not in SCHEMES:
        raise ValueError(f"quantization must be one of {SCHEMES} (or 'auto'/'none'), got {scheme!r}")
    if scheme.startswith("int4"):
        return "int4", int(scheme.split("-g")[1]) if "-g" in scheme else 128
    return scheme, None


def scheme_for_inputs(scheme: str, in_dims: dict[str, int]) -> str:
    """``scheme`` for a model whose quantized matrices have these input dimensions (matrix name ->
    dimension): plain ``"int4"`` becomes ``int4-gN``, N the largest of ``INT4_GROUPS`` that divides
    every one (logged); an explicit ``int4-gN`` whose N does not divide one is refused, naming it.
    Other schemes are returned as they are."""
    parse_scheme(scheme)
    if not scheme.startswith("int4"):
        return scheme
    fits = tuple(g for g in sorted(INT4_GROUPS, reverse=True) if all(n % g == 0 for n in in_dims.values()))
    if scheme == "int4":
        if not fits:
            raise ValueError(f"quantization='int4': no group size of {INT4_GROUPS} divides every quantized "
                             f"matrix's input dimension {in_dims}; use 'int8' or 'fp8'")
        log.info("quantization int4: group size %d, the largest of %s dividing every quantized matrix's input "
                 "dimension (%s)", fits[0], sorted(INT4_GROUPS, reverse=True),
                 ", ".join(f"{k} {n}" for k, n in in_dims.items()))
        return f"int4-g{fits[0]}"
    group = parse_scheme(scheme)[1]
    bad = {k: n for k, n in in_dims.items() if n % group}
    if bad:
        raise ValueError(f"quantization={scheme!r}: group size {group} does not divide the input dimension of "
                         f"{', '.join(f'{k} ({n})' for k, n in bad.items())}; use "
                         f"{' or '.join(repr(f'int4-g{g}') for g in fits) or 'int8'}, or 'int4' (chooses the group)")
    return scheme


def check_device_supports(scheme: str, device=None) -> None:
    """fp8 needs fp8 tensor cores (NVIDIA compute capability 8.9+: Ada, Hopper and later); CPUs run
    it emulated in float32, for tests. Anything else is refused rather than silently run another way."""
    if not scheme.startswith("fp8"):
        return
    device = device or jax.devices()[0]
    if device.platform == "cpu":
        return
    cc = getattr(device, "compute_capability", None)
    if device.platform == "gpu" and cc is not None and tuple(int(c) for c in str(cc).split(".")[:2]) >= (8, 9):
        return
    raise ValueError(f"quantization='fp8' needs fp8 tensor cores (NVIDIA compute capability >= 8.9); "
                     f"{device.device_kind} ({device.platform}, compute capability {cc}) has none: use one of "
                     f"{tuple(s for s in SCHEMES if s != 'fp8')}")


def quantize(w: jax.Array, scheme: str, importance=None) -> QArray:
    """A float weight ``[..., out, in]`` quantized by ``scheme`` (see the module docstring).

    ``importance`` (int4 only; broadcastable to ``w``, positive): how much each weight's squared error
    counts in the choice of its group's grid (``_int4``); None weighs all alike."""
    fmt, group = parse_scheme(scheme)
    n = w.shape[-1]
    if group is not None and n % group:
        raise ValueError(f"quantization={scheme!r}: group size {group} does not divide the weight's input "
                         f"dimension {n} (shape {tuple(w.shape)}); use a group size among "
                         f"{tuple(g for g in INT4_GROUPS if n % g == 0) or 'none'} or 'int8'")
    if importance is not None and fmt != "int4":
        raise ValueError(f"importance weighs the int4 grid search; quantization={scheme!r} has none "
                         f"({', '.join(f'int4-g{g}' for g in INT4_GROUPS)} do)")
    if fmt == "int4":
        importance = None if importance is None else jnp.asarray(importance, jnp.float32)
        values, scales, offsets = _int4(jnp.asarray(w), group, importance)
    else:
        values, scales, offsets = _QUANTIZERS[fmt](jnp.asarray(w), group)
    return QArray(values, scales, offsets, None, None, fmt, group or n)


@_load_time_jit
def _int8(w, group):
    del group
    w = w.astype(jnp.float32)
    s = jnp.max(jnp.abs(w), axis=-1, keepdims=True) / 127.0
    s = jnp.where(s == 0, 1.0, s)
    return jnp.clip(jnp.round(w / s), -127, 127).astype(jnp.int8), s, None


# The grids tried per group, as llama.cpp's make_qkx2_quants tries them for Q4_K (ggml-quants.c:
# rmin -1, rdelta 0.1, nstep 20): codes rounded at inverse scales (15 + t) / (max - min), t in
# -1.0 ... +1.0 (t = 0: min/max); each set of codes gets its (importance-weighted) least-squares
# scale and offset, and the one with the least weighted squared error wins. SmolLM2 int4-g64,
# perplexity on 512 held tokens (float32 16.90): 20.03 with the 9 range trims this replaced, 19.21
# with these. Measured no better (all within the +-3% that equally good grids scatter by on this
# model): weighting errors by the norm gain squared (19.53) or |gain| (19.76), llama.cpp's rms + |x|
# weights (19.82), the activations' own second moments from 1,024 other held tokens (19.43), two
# alternating refits (19.38), 41 grids over t in -3 ... +1 (19.33), 16 asymmetric trims with refits
# (19.76, though the least weight error of all), HQQ's lp (p = 0.7) zero-point optimisation from
# min/max (19.96) or from this search (19.38). What did help is an importance from the first
# token's activations (``models.weights``: the attention sink's massive dimensions), 19.11 -> 17.86.
_GRID_STEPS = tuple(round(-1.0 + 0.1 * i, 6) for i in range(21))


@functools.partial(_load_time_jit, static_argnums=1)
def _int4(w, group, importance):
    """``w = q * scale + offset`` per group (a float zero point, as llama.cpp's Q4_1: the grid need
    not contain 0), scale and offset the ``importance``-weighted least-squares fit of the best of
    ``_GRID_STEPS``' codes, stored in float16 (the codes are then rounded, to nearest, against the
    float16 values). A group already on a 16-level grid (a Q4_1 block, at group 32) is reproduced
    exactly, whatever the importance: its min/max codes fit with zero error. Without an importance
    its multiplies are left out (they cost ~1.3x on a llama3-8b w_gate_up)."""
    *lead, n = w.shape
    g = w.astype(jnp.float32).reshape(*lead, n // group, group)
    if importance is None:
        def weigh(x):
            return x
        sc = float(group)
    else:
        c = jnp.broadcast_to(importance, w.shape).reshape(g.shape)

        def weigh(x):
            return c * x
        sc = jnp.sum(c, axis=-1, keepdims=True)
    lo, hi = jnp.min(g, axis=-1, keepdims=True), jnp.max(g, axis=-1, keepdims=True)
    span = jnp.where(hi > lo, hi - lo, 1.0)
    u = (g - lo) / span  # the group mapped onto [0, 1]: each grid's codes are one multiply away
    mean_u = jnp.sum(weigh(u), axis=-1, keepdims=True) / sc  # weighted means throughout
    best = None
    for t in _GRID_STEPS:
        q = jnp.minimum(jnp.floor(u * (15.0 + t) + 0.5), 15.0)  # round half up: cheaper than round-half-even
        cq = weigh(q)
        # one variadic reduction (one pass over the group) for sum(c q), sum(c q^2), sum(c q u)
        sq, sqq, squ = jax.lax.reduce((cq, cq * q, cq * u), (0.0, 0.0, 0.0),
                                      lambda a, b: (a[0] + b[0], a[1] + b[1], a[2] + b[2]), (q.ndim - 1,))
        mean_q = sq[..., None] / sc
        sll = sqq[..., None] - sq[..., None] * mean_q  # sum(c (q - mean q)^2)
        slu = squ[..., None] - sq[..., None] * mean_u  # sum(c (q - mean q) (u - mean u))
        ok = sll > 0
        s = jnp.where(ok, slu / jnp.where(ok, sll, 1.0), 0.0)  # the least-squares slope, in u's units
        cand = (jnp.where(ok, s * slu, -1.0), jnp.float32(t))  # error = sum(c (u - mean u)^2) - s * slu
        if best is None:
            best = cand
        else:
            take = cand[0] > best[0]
            best = tuple(jnp.where(take, a, b) for a, b in zip(cand, best))
    # The chosen codes' fit again, from centred sums: with a few weights thousands of times the rest
    # the one-pass sums above cancel badly, and a group on a 16-level grid must come back exactly.
    q = jnp.minimum(jnp.floor(u * (15.0 + best[1]) + 0.5), 15.0)
    mean_q = jnp.sum(weigh(q), axis=-1, keepdims=True) / sc
    dq = q - mean_q
    sll = jnp.sum(weigh(dq * dq), axis=-1, keepdims=True)
    slu = jnp.sum(weigh(dq * (u - mean_u)), axis=-1, keepdims=True)
    s = jnp.where(sll > 0, slu / jnp.where(sll > 0, sll, 1.0), 0.0)
    m = mean_u - s * mean_q
    s, m = s * span, lo + m * span
    s = s[..., 0].astype(jnp.float16)
    s = jnp.where(s == 0, jnp.float16(1), s)
    m = m[..., 0].astype(jnp.float16)
    sf, mf = s.astype(jnp.float32)[..., None], m.astype(jnp.float32)[..., None]
    q = jnp.clip(jnp.round((g - mf) / sf), 0, 15)
    q = q.astype(jnp.uint8).reshape(*lead, n // 32, 2, 16)
    packed = (q[..., 0, :] | (q[..., 1, :] << jnp.uint8(4))).reshape(*lead, n // 2)
    return packed, s, m


@_load_time_jit
def _fp8(w, group):
    del group
    w = w.astype(jnp.float32)
    s = jnp.max(jnp.abs(w), axis=-1, keepdims=True) / FP8_MAX
    s = jnp.where(s == 0, 1.0, s)
    return (w / s).astype(jnp.float8_e4m3fn), s, None


_QUANTIZERS = {"int8": _int8, "fp8": _fp8}
