"""Continuous batching: every scheduling path must give the tokens of the same request run alone."""

import functools

import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams
from jaxinfer.batching.request import Status

# float32 on every backend: the exactness tests compare token ids across differently shaped steps, and
# in bfloat16 a GPU's 1-row and 5-row steps round differently enough to flip near-tied argmaxes of a
# random model (tests/test_speculative.py failed so natively on an H200, and passed in float32).
BASE = dict(load_format="dummy", dtype="float32", max_num_seqs=8, max_num_batched_tokens=64, num_pages=128, max_model_len=256,
            seq_buckets=(1, 2, 4, 8), page_buckets=(4, 16))
MAX_TOKENS = 20


def greedy(n=MAX_TOKENS):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


@functools.lru_cache(maxsize=None)
def _oracle(model: str) -> LLM:
    return LLM(model, **BASE)


@functools.lru_cache(maxsize=None)
def run_alone(model: str, prompt: tuple, n: int = MAX_TOKENS) -> list[int]:
    """The oracle: each request run by itself on an otherwise idle engine."""
    return _oracle(model).generate([list(prompt)], greedy(n))[0].outputs[0].token_ids


@pytest.fixture(scope="module")
def alone():
    return functools.partial(run_alone, "tiny-llama3")


def make_prompts(seed, n, low=3, high=120, prefix=()):
    rng = np.random.default_rng(seed)
    return [list(prefix) + rng.integers(3, 500, rng.integers(low, high)).tolist() for _ in range(n)]


def drive(engine, arrivals, params=None, priorities=None, aborts=()):
    """Add request i at step arrivals[i]; abort request j at step aborts[j]. Returns finished outputs."""
    done, step, pending = {}, 0, sorted(range(len(arrivals)), key=lambda i: arrivals[i][0])
    aborts = dict(aborts)
    while pending or engine.has_unfinished():
        while pending and arrivals[pending[0]][0] <= step:
            i = pending.pop(0)
            engine.add_request(f"r{i}", arrivals[i][1], params[i] if params else greedy(),
                               priorities[i] if priorities else 0)
        for rid, at in list(aborts.items()):
            if at == step:
                engine.abort(rid)
                del aborts[rid]
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        step += 1
        assert step < 5000, "engine made no progress"
    return done


def assert_no_leak(engine):
    b = engine.scheduler.kv.blocks
    assert b.num_used == 0 and all(c == 0 for c in b.ref_count)
    assert not engine.scheduler.requests and not engine.has_unfinished()


PATHS = {
    "staggered": dict(),  # staggered arrivals only
    "preempt-recompute": dict(num_pages=24, preemption_mode="recompute"),
    "preempt-swap": dict(num_pages=24, preemption_mode="swap"),
    "chunk1": dict(prefill_chunk_size=1),
    "chunk5": dict(prefill_chunk_size=5),
    "chunk16-nocache": dict(prefill_chunk_size=16, enable_prefix_caching=False),
}
# A second family (sliding windows, soft caps, post-norms) on the paths that move KV pages around.
GEMMA_PATHS = ("staggered", "preempt-recompute", "preempt-swap", "chunk5")


@pytest.mark.parametrize("model,path", [("tiny-llama3", p) for p in PATHS] + [("tiny-gemma2", p) for p in GEMMA_PATHS])
def test_scheduling_paths_match_alone(model, path):
    opts = PATHS[path]
    llm = LLM(model, **{**BASE, **opts})
    ps = make_prompts(0, 10)
    arrivals = [(i, p) for i, p in enumerate(ps)]
    done = drive(llm.engine, arrivals)
    for i, p in enumerate(ps):
        assert done[f"r{i}"].token_ids == run_alone(model, tuple(p)), f"request {i} diverged"
    if "num_pages" in opts:
        assert llm.engine.stats()["preemptions"] > 0, "pool was meant to force preemption"
    assert_no_leak(llm.engine)


@pytest.mark.parametrize("model,caching", [("tiny-llama3", True), ("tiny-llama3", False), ("tiny-gemma2", True)])
def test_shared_prefixes(model, caching):
    prefix = make_prompts(1, 1, 70, 71)[0]
    ps = make_prompts(2, 6, 1, 20, prefix=prefix)
    llm = LLM(model, **{**BASE, "enable_prefix_caching": caching})
    done = drive(llm.engine, [(2 * i, p) for i, p in enumerate(ps)])
    for i, p in enumerate(ps):
        assert done[f"r{i}"].token_ids == run_alone(model, tuple(p))
    hits = llm.engine.stats()["prefix_cache_hits"]
    assert (hits > 0) == caching
    assert_no_leak(llm.engine)


def test_prefix_cache_skips_the_shared_prefill():
    llm = LLM("tiny-llama3", **{**BASE, "max_num_batched_tokens": 128, "num_pages": 128, "max_model_len": 512,
                                "page_buckets": (4, 32)})
    prefix = make_prompts(3, 1, 256, 257)[0]
    first, second = prefix + [7, 8, 9], prefix + [11, 12, 13, 14, 15]
    llm.generate([first], greedy(4))
    before = llm.engine.stats()["computed_prompt_tokens"]
    out = llm.generate([second], greedy(4))[0]
    assert llm.engine.stats()["computed_prompt_tokens"] - before == len(second) - 256
    assert out.num_cached_tokens == 256
    fresh = LLM("tiny-llama3", **{**BASE, "max_num_batched_tokens": 128, "num_pages": 128, "max_model_len": 512,
                                  "page_buckets": (4, 32), "enable_prefix_caching": False})
    assert fresh.generate([second], greedy(4))[0].outputs[0].token_ids == out.outputs[0].token_ids


def test_aborts_mid_flight(alone):
    llm = LLM("tiny-llama3", **BASE)
    ps = make_prompts(4, 8)
    done = drive(llm.engine, [(i, p) for i, p in enumerate(ps)], aborts=[("r1", 4), ("r4", 9), ("r6", 6)])
    assert set(done) == {f"r{i}" for i in (0, 2, 3, 5, 7)}
    for i in (0, 2, 3, 5, 7):
        assert done[f"r{i}"].token_ids == alone(tuple(ps[i]))
    assert_no_leak(llm.engine)
    assert not llm.engine.abort("r1")  # already gone


def test_abort_frees_pages_at_once():
    llm = LLM("tiny-llama3", **BASE)
    eng = llm.engine
    eng.add_request("a", make_prompts(5, 1, 60, 61)[0], greedy())
    eng.step()
    assert eng.stats()["kv_pages_used"] > 0
    assert eng.abort("a")
    assert eng.stats()["kv_pages_used"] == 0 and not eng.has_unfinished()


@pytest.mark.parametrize("contention", ["slots", "pages"])
def test_priority_preempts_and_finishes_first(contention):
    """A late high-priority request jumps ahead of earlier low-priority ones of the same length."""
    limits = dict(max_num_seqs=1) if contention == "slots" else dict(max_num_seqs=4, num_pages=9, max_model_len=128)
    llm = LLM("tiny-llama3", **{**BASE, **limits, "scheduling_policy": "priority"})
    ps = make_prompts(6, 5, 40, 41)
    eng = llm.engine
    for i in range(4):
        eng.add_request(f"low{i}", ps[i], greedy(30), priority=5)
    order = []
    for _ in range(3):
        order += [o.request_id for o in eng.step() if o.finished]
    assert not order and eng.scheduler.running
    eng.add_request("high", ps[4], greedy(30), priority=0)
    while eng.has_unfinished():
        order += [o.request_id for o in eng.step() if o.finished]
    assert order[0] == "high", order
    assert eng.stats()["preemptions"] > 0
    assert_no_leak(eng)


def test_randomized_workload_no_leak_no_recompile(alone):
    """200 requests: random lengths, arrival steps, priorities and aborts, after warm-up."""
    llm = LLM("tiny-llama3", **{**BASE, "num_pages": 40, "scheduling_policy": "priority",
                                "token_buckets": (16, 32, 64)})
    eng = llm.engine
    eng.warmup()
    compiled = eng.num_compilations
    rng = np.random.default_rng(7)
    n = 200
    ps = make_prompts(8, n, 1, 90)
    arrivals = sorted((int(rng.integers(0, 400)), p) for p in ps)
    params = [greedy(int(rng.integers(1, 25))) for _ in range(n)]
    priorities = rng.integers(0, 3, n).tolist()
    aborted = rng.choice(n, 25, replace=False)
    aborts = [(f"r{i}", arrivals[i][0] + int(rng.integers(0, 10))) for i in aborted]
    done = drive(eng, arrivals, params, priorities, aborts)
    assert eng.num_compilations == compiled, "a step shape was compiled after warm-up"
    assert len(done) >= n - len(aborted)
    assert eng.stats()["preemptions"] > 0
    assert_no_leak(eng)
    for i in range(0, n, 25):  # spot-check against the oracle
        rid = f"r{i}"
        if rid in done:
            assert done[rid].token_ids == alone(tuple(arrivals[i][1]), params[i].max_tokens)


def test_kv_utilization_vs_static_allocation():
    """Paged allocation wastes at most the last partial page per sequence; static wastes the rest."""
    llm = LLM("tiny-llama3", **{**BASE, "max_num_batched_tokens": 128, "num_pages": 128})
    eng = llm.engine
    ps = make_prompts(9, 8, 60, 200)
    for i, p in enumerate(ps):
        eng.add_request(f"u{i}", p, greedy(40))
    paged, static = [], []
    while eng.has_unfinished():
        eng.step()
        running = [s for s in eng.scheduler.running if s.status is Status.RUNNING]
        if running and all(not s.is_prefill for s in running):
            stored = sum(s.num_computed_tokens for s in running)
            paged.append(eng.stats()["kv_utilization"])
            static.append(stored / (len(running) * eng.max_model_len))
    assert np.mean(paged) >= 0.95, np.mean(paged)
    assert np.mean(static) < 0.8


def test_decode_only_steps_up_to_the_kernels_limit(alone, monkeypatch):
    """A backend's decode-only op takes decode-only steps of at most ``decode_attention_max_seqs``
    (padded) sequences: warm-up compiles those variants and no others, larger decode steps run as
    ordinary ones, nothing compiles after warm-up, and the tokens are the requests' run alone. The op
    here is the jnp composition, recording the sequence bucket of each step it is traced for."""
    from jaxinfer.batching.backend import CpuBackend
    from jaxinfer.models.layers import Ops, rope_write_kv
    from jaxinfer.paged.attention import ragged_paged_attention

    traced = []

    def decode_attention(qkv, x, positions, inv_freq, cache, layer, md, *, num_heads, eps, scale, soft_cap,
                         sliding_window):
        traced.append(md.page_table.shape[0])
        q, cache = rope_write_kv(qkv, x, positions, inv_freq, cache, layer, md.slot_mapping, num_heads=num_heads,
                                 num_kv_heads=cache.k.shape[3], eps=eps)
        return ragged_paged_attention(q, cache.k, cache.v, layer, md, scale=scale, soft_cap=soft_cap,
                                      sliding_window=sliding_window), cache

    monkeypatch.setattr(CpuBackend, "ops", lambda *_: Ops(attention=ragged_paged_attention,
                                                          decode_attention=decode_attention,
                                                          decode_attention_max_seqs=2))
    eng = LLM("tiny-llama3", **BASE).engine
    eng.warmup(greedy_only=True)
    assert set(traced) == {1, 2}, traced  # the decode-only variants of the 1- and 2-sequence buckets only
    compiled, traced[:] = eng.num_compilations, []
    ps = make_prompts(11, 5, 3, 40)
    # 5 at once: decode steps of 5 (bucket 8) and 3-4 (bucket 4) sequences, then 1-2 as they finish
    done = drive(eng, [(0, p) for p in ps], [greedy(n) for n in (4, 8, 12, 16, 20)])
    assert eng.num_compilations == compiled, "a step shape was compiled after warm-up"
    assert not traced  # compiled in warm-up: no step retraced the op
    for i, (p, n) in enumerate(zip(ps, (4, 8, 12, 16, 20))):
        assert done[f"r{i}"].token_ids == alone(tuple(p), n)


def test_step_inputs_travel_as_one_buffer():
    """The packed transfer gives back every host array of a step bit for bit, dtypes and static
    fields included (floats and unsigned seeds ride in int32 words)."""
    import jax
    from jaxinfer.batching.inputs import pack_inputs, unpack_inputs
    from jaxinfer.paged.kv_cache import BatchMetadata

    rng = np.random.default_rng(0)
    md = BatchMetadata(*(rng.integers(-5, 99, n).astype(np.int32) for n in (8, 6, 3, 4, 3)), decode_only=True)
    tree = (md, np.array([0.5, -1.25, np.inf], np.float32), np.array([2**32 - 1, 7, 0], np.uint32))
    buf, packing = pack_inputs(tree)
    assert buf.dtype == np.int32 and buf.shape == (8 + 6 + 3 + 4 + 3 + 3 + 3,)
    back = jax.jit(unpack_inputs, static_argnums=1)(buf, packing)
    assert back[0].decode_only is True
    for a, b in zip(jax.tree.leaves(tree), jax.tree.leaves(back)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, np.asarray(b))


@pytest.mark.parametrize("prompt_len,buckets,want", [
    (10, (8, 64), [1] * 7 + [1]),  # 17 tokens would run as 64 (27% full): the prompt gets what fits 8
    (30, (8, 64), [1] * 7 + [30]),  # 37 of 64 is full enough: the whole prompt goes
    (10, (), [1] * 7 + [10]),  # no buckets given: nothing is trimmed
])
def test_prefill_trimmed_to_the_smaller_bucket(prompt_len, buckets, want):
    """A few prefill tokens on top of a full decode batch must not push a step into a bucket that is
    mostly padding; decodes are never trimmed, and the trimmed prompt goes on in the next step."""
    from jaxinfer.batching.kv_manager import KVCacheManager
    from jaxinfer.batching.request import Request
    from jaxinfer.batching.scheduler import Scheduler, SchedulerConfig

    sched = Scheduler(SchedulerConfig(8, 64, 64, 256, token_buckets=buckets), KVCacheManager(64, 16, False))
    for i in range(7):
        sched.add_request(Request(f"d{i}", [5], greedy(), 0, arrival_index=i))
    sched.dispatched(sched.schedule(), 1)  # as if run: each now decodes, its next token in flight
    sched.add_request(Request("p", list(range(3, 3 + prompt_len)), greedy(), 0, arrival_index=7))
    batch = sched.schedule()
    assert batch.num_tokens == want and batch.request_ids[-1] == "p"
    sched.dispatched(batch, 1)
    if want[-1] < prompt_len:
        assert sched.schedule().num_tokens[-1] == 1  # still trimmed while the decodes fill bucket 8


def test_multi_step_decode_matches_single_steps():
    """``num_scheduler_steps=4`` (the CPU default) decodes 4 tokens per dispatch and gives every
    request the tokens of single steps: greedy and seeded sampling, ``max_tokens`` that are no
    multiple of 4, a stop token met inside a run (the rest of the run dropped), a logprobs request
    (single steps while it runs), staggered arrivals, preemption by a small pool and an abort; no
    pages leak. The oracle is the same engine with ``num_scheduler_steps=1``."""
    ps = make_prompts(12, 8, 3, 60)
    single = LLM("tiny-llama3", **{**BASE, "num_scheduler_steps": 1})
    free = single.generate([ps[0]], greedy(20))[0].outputs[0].token_ids
    stop = free[6]  # met inside the second 4-token run
    params = [SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=(stop,))] + [
        greedy(n) for n in (5, 13, 20)] + [
        SamplingParams(max_tokens=18, temperature=0.8, top_p=0.9, seed=5 + i, ignore_eos=True) for i in range(2)] + [
        SamplingParams(max_tokens=15, temperature=0.0, logprobs=2, ignore_eos=True), greedy(11)]
    arrivals = [(i, p) for i, p in enumerate(ps)]
    want = drive(single.engine, arrivals, params)
    assert single.engine.scheduler.inflight.num_dispatched == single.engine.stats()["steps"]
    assert want["r0"].finish_reason == "stop" and want["r0"].token_ids == free[:free.index(stop)]
    # a large pool; a small one (preemption); 3 slots for 8 requests (runs while the rest wait for a slot)
    for opts in (dict(num_pages=128), dict(num_pages=16), dict(max_num_seqs=3, seq_buckets=(1, 2, 4))):
        multi = LLM("tiny-llama3", **{**BASE, "num_scheduler_steps": 4, **opts})
        done = drive(multi.engine, arrivals, params, aborts=[("r7", 9)])
        stats = multi.engine.stats()
        runs = (stats["steps"] - multi.engine.scheduler.inflight.num_dispatched) // 3  # 4 steps, 1 dispatch
        least = {128: 3, 16: 1}.get(opts.get("num_pages"), 8)  # 3 slots: 12 runs; 4 if waiting stopped them
        assert runs >= least, f"{runs} dispatches ran 4 decode steps"
        assert (stats["preemptions"] > 0) == (opts.get("num_pages") == 16)
        for i in range(7):
            got, ref = done[f"r{i}"], want[f"r{i}"]
            assert (got.token_ids, got.finish_reason) == (ref.token_ids, ref.finish_reason), f"request {i}"
            if ref.logprobs is not None:  # the same entries; values within float32 rounding of other step shapes
                assert [d.keys() for d in got.logprobs] == [d.keys() for d in ref.logprobs]
                np.testing.assert_allclose([v for d in got.logprobs for v in d.values()],
                                           [v for d in ref.logprobs for v in d.values()], rtol=0, atol=1e-5)
        assert_no_leak(multi.engine)
