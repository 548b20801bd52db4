"""Perplexity of a model on a token sequence: the quality oracle for quantized weights and KV caches.

The sequence runs as one request through the paged cache, a fixed-size chunk of tokens per step
(one compiled shape), every token's logits kept; the mean negative log-likelihood of each next token
is exponentiated. ``score`` also returns each position's negative log-likelihood (so a text's parts
can be scored apart: where a quantization loses) and greedy (argmax) next token, so two runs (say
float and int8 KV) can be compared by how often their greedy choices agree on the same text.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.models.config import ModelConfig
from jaxinfer.models.decoder import forward
from jaxinfer.models.spec import Weights
from jaxinfer.paged.kv_cache import BatchMetadata, KVCache, kv_storage_dtype


@functools.partial(jax.jit, static_argnames=("config",), donate_argnames=("cache",))
def _chunk_nll(weights, tokens, targets, positions, cache, md, config):
    logits, cache = forward(weights, tokens, positions, cache, md, config)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.take_along_axis(logp, targets[:, None], axis=-1)[:, 0], jnp.argmax(logits, axis=-1), cache


@dataclasses.dataclass(frozen=True)
class Score:
    perplexity: float
    greedy: np.ndarray  # int32 [n - 1]: the argmax next token after each prefix ``token_ids[:i + 1]``
    nll: np.ndarray  # float64 [n - 1]: -log p(token_ids[i + 1] | token_ids[:i + 1])


def perplexity(weights: Weights, config: ModelConfig, token_ids, chunk: int = 256, page_size: int = 16,
               kv_cache_dtype: str = "auto") -> float:
    """``exp(mean(-log p(token[i + 1] | token[:i + 1])))`` over ``token_ids`` (at least two)."""
    return score(weights, config, token_ids, chunk, page_size, kv_cache_dtype).perplexity


def score(weights: Weights, config: ModelConfig, token_ids, chunk: int = 256, page_size: int = 16,
          kv_cache_dtype: str = "auto") -> Score:
    """``perplexity`` and the greedy next tokens, with the KV cache stored as ``kv_cache_dtype``
    (``auto``: the weights' dtype; ``int8``/``fp8``: quantized, ``jaxinfer.paged.kv_cache``)."""
    ids = np.asarray(token_ids, np.int32)
    n = len(ids)
    if n < 2:
        raise ValueError(f"perplexity needs at least two tokens, got {n}")
    pages = -(-n // page_size)
    dtype = kv_storage_dtype(kv_cache_dtype, weights.final_norm.dtype)
    cache = KVCache.zeros(config.num_layers, pages, page_size, config.num_kv_heads, config.head_dim, dtype)
    page_table = jnp.arange(pages, dtype=jnp.int32)[None]
    nlls, greedy = [], []
    for start in range(0, n - 1, chunk):
        real = min(chunk, n - 1 - start)  # tokens whose next token is known
        pos = start + np.arange(chunk, dtype=np.int32)
        tokens = np.zeros(chunk, np.int32)
        tokens[:real] = ids[start:start + real]
        targets = np.zeros(chunk, np.int32)
        targets[:real] = ids[start + 1:start + real + 1]
        slots = np.where(np.arange(chunk) < real, pos, pages * page_size).astype(np.int32)
        md = BatchMetadata(slot_mapping=jnp.asarray(slots), page_table=page_table,
                           seq_lens=jnp.asarray([start + real], jnp.int32),
                           query_start=jnp.asarray([0, real], jnp.int32),
                           logits_indices=jnp.arange(chunk, dtype=jnp.int32))
        nll, best, cache = _chunk_nll(weights, jnp.asarray(tokens), jnp.asarray(targets), jnp.asarray(pos), cache, md,
                                config)
        nlls.append(np.asarray(nll, np.float64)[:real])
        greedy.append(np.asarray(best)[:real])
    nll = np.concatenate(nlls)
    return Score(math.exp(nll.mean()), np.concatenate(greedy).astype(np.int32), nll)
