"""Oracles shared by the tests, and the one way a test imports a benchmark (importable: pytest puts this
folder on sys.path)."""

import functools
import importlib
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.models.decoder import forward
from jaxinfer.paged.kv_cache import BatchMetadata, KVCache

PAGE_SIZE = 16
BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


def benchmark_module(name: str):
    """``benchmarks/<name>.py``, imported as module ``name`` the way it runs: benchmarks are scripts that
    import each other by plain name (``from ceilings import timeit``), which works because a script's own
    folder is on sys.path, so ``benchmarks/`` is put there (here only)."""
    if BENCHMARKS not in sys.path:
        sys.path.insert(0, BENCHMARKS)
    return importlib.import_module(name)


@functools.partial(jax.jit, static_argnames="config")
def _forward(weights, tokens, positions, cache, md, config):
    return forward(weights, tokens, positions, cache, md, config)[0]


def all_position_logits(config, weights, tokens) -> np.ndarray:
    """Logits ``[T, V]`` of one sequence prefilled in a single step (logits_indices selects every row)."""
    t = len(tokens)
    pages = -(-t // PAGE_SIZE)
    cache = KVCache.zeros(config.num_layers, pages, PAGE_SIZE, config.num_kv_heads, config.head_dim)
    md = BatchMetadata(
        slot_mapping=jnp.arange(t, dtype=jnp.int32), page_table=jnp.arange(pages, dtype=jnp.int32)[None],
        seq_lens=jnp.array([t], jnp.int32), query_start=jnp.array([0, t], jnp.int32),
        logits_indices=jnp.arange(t, dtype=jnp.int32))
    positions = jnp.arange(t, dtype=jnp.int32)
    return np.asarray(_forward(weights, jnp.asarray(tokens, jnp.int32), positions, cache, md, config))
