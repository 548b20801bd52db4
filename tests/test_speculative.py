"""Speculative decoding: outputs with proposals verified per step are those without speculation.

Greedy: token-identical to the same requests run without speculation, on every scheduling path.
Sampling: rejection sampling keeps the target's distribution (chi-square at the sampling layer).
Proposals come from the n-gram proposer and from a replay proposer that knows the answer but corrupts
some proposals, so every step exercises partial acceptance (a random model rarely repeats itself).
"""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats as scistats

from jaxinfer import LLM, SamplingParams
from jaxinfer.batching.config import EngineConfig
from jaxinfer.batching.speculative import NgramProposer
from jaxinfer.server.metrics import Metrics
from jaxinfer.sampling import SamplingBatch, _filtered, verify
from test_batching import BASE, assert_no_leak, drive, greedy, make_prompts, run_alone

MODEL = "tiny-llama3"


class Replay:
    """Proposes the greedy answer (known from a run without speculation), wrong at a random position
    with probability ``wrong``: acceptance then stops there."""

    def __init__(self, answers: dict[tuple, list[int]], wrong: float = 0.3, seed: int = 0):
        self.answers, self.wrong, self.rng = answers, wrong, np.random.default_rng(seed)

    def propose(self, seqs, limits):
        out = []
        for s, k in zip(seqs, limits):
            ans = self.answers.get(tuple(s.prompt_token_ids), [])
            context, skip = s.assumed_context()
            at = len(context) + skip - len(s.prompt_token_ids)
            prop = list(ans[at:at + k])
            if prop and self.rng.random() < self.wrong:
                prop[self.rng.integers(len(prop))] = int(self.rng.integers(3, 500))
            out.append(prop)
        return out


@functools.lru_cache(maxsize=4)  # bounded: each engine's compiled steps hold ~3k memory maps (conftest.py)
def spec_llm(k: int, **options) -> LLM:
    return LLM(MODEL, **{**BASE, **options}, speculative_method="ngram", num_speculative_tokens=k)


def run_batch(llm, prompts, params, proposer=None, arrivals=None, aborts=()):
    if proposer is not None:
        llm.engine.proposer = proposer
    arrivals = arrivals or [0] * len(prompts)
    done = drive(llm.engine, list(zip(arrivals, prompts)), params, aborts=aborts)
    return {int(rid[1:]): out for rid, out in done.items()}


PATHS = {
    "staggered": dict(),
    "preempt-recompute": dict(num_pages=10, max_model_len=128, preemption_mode="recompute"),
    "preempt-swap": dict(num_pages=10, max_model_len=128, preemption_mode="swap"),
    "chunk1": dict(prefill_chunk_size=1),
    "chunk16-nocache": dict(prefill_chunk_size=16, enable_prefix_caching=False),
}


# Every path with steps in flight (the harder case: discarded steps), and synchronous steps on a path of each
# kind (arrivals, preemption by recompute and by swap, chunked prefill), with replayed and n-gram proposals.
@pytest.mark.parametrize("k,path,proposer,overlap", [(3, p, "replay", True) for p in PATHS] + [
    (3, "staggered", "replay", False), (3, "preempt-recompute", "replay", False), (5, "preempt-swap", "replay", False),
    (5, "staggered", "ngram", True), (1, "chunk1", "ngram", False)])
def test_greedy_identical_to_no_speculation(k, path, proposer, overlap, caplog):
    """``overlap``: verifying steps stay in flight (``speculative_overlap``), so a step after one that
    rejected a proposal is dispatched and then discarded, on every scheduling path."""
    # Repeated halves give the n-gram proposer something to find.
    prompts = [p + p[:20] for p in make_prompts(7, 7, high=60)]
    want = {i: run_alone(MODEL, tuple(p)) for i, p in enumerate(prompts)}
    answers = {tuple(p): want[i] for i, p in enumerate(prompts)}
    llm = spec_llm(k, **PATHS[path], speculative_overlap=overlap)
    # request 6 does not speculate (penalties) and shares every step with those that do
    params = [greedy()] * 6 + [SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True,
                                              presence_penalty=1e-9)]
    with caplog.at_level("DEBUG", logger="jaxinfer.batching.scheduler"):
        got = run_batch(llm, prompts, params, Replay(answers) if proposer == "replay" else NgramProposer(1, 4),
                        arrivals=[0, 0, 0, 1, 1, 2, 4])
    # preempted with proposals in flight (what the scheduler logs of each preemption)
    victims = [int(m.group(1)) > 0 for r in caplog.records if (m := re.search(r"(\d+) of them proposals",
                                                                               r.getMessage()))]
    assert {i: o.token_ids for i, o in got.items()} == want
    s = llm.engine.stats()
    assert s["spec_proposed_tokens"] > 0
    if proposer == "replay":
        assert 0 < s["spec_accepted_tokens"] < s["spec_proposed_tokens"]
        assert (s["spec_discarded"] > 0) == overlap
    if path.startswith("preempt"):
        assert s["preemptions"] > 0 and (any(victims) or not overlap)
    assert_no_leak(llm.engine)


@pytest.mark.parametrize("draft,agrees,overlap", [("tiny-llama3", True, False), ("tiny-gemma2", False, False),
                                                  ("tiny-llama3", True, True)])
def test_draft_model_greedy_identical(draft, agrees, overlap):
    """The target itself as draft always agrees; a different random model (same vocabulary) rarely does.
    ``overlap``: the draft proposes past the token of the step in flight (its own guess of it)."""
    prompts = make_prompts(17, 4, high=50)
    want = {i: run_alone(MODEL, tuple(p)) for i, p in enumerate(prompts)}
    llm = LLM(MODEL, **{**BASE, **PATHS["preempt-recompute"]}, speculative_method="draft", speculative_model=draft,
              num_speculative_tokens=3, speculative_overlap=overlap)
    got = run_batch(llm, prompts, [greedy()] * 4, arrivals=[0, 0, 2, 5])
    assert {i: o.token_ids for i, o in got.items()} == want
    rate = llm.engine.stats()["spec_acceptance_rate"]
    assert rate == 1.0 if agrees else rate < 0.2
    assert_no_leak(llm.engine)
    assert_no_leak(llm.engine.proposer.engine)


@pytest.mark.parametrize("overlap", [False, True])
def test_prefix_caching_with_speculation(overlap):
    shared = make_prompts(3, 1, low=40, high=41)[0]
    prompts = [shared + p for p in make_prompts(4, 4, high=30)]
    want = {i: run_alone(MODEL, tuple(p)) for i, p in enumerate(prompts)}
    llm = spec_llm(3, speculative_overlap=overlap)
    hits = llm.engine.stats()["prefix_cache_hits"]
    got = run_batch(llm, prompts, [greedy()] * 4, Replay({tuple(p): want[i] for i, p in enumerate(prompts)}),
                    arrivals=[0, 2, 4, 6])
    assert {i: o.token_ids for i, o in got.items()} == want
    assert llm.engine.stats()["prefix_cache_hits"] > hits
    # A page is published only once its tokens are accepted: every cached page holds the tokens it is keyed by.
    b = llm.engine.scheduler.kv.blocks
    for key, page in b.cached.items():
        assert b.page_key[page] == key and len(b.page_tokens[page]) == b.page_size
    assert_no_leak(llm.engine)


def test_stops_and_max_tokens_inside_a_proposal():
    prompts = make_prompts(11, 4, high=40)
    full = [run_alone(MODEL, tuple(p)) for p in prompts]
    # Always-right replay proposals of 5: a stop id at output 6, max_tokens 7, 8 land inside proposals.
    llm = spec_llm(5)
    params = [SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, stop_token_ids=(full[0][6],)),
              SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2),
              greedy()]
    got = run_batch(llm, prompts, params, Replay({tuple(p): f for p, f in zip(prompts, full)}, wrong=0.0))
    assert got[0].token_ids == full[0][:full[0].index(full[0][6])] and got[0].finish_reason == "stop"
    assert got[1].token_ids == full[1][:7] and got[1].finish_reason == "length"
    assert got[2].token_ids == full[2][:8] and len(got[2].logprobs) == 8
    assert got[3].token_ids == full[3]
    # logprobs of accepted tokens are the target's (those of the run without speculation)
    plain = LLM(MODEL, **BASE).generate([prompts[2]], params[2])[0].outputs[0]
    for a, b in zip(got[2].logprobs, plain.logprobs):
        assert a.keys() == b.keys()
        np.testing.assert_allclose([a[t] for t in b], [b[t] for t in b], atol=1e-4)
    s = llm.engine.stats()
    assert s["spec_mean_accepted_length"] > 2
    metrics = Metrics(lambda: s).render().decode()
    assert f"jaxinfer_spec_accepted_tokens_total {float(s['spec_accepted_tokens'])}" in metrics
    assert "jaxinfer_spec_acceptance_rate" in metrics
    assert_no_leak(llm.engine)


class Scripted(Replay):
    """Proposes the answer, except a wrong token wherever it proposes output index ``wrong_at``."""

    def __init__(self, answers, wrong_at: int):
        super().__init__(answers, wrong=0.0)
        self.wrong_at = wrong_at

    def propose(self, seqs, limits):
        out = super().propose(seqs, limits)
        for s, prop in zip(seqs, out):
            context, skip = s.assumed_context()
            j = self.wrong_at - (len(context) + skip - len(s.prompt_token_ids))
            if 0 <= j < len(prop):
                prop[j] = (prop[j] + 1) % 500
        return out


@pytest.mark.parametrize("case", ["max_tokens", "stop", "logprobs", "none"])
def test_discarded_step_after_a_rejection(case):
    """Batch 1, k = 3, every step in flight (``speculative_overlap``): the verify step covering
    output indices 4-8 rejects its proposal of index 6, so the step dispatched after it (the bonus
    token 8 and proposals 9-11, computed from the rejected proposal) is discarded, and the request goes
    on from the correction at index 6. ``max_tokens`` 10 and a stop id at index 10 land inside that
    discarded step; the output is that of the request run alone (logprobs too)."""
    prompt = make_prompts(31, 1, low=30, high=31)[0]
    full = run_alone(MODEL, tuple(prompt))
    stop = full[10]
    params = dict(max_tokens=SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
                  stop=SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, stop_token_ids=(stop,)),
                  logprobs=SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=2),
                  none=greedy())[case]
    llm = spec_llm(3, speculative_overlap=True)
    before = llm.engine.stats()["spec_discarded"]
    got = run_batch(llm, [prompt], [params], Scripted({tuple(prompt): full}, wrong_at=6))[0]
    want = LLM(MODEL, **BASE).generate([prompt], params)[0].outputs[0] if case == "logprobs" else None
    expected = {"max_tokens": full[:10], "stop": full[:full.index(stop)]}.get(case, full)
    assert got.token_ids == expected
    if want is not None:
        for a, b in zip(got.logprobs, want.logprobs, strict=True):
            assert a.keys() == b.keys()
            np.testing.assert_allclose([a[t] for t in b], [b[t] for t in b], atol=1e-4)
    assert llm.engine.stats()["spec_discarded"] == before + 1
    assert_no_leak(llm.engine)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_aborts_and_preemption_with_steps_in_flight(mode):
    """Steps stay in flight while requests are aborted and preempted around them; every request that
    is not aborted gives the tokens it gives alone."""
    prompts = [p + p[:10] for p in make_prompts(41, 8, low=30, high=80)]
    want = {i: run_alone(MODEL, tuple(p)) for i, p in enumerate(prompts)}
    llm = spec_llm(3, num_pages=10, max_model_len=128, preemption_mode=mode, speculative_overlap=True)
    before = llm.engine.stats()
    got = run_batch(llm, prompts, [greedy()] * 8, Replay({tuple(p): want[i] for i, p in enumerate(prompts)}),
                    arrivals=[0, 0, 0, 1, 2, 3, 5, 8], aborts=[("r1", 4), ("r4", 7), ("r6", 9)])
    assert set(got) >= {0, 2, 3, 5, 7} and {i: o.token_ids for i, o in got.items()} == {i: want[i] for i in got}
    s = llm.engine.stats()
    assert s["preemptions"] > before["preemptions"] and s["spec_discarded"] > before["spec_discarded"]
    assert_no_leak(llm.engine)


def test_speculation_pauses_above_max_num_seqs(caplog):
    """Above ``speculative_max_num_seqs`` running sequences no step verifies proposals (and the log says
    so); once the batch shrinks back, speculation resumes. Outputs stay those without speculation."""
    prompts = make_prompts(23, 4, high=40)
    want = {i: run_alone(MODEL, tuple(p)) for i, p in enumerate(prompts)}
    llm = spec_llm(3, speculative_max_num_seqs=2)
    proposed = []  # running sequences at each step that proposed

    class Counting(Replay):
        def propose(self, seqs, limits):
            proposed.append(len(llm.engine.scheduler.running))
            return super().propose(seqs, limits)

    # four requests together, then the short ones finish and two are left
    params = [greedy(4), greedy(4), greedy(), greedy()]
    with caplog.at_level("INFO", logger="jaxinfer.batching.engine"):
        got = run_batch(llm, prompts, params, Counting({tuple(p): w for p, w in zip(prompts, want.values())},
                                                       wrong=0.0))
    assert {i: o.token_ids for i, o in got.items()} == {i: w[:len(got[i].token_ids)] for i, w in want.items()}
    assert [len(got[i].token_ids) for i in range(4)] == [4, 4, 20, 20]
    assert proposed and max(proposed) <= 2  # never proposed while 3 or 4 ran
    paused = [r.getMessage() for r in caplog.records if "speculative decoding paused" in r.getMessage()]
    resumed = [r.getMessage() for r in caplog.records if "speculative decoding resumed" in r.getMessage()]
    assert paused and "speculative_max_num_seqs=2" in paused[0] and resumed
    assert_no_leak(llm.engine)


@pytest.mark.parametrize("overlap", [False, True])
def test_randomized_workload_no_leak(overlap):
    rng = np.random.default_rng(5)
    n = 200
    prompts = [p + p[:10] for p in make_prompts(9, n, high=40)]
    llm = spec_llm(4, num_pages=12, max_model_len=96, preemption_mode="swap", speculative_overlap=overlap)
    params = [SamplingParams(max_tokens=int(rng.integers(1, 24)), temperature=float(rng.choice([0.0, 1.0])),
                             ignore_eos=True, seed=i) for i in range(n)]
    arrivals = np.sort(rng.integers(0, 150, n)).tolist()
    aborts = [(f"r{i}", arrivals[i] + int(rng.integers(0, 6))) for i in rng.choice(n, 25, replace=False)]
    got = run_batch(llm, prompts, params, NgramProposer(1, 3), arrivals, aborts)
    assert len(got) >= n - 25
    s = llm.engine.stats()
    assert s["preemptions"] > 0 and s["spec_accepted_tokens"] > 0 and (s["spec_discarded"] > 0) == overlap
    assert_no_leak(llm.engine)


def test_no_compilation_after_warmup():
    llm = LLM(MODEL, load_format="dummy", max_num_seqs=1, max_num_batched_tokens=16, max_model_len=256,
              seq_buckets=(1,), page_buckets=(16,), speculative_method="ngram", num_speculative_tokens=3)
    assert llm.engine.runner.buckets.tokens == (1, 4, 8, 16)  # the batch-1 verify step has its own bucket
    llm.warmup(greedy_only=True)
    before = llm.engine.num_compilations
    prompt = make_prompts(21, 1, low=40, high=41)[0]
    llm.generate([prompt + prompt], greedy(24))
    assert llm.engine.stats()["spec_steps"] > 0 and llm.engine.num_compilations == before


@pytest.mark.parametrize("overlap", [False, True])
def test_seeded_sampling_repeats_with_speculation(overlap):
    prompts = [p + p for p in make_prompts(13, 1, low=20, high=21)]
    params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=3, ignore_eos=True)
    llm = spec_llm(5, speculative_overlap=overlap)
    llm.engine.proposer = NgramProposer(1, 2)
    runs = [[o.outputs[0].token_ids for o in llm.generate(prompts, params)] for _ in range(2)]
    assert runs[0] == runs[1]


# ------------------------------------------------------------------------ sampling exactness


def test_sampling_with_discarded_steps_keeps_the_distribution():
    """Temperature 1, top-k 4, k = 1, steps in flight: a request's first verify step (output index 1,
    proposed from a guess of index 0) is followed by a step dispatched ahead that is discarded whenever
    the proposal is rejected. The tokens at output indices 1-3 over 1000 seeds are distributed as
    without speculation (two-sample chi-square per index, alpha = 0.001 each; other seeds, so the
    two samples are independent)."""
    prompt = make_prompts(51, 1, low=12, high=13)[0]
    n = 1000

    class Greedy:
        """Proposes the greedy continuation of each sequence's own context (guessing its unknown token the
        same way): accepted about as often as the top token's probability."""

        def propose(self, seqs, limits):
            out = []
            for s, k in zip(seqs, limits):
                context, skip = s.assumed_context()
                out.append(run_alone(MODEL, tuple(context), skip + k)[skip:])
            return out

    def sample(llm, seeds):
        params = [SamplingParams(max_tokens=4, temperature=1.0, top_k=4, seed=int(s), ignore_eos=True) for s in seeds]
        return np.asarray([o.outputs[0].token_ids for o in llm.generate([prompt] * n, params, use_tqdm=False)])

    plain = sample(LLM(MODEL, **BASE), range(n))
    llm = spec_llm(1, speculative_overlap=True)
    llm.engine.proposer = Greedy()
    before = llm.engine.stats()
    spec = sample(llm, range(n, 2 * n))
    s = llm.engine.stats()
    assert s["spec_discarded"] - before["spec_discarded"] > n // 2  # 869 of 1000 when written
    assert 0.1 < (s["spec_accepted_tokens"] - before["spec_accepted_tokens"]) / (
        s["spec_proposed_tokens"] - before["spec_proposed_tokens"]) < 0.9
    for j in (1, 2, 3):
        values = np.union1d(plain[:, j], spec[:, j])
        table = [[np.sum(x[:, j] == v) for v in values] for x in (plain, spec)]
        _, pvalue, _, _ = scistats.chi2_contingency(table)
        assert pvalue > 1e-3, (j, table)


def _sampling_batch(rows, temperature=1.0, top_p=1.0, proposals=None):
    return dataclasses.replace(SamplingBatch.greedy(rows, 16), temperature=np.full(rows, temperature, np.float32),
                               top_p=np.full(rows, top_p, np.float32), seed=np.arange(rows, dtype=np.uint32),
                               proposals=proposals)


@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_rejection_sampling_keeps_the_target_distribution(top_p):
    """Rows share one context: the first token and, when the proposal is accepted, the second must
    follow the target's (filtered) distributions at the two positions; chi-square, alpha = 0.001 each."""
    vocab, rows = 8, 40000
    logits = jax.random.normal(jax.random.key(0), (2, vocab)) * 1.5
    b1 = _sampling_batch(1, top_p=top_p)
    target = []
    for j in range(2):
        target.append(np.asarray(_filtered(logits[j:j + 1], b1, lambda m: jax.nn.softmax(m[0])), np.float64))
    # propose the target's second most likely first token, then an arbitrary one
    d0 = int(np.argsort(-target[0])[1])
    proposals = np.tile(np.asarray([[d0, 5]], np.int32), (rows, 1))
    b = _sampling_batch(rows, top_p=top_p, proposals=proposals)
    k1_logits = jnp.broadcast_to(jnp.concatenate([logits, logits[1:]])[None], (rows, 3, vocab))
    res = jax.jit(verify)(k1_logits, b)
    tokens, acc = np.asarray(res.tokens), np.asarray(res.num_accepted)
    first = np.bincount(tokens[:, 0], minlength=vocab)
    second = np.bincount(tokens[acc >= 1, 1], minlength=vocab)
    for counts, p in ((first, target[0]), (second, target[1])):
        assert counts[p == 0].sum() == 0  # nothing outside the filtered support
        support = p > 0
        _, pvalue = scistats.chisquare(counts[support], counts.sum() * p[support] / p[support].sum())
        assert pvalue > 1e-3, (counts, p)
    assert abs((acc >= 1).mean() - target[0][d0]) < 0.01  # accepted with probability p(d)


def test_greedy_verify_accepts_the_matching_prefix():
    logits = jax.nn.one_hot(jnp.asarray([[4, 6, 1, 3]]), 8)  # target argmax per position: 4 6 1 3
    check = jax.jit(functools.partial(verify, greedy_only=True))
    res = check(logits, _sampling_batch(1, temperature=0.0, proposals=np.asarray([[4, 6, 2]], np.int32)))
    assert int(res.num_accepted[0]) == 2 and res.tokens[0].tolist() == [4, 6, 1, -1]  # -1: not emitted
    res = check(logits, _sampling_batch(1, temperature=0.0, proposals=np.asarray([[4, -1, -1]], np.int32)))
    assert int(res.num_accepted[0]) == 1 and res.tokens[0].tolist() == [4, 6, -1, -1]


# -------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("options,match", [
    (dict(speculative_method="medusa"), "speculative_method must be None or one of"),
    (dict(speculative_method="ngram", num_speculative_tokens=0), "num_speculative_tokens"),
    (dict(speculative_method="ngram", num_speculative_tokens=17), r"num_speculative_tokens must be in \[1, 16\]"),
    (dict(speculative_method="ngram", ngram_min=3, ngram_max=2), "ngram_min"),
    (dict(speculative_method="draft"), "speculative_model must be given"),
    (dict(speculative_method="ngram", speculative_model="tiny-llama3"), "speculative_model must be given"),
])
def test_bad_speculative_options(options, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**options)


def test_draft_with_another_vocabulary_is_refused():
    with pytest.raises(ValueError, match="vocabulary of 384 tokens but the target's has 512"):
        LLM(MODEL, **BASE, speculative_method="draft", speculative_model="tiny-llama-tied")


def test_ngram_lookup():
    p = NgramProposer(1, 3)
    assert p.lookup([1, 2, 3, 4, 9, 2, 3], 2) == [4, 9]  # trigram missing, bigram [2, 3] found
    assert p.lookup([5, 1, 7, 1], 3) == [7, 1]  # the latest earlier match; runs out of tokens after it
    assert p.lookup([1, 2, 3], 4) == []
