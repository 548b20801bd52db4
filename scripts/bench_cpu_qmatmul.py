"""Time SmolLM2-135M's matmuls on CPU: float32, GGUF Q4_1 through XLA, Q4_1 through the native kernel.

One jitted chain of every matmul of a decode step (30 layers scanned, as the engine does: wqkv
960x576, wo 576x576, w_gate_up 3072x576, w_down 576x1536; then the lm_head 49152x576, Q8_0 in the
GGUF), each matmul's input computed from the previous output (a residual add, SiLU-and-multiply:
the small XLA ops between them stay in the chain, so a kernel that lets XLA's threads sleep pays
for it here). Random codes and scales (the time does not depend on them). Variants:

- ``f32``: float32 weights stored ``[in, out]`` (the engine's CPU layout, ``spec.InOut``), XLA's dot;
- ``q4_1-xla``: ``QArray``s through XLA (dequantize, then the dot: ``qlinear`` without the kernel);
- ``q4_1-kernel``: through ``cpu_kernel.qmatmul`` on XLA's intra-op pool;
- ``q4_1-kernel-1t``: the kernel on the calling thread alone (what the pool adds).

``--engine``: instead, the embedded SmolLM2's whole decode step (``benchmark.decode_step``: one
step of 1 or 8 sequences at context 128, the CPU buckets 1 / 8 / 128 tokens) for ``none`` (float32),
``gguf`` (Q4_1 + Q8_0 through the kernel) and ``gguf-1t`` (the kernel on the calling thread alone),
the engines built first and timed in turn.

For each ``--tokens`` count: the fastest of ``--reps`` timed runs (after a warm-up; the variants
timed in turn, so a burst of other load on a shared machine hits all of them; medians in the JSON),
in ms per chain. Prints a table, writes JSON to ``--out``.

    PYTHONPATH=$PWD nice -n 19 .venv/bin/python scripts/bench_cpu_qmatmul.py --out docs/results/cpu-qmatmul.json
    PYTHONPATH=$PWD nice -n 19 .venv/bin/python scripts/bench_cpu_qmatmul.py --engine --out docs/results/cpu-qmatmul-engine.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp

from jaxinfer.models import layers
from jaxinfer.models.spec import InOut
from jaxinfer.quant import FORMATS, QArray, cpu_kernel

HIDDEN, LAYERS, VOCAB = 576, 30, 49152
SHAPES = {"wqkv": (960, HIDDEN), "wo": (HIDDEN, HIDDEN), "w_gate_up": (3072, HIDDEN), "w_down": (HIDDEN, 1536)}


def random_qarray(key, shape: tuple[int, ...], fmt: str) -> QArray:
    """Random GGUF-style blocks (group 32, float16 scales) of ``[..., out, in]``."""
    f = FORMATS[fmt]
    *lead, n = shape
    k1, k2, k3 = jax.random.split(key, 3)
    codes = (*lead, n if f.bits == 8 else n // 2)
    values = jax.random.randint(k1, codes, -128 if f.signed else 0, 128 if f.signed else 256, jnp.int32)
    values = values.astype(jnp.int8 if f.signed else jnp.uint8)
    scales = (jax.random.uniform(k2, (*lead, n // 32)) * 1e-2).astype(jnp.float16)
    offsets = (jax.random.normal(k3, (*lead, n // 32)) * 1e-2).astype(jnp.float16) if f.offsets else None
    return QArray(values, scales, offsets, None, None, fmt, 32)


def weights(kind: str) -> dict:
    keys = iter(jax.random.split(jax.random.key(0), 8))
    if kind == "f32":
        w = {k: InOut(jax.random.normal(next(keys), (LAYERS, i, o), jnp.float32) * 0.02) for k, (o, i) in SHAPES.items()}
        w["lm_head"] = InOut(jax.random.normal(next(keys), (HIDDEN, VOCAB), jnp.float32) * 0.02)
        return w
    w = {k: random_qarray(next(keys), (LAYERS, o, i), "q4_1") for k, (o, i) in SHAPES.items()}
    w["lm_head"] = random_qarray(next(keys), (VOCAB, HIDDEN), "q8_0")
    return w


def step(w: dict, x: jax.Array) -> jax.Array:
    def layer(h, lw):
        qkv = layers.linear(h, lw["wqkv"])
        h = h + layers.linear(qkv[:, :HIDDEN], lw["wo"])
        gu = layers.linear(h, lw["w_gate_up"])
        h = h + layers.linear(jax.nn.silu(gu[:, :1536]) * gu[:, 1536:], lw["w_down"])
        return h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + 1e-6), None

    h, _ = jax.lax.scan(layer, x, {k: v for k, v in w.items() if k != "lm_head"})
    return layers.linear(h, w["lm_head"])


def compiled_chain(variant: str, w: dict, tokens: int):
    """The chain compiled with ``variant``'s routing (read when it is traced), and its input."""
    supported, threads = cpu_kernel.supported, cpu_kernel.THREADS
    if variant == "q4_1-xla":
        cpu_kernel.supported = lambda w: False
    cpu_kernel.THREADS = 1 if variant.endswith("-1t") else 0
    try:
        x = jax.random.normal(jax.random.key(1), (tokens, HIDDEN), jnp.float32)
        jax.clear_caches()  # jit's trace cache is keyed by the function: trace again with this routing
        return jax.jit(step).lower(w, x).compile(), x
    finally:
        cpu_kernel.supported, cpu_kernel.THREADS = supported, threads


def engine_steps(reps: int) -> list[dict]:
    """The engine's decode step at batch 1 and 8 per weight format (see the module docstring)."""
    import numpy as np
    from benchmark import decode_step, random_prompts  # scripts/ is on sys.path when run as a script
    from jaxinfer import LLM
    steps = {}
    for name, quantization, threads in (("none", "none", 0), ("gguf", "gguf", 0), ("gguf-1t", "gguf", 1)):
        cpu_kernel.THREADS = threads
        jax.clear_caches()
        llm = LLM("smollm2-135m", quantization=quantization, compilation_cache_dir="", max_num_seqs=8,
                  max_num_batched_tokens=128, max_model_len=256, token_buckets=(1, 8, 128), seq_buckets=(1, 8),
                  page_buckets=(16,))
        prompts = random_prompts(np.random.default_rng(4), 8, [128] * 8, llm.engine.model_config.vocab_size)
        for b in (1, 8):
            fn = decode_step(llm, prompts[:b])[0]
            jax.block_until_ready(fn())
            steps[name, b] = (llm, fn, [])
    cpu_kernel.THREADS = 0
    for _ in range(reps):
        for _, fn, times in steps.values():
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            times.append((time.perf_counter() - t0) * 1e3)
    return [{"variant": name, "seqs": b, "ms": round(min(t), 3), "median_ms": round(statistics.median(t), 3)}
            for (name, b), (_, _, t) in steps.items()]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8])
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--variants", nargs="+", default=["f32", "q4_1-xla", "q4_1-kernel", "q4_1-kernel-1t"])
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "cpu-qmatmul.json"))
    p.add_argument("--engine", action="store_true", help="time the engine's decode step instead (see above)")
    args = p.parse_args()
    if args.engine:
        rows = engine_steps(args.reps)
        base = {r["seqs"]: r["ms"] for r in rows if r["variant"] == "none"}
        print("| weights | seqs | step ms (fastest) | median | tok/s | vs float32 |\n|---|---:|---:|---:|---:|---:|")
        for r in rows:
            print(f"| {r['variant']} | {r['seqs']} | {r['ms']:.2f} | {r['median_ms']:.2f} | "
                  f"{r['seqs'] * 1e3 / r['ms']:.1f} | {base[r['seqs']] / r['ms']:.2f}x |")
        with open(args.out, "w") as f:
            json.dump({"engine_steps": rows, "load": os.getloadavg(), "cpus": os.cpu_count(), "jax": jax.__version__},
                      f, indent=2)
        print(f"(json: {args.out})")
        return
    chains = {}
    for variant in args.variants:
        w = weights("f32" if variant == "f32" else "q")
        for t in args.tokens:
            fn, x = compiled_chain(variant, w, t)
            fn(w, x).block_until_ready()
            chains[variant, t] = (fn, w, x, [])
    for _ in range(args.reps):  # round robin: a burst of load on this shared machine hits every variant
        for fn, w, x, times in chains.values():
            t0 = time.perf_counter()
            fn(w, x).block_until_ready()
            times.append((time.perf_counter() - t0) * 1e3)
    rows = [{"variant": v, "tokens": t, "ms": round(min(c[3]), 3), "median_ms": round(statistics.median(c[3]), 3)}
            for (v, t), c in chains.items()]
    for r in rows:
        print(f"{r['variant']:16s} T={r['tokens']:4d} {r['ms']:9.2f} ms (median {r['median_ms']:.2f})")
    base = {r["tokens"]: r["ms"] for r in rows if r["variant"] == "f32"}
    print(f"\n| variant | {' | '.join(f'T={t} ms' for t in args.tokens)} | {' | '.join(f'T={t} vs f32' for t in args.tokens)} |")
    print(f"|---|{'---:|' * 2 * len(args.tokens)}")
    for variant in args.variants:
        ms = {r["tokens"]: r["ms"] for r in rows if r["variant"] == variant}
        ratio = [f"{base[t] / ms[t]:.2f}x" if t in base else "" for t in args.tokens]
        print(f"| {variant} | {' | '.join(f'{ms[t]:.2f}' for t in args.tokens)} | {' | '.join(ratio)} |")
    with open(args.out, "w") as f:
        json.dump({"rows": rows, "load": os.getloadavg(), "cpus": os.cpu_count(),
                   "jax": jax.__version__}, f, indent=2)
    print(f"(json: {args.out})")


if __name__ == "__main__":
    main()
