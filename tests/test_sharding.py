"""Sharded runs (``jaxinfer.models.sharding``): the same greedy tokens as one device, weights split,
no recompilation after warm-up, the expected collectives; and the mesh's errors.

The runs need several XLA host devices, fixed when JAX starts, so each device count runs
``sharded_runs.py`` in its own process (all at once); the rest of the suite keeps its one device.
"""

import concurrent.futures
import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from jaxinfer.models import sharding
from jaxinfer.models.config import PRESETS
from jaxinfer.models.spec import param_spec

HERE = os.path.dirname(os.path.abspath(__file__))
# Device count -> runs (see sharded_runs.py). Every model's one-device tokens come from the 2-device process.
RUNS = {
    2: ["tiny-gqa8:1:1", "tiny-qwen2:1:1", "tiny-qwen2-moe:1:1", "tiny-gqa8:2:1",
        "tiny-gqa8:1:1:int4-g32", "tiny-gqa8:2:1:int4-g32", "tiny-qwen2:1:1:fp8", "tiny-qwen2:2:1:fp8",
        "tiny-qwen2-moe:1:1:int8", "tiny-qwen2-moe:2:1:int8", "tiny-gqa8:1:1:int4-g32:int8", "tiny-gqa8:2:1:int4-g32:int8",
        "collectives:tiny-gqa8:2:reference:int4-g32:int8", "collectives:tiny-gqa8:2:reference:int8:fp8"],
    3: ["smollm2-135m:1:1", "load:smollm2-135m:3", "smollm2-135m:1:1:gguf",
        "smollm2-135m:3:1:gguf", "load:smollm2-135m:3:gguf", "load:smollm2-135m:3:int8"],
    4: ["tiny-gqa8:4:1", "tiny-qwen2:4:1", "tiny-qwen2:2:1", "collectives:tiny-qwen2:4",
        "collectives:tiny-gqa8:4:interpret"],
    8: ["tiny-gqa8:8:1", "tiny-gqa8:4:2", "tiny-qwen2-moe:8:1", "collectives:tiny-qwen2-moe:8"],
}


def _start(devices: int, runs: list[str]) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")]))
    return subprocess.Popen([sys.executable, os.path.join(HERE, "sharded_runs.py"), str(devices), *runs],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _result(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=900)
    lines = [x for x in out.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, err[-4000:]
    return json.loads(lines[-1][len("RESULT "):])


def _multihost() -> dict:
    """Two processes of 4 host devices each on localhost (gloo), one tensor-parallel-8 engine."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [_start(4, [f"multihost:tiny-gqa8:8:{port}:2:{i}"]) for i in (1, 0)]
    follower, leader = procs
    result = _result(leader)
    follower.communicate(timeout=120)
    assert follower.returncode == 0
    return {"multihost": result[f"multihost:tiny-gqa8:8:{port}:2:0"]}


@pytest.fixture(scope="module")
def results() -> dict:
    with concurrent.futures.ThreadPoolExecutor(len(RUNS) + 1) as pool:
        parts = [pool.submit(lambda item=item: _result(_start(*item))) for item in RUNS.items()]
        parts.append(pool.submit(_multihost))
        return {k: v for part in parts for k, v in part.result().items()}


@pytest.mark.parametrize("run", ["tiny-gqa8:2:1", "tiny-gqa8:4:1", "tiny-gqa8:8:1",
                                 "tiny-gqa8:4:2", "tiny-qwen2:4:1", "tiny-qwen2-moe:8:1"])
def test_sharded_greedy_matches_one_device(results, run):
    model = run.split(":")[0]
    one, got = results[f"{model}:1:1"], results[run]
    assert len(set(map(tuple, one["tokens"]))) == 2  # the prompts differ, and so do their outputs
    assert got["tokens"] == one["tokens"]
    assert got["compilations_after_warmup"] == 0
    dp = int(run.split(":")[2])
    assert len(got["generation_tokens_per_replica"]) == dp
    assert all(n > 0 for n in got["generation_tokens_per_replica"])  # every replica served a request


@pytest.mark.parametrize("run", ["tiny-gqa8:2:1", "tiny-gqa8:4:1", "tiny-gqa8:8:1",
                                 "tiny-qwen2:4:1", "tiny-qwen2-moe:8:1"])
def test_parameter_bytes_fall_with_tensor_parallel(results, run):
    """Measured from the arrays' shards: every device holds about 1/tp of the weights (plus the
    replicated norms and router, and KV heads repeated past their count)."""
    model, tp, _ = run.split(":")
    one = results[f"{model}:1:1"]["param_bytes_per_device"][0]
    per_device = results[run]["param_bytes_per_device"]
    assert len(per_device) == 1  # the same on every device
    assert one / int(tp) <= per_device[0] <= 1.15 * one / int(tp)


@pytest.mark.parametrize("run", ["tiny-gqa8:2:1:int4-g32", "tiny-qwen2:2:1:fp8", "tiny-qwen2-moe:2:1:int8",
                                 "smollm2-135m:3:1:gguf"])
def test_quantized_weights_split_with_their_scales(results, run):
    """Quantized weights over a mesh (int4 groups, fp8 and int8 per-row scales, the embedded model's
    own Q4_1 / Q8_0 blocks): each device holds about 1/tp of the quantized bytes, codes and scales
    alike, and greedy tokens equal the same quantization on one device."""
    model, tp, _, quantization = run.split(":")
    one = results[f"{model}:1:1:{quantization}"]
    got = results[run]
    assert got["tokens"] == one["tokens"] and got["compilations_after_warmup"] == 0
    assert one["param_bytes_per_device"][0] < results[f"{model}:1:1"]["param_bytes_per_device"][0]  # quantized
    assert len(got["param_bytes_per_device"]) == 1
    assert one["param_bytes_per_device"][0] / int(tp) <= got["param_bytes_per_device"][0] \
        <= 1.15 * one["param_bytes_per_device"][0] / int(tp)


def test_quantized_cache_split_with_its_scales(results):
    """An int8 KV cache under int4 weights over 2 devices: the same greedy tokens as one device, each
    device holding its KV head's codes and scales."""
    one, got = results["tiny-gqa8:1:1:int4-g32:int8"], results["tiny-gqa8:2:1:int4-g32:int8"]
    assert got["tokens"] == one["tokens"] and got["compilations_after_warmup"] == 0
    assert got["kv_heads_per_device"] == [1] and got["kv_scale_heads_per_device"] == [1]


@pytest.mark.parametrize("run, kv_heads", [("smollm2-135m:3:1:gguf", 1), ("tiny-gqa8:2:1", 1), ("tiny-gqa8:8:1", 1)])
def test_kv_cache_split_by_kv_head(results, run, kv_heads):
    assert results[run]["kv_heads_per_device"] == [kv_heads]


@pytest.mark.parametrize("run", ["collectives:tiny-qwen2:4", "collectives:tiny-qwen2-moe:8",
                                 "collectives:tiny-gqa8:4:interpret", "collectives:tiny-gqa8:2:reference:int4-g32:int8",
                                 "collectives:tiny-gqa8:2:reference:int8:fp8"])
def test_step_collectives(results, run):
    """Random weights with non-zero Q/K/V biases: the sharded step's logits (vocabulary-sharded) match
    one device's; its HLO all-reduces (embedding, then attention output and MLP/experts in the scanned
    layer body) and gathers no weights. The Pallas (TPU, interpreted) kernel runs per device on its
    heads, KV heads repeated. Quantized weights (each projection and the logits through the CPU
    kernel, a custom call GSPMD would gather the codes around) and a quantized cache (its scales split
    with its heads) keep that: one device's logits with the same weights and cache, no gathers."""
    r = results[run]
    assert r["max_abs_diff"] < 1e-4
    assert r["logits_spec"] == "P(None, 'tp')"
    assert r["all_reduces"] == 3
    assert r["all_gather_sizes"] == []


def test_tensor_parallel_on_some_of_the_devices(results):
    """tensor_parallel=2 on a 4-device host runs on the first two devices, with the one-device tokens."""
    got = results["tiny-qwen2:2:1"]
    assert got["tokens"] == results["tiny-qwen2:1:1"]["tokens"] and got["compilations_after_warmup"] == 0
    assert got["device_ids"] == [0, 1]


def test_two_processes_match_one_device(results):
    """JAX's multi-controller run: process 0 schedules and broadcasts each step's inputs, both run
    it over the 8 devices of the two processes (``batching.multihost``)."""
    r = results["multihost"]
    assert r["devices"] == [8, 4]
    assert r["tokens"] == results["tiny-gqa8:1:1"]["tokens"]
    assert r["compilations_after_warmup"] == 0


@pytest.mark.parametrize("run", ["load:smollm2-135m:3", "load:smollm2-135m:3:gguf", "load:smollm2-135m:3:int8"])
def test_checkpoints_load_straight_into_shards(results, run):
    """GGUF tensors placed slice by slice, and an orbax checkpoint restored into shards, give the
    same arrays with the same shardings as the whole model loaded on one device and then split; so do
    the GGUF's own blocks and int8 quantized at load (every field of a quantized leaf, and a saved
    quantized checkpoint restored over the mesh)."""
    r = results[run]
    assert r["direct"] and r["orbax"] and r["wqkv_spec"] == "P(None, 'tp', None)"
    # a float orbax checkpoint asked for a scheme is quantized, then split (rows, or the input of wo/w_down)
    assert r["float_orbax"] == {"load:smollm2-135m:3": ["float"], "load:smollm2-135m:3:gguf": [],
                                "load:smollm2-135m:3:int8": ["('int8', \"P(None, 'tp', None)\")",
                                                             "('int8', \"P(None, None, 'tp')\")"]}[run]


def test_mesh_errors_name_the_valid_sizes():
    fake = [object()] * 8  # validation needs only the count
    llama = PRESETS["tiny-gqa8"]  # 8 query heads, 2 KV heads
    with pytest.raises(ValueError, match=r"tensor_parallel=16 exceeds the 8 devices; .*\[1, 2, 4, 8\]"):
        sharding.make_mesh(llama, 16, 1, fake)
    with pytest.raises(ValueError, match=r"num_heads=9 is not divisible by 2.*\[1, 3\]"):
        sharding.make_mesh(PRESETS["smollm2-135m"], 2, 4, fake)
    with pytest.raises(ValueError, match=r"data_parallel \* tensor_parallel \(4 \* 4 = 16\) exceeds the 8 devices"):
        sharding.make_mesh(llama, 4, 4, fake)
    distinct = [object() for _ in range(8)]  # fewer than there are: the first ones, in order
    assert list(sharding.make_mesh(llama, 2, 2, distinct).devices.flat) == distinct[:4]
    with pytest.raises(ValueError, match="tensor_parallel must be a positive integer"):
        sharding.make_mesh(llama, 0, 1, fake)
    assert sharding.make_mesh(llama, 1, 1, fake) is None  # one device: the unsharded step
    moe = PRESETS["tiny-qwen2-moe"].replace(num_experts=6)
    with pytest.raises(ValueError, match="num_experts=6 is not divisible by 4"):
        sharding.make_mesh(moe, 4, 2, fake)


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_fused_layout_gives_each_device_whole_heads(tp):
    """Device i's rows of the fused q|k|v are its query heads and the KV heads they read (one,
    repeated, once tp exceeds the KV heads); its gate|up rows are a gate slice and the same up slice."""
    c = PRESETS["tiny-gqa8"]
    hd, h, kvh, f = c.head_dim, c.num_heads, c.num_kv_heads, c.intermediate_size
    spec = param_spec(c).layer
    rows = sharding._fused_rows(c, spec["wqkv"], tp).reshape(tp, -1) // hd
    kv_local = max(kvh, tp) // tp
    for i, r in enumerate(rows):
        q, k, v = np.split(r[::hd], [h // tp, h // tp + kv_local])
        assert list(q) == list(range(i * h // tp, (i + 1) * h // tp))
        assert set(q // (h // kvh)) == set(k - h) == set(v - h - kvh)  # the KV head of its query heads
    gu = sharding._fused_rows(c, spec["w_gate_up"], tp).reshape(tp, 2, -1)
    assert (gu[:, 1] == gu[:, 0] + f).all() and (np.sort(gu[:, 0].ravel()) == np.arange(f)).all()
