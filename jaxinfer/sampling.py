"""On-device sampling: its own stage after the forward pass, batched with per-row parameters.

Every row carries its own temperature, top-k, top-p, min-p and seed. Randomness is keyed by
``(seed, index of the generated token)``, so a seeded request samples the same tokens whatever
else shares its batch, and again after preemption and recompute.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


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
    # Generated-token counts for penalties as sparse (row, token, count) triples padded with count 0.
    penalty_rows: jax.Array  # i32 [K]
    penalty_tokens: jax.Array  # i32 [K]
    penalty_counts: jax.Array  # f32 [K]

    @staticmethod
    def greedy(rows: int, penalty_slots: int) -> SamplingBatch:
        """Host arrays for ``rows`` greedy rows with every filter and penalty off (warm-up, benchmarks)."""
        z = np.zeros(rows, np.float32)
        return SamplingBatch(z, np.zeros(rows, np.int32), z + 1, z, np.zeros(rows, np.uint32), np.zeros(rows, np.int32),
                             z, z, np.zeros(penalty_slots, np.int32), np.zeros(penalty_slots, np.int32),
                             np.zeros(penalty_slots, np.float32))


@dataclasses.dataclass
class SampleResult:
    tokens: jax.Array  # i32 [S]
    logprobs: jax.Array | None  # f32 [S]: logprob of the sampled token under the model's distribution
    top_tokens: jax.Array | None  # i32 [S, n]
    top_logprobs: jax.Array | None  # f32 [S, n]


jax.tree_util.register_dataclass(SampleResult, data_fields=["tokens", "logprobs", "top_tokens", "top_logprobs"],
                                 meta_fields=[])


def _apply_penalties(logits: jax.Array, b: SamplingBatch) -> jax.Array:
    counts = jnp.zeros_like(logits).at[b.penalty_rows, b.penalty_tokens].add(b.penalty_counts)
    present = (counts > 0).astype(logits.dtype)
    return logits - b.frequency_penalty[:, None] * counts - b.presence_penalty[:, None] * present


def _sample_random(logits: jax.Array, b: SamplingBatch) -> jax.Array:
    """Temperature, then top-k / top-p / min-p filtering on the sorted distribution, then Gumbel-max."""
    vocab = logits.shape[-1]
    temp = jnp.where(b.temperature > 0, b.temperature, 1.0)
    scaled = logits / temp[:, None]
    order = jnp.argsort(-scaled, axis=-1)
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    rank = jnp.arange(vocab)[None, :]
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    keep = (b.top_k[:, None] <= 0) | (rank < b.top_k[:, None])
    before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above this token
    keep &= (before < b.top_p[:, None]) | (rank == 0)
    keep &= probs >= b.min_p[:, None] * probs[:, :1]
    masked = jnp.where(keep, sorted_logits, -jnp.inf)

    def gumbel(seed, step):
        key = jax.random.fold_in(jax.random.key(seed), step)
        return jax.random.gumbel(key, (vocab,), jnp.float32)

    noise = jax.vmap(gumbel)(b.seed, b.step)
    choice = jnp.argmax(masked + noise, axis=-1)
    return jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0]


def apply_bitmask(logits: jax.Array, bitmask: jax.Array) -> jax.Array:
    """Tokens whose bit is clear in ``bitmask [S, ceil(V/32)]`` (int32; bit ``t % 32`` of word
    ``t // 32`` is token t) get -inf: what structured outputs allow (``batching.structured``)."""
    bits = (bitmask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1
    allowed = bits.reshape(bitmask.shape[0], -1)[:, :logits.shape[-1]].astype(bool)
    return jnp.where(allowed, logits, -jnp.inf)


def sample(logits: jax.Array, b: SamplingBatch, *, greedy_only: bool = False, num_logprobs: int | None = None,
           penalties: bool = False, bitmask: jax.Array | None = None) -> SampleResult:
    """Sample one token per row of float32 ``logits [S, V]``.

    The flags are static (the host knows them from the requests), so a step compiles without work it
    does not need: ``greedy_only`` skips the sort over the vocabulary. A traced ``lax.cond`` would do
    the same at run time, but XLA on GPU reads its predicate on the host, which blocks the dispatch
    of the whole step. ``num_logprobs=None`` skips logprobs altogether (the log-softmax is a few
    reduction kernels over the vocabulary, ~1% of an 8B batch-1 step on an H200); otherwise the
    sampled token's logprob and the top ``num_logprobs`` are returned, those of the model's raw
    distribution (as in vLLM/OpenAI). ``bitmask`` (structured outputs) masks the logits before
    anything else; a step without constrained rows passes None and compiles without it.
    """
    logits = logits.astype(jnp.float32)
    adjusted = logits if bitmask is None else apply_bitmask(logits, bitmask)
    adjusted = _apply_penalties(adjusted, b) if penalties else adjusted
    tokens = jnp.argmax(adjusted, axis=-1)
    if not greedy_only:
        tokens = jnp.where(b.temperature == 0, tokens, _sample_random(adjusted, b))
    tokens = tokens.astype(jnp.int32)
    if num_logprobs is None:
        return SampleResult(tokens, None, None, None)
    logprobs_all = jax.nn.log_softmax(logits, axis=-1)
    token_lp = jnp.take_along_axis(logprobs_all, tokens[:, None], axis=-1)[:, 0]
    top_lp = top_ids = None
    if num_logprobs:
        top_lp, top_ids = jax.lax.top_k(logprobs_all, num_logprobs)
        top_ids = top_ids.astype(jnp.int32)
    return SampleResult(tokens, token_lp, top_ids, top_lp)
