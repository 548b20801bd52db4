"""Sharded runs on forced host devices, printed as one JSON object (run by test_sharding.py).

XLA's host device count is fixed when JAX starts, and the rest of the suite runs on one device, so
these run in their own process: ``python tests/sharded_runs.py DEVICES RUN...``, each RUN one of
``MODEL:TP:DP[:QUANTIZATION[:KV_CACHE_DTYPE]]`` (an engine generating ``PROMPTS`` greedily, dummy weights
except for the embedded SmolLM2; full precision unless a quantization is named),
``collectives:MODEL:TP[:BACKEND[:QUANTIZATION[:KV_CACHE_DTYPE]]]`` (a prefill and a decode step's logits,
the prefill's compiled collectives; on one device ``collectives:MODEL:1:pallas_gpu`` checks the GPU
kernels per device) or ``load:MODEL:TP[:QUANTIZATION]``
(the checkpoint loaded straight into shards, and restored from orbax into shards, against the
one-device load laid out afterwards). ``multihost:MODEL:TP:PORT:PROCESSES:ID`` joins a multi-process
run on localhost first (``batching.multihost``): process 0 generates, the others follow.
"""

import dataclasses
import os
import re
import sys

NUM_DEVICES, RUNS = int(sys.argv[1]), sys.argv[2:]
# The device count after the flags inherited (conftest.py's; XLA takes a repeated flag's last value).
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={NUM_DEVICES}"
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import json  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

from jaxinfer.llm import LLM  # noqa: E402
from jaxinfer.models import sharding  # noqa: E402
from jaxinfer.models.config import PRESETS  # noqa: E402
from jaxinfer.models.decoder import forward  # noqa: E402
from jaxinfer.models.layers import Ops  # noqa: E402
from jaxinfer.models.spec import init_dummy_weights  # noqa: E402
from jaxinfer.paged.kv_cache import BatchMetadata, KVCache  # noqa: E402
from jaxinfer.sampling_params import SamplingParams  # noqa: E402

# Two prompts of different lengths: one prefill step of both, then decode steps (one bucket each).
PROMPTS = [[1, 5, 9, 13, 200], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]]
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
# Full precision throughout: one device would otherwise run the GGUF's own blocks (quantization
# "auto" on CPU) where a mesh dequantizes them, and weights, bytes and tokens compare like with like.
SMALL = dict(max_num_seqs=2, max_num_batched_tokens=32, max_model_len=128, token_buckets=(32,), seq_buckets=(2,),
             page_buckets=(8,), quantization="none")


def run(model: str, tp: int, dp: int = 1, **options) -> dict:
    llm = LLM(model, tensor_parallel=tp, data_parallel=dp, **{**SMALL, **options})
    llm.warmup(greedy_only=True)
    compiled = llm.engine.num_compilations
    tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    out = dict(tokens=tokens, compilations_after_warmup=llm.engine.num_compilations - compiled)
    engines = getattr(llm.engine, "replicas", [llm.engine])
    per_device = sharding.per_device_bytes([e.runner.weights for e in engines])
    out["param_bytes_per_device"] = sorted(set(per_device.values()))
    out["generation_tokens_per_replica"] = [e.stats()["generation_tokens"] for e in engines]
    out["device_ids"] = sorted({d.id for e in engines for d in jax.tree.leaves(e.runner.weights)[0].devices()})
    out["kv_heads_per_device"] = sorted({s.data.shape[3] for e in engines for s in e.runner.cache.k.addressable_shards})
    if engines[0].runner.cache.quantized:
        out["kv_scale_heads_per_device"] = sorted({s.data.shape[3] for e in engines
                                                   for s in e.runner.cache.k_scale.addressable_shards})
    return out


def collectives(config, tp: int, bias: bool, backend: str = "reference", quantization: str = "none",
                kv_cache_dtype: str = "auto") -> dict:
    """One sharded prefill step on random weights (non-zero Q/K/V biases where the family has them),
    attention by ``backend`` per device, the weights under ``quantization`` and the cache in
    ``kv_cache_dtype``: its logits against one device's reference step with the same weights and
    cache dtype, and the collectives in its compiled HLO."""
    from jaxinfer.batching.backend import backend_for
    from jaxinfer.paged.kv_cache import kv_storage_dtype
    from jaxinfer.quant import quantize

    w = init_dummy_weights(config, jax.random.key(1))
    if bias:
        w.layers["qkv_bias"] = jax.random.normal(jax.random.key(2), w.layers["qkv_bias"].shape)
    if quantization != "none":  # every matrix, stacked layers included (per layer: same scales)
        w = dataclasses.replace(w, layers={n: quantize(a, quantization) if n in ("wqkv", "wo", "w_gate_up", "w_down")
                                           else a for n, a in w.layers.items()}, lm_head=quantize(w.lm_head, quantization))
    kv_dtype = kv_storage_dtype(kv_cache_dtype, jnp.float32)
    t = 12
    tokens = jnp.arange(t, dtype=jnp.int32) * 37 % config.vocab_size
    prefill = BatchMetadata(jnp.arange(t, dtype=jnp.int32), jnp.zeros((1, 1), jnp.int32), jnp.array([t], jnp.int32),
                            jnp.array([0, t], jnp.int32), jnp.arange(t, dtype=jnp.int32))
    # Then one decode-only step (a backend's fused decode kernel where it has one) at position t.
    decode = BatchMetadata(jnp.array([t], jnp.int32), jnp.zeros((1, 1), jnp.int32), jnp.array([t + 1], jnp.int32),
                           jnp.array([0, 1], jnp.int32), jnp.zeros(1, jnp.int32), decode_only=True)
    steps = [(tokens, jnp.arange(t, dtype=jnp.int32), prefill), (tokens[:1], jnp.array([t], jnp.int32), decode)]
    # One device: a mesh of it, so that the per-device ops (shard_map) run even there.
    mesh = sharding.make_mesh(config, tp, NUM_DEVICES // tp) or Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1),
                                                                    (sharding.DP, sharding.TP))

    def run_steps(weights, cache, ops):
        fn = jax.jit(lambda w, c, x, p, md: forward(w, x, p, c, md, config, ops))
        logits = []
        for x, p, md in steps:
            out, cache = fn(weights, cache, x, p, md)
            logits.append(out)
        return logits, fn.lower(weights, cache, *steps[0]).compile().as_text()

    ref, _ = run_steps(w, KVCache.zeros(config.num_layers, 1, 16, config.num_kv_heads, config.head_dim, kv_dtype), Ops())
    ops = sharding.sharded_ops(backend_for("cpu").ops(backend, config.head_dim, kv_cache_dtype != "auto"), config,
                               mesh)
    got, hlo = run_steps(sharding.place_weights(w, config, mesh),
                         sharding.zeros_cache(config, mesh, 1, 16, kv_dtype), ops)
    gathers = [int(np.prod([int(d) for d in m.split(",") if d] or [1]))
               for m in re.findall(r"= \w+\[([\d,]*)\][^=]*? all-gather(?:-start)?\(", hlo)]
    return dict(max_abs_diff=max(float(jnp.max(jnp.abs(g - r))) for g, r in zip(got, ref)),
                logits_spec=str(got[0].sharding.spec),
                all_reduces=len(re.findall(r" all-reduce(?:-start)?\(", hlo)), all_gather_sizes=gathers)


def load(model: str, tp: int, quantization: str = "none") -> dict:
    import tempfile

    from jaxinfer.models.weights import load_config, load_model, resolve_model, save_converted

    mesh = sharding.make_mesh(load_config(resolve_model(model)), tp, NUM_DEVICES // tp)
    config, whole = load_model(model, quantization=quantization)
    want = sharding.place_weights(whole, config, mesh)

    def same(got):
        return all(jax.tree.leaves(jax.tree.map(
            lambda a, b: a.sharding == b.sharding and bool((np.asarray(a) == np.asarray(b)).all()), want, got)))

    with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryDirectory() as floats:
        save_converted(whole, config, tmp)
        restored = load_model(tmp, mesh=mesh, quantization=quantization)[1]
        kinds = set()
        if quantization != "gguf":  # a scheme quantizes a float checkpoint now, then splits it
            save_converted(load_model(model)[1], config, floats)
            from_floats = load_model(floats, mesh=mesh, quantization=quantization)[1]
            kinds = {(x.scheme, str(x.values.sharding.spec)) if hasattr(x, "scheme") else "float"
                     for x in jax.tree.leaves(from_floats.layers, is_leaf=lambda x: hasattr(x, "scheme"))}
    return dict(direct=same(load_model(model, mesh=mesh, quantization=quantization)[1]), orbax=same(restored),
                wqkv_spec=str(jax.tree.leaves(want.layers["wqkv"])[0].sharding.spec), float_orbax=sorted(map(str, kinds)))


def main():
    results = {}
    if RUNS[0].startswith("multihost:"):
        from jaxinfer.batching.multihost import initialize

        model, tp, port, processes, pid = RUNS[0].split(":")[1:]
        initialize(f"127.0.0.1:{port}", int(processes), int(pid))
        if int(pid):
            from jaxinfer.batching.config import EngineConfig
            from jaxinfer.batching.factory import run_follower

            run_follower(model, EngineConfig(tensor_parallel=int(tp), load_format="dummy", seed=3, **SMALL))
            return
        results[RUNS[0]] = run(model, int(tp), 1, load_format="dummy", seed=3)
        results[RUNS[0]]["devices"] = [jax.device_count(), jax.local_device_count()]
        print("RESULT " + json.dumps(results), flush=True)
        return
    for spec in RUNS:
        kind, *rest = spec.split(":")
        if kind == "collectives":
            model, tp, *options = rest
            config = PRESETS[model]
            results[spec] = collectives(config, int(tp), config.qkv_bias, *options)
        elif kind == "load":
            results[spec] = load(rest[0], int(rest[1]), *rest[2:])
        else:
            tp, dp, *quantized = rest
            options = {} if kind == "smollm2-135m" else dict(load_format="dummy", seed=3)
            options.update(zip(("quantization", "kv_cache_dtype"), quantized))
            results[spec] = run(kind, int(tp), int(dp), **options)
    print("RESULT " + json.dumps(results))


if __name__ == "__main__":
    main()
