"""On-device sampling: its own stage after the forward pass, batched with per-row parameters.

Every row carries its own temperature, top-k, top-p, min-p and seed. Randomness is keyed by
``(seed, index of the generated token)``, so a seeded request samples the same tokens whatever
else shares its batch, and again after preemption and recompute.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LogitTerms:
    """Sparse per-(row, token) terms that adjust the logits before sampling, padded to a power of two
    ``[K]`` (one compiled shape per size). Padding entries carry an out-of-range row, so every scatter
    drops them.

    One entry per distinct (row, token) the step needs: tokens a row generated (``counts``, for
    presence and frequency penalties), tokens of its prompt or output (``seen``, for the repetition
    penalty), and tokens whose logit is shifted (``bias``: ``logit_bias``, and ``-inf`` for the end
    tokens ``min_tokens`` holds back, each applied while the row's ``step < until``)."""

    rows: jax.Array  # i32 [K]; padding: the step's row count (dropped)
    tokens: jax.Array  # i32 [K]
    counts: jax.Array  # f32 [K]: times the row generated the token
    seen: jax.Array  # f32 [K]: 1 where the token is in the row's prompt or output
    bias: jax.Array  # f32 [K]: added to the logit while the row's step < ``until``
    until: jax.Array  # i32 [K]

    @staticmethod
    def empty(rows: int, slots: int) -> LogitTerms:
        """``slots`` padding entries for a step of ``rows`` rows: no term at all."""
        zeros = lambda dtype: np.zeros(slots, dtype)  # noqa: E731 (each its own array: the host fills them)
        return LogitTerms(np.full(slots, rows, np.int32), zeros(np.int32), zeros(np.float32), zeros(np.float32),
                          zeros(np.float32), zeros(np.int32))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplingBatch:
    """Per-row sampling inputs, padded to the step's sequence bucket ``[S]``."""

    temperature: jax.Array  # f32; 0 means greedy
    top_k: jax.Array  # i32; <= 0 disables
    top_p: jax.Array  # f32; 1 disables
    min_p: jax.Array  # f32; 0 disables
    seed: jax.Array  # u32
    step: jax.Array  # i32: how many tokens this request has generated so far
    presence_penalty: jax.Array  # f32
    frequency_penalty: jax.Array  # f32
    repetition_penalty: jax.Array  # f32; 1 disables
    terms: LogitTerms  # read only by steps compiled with ``logit_terms``
    # Speculative steps only: the tokens proposed after each row's last one, padded with -1 (``verify``).
    proposals: jax.Array | None = None  # i32 [S, num_speculative_tokens]

    @staticmethod
    def greedy(rows: int, term_slots: int) -> SamplingBatch:
        """Host arrays for ``rows`` greedy rows with every filter and penalty off (warm-up, benchmarks)."""
        z = np.zeros(rows, np.float32)
        return SamplingBatch(z, np.zeros(rows, np.int32), z + 1, z, np.zeros(rows, np.uint32), np.zeros(rows, np.int32),
                             z, z, z + 1, LogitTerms.empty(rows, term_slots))


@dataclasses.dataclass
class SampleResult:
    tokens: jax.Array  # i32 [S]
    logprobs: jax.Array | None  # f32 [S]: logprob of the sampled token under the model's distribution
    top_tokens: jax.Array | None  # i32 [S, n]
    top_logprobs: jax.Array | None  # f32 [S, n]


jax.tree_util.register_dataclass(SampleResult, data_fields=["tokens", "logprobs", "top_tokens", "top_logprobs"],
                                 meta_fields=[])


def _apply_terms(logits: jax.Array, b: SamplingBatch) -> jax.Array:
    """The logits with each row's bias, then its repetition, frequency and presence penalties (vLLM's
    order and definitions): repetition divides a seen token's positive logit by the penalty and
    multiplies a negative one; frequency subtracts per occurrence in the output, presence once."""
    t = b.terms
    live = b.step[jnp.minimum(t.rows, b.step.shape[0] - 1)] < t.until
    logits = logits.at[t.rows, t.tokens].add(jnp.where(live, t.bias, 0.0), mode="drop")
    counts = jnp.zeros_like(logits).at[t.rows, t.tokens].add(t.counts, mode="drop")
    seen = jnp.zeros_like(logits).at[t.rows, t.tokens].add(t.seen, mode="drop") > 0
    rp = b.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rp, logits * rp), logits)
    present = (counts > 0).astype(logits.dtype)
    return logits - b.frequency_penalty[:, None] * counts - b.presence_penalty[:, None] * present


def _scaled(logits: jax.Array, b: SamplingBatch) -> jax.Array:
    """The logits over each row's temperature (greedy rows, temperature 0, left as they are)."""
    return logits / jnp.where(b.temperature > 0, b.temperature, 1.0)[:, None]


def _ordered(x: jax.Array) -> jax.Array:
    """float32 -> int32 keys in the same order (a float's sign-magnitude bits, negatives flipped), so a
    threshold can be searched for by bisection over integers."""
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    return jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits)


def _midpoint(lo: jax.Array, hi: jax.Array) -> jax.Array:
    return (lo >> 1) + (hi >> 1) + (lo & hi & 1)  # floor((lo + hi) / 2) without overflowing int32


def _bisected(keys, probs, top_k, top_p):
    """``_kept``'s top-k and top-p thresholds (as keys) without sorting: two bisections over the int32
    keys, 32 halvings each (exact), every one a compare and a sum over ``[S, V]``."""
    lo, hi = jnp.min(keys, axis=-1), jnp.max(keys, axis=-1)

    def halve(_, c):
        lo_k, hi_k, lo_p, hi_p = c
        mid = _midpoint(lo_k, hi_k)  # invariant: count(keys >= lo_k) >= k > count(keys >= hi_k)
        ok = jnp.sum(keys >= mid[:, None], axis=-1) >= top_k
        lo_k, hi_k = jnp.where(ok, mid, lo_k), jnp.where(ok, hi_k, mid)
        mid = _midpoint(lo_p, hi_p)  # invariant: mass(keys > lo_p) >= top_p > mass(keys > hi_p)
        ok = jnp.sum(jnp.where(keys > mid[:, None], probs, 0.0), axis=-1) < top_p
        lo_p, hi_p = jnp.where(ok, lo_p, mid), jnp.where(ok, mid, hi_p)
        return lo_k, hi_k, lo_p, hi_p

    lo_k, _, _, hi_p = jax.lax.fori_loop(0, 32, halve, (lo, hi + 1, lo - 1, hi))
    return lo_k, hi_p


def _sorted(keys, probs, top_k, top_p):
    """``_kept``'s top-k and top-p thresholds (as keys) read off the sorted vocabulary (where sorting is
    cheap: GPU, TPU)."""
    keys, probs = jax.lax.sort((-keys - 1, probs), num_keys=1)  # descending keys (-k - 1 cannot overflow)
    keys = -keys - 1
    before = jnp.cumsum(probs, axis=-1)
    before = jnp.concatenate([jnp.zeros_like(before[:, :1]), before[:, :-1]], axis=-1)  # the mass above each rank
    last = jnp.sum(before < top_p[:, None], axis=-1) - 1  # the last rank top-p keeps (rank 0 always)
    take = lambda i: jnp.take_along_axis(keys, i[:, None], axis=-1)[:, 0]  # noqa: E731
    return take(top_k - 1), take(jnp.maximum(last, 0))


def _kept(scaled: jax.Array, b: SamplingBatch) -> jax.Array:
    """Which tokens top-k / top-p / min-p keep, ``[S, V]`` bool in vocabulary order.

    Each filter keeps the tokens whose scaled logit reaches a per-row threshold: top-k the k-th
    largest, top-p the smallest that still has less than ``top_p`` of the probability mass strictly
    above it (so the most likely token always stays), min-p ``min_p`` times the top probability.
    Tokens tied at a threshold are all kept. The top-k / top-p thresholds come from a bisection on
    CPU (XLA:CPU sorted 16 x 49,152 logits in ~280 ms against ~7 ms for a SmolLM2 decode step) and
    from the sorted vocabulary elsewhere: the same thresholds either way."""
    vocab = scaled.shape[-1]
    probs = jax.nn.softmax(scaled, axis=-1)
    keys = _ordered(scaled)
    top_k = jnp.where((b.top_k <= 0) | (b.top_k > vocab), vocab, b.top_k)
    t_k, t_p = jax.lax.platform_dependent(keys, probs, top_k, b.top_p, cpu=_bisected, default=_sorted)
    t_p = jnp.where(b.top_p >= 1.0, jnp.iinfo(jnp.int32).min, t_p)
    keep = (keys >= t_k[:, None]) & (keys >= t_p[:, None])
    return keep & (probs >= b.min_p[:, None] * jnp.max(probs, axis=-1, keepdims=True))


def _filtered(scaled: jax.Array, b: SamplingBatch, use: Callable):
    """``use(masked)``: ``masked`` is ``scaled`` with what top-k / top-p / min-p filter out at ``-inf``.
    Rows that filter nothing (the API's defaults) need no thresholds: on CPU, where XLA evaluates a
    ``lax.cond`` in place, a batch of such rows skips them; elsewhere they are computed anyway (a
    GPU's ``cond`` would read the predicate on the host, blocking the step's dispatch). ``use`` runs
    inside each branch, so it fuses with the masking and the branch returns only its (per-row)
    result: a cond returning the ``[S, V]`` logits cost 6% of a SmolLM2 sampled batch-8 step."""
    plain = ((b.top_k <= 0) | (b.top_k >= scaled.shape[-1])) & (b.top_p >= 1.0) & (b.min_p <= 0.0)
    filtered = lambda: use(jnp.where(_kept(scaled, b), scaled, -jnp.inf))  # noqa: E731
    on_cpu = lambda: jax.lax.cond(jnp.all(plain), lambda: use(scaled), filtered)  # noqa: E731
    return jax.lax.platform_dependent(cpu=on_cpu, default=filtered)


def argmax(x: jax.Array) -> jax.Array:
    """``jnp.argmax(x, axis=-1)`` as int32: the first index of each row's maximum (a NaN's index if the
    row has one: the first on CPU; XLA's GPU argmax returned the last of two). On CPU XLA lowers
    argmax to a reduce over (value, index) pairs that it does not vectorize, which took 1.6 ms of a
    batch-8 SmolLM2 decode step (8 x 49,152 logits; 0.22 ms at batch 1), so there it is a max, then a
    min over the indices that reach it: 0.37 against 1.87 ms alone at 8 rows, the same index (the
    whole decode step: 1.3% faster at batch 1, 3.0% at batch 8, in process). Other platforms keep
    argmax."""
    def two_pass(x):
        m = jnp.max(x, axis=-1, keepdims=True)  # NaN if the row has one: then only isnan matches
        index = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
        return jnp.min(jnp.where((x == m) | jnp.isnan(x), index, x.shape[-1]), axis=-1)

    return jax.lax.platform_dependent(x, cpu=two_pass, default=lambda x: jnp.argmax(x, axis=-1).astype(jnp.int32))


def _row_keys(b: SamplingBatch):
    """One key per row, from ``(seed, index of the generated token)``."""
    return jax.vmap(lambda seed, step: jax.random.fold_in(jax.random.key(seed), step))(b.seed, b.step)


def _gumbel(shape, b: SamplingBatch) -> jax.Array:
    """Gumbel noise ``[S, V]``, keyed per row by ``_row_keys``."""
    return jax.vmap(lambda key: jax.random.gumbel(key, shape[-1:], jnp.float32))(_row_keys(b))


def _gumbel_argmax(masked: jax.Array, b: SamplingBatch) -> jax.Array:
    """A sample from ``softmax(masked)`` per row (Gumbel-max), keyed per row by ``_row_keys``."""
    return argmax(masked + _gumbel(masked.shape, b))


def _sample_random(logits: jax.Array, b: SamplingBatch) -> jax.Array:
    """Temperature, then top-k / top-p / min-p filtering, then Gumbel-max. A row's token depends only on
    its own parameters and key (the noise is indexed by token)."""
    return _filtered(_scaled(logits, b), b, lambda masked: _gumbel_argmax(masked, b))


def apply_bitmask(logits: jax.Array, bitmask: jax.Array) -> jax.Array:
    """Tokens whose bit is clear in ``bitmask [S, ceil(V/32)]`` (int32; bit ``t % 32`` of word
    ``t // 32`` is token t) get -inf: what structured outputs allow (``batching.structured``)."""
    bits = (bitmask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1
    allowed = bits.reshape(bitmask.shape[0], -1)[:, :logits.shape[-1]].astype(bool)
    return jnp.where(allowed, logits, -jnp.inf)


def _unless_all_greedy(greedy_only: bool | None, b: SamplingBatch, greedy, sampled: Callable):
    """``greedy`` if every row is greedy, else ``sampled()``: decided by the static ``greedy_only``, or
    at run time where it is ``None`` (``sample`` says when)."""
    if greedy_only is None:
        return jax.lax.cond(jnp.all(b.temperature == 0), lambda: greedy, sampled)
    return greedy if greedy_only else sampled()


def sample(logits: jax.Array, b: SamplingBatch, *, greedy_only: bool | None = False,
           num_logprobs: int | None = None, logit_terms: bool = False, bitmask: jax.Array | None = None) -> SampleResult:
    """Sample one token per row of float32 ``logits [S, V]``.

    The flags are static (the host knows them from the requests), so a step compiles without work it
    does not need: ``greedy_only`` skips sampling and its filters. ``greedy_only=None`` decides
    that at run time (a ``lax.cond`` on the temperatures), so greedy and sampled steps share one
    executable: what the CPU does (``ModelRunner``), where XLA evaluates the predicate in place; XLA
    on GPU reads it on the host, which blocks the dispatch of the whole step. ``num_logprobs=None``
    skips logprobs altogether (the log-softmax is a few reduction kernels over the vocabulary, ~1% of
    an 8B batch-1 step on an H200); otherwise the sampled token's logprob and the top
    ``num_logprobs`` are returned, those of the model's raw distribution (as in vLLM/OpenAI). ``bitmask`` (structured outputs) masks the logits before
    anything else; a step without constrained rows passes None and compiles without it.
    """
    logits = logits.astype(jnp.float32)
    adjusted = logits if bitmask is None else apply_bitmask(logits, bitmask)
    adjusted = _apply_terms(adjusted, b) if logit_terms else adjusted
    greedy = argmax(adjusted)
    tokens = _unless_all_greedy(greedy_only, b, greedy,
                                lambda: jnp.where(b.temperature == 0, greedy, _sample_random(adjusted, b)))
    tokens = tokens.astype(jnp.int32)
    return SampleResult(tokens, *_logprobs(logits, tokens, num_logprobs))


def _logprobs(logits: jax.Array, tokens: jax.Array, num_logprobs: int | None):
    """``(token logprob [S], top ids [S, n], top logprobs [S, n])`` of the raw ``logits [S, V]``, as
    vLLM/OpenAI report them; ``None`` for what was not asked (``num_logprobs`` None: nothing; 0: no top)."""
    if num_logprobs is None:
        return None, None, None
    logprobs_all = jax.nn.log_softmax(logits, axis=-1)
    token_lp = jnp.take_along_axis(logprobs_all, tokens[:, None], axis=-1)[:, 0]
    top_lp = top_ids = None
    if num_logprobs:
        top_lp, top_ids = jax.lax.top_k(logprobs_all, num_logprobs)
        top_ids = top_ids.astype(jnp.int32)
    return token_lp, top_ids, top_lp


@dataclasses.dataclass
class VerifyResult:
    """A speculative step's outcome per sequence: ``tokens[s, :num_accepted[s] + 1]`` are its new tokens
    (the accepted proposals, then one the target chose itself), and -1 follows them, so the host reads
    the step's outcome from ``tokens`` alone: one copy to wait for, not two (each costs a round trip
    after a synchronous step; ``LLMEngine._read_verified``)."""
    tokens: jax.Array  # i32 [S, K + 1], -1 past the emitted tokens
    num_accepted: jax.Array  # i32 [S]
    logprobs: jax.Array | None  # f32 [S, K + 1]
    top_tokens: jax.Array | None  # i32 [S, K + 1, n]
    top_logprobs: jax.Array | None  # f32 [S, K + 1, n]


jax.tree_util.register_dataclass(VerifyResult, data_fields=["tokens", "num_accepted", "logprobs", "top_tokens",
                                                            "top_logprobs"], meta_fields=[])


def _per_position(b: SamplingBatch, k1: int) -> SamplingBatch:
    """``b`` with each row repeated for the ``k1`` positions a sequence is verified at; position ``j``
    samples the request's ``step + j``-th token, so its randomness is that token's. Logit terms apply
    at position 0 only (a request with any does not speculate: later positions would need the
    proposals counted)."""
    rep = lambda x: jnp.repeat(x, k1)  # noqa: E731
    step = (b.step[:, None] + jnp.arange(k1, dtype=b.step.dtype)[None, :]).reshape(-1)
    terms = dataclasses.replace(b.terms, rows=b.terms.rows * k1)  # padding (row S) lands on S * k1: dropped
    return SamplingBatch(rep(b.temperature), rep(b.top_k), rep(b.top_p), rep(b.min_p), rep(b.seed), step,
                         rep(b.presence_penalty), rep(b.frequency_penalty), rep(b.repetition_penalty), terms)


def verify(logits: jax.Array, b: SamplingBatch, *, greedy_only: bool | None = False,
           num_logprobs: int | None = None, logit_terms: bool = False) -> VerifyResult:
    """Accept a prefix of each row's proposed tokens against the target's ``logits [S, K + 1, V]``.

    ``logits[s, j]`` is the target's distribution after proposal ``j - 1`` (``j = 0``: after the
    sequence's last known token); ``b.proposals [S, K]`` is padded with -1 (never accepted). Greedy
    rows accept the longest prefix equal to the target's argmax. Sampled rows use rejection sampling
    against a point-mass proposal (Leviathan et al. 2023 with ``q = 1`` at the proposed token): accept
    proposal ``d`` with probability ``p(d)`` under the target's filtered distribution ``p``, and on
    rejection sample from ``p`` with ``d`` removed, renormalized; so every emitted token is distributed
    exactly as ``p``. After the accepted prefix one token is always the target's own (the correction
    or, if all were accepted, the next one), so a step emits ``num_accepted + 1`` tokens.
    """
    s, k1, vocab = logits.shape
    k = k1 - 1
    rb = _per_position(b, k1)
    flat = logits.reshape(s * k1, vocab).astype(jnp.float32)
    adjusted = _apply_terms(flat, rb) if logit_terms else flat
    target = argmax(adjusted).reshape(s, k1)
    prop = jnp.concatenate([b.proposals, jnp.full((s, 1), -1, jnp.int32)], axis=1)  # position K: nothing proposed
    accept = prop == target
    accept, tokens = _unless_all_greedy(greedy_only, b, (accept, target),
                                        lambda: _verify_sampled(adjusted, rb, b, prop, accept, target))
    num_accepted = jnp.sum(jnp.cumprod(accept[:, :k].astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)
    per_position = _logprobs(flat, tokens.reshape(-1), num_logprobs)  # positions as rows, then [S, K + 1, ...]
    emitted = jnp.where(jnp.arange(k1)[None, :] <= num_accepted[:, None], tokens, -1)
    return VerifyResult(emitted, num_accepted, *(None if x is None else x.reshape(s, k1, *x.shape[1:])
                                                  for x in per_position))


def _verify_sampled(adjusted, rb: SamplingBatch, b: SamplingBatch, prop, accept, target):
    """``verify``'s acceptance and tokens with sampled rows: rejection sampling (greedy rows as given)."""
    s, k1 = prop.shape
    vocab = adjusted.shape[-1]
    d = prop.reshape(-1)
    proposed = (d >= 0)[:, None] & (jnp.arange(vocab)[None, :] == d[:, None])

    def p_d_and_residual(masked):
        p_d = jnp.sum(jnp.where(proposed, jax.nn.softmax(masked, axis=-1), 0.0), axis=-1)
        return p_d, _gumbel_argmax(jnp.where(proposed, -jnp.inf, masked), rb)  # residual (or plain) sample

    p_d, resampled = _filtered(_scaled(adjusted, rb), rb, p_d_and_residual)
    u = jax.vmap(lambda key: jax.random.uniform(jax.random.fold_in(key, 1)))(_row_keys(rb))
    kept = (d >= 0) & (u < p_d)
    sampled = jnp.where(kept, d, resampled).reshape(s, k1).astype(jnp.int32)
    greedy_row = (b.temperature == 0)[:, None]
    accept = jnp.where(greedy_row, accept, kept.reshape(s, k1))
    tokens = jnp.where(greedy_row, target, sampled)
    return accept, tokens
