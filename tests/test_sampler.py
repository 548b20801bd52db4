"""The on-device sampler against direct computations on the same logits."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import sampling
from jaxinfer.sampling import LogitTerms, SamplingBatch, _bisected, _kept, _ordered, _sorted, argmax, sample


def batch(n, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=None, step=0, presence=0.0, frequency=0.0,
          repetition=1.0, terms=()):
    """``terms``: (row, token, count, seen, bias, until) entries (``LogitTerms``), padded to 16."""
    full = lambda v, dt: np.full(n, v, dt)
    seeds = np.arange(n, dtype=np.uint32) if seed is None else full(seed, np.uint32)
    t = LogitTerms.empty(n, 16)
    for i, (row, token, count, seen, bias, until) in enumerate(terms):
        t.rows[i], t.tokens[i], t.counts[i], t.seen[i], t.bias[i], t.until[i] = row, token, count, seen, bias, until
    return SamplingBatch(full(temperature, np.float32), full(top_k, np.int32), full(top_p, np.float32),
                         full(min_p, np.float32), seeds, full(step, np.int32), full(presence, np.float32),
                         full(frequency, np.float32), full(repetition, np.float32), t)


@pytest.fixture(scope="module")
def logits():
    return jax.random.normal(jax.random.key(0), (4, 50), jnp.float32) * 3


def test_greedy_is_argmax(logits):
    out = sample(logits, batch(4, temperature=0.0))
    np.testing.assert_array_equal(out.tokens, np.argmax(logits, -1))


def test_argmax_takes_the_first_maximum_and_a_nan():
    """``argmax`` (two reductions on CPU) equals numpy's argmax: ties go to the first index, a row
    with a NaN gives the NaN's index (never one past the vocabulary; with several NaNs XLA's GPU
    argmax returned the last, so one here), an all -inf row gives 0."""
    x = np.round(np.random.default_rng(0).standard_normal((6, 1000)), 1).astype(np.float32)  # many ties
    x[1, [7, 500]] = 9.0
    x[2, 30] = np.nan
    x[3] = -np.inf
    x[4, -1] = 50.0
    got = jax.jit(argmax)(jnp.asarray(x))
    assert got.dtype == jnp.int32
    np.testing.assert_array_equal(got, np.argmax(x, axis=-1))
    assert list(np.asarray(got)[1:5]) == [7, 30, 0, 999]


@pytest.mark.parametrize("kw", [dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0)])
def test_filters_that_leave_one_token_are_greedy(logits, kw):
    out = sample(logits, batch(4, **kw))
    np.testing.assert_array_equal(out.tokens, np.argmax(logits, -1))


def test_frequencies_match_softmax():
    """Gumbel-max over many seeds draws from softmax(logits / T): compare empirical frequencies."""
    n = 4000
    row = jnp.asarray([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    probs = np.asarray(jax.nn.softmax(row / 0.7))
    out = sample(jnp.tile(row, (n, 1)), batch(n, temperature=0.7))
    freq = np.bincount(np.asarray(out.tokens), minlength=6) / n
    # 4 standard errors of a binomial proportion: fails only if the sampler is biased.
    np.testing.assert_array_less(np.abs(freq - probs), 4 * np.sqrt(probs * (1 - probs) / n) + 1e-3)


def test_top_k_and_top_p_restrict_support():
    n = 2000
    row = jnp.asarray([3.0, 2.9, 2.8, 0.0, -1.0])
    tk = np.asarray(sample(jnp.tile(row, (n, 1)), batch(n, top_k=2)).tokens)
    assert set(tk.tolist()) == {0, 1}
    p = np.asarray(jax.nn.softmax(row))
    # top_p just above the top-2 mass keeps exactly three tokens.
    tp = np.asarray(sample(jnp.tile(row, (n, 1)), batch(n, top_p=float(p[:2].sum()) + 1e-3)).tokens)
    assert set(tp.tolist()) == {0, 1, 2}
    mp = np.asarray(sample(jnp.tile(row, (n, 1)), batch(n, min_p=float(p[2] / p[0]) * 0.99)).tokens)
    assert set(mp.tolist()) == {0, 1, 2}


def _reference_kept(x, top_k, top_p, min_p):
    """What the filters keep, from their definitions, in numpy (float64 masses)."""
    n, vocab = x.shape
    probs = np.asarray(jax.nn.softmax(jnp.asarray(x), axis=-1), np.float64)
    want = np.zeros((n, vocab), bool)
    for r in range(n):
        k = vocab if top_k[r] <= 0 else min(top_k[r], vocab)
        kth = np.sort(x[r])[::-1][k - 1]
        above = np.array([probs[r][x[r] > v].sum() for v in x[r]]) if top_p[r] < 1 else np.zeros(vocab)
        want[r] = (x[r] >= kth) & (above < top_p[r]) & (probs[r] >= min_p[r] * probs[r].max())
    return want, probs


def _consecutive(n: int, rng) -> np.ndarray:
    """``n`` float32 logits one ulp apart, shuffled: their int32 keys are consecutive."""
    return (np.float32(1.0).view(np.int32) + rng.permutation(n)).astype(np.int32).view(np.float32)


def test_filters_keep_the_tokens_at_or_above_their_thresholds():
    """The kept set of each filter, against numpy on the same rows: top-k the tokens at or above the
    k-th largest logit, top-p each token with less than top_p of the mass strictly above it, min-p
    each token of at least min_p times the top probability (ties at a threshold all kept). Both ways
    of finding the thresholds (the CPU's bisection, the other platforms' sort) give that set.
    Random rows mix every filter at and beyond its limits, some with -inf logits (a structured-output
    mask); built rows have ties at the k-th logit, and logits that are consecutive floats (keys one
    apart, where a bisection off by one shows): 3,000 of them, and 8 under every k and every top-p
    between two cumulative masses."""
    rng = np.random.default_rng(0)
    n, vocab = 48, 3000
    x = (rng.standard_normal((n, vocab)) * rng.uniform(0.3, 8, (n, 1))).astype(np.float32)
    x[::5, rng.integers(0, vocab, 500)] = -np.inf
    top_k = rng.choice([-1, 0, 1, 2, 40, vocab - 1, vocab, vocab + 5], n).astype(np.int32)
    top_p = rng.choice([1e-6, 0.1, 0.5, 0.9, 0.95, 0.999, 1.0], n).astype(np.float32)
    min_p = rng.choice([0.0, 0.0, 0.01, 0.2, 1.0], n).astype(np.float32)
    x[0] = rng.permutation(np.repeat(np.arange(30, dtype=np.float32), 100))  # 100 tokens tie at each value
    top_k[0], top_p[0], min_p[0] = 250, 1.0, 0.0  # keeps the three highest values: 300 tokens
    x[1], top_k[1], top_p[1], min_p[1] = _consecutive(vocab, rng), 1234, 1.0, 0.0
    x[2], top_k[2], top_p[2], min_p[2] = _consecutive(vocab, rng), 0, 0.3001, 0.0
    small = np.stack([_consecutive(8, rng) for _ in range(16)])  # near-uniform: cumulative masses ~1/8 apart
    masses = np.cumsum(np.sort(np.asarray(jax.nn.softmax(jnp.asarray(small[0])), np.float64))[::-1])
    cases = [(x, top_k, top_p, min_p),
             (small, np.r_[np.arange(1, 9), np.zeros(8)].astype(np.int32),
              np.r_[np.ones(8), (np.r_[0, masses[:-1]] + masses) / 2].astype(np.float32), np.zeros(16, np.float32))]
    references = [_reference_kept(*case) for case in cases]
    (built, built_probs), (small_want, _) = references
    assert built[0].sum() == 300 and built[1].sum() == 1234  # the built rows are what they are meant to be
    assert 0.3001 <= built_probs[2][built[2]].sum() < 0.3001 + 1.1 / vocab
    assert small_want.sum(1).tolist() == [*range(1, 9), *range(1, 9)]  # the small rows: each k, each top-p
    for (x, top_k, top_p, min_p), (want, probs) in zip(cases, references):
        b = batch(len(x))
        b = dataclasses.replace(b, top_k=top_k, top_p=top_p, min_p=min_p)
        np.testing.assert_array_equal(np.asarray(jax.jit(_kept)(jnp.asarray(x), b)), want)  # this platform's path
        keys, k = _ordered(jnp.asarray(x)), jnp.where(top_k <= 0, len(x[0]), np.minimum(top_k, len(x[0])))
        for thresholds in (_bisected, _sorted):  # both paths, whatever this platform is
            t_k, t_p = jax.jit(thresholds)(keys, jnp.asarray(probs, jnp.float32), k, top_p)
            kept = (keys >= t_k[:, None]) & ((keys >= t_p[:, None]) | (top_p[:, None] >= 1))
            np.testing.assert_array_equal(kept & (probs >= min_p[:, None] * probs.max(-1, keepdims=True)), want,
                                          err_msg=thresholds.__name__)


def test_seed_and_step_determine_the_draw(logits):
    a = sample(logits, batch(4, seed=123, step=5)).tokens
    b = sample(logits[::-1], batch(4, seed=123, step=5)).tokens[::-1]  # rows reordered in the batch
    np.testing.assert_array_equal(a, b)
    draws = {tuple(np.asarray(sample(logits, batch(4, seed=123, step=s)).tokens)) for s in range(8)}
    assert len(draws) > 1


def test_logprobs_are_those_of_the_raw_distribution(logits):
    out = sample(logits, batch(4, temperature=0.5, seed=3), num_logprobs=5)
    lp = np.asarray(jax.nn.log_softmax(logits, -1))
    np.testing.assert_allclose(out.logprobs, lp[np.arange(4), np.asarray(out.tokens)], rtol=1e-6)
    np.testing.assert_array_equal(out.top_tokens, np.argsort(-lp, -1)[:, :5])
    np.testing.assert_allclose(out.top_logprobs, -np.sort(-lp, -1)[:, :5], rtol=1e-6)


def test_logprobs_only_when_asked(logits):
    """``None`` skips the log-softmax; ``0`` still gives the sampled token's own logprob."""
    none = sample(logits, batch(4, temperature=0.0))
    assert none.logprobs is None and none.top_tokens is None
    own = sample(logits, batch(4, temperature=0.0), num_logprobs=0)
    lp = np.asarray(jax.nn.log_softmax(logits, -1))
    np.testing.assert_array_equal(own.tokens, none.tokens)
    np.testing.assert_allclose(own.logprobs, lp.max(-1), rtol=1e-6)
    assert own.top_tokens is None


def test_penalties_push_away_from_generated_tokens():
    row = jnp.asarray([[2.0, 1.9, 0.0, -1.0]])
    plain = sample(row, batch(1, temperature=0.0)).tokens
    assert int(plain[0]) == 0
    pen = batch(1, temperature=0.0, frequency=0.1, terms=[(0, 0, 3.0, 0, 0, 0)])  # 2.0 - 0.3 < 1.9
    assert int(sample(row, pen, logit_terms=True).tokens[0]) == 1
    pres = batch(1, temperature=0.0, presence=0.2, terms=[(0, 0, 1.0, 0, 0, 0)])  # 2.0 - 0.2 < 1.9
    assert int(sample(row, pres, logit_terms=True).tokens[0]) == 1


def _reference_terms(logits, terms, step, rp, presence, frequency):
    """vLLM's definitions, entry by entry in numpy: biases live while step < until; then a seen token's
    positive logit divided by the repetition penalty and a negative one multiplied; frequency per
    count, presence once."""
    x = np.array(logits, np.float64)
    counts, seen = np.zeros_like(x), np.zeros(x.shape, bool)
    for row, token, count, s, bias, until in terms:
        if step[row] < until:
            x[row, token] += bias
        counts[row, token] += count
        seen[row, token] |= s > 0
    x = np.where(seen, np.where(x > 0, x / rp[:, None], x * rp[:, None]), x)
    return x - frequency[:, None] * counts - presence[:, None] * (counts > 0)


def test_logit_terms_match_their_definitions():
    """Every term at once on several rows, duplicates included (two entries of one token add up), and
    a bias past its ``until`` gone: the adjusted logits equal the numpy definitions, and greedy
    sampling picks their argmax."""
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 12)).astype(np.float32) * 2
    terms = [(0, 3, 2.0, 1, 0.0, 0), (0, 3, 0.0, 1, 1.5, 99), (0, 5, 0.0, 1, 0.0, 0), (1, 7, 0.0, 0, -np.inf, 4),
             (1, 2, 0.0, 0, 40.0, 2), (2, 1, 1.0, 1, 0.0, 0), (2, 9, 0.0, 0, -3.0, 10)]
    b = batch(3, temperature=0.0, presence=0.3, frequency=0.2, repetition=1.7, terms=terms)
    b.step = np.asarray([0, 3, 5], np.int32)  # row 1: the bias on token 2 (until 2) is over, -inf on 7 is not
    got = jax.jit(lambda x, sb: sampling._apply_terms(x, sb))(jnp.asarray(logits), b)
    want = _reference_terms(logits, terms, b.step, b.repetition_penalty, b.presence_penalty, b.frequency_penalty)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-6)
    assert np.isneginf(np.asarray(got)[1, 7]) and np.asarray(got)[1, 2] == pytest.approx(logits[1, 2])
    # and the step samples from them: greedy picks are the adjusted argmax
    np.testing.assert_array_equal(sample(jnp.asarray(logits), b, logit_terms=True).tokens, np.argmax(want, -1))


def test_padding_terms_change_nothing():
    """Padding entries carry an out-of-range row: a step with only padding equals one without terms."""
    logits = jax.random.normal(jax.random.key(3), (4, 30)) * 3
    b = batch(4, seed=5, repetition=1.9, presence=1.0, frequency=1.0)
    np.testing.assert_array_equal(sample(logits, b, logit_terms=True).tokens, sample(logits, b).tokens)


@pytest.mark.parametrize("temps", [(0.0, 0.0, 0.0, 0.0), (0.0, 0.8, 0.0, 1.3), (0.7, 0.8, 1.0, 1.3)])
def test_greedy_decided_in_the_step_matches_the_static_flag(logits, temps):
    """``greedy_only=None`` (the CPU's one executable for greedy and sampled steps) draws exactly what
    the static flags draw: all-greedy batches, mixed ones and all-sampled ones."""
    b = batch(4, seed=7, step=3)
    b.temperature = np.asarray(temps, np.float32)
    static = sample(logits, b, greedy_only=all(t == 0 for t in temps)).tokens
    decided = jax.jit(lambda lg, sb: sample(lg, sb, greedy_only=None).tokens)(logits, b)
    np.testing.assert_array_equal(decided, static)
    if all(temps):  # so a step that always took the greedy branch would fail here
        assert not np.array_equal(static, np.argmax(logits, -1))
