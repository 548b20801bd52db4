"""Embeddings: each prompt's final hidden states pooled into one vector, as vLLM's pooling runner
does for decoder embedding models.

Why a pass of its own rather than the generation step: an embedding samples nothing and keeps no
KV. A pass is one prefill of whole prompts, packed as the step packs a batch (ragged tokens, one
page table row per prompt), over a scratch KV cache made for the pass and dropped after it, as
``perplexity`` runs its sequence outside the engine's pool. So the engine's pool, pages and
scheduler are not involved (an embedding never waits for pages or preempts a request) and the
step's compiled shapes are untouched. The model is the one ``decoder.forward``, with ``hidden=True``:
the final norm's output in place of the logits.

The same pass gives prompt logprobs (``token_logprobs``: vLLM's ``prompt_logprobs``): the logits of
every prompt token, each position's log-probability of the token that follows it and its top ``k``.

``pooling``: "last" takes the last prompt token's state (what causal embedding models such as
e5-mistral and gte-Qwen2 are trained for), "mean" the mean over the prompt's tokens. ``normalize``
then divides each vector by its L2 norm (vLLM's ``embed`` task's default; ``F.normalize``'s epsilon).
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.models.config import ModelConfig
from jaxinfer.models.decoder import forward
from jaxinfer.models.layers import Ops
from jaxinfer.models.spec import Weights
from jaxinfer.paged.kv_cache import BatchMetadata, KVCache

log = logging.getLogger(__name__)

POOLING = ("last", "mean")
_EPS = 1e-12  # torch.nn.functional.normalize's: an all-zero vector stays zero


def scratch_pages(num_tokens: int, num_seqs: int, page_size: int) -> int:
    """Pages a pass of ``num_tokens`` tokens in at most ``num_seqs`` prompts can need (each prompt's
    last page is partly empty: at most one page more per prompt than the tokens fill)."""
    return -(-num_tokens // page_size) + num_seqs


def pack(prompts: list[list[int]], num_tokens: int, num_seqs: int, page_size: int, pooling: str):
    """Host inputs of one pass: ``(tokens, positions, md, segments)``, padded to ``num_tokens`` tokens
    and ``num_seqs`` sequences; prompt ``i``'s pages follow prompt ``i - 1``'s in a pool of
    ``scratch_pages`` pages. ``md.logits_indices`` selects each prompt's last token ("last") or every
    token ("mean"); ``segments`` is each token's prompt (``num_seqs`` for padding)."""
    lens = np.asarray([len(p) for p in prompts], np.int32)
    n, real = len(prompts), int(lens.sum())
    assert n <= num_seqs and real <= num_tokens, (n, num_seqs, real, num_tokens)
    num_pages = scratch_pages(num_tokens, num_seqs, page_size)
    per_seq = -(-num_tokens // page_size)
    seq_pages = -(-lens // page_size)
    first_page = np.concatenate([[0], np.cumsum(seq_pages)[:-1]]).astype(np.int32)
    page_table = np.zeros((num_seqs, per_seq), np.int32)
    for i in range(n):
        page_table[i, :seq_pages[i]] = first_page[i] + np.arange(seq_pages[i], dtype=np.int32)
    ends = np.cumsum(lens).astype(np.int32)
    segments = np.full(num_tokens, num_seqs, np.int32)
    segments[:real] = np.repeat(np.arange(n, dtype=np.int32), lens)
    positions = np.zeros(num_tokens, np.int32)
    positions[:real] = np.arange(real, dtype=np.int32) - (ends - lens)[segments[:real]]
    tokens = np.zeros(num_tokens, np.int32)
    tokens[:real] = np.concatenate([np.asarray(p, np.int32) for p in prompts])
    slots = np.full(num_tokens, num_pages * page_size, np.int32)  # past the pool: padding's writes drop
    slots[:real] = (first_page[segments[:real]] * page_size) + positions[:real]
    seq_lens = np.zeros(num_seqs, np.int32)
    seq_lens[:n] = lens
    query_start = np.full(num_seqs + 1, real, np.int32)
    query_start[:n] = ends - lens
    if pooling == "mean":
        rows = np.arange(num_tokens, dtype=np.int32)
    else:
        rows = np.zeros(num_seqs, np.int32)
        rows[:n] = ends - 1
    md = BatchMetadata(slots, page_table, seq_lens, query_start, rows)
    return tokens, positions, md, segments


@functools.partial(jax.jit, static_argnames=("config", "ops", "k"), donate_argnames=("cache",))
def token_logprobs(weights: Weights, cache: KVCache, tokens, positions, md: BatchMetadata, targets, *,
                   config: ModelConfig, ops: Ops, k: int):
    """One pass (``pack``'s inputs with every token's logits, pooling "mean"): per token, the
    log-probability of ``targets`` (the prompt's next token) ``[T]``, its rank ``[T]`` (vLLM's: how
    many tokens are at least as likely, so 1 for the most likely), and the top ``k`` ``([T, k]``
    log-probabilities, ids; None for ``k == 0``), float32 under the model's own distribution; and
    the scratch cache (donated, dropped by the caller)."""
    log.info("compiling prompt logprobs pass: tokens=%d top=%d", tokens.shape[0], k)
    logits, cache = forward(weights, tokens, positions, cache, md, config, ops)
    lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    target = jnp.take_along_axis(lp, targets[:, None], axis=-1)
    rank = jnp.sum(lp >= target, axis=-1, dtype=jnp.int32)
    top = jax.lax.top_k(lp, k) if k else None
    return target[:, 0], rank, top, cache


@functools.partial(jax.jit, static_argnames=("config", "ops", "pooling", "normalize"), donate_argnames=("cache",))
def pooled(weights: Weights, cache: KVCache, tokens, positions, md: BatchMetadata, segments, *, config: ModelConfig,
           ops: Ops, pooling: str, normalize: bool) -> tuple[jax.Array, KVCache]:
    """One pass (``pack``'s inputs): the pooled vectors ``[num_seqs, hidden]`` (float32; padding rows
    zero) and the scratch cache (donated, so its writes happen in place; the caller drops it)."""
    num_seqs = md.seq_lens.shape[0]
    log.info("compiling embedding pass: tokens=%d seqs=%d pooling=%s", tokens.shape[0], num_seqs, pooling)
    x, cache = forward(weights, tokens, positions, cache, md, config, ops, hidden=True)
    if pooling == "mean":
        sums = jax.ops.segment_sum(x, segments, num_segments=num_seqs + 1)[:num_seqs]
        x = sums / jnp.maximum(md.seq_lens, 1).astype(jnp.float32)[:, None]
    x = jnp.where((md.seq_lens > 0)[:, None], x, 0.0)
    if normalize:
        x = x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), _EPS)
    return x, cache
