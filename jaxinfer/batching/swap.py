"""Swap preemption's copies: a request's KV pages to host memory and back into pages of the pool.

Every leaf of the cache travels (a quantized cache's scales with its codes). Copies are padded to a
power-of-two page count so they compile O(log pages) times, not once per count: padding reads page 0
(and is cut off) and writes nowhere (an out-of-pool index, dropped).
"""

from __future__ import annotations

import jax
import numpy as np

from jaxinfer.paged.kv_cache import KVCache


def _padded_pages(pages: list[int], n: int, fill: int) -> np.ndarray:
    """The first ``n`` pages, padded with ``fill`` to a power-of-two length."""
    idx = np.full(1 << max(0, (n - 1).bit_length()), fill, np.int32)
    idx[:n] = pages[:n]
    return idx


def _gather(cache: KVCache, idx):
    return [x[:, idx] for x in jax.tree.leaves(cache)]


def _scatter(cache: KVCache, saved, idx):
    leaves, treedef = jax.tree.flatten(cache)
    return jax.tree.unflatten(treedef, [x.at[:, idx].set(y, mode="drop") for x, y in zip(leaves, saved)])


class Swapper:
    def __init__(self, cache_sharding=None):
        kw = {} if cache_sharding is None else dict(out_shardings=cache_sharding)
        self._gather = jax.jit(_gather)
        self._scatter = jax.jit(_scatter, donate_argnums=(0,), **kw)

    def out(self, cache: KVCache, pages: list[int]) -> list[np.ndarray]:
        """Host copies of ``pages`` of every cache leaf."""
        n = len(pages)
        return [np.asarray(x)[:, :n] for x in self._gather(cache, _padded_pages(pages, n, 0))]

    def into(self, cache: KVCache, data: list[np.ndarray], pages: list[int]) -> KVCache:
        """``cache`` (donated) with ``data`` (``out``'s copies) written into ``pages``."""
        n = data[0].shape[1]
        if not n:
            return cache
        idx = _padded_pages(pages, n, cache.num_pages)  # out of range: dropped
        pad = [(0, 0), (0, len(idx) - n)]
        return self._scatter(cache, [np.pad(x, pad + [(0, 0)] * (x.ndim - 2)) for x in data], idx)
