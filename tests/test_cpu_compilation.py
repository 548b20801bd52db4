"""Bounded compilation: warm-up compiles exactly its plan and nothing compiles after it, live
executables never exceed ``max_executables`` (and their memory maps stay bounded), evicted steps
recompile correctly, and the persistent compilation cache directory is used."""

import os

import jax
import numpy as np
import pytest

from helpers import benchmark_module
from jaxinfer import LLM, SamplingParams
from jaxinfer.batching.config import EngineConfig, default_compilation_cache_dir
from jaxinfer.batching.backend import backend_for
from jaxinfer.batching.compilation import first_steps

TINY = dict(load_format="dummy", max_num_seqs=4, max_num_batched_tokens=32, num_pages=64, max_model_len=128)
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _maps() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def test_cpu_default_buckets_are_coarse():
    b = backend_for("cpu").buckets(128, 16, 64)
    assert (b.tokens, b.seqs, b.pages) == ((1, 8, 16, 64, 128), (1, 4, 8, 16), (64,))
    assert len(b.all_shapes()) == 16  # the server's defaults: 624 shapes with powers of two
    assert backend_for("gpu").buckets(128, 16, 64).tokens == (8, 16, 32, 64, 128)


def test_warmup_compiles_the_plan_and_nothing_more(tmp_path):
    llm = LLM("tiny-llama3", compilation_cache_dir=str(tmp_path), **TINY)
    runner = llm.engine.runner
    plan = runner.warmup_plan(greedy_only=True)
    llm.warmup(greedy_only=True)
    assert runner.compiler.num_executables == len(plan) == llm.engine.num_compilations
    assert llm.engine.stats()["steps"] == 0, "warm-up must compile without running steps"
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 500, n).tolist() for n in (3, 9, 17, 30, 5)]
    llm.generate(prompts, GREEDY)
    assert llm.engine.num_compilations == len(plan), "a step shape was compiled after warm-up"
    assert any(os.scandir(tmp_path)), "the persistent compilation cache directory was not written"


def test_nothing_compiles_after_warmup_for_a_varied_workload(tmp_path):
    """After ``warmup(structured=True)``, a workload of every kind warm-up plans for compiles nothing at
    all, counted by JAX itself (every executable it builds, the engine's steps or any other): staggered
    arrivals of prompts from 1 to 100 tokens, batches of 1 to 4, chunked prefills next to decodes, runs
    of 4 decode steps, greedy and seeded sampling, stop tokens and aborts, a constrained request, and a
    step that fails and is recomputed (a fresh KV pool)."""
    llm = LLM("smollm2-135m", compilation_cache_dir=str(tmp_path), max_num_seqs=4, max_num_batched_tokens=32,
              max_model_len=192)
    llm.warmup(structured=True)
    seen = benchmark_module("compiles_after_warmup").varied_workload(llm, (1, 5, 17, 33, 60, 100, 9, 2), 14)
    assert seen["failed"], "the step meant to fail did not run"
    assert seen["compiled"] == [], f"compiled after warm-up: {seen['compiled']}"
    assert {f"r{i}" for i in range(8) if i != 4} | {"choice"} <= set(seen["finished"]), seen["finished"]


def test_greedy_and_sampled_steps_share_one_executable_per_shape(tmp_path):
    """On CPU a step decides greedy or sampled itself: warm-up compiles one step per shape (not two),
    and greedy, sampled and mixed batches then run without compiling."""
    llm = LLM("tiny-llama3", compilation_cache_dir=str(tmp_path), **TINY)
    runner = llm.engine.runner
    plan = runner.warmup_plan()
    single = [p for p in plan if p.steps == 1]  # the rest: multi-step decodes (``num_scheduler_steps``)
    assert len(single) == len(runner.buckets.all_shapes()) and all(p.greedy is None for p in plan)
    llm.warmup()
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 500, n).tolist() for n in (4, 11, 23)]
    sampled = SamplingParams(max_tokens=6, temperature=0.9, seed=3, ignore_eos=True)
    llm.generate(prompts, GREEDY)
    llm.generate(prompts, sampled)
    llm.generate(prompts, [GREEDY, sampled, GREEDY])
    assert llm.engine.num_compilations == len(plan), "a greedy or sampled step compiled after warm-up"


def test_penalties_compile_once_per_power_of_two():
    """A step with penalties carries its requests' generated-token counts padded to a power of two, so a
    longer request reuses the shorter one's steps instead of compiling one per count."""
    llm = LLM("tiny-llama3", compilation_cache_dir="", **TINY)
    penalized = lambda n: SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, presence_penalty=0.5)
    llm.generate([[5, 6, 7]], penalized(20))  # its steps carry 0-19 generated tokens: the 16- and 32-slot variants
    before = llm.engine.num_compilations
    assert llm.generate([[8, 9, 10]], penalized(30))[0].outputs[0].token_ids
    assert llm.engine.num_compilations == before


def test_warmup_refuses_a_plan_larger_than_the_bound():
    llm = LLM("tiny-llama3", compilation_cache_dir="", max_executables=3, **TINY)
    with pytest.raises(ValueError, match="max_executables"):
        llm.warmup()


def test_executables_bounded_and_correct_after_eviction():
    """Many distinct shapes in one process: at most max_executables stay alive, the process's memory
    maps stop growing, and steps recompiled after eviction give the same tokens."""
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 500, n).tolist() for n in (2, 15, 40, 90)]
    ref = [o.outputs[0].token_ids for o in LLM("tiny-llama3", compilation_cache_dir="", **TINY).generate(prompts, GREEDY)]
    llm = LLM("tiny-llama3", compilation_cache_dir="", max_executables=2,
              token_buckets=(1, 4, 32), seq_buckets=(1, 4), page_buckets=(2, 8), **TINY)
    counts = []
    for _ in range(2):
        for p in prompts:  # alone: each prompt meets its own prefill and decode shapes
            assert llm.generate([p], GREEDY)[0].outputs[0].token_ids == ref[prompts.index(p)]
            assert llm.engine.runner.compiler.num_executables <= 2
        counts.append(_maps())
    assert llm.engine.num_compilations > 2 * len(prompts), "the soak did not evict and recompile"
    assert counts[-1] <= counts[0] + 200, f"memory maps grew with compilations: {counts}"
    jax.clear_caches()


def test_compilation_cache_dir_defaults_to_the_user_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_compilation_cache_dir() == str(tmp_path / "jaxinfer" / "xla")
    with pytest.raises(ValueError, match="max_executables"):
        EngineConfig(max_executables=0)


def test_background_warmup_compiles_the_plan_once_while_serving(tmp_path):
    """The server's warm-up: the first steps before it returns, the rest in a thread while requests
    run; each planned step is compiled exactly once (a step waits for a compilation under way), and
    tokens equal those of a fully warmed-up engine."""
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, 500, n).tolist() for n in (3, 17, 30)]
    ref = LLM("tiny-llama3", compilation_cache_dir="", **TINY)
    ref.warmup(greedy_only=True)
    want = [o.outputs[0].token_ids for o in ref.generate(prompts, GREEDY)]
    llm = LLM("tiny-llama3", compilation_cache_dir=str(tmp_path), **TINY)
    runner = llm.engine.runner
    plan = runner.warmup_plan(greedy_only=True)
    first = first_steps(plan, runner.buckets)
    assert 0 < len(first) < len(plan)
    llm.warmup(greedy_only=True, background=True)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == want
    llm.engine.wait_warmup()
    assert runner.compiler.num_executables == len(plan) == llm.engine.num_compilations


@pytest.mark.parametrize("layer_loop", ["indexed", "scan"])
def test_steps_update_the_pool_in_place(layer_loop):
    """Every step, and the multi-step decode (``num_scheduler_steps``, 4 on CPU) at each of its steps,
    writes every layer's K/V after the layers read the pool: the compiled code must not copy the pool
    (XLA:CPU once copied it several times per layer where a write could precede a read: ~28 s per
    SmolLM2 step; ``paged.kv_cache``). After unrolled layers it did copy it (twice per step), so that
    pairing is refused."""
    import re
    llm = LLM("tiny-llama3", compilation_cache_dir="", layer_loop=layer_loop, **TINY)
    runner = llm.engine.runner
    llm.warmup(greedy_only=True)
    pool = ",".join(map(str, runner.cache.k.shape))
    steps = {key[0]: exe for key, exe in runner.compiler._executables.items()}
    assert runner._multi in steps and runner._step in steps and runner.num_scheduler_steps == 4
    for key, exe in runner.compiler._executables.items():
        text = exe.as_text()
        assert f"[{pool}]" in text and not [line for line in text.splitlines()
                                            if re.search(r"\bcopy\(", line) and f"[{pool}]" in line]
    with pytest.raises(ValueError, match="layer_loop='unroll' does not go with attention_backend='cpu'"):
        LLM("tiny-llama3", layer_loop="unroll", **TINY)
