"""Turns a scheduled batch into bucketed device arrays and runs the compiled step on them.

The step (forward + sampling) is compiled once per bucket of (tokens, sequences, pages per
sequence); the KV cache is donated to it, so each step updates the cache in place.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import itertools
import logging

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from jaxinfer.batching.scheduler import ScheduledBatch
from jaxinfer.models.config import ModelConfig
from jaxinfer.models.llama import Weights, forward
from jaxinfer.paged.kv_cache import BatchMetadata, KVCache
from jaxinfer.sampling import SampleResult, SamplingBatch, sample

log = logging.getLogger(__name__)


def powers_of_two(low: int, high: int) -> tuple[int, ...]:
    """``low, 2*low, ...`` up to and including ``high`` (which is added if not a power of two)."""
    out, b = [], max(1, low)
    while b < high:
        out.append(b)
        b *= 2
    return tuple(out) + (high,)


@dataclasses.dataclass(frozen=True)
class Buckets:
    tokens: tuple[int, ...]
    seqs: tuple[int, ...]
    pages: tuple[int, ...]

    @staticmethod
    def pick(buckets: tuple[int, ...], n: int) -> int:
        i = bisect.bisect_left(buckets, n)
        if i == len(buckets):
            raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")
        return buckets[i]

    def all_shapes(self):
        """Every (tokens, seqs, pages) a step can take: a sequence has at least one token."""
        return [(t, s, p) for t, s, p in itertools.product(self.tokens, self.seqs, self.pages)
                if s <= t or s == self.seqs[0]]


class ModelRunner:
    def __init__(self, config: ModelConfig, weights: Weights, cache: KVCache, buckets: Buckets,
                 attention, max_logprobs: int = 20):
        self.config = config
        self.weights = weights
        self.cache = cache
        self.buckets = buckets
        self.max_logprobs = max_logprobs
        self.num_compilations = 0
        self._attention = attention
        self._step = jax.jit(self._step_fn, static_argnames=("num_logprobs", "penalties"), donate_argnums=(1,))
        self._swap_in = jax.jit(self._swap_in_fn, donate_argnums=(0,))

    def _step_fn(self, weights, cache, tokens, positions, md, sb, *, num_logprobs, penalties):
        self.num_compilations += 1  # runs only while tracing, i.e. once per compiled shape
        log.info("compiling step: tokens=%d seqs=%d pages=%d logprobs=%d penalties=%s", tokens.shape[0],
                 md.page_table.shape[0], md.page_table.shape[1], num_logprobs, penalties)
        logits, cache = forward(weights, tokens, positions, cache, md, self.config, self._attention)
        return sample(logits, sb, num_logprobs=num_logprobs, penalties=penalties), cache

    def prepare(self, batch: ScheduledBatch):
        """Host arrays for one step, padded to the smallest buckets that hold it."""
        ps = self.cache.page_size
        n_real = sum(batch.num_tokens)
        t_pad = Buckets.pick(self.buckets.tokens, n_real)
        s_pad = Buckets.pick(self.buckets.seqs, len(batch))
        p_pad = Buckets.pick(self.buckets.pages, max(len(s.page_table) for s in batch.seqs))

        tokens = np.zeros(t_pad, np.int32)
        positions = np.zeros(t_pad, np.int32)
        slots = np.full(t_pad, self.cache.num_pages * ps, np.int32)  # past the pool: writes dropped
        page_table = np.zeros((s_pad, p_pad), np.int32)
        seq_lens = np.zeros(s_pad, np.int32)
        query_start = np.full(s_pad + 1, n_real, np.int32)
        logits_idx = np.zeros(s_pad, np.int32)
        f32 = functools.partial(np.zeros, s_pad, np.float32)
        temperature, top_p, min_p, presence, frequency = f32(), f32() + 1, f32(), f32(), f32()
        top_k, seeds, steps = np.zeros(s_pad, np.int32), np.zeros(s_pad, np.uint32), np.zeros(s_pad, np.int32)
        pen_rows, pen_tokens, pen_counts = [], [], []

        off = 0
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_tokens)):
            start = seq.num_computed_tokens
            pos = np.arange(start, start + n, dtype=np.int32)
            tokens[off:off + n] = seq.token_ids[start:start + n]
            positions[off:off + n] = pos
            pt = np.asarray(seq.page_table, np.int32)
            slots[off:off + n] = pt[pos // ps] * ps + pos % ps
            page_table[i, :len(pt)] = pt
            seq_lens[i] = start + n
            query_start[i] = off
            logits_idx[i] = off + n - 1
            off += n
            p = seq.params
            temperature[i], top_p[i], top_k[i], min_p[i] = p.temperature, p.top_p, p.top_k, p.min_p
            seeds[i], steps[i] = seq.seed & 0xFFFFFFFF, len(seq.output_token_ids)
            if p.presence_penalty or p.frequency_penalty:
                presence[i], frequency[i] = p.presence_penalty, p.frequency_penalty
                ids, counts = np.unique(np.asarray(seq.output_token_ids, np.int32), return_counts=True)
                pen_rows += [i] * len(ids)
                pen_tokens += ids.tolist()
                pen_counts += counts.tolist()

        k = Buckets.pick(powers_of_two(16, max(16, len(pen_rows))), max(1, len(pen_rows)))
        pad = k - len(pen_rows)
        sb = SamplingBatch(temperature, top_k, top_p, min_p, seeds, steps, presence, frequency,
                           np.asarray(pen_rows + [0] * pad, np.int32), np.asarray(pen_tokens + [0] * pad, np.int32),
                           np.asarray(pen_counts + [0] * pad, np.float32))
        md = BatchMetadata(slots, page_table, seq_lens, query_start, logits_idx)
        want_logprobs = any(s.params.logprobs is not None for s in batch.seqs)
        return tokens, positions, md, sb, (self.max_logprobs if want_logprobs else 0), bool(pen_rows)

    def run(self, batch: ScheduledBatch) -> SampleResult:
        """Dispatch one step; the result stays on device until the caller reads it."""
        tokens, positions, md, sb, num_logprobs, penalties = self.prepare(batch)
        result, self.cache = self._step(self.weights, self.cache, tokens, positions, md, sb,
                                        num_logprobs=num_logprobs, penalties=penalties)
        return result

    def warmup(self, shapes=None) -> None:
        """Compile every bucket ahead of time (greedy, no logprobs, no penalties)."""
        shapes = self.buckets.all_shapes() if shapes is None else shapes
        for t, s, p in tqdm(shapes, desc="compiling buckets", unit="shape"):
            tokens = np.zeros(t, np.int32)
            slots = np.full(t, self.cache.num_pages * self.cache.page_size, np.int32)
            md = BatchMetadata(slots, np.zeros((s, p), np.int32), np.zeros(s, np.int32),
                               np.zeros(s + 1, np.int32), np.zeros(s, np.int32))
            z = np.zeros(s, np.float32)
            sb = SamplingBatch(z, np.zeros(s, np.int32), z + 1, z, np.zeros(s, np.uint32), np.zeros(s, np.int32),
                               z, z, np.zeros(16, np.int32), np.zeros(16, np.int32), np.zeros(16, np.float32))
            result, self.cache = self._step(self.weights, self.cache, tokens, tokens, md, sb,
                                            num_logprobs=0, penalties=False)
        jax.block_until_ready(self.cache)

    def swap_out(self, pages: list[int]):
        """Copy pages to host memory (for swap preemption)."""
        idx = np.asarray(pages, np.int32)
        return np.asarray(self.cache.k[:, idx]), np.asarray(self.cache.v[:, idx])

    @staticmethod
    def _swap_in_fn(cache: KVCache, k, v, idx):
        return KVCache(cache.k.at[:, idx].set(k), cache.v.at[:, idx].set(v))

    def swap_in(self, data, pages: list[int]) -> None:
        k, v = data
        n = k.shape[1]
        if n:
            self.cache = self._swap_in(self.cache, k, v, np.asarray(pages[:n], np.int32))
