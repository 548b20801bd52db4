"""Turns a scheduled batch into bucketed device arrays and runs the compiled step on them.

The step (forward + sampling) is compiled once per bucket of (tokens, sequences, pages per
sequence); the KV cache is donated to it, so each step updates the cache in place.

Compiled steps are held in an LRU of at most ``max_executables``: every XLA:CPU executable keeps
its code in memory mappings, and a process that compiled ~400 SmolLM2 step shapes died with
"LLVM ERROR: Unable to allocate section memory" (``vm.max_map_count`` 65530). An evicted step is
dropped together with JAX's own caches, which would otherwise keep it alive.

Warm-up may leave most of its plan to a background thread (``warmup(background=True)``, what the
server does): the steps a single request runs first are compiled before it returns, the rest while
requests are already served. A step whose shape is still being compiled waits for that compilation
rather than starting a second one; the set compiled is the plan either way.
"""

from __future__ import annotations

import bisect
import collections
import concurrent.futures
import dataclasses
import itertools
import logging
import os
import threading

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from jaxinfer.batching import multihost
from jaxinfer.batching.scheduler import ScheduledBatch
from jaxinfer.batching.sequence import SAMPLED
from jaxinfer.batching.structured import bitmask_width
from jaxinfer.models import sharding
from jaxinfer.models.config import ModelConfig
from jaxinfer.models.decoder import forward
from jaxinfer.models.layers import Ops
from jaxinfer.models.spec import Weights
from jaxinfer.paged.kv_cache import BatchMetadata, KVCache, write_kv_layers
from jaxinfer.sampling import SampleResult, SamplingBatch, VerifyResult, sample, verify

log = logging.getLogger(__name__)
_PENALTY_SLOTS = 16  # the smallest bucket of a step's (row, token, count) penalty triples


def geometric(low: int, high: int, factor: int) -> tuple[int, ...]:
    """``low, low*factor, ...`` below ``high``, then ``high``."""
    out, b = [], max(1, min(low, high))
    while b < high:
        out.append(b)
        b *= factor
    return tuple(out) + (high,)


def default_buckets(backend: str, max_tokens: int, max_seqs: int, max_pages: int) -> "Buckets":
    """The bucket set used where none is given.

    CPU: a 1-token bucket for batch-1 decode, an 8-token one for decode batches of 2-8 sequences,
    then 16 tokens and x4 steps; sequences 1, 4, 8, 16, x4...; one page bucket, the longest: the
    reference attention (the CPU's) reads only as much context as the batch's longest sequence fills
    (``paged.attention``), so shorter page buckets saved nothing but compiled a step each
    (docs/benchmarks.md has the step time per bucket). Measured on SmolLM2 (2-core box, under
    load): a step of 2 or 4 tokens cost about what 8 do (168 and 206 ms against 138-165 ms: XLA:CPU's dots for 2-4 rows are
    slow) while 16 tokens cost 335-375 ms, so 8 decodes padded to 16 paid twice over; the 8-token
    bucket made the 8 x (128 + 128) workload faster. SmolLM2's server defaults plan 16 shapes (one
    step each: greedy or not is decided in the step on CPU), not the 624 whose compilation ran out of
    memory maps; the server compiles a single request's first steps before it answers and the rest
    in the background.
    Elsewhere powers of two (tokens from 8, pages from 4): each compile is cheap next to the
    padding it saves on an accelerator."""
    if backend == "cpu":
        tokens = {1, *(b for b in (8,) if b < max_tokens), *geometric(16, max_tokens, 4)} if max_tokens > 1 else {1}
        seqs = {*geometric(1, max_seqs, 4), *(b for b in (8,) if b < max_seqs)}
        return Buckets(tuple(sorted(tokens)), tuple(sorted(seqs)), (max_pages,))
    return Buckets(geometric(min(8, max_tokens), max_tokens, 2), geometric(1, max_seqs, 2),
                   geometric(min(4, max_pages), max_pages, 2))


def _padded_pages(pages: list[int], n: int, fill: int) -> np.ndarray:
    """The first ``n`` pages, padded with ``fill`` to a power-of-two length."""
    idx = np.full(1 << max(0, (n - 1).bit_length()), fill, np.int32)
    idx[:n] = pages[:n]
    return idx


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

    def decode_shapes(self):
        """The (tokens, seqs, pages) a decode-only step (one token per sequence) can take."""
        pairs = {(self.pick(self.tokens, n), self.pick(self.seqs, n)) for n in range(1, self.seqs[-1] + 1)}
        return [(t, s, p) for t, s in sorted(pairs) for p in self.pages]


@dataclasses.dataclass(frozen=True)
class Packing:
    """Static layout of a step's host inputs in their one int32 transfer buffer."""
    treedef: object
    parts: tuple[tuple[tuple[int, ...], str], ...]  # (shape, dtype) of each leaf, in order


def pack_inputs(tree) -> tuple[np.ndarray, Packing]:
    """A step's host arrays (all 4-byte dtypes) as one int32 buffer.

    Each array sent to the device is a copy the step waits for: on an H200 the copies of a batch-1
    step started only once the previous step had finished, ~3 us apart, so six of them put a 25 us
    gap between steps. One buffer is one copy."""
    leaves, treedef = jax.tree.flatten(tree)
    assert all(x.dtype.itemsize == 4 for x in leaves), [x.dtype for x in leaves]
    buf = np.concatenate([np.ascontiguousarray(x).view(np.int32).ravel() for x in leaves])
    return buf, Packing(treedef, tuple((x.shape, x.dtype.str) for x in leaves))


def unpack_inputs(buf: jax.Array, packing: Packing):
    """``pack_inputs`` undone inside the step: slices of the buffer, floats bit-cast back."""
    leaves, offset = [], 0
    for shape, dtype in packing.parts:
        n = int(np.prod(shape))
        x = buf[offset:offset + n].reshape(shape)
        leaves.append(x if np.dtype(dtype) == np.int32 else jax.lax.bitcast_convert_type(x, np.dtype(dtype)))
        offset += n
    return jax.tree.unflatten(packing.treedef, leaves)


class ConstrainedSample:
    """The sampling half of a step with constrained sequences (``ModelRunner.run_forward``).

    ``bitmask`` is the step's token bitmask ``[S, ceil(vocab/32)]`` (int32; bit ``t % 32`` of word
    ``t // 32`` allows token t), a view into the step's one host transfer buffer, which steps of the
    same shape reuse. The caller writes every row (all bits set where unconstrained) and then calls
    this object to dispatch the sampling. Reuse is safe because the engine writes it only after
    reading the tokens of every step dispatched before (their sampling, the buffer's last readers,
    has finished; on CPU the device may read the host buffer in place)."""

    def __init__(self, runner: "ModelRunner", logits, prev_tokens, sb, flags: dict, rows: int):
        self._runner, self._logits, self._prev, self._flags = runner, logits, prev_tokens, flags
        self.rows = rows
        width = bitmask_width(runner.config.vocab_size)
        # pack_inputs((sb, bitmask))'s layout, with the bitmask last: written in place, never copied
        self._head, head = pack_inputs(sb)
        self._packing = Packing(jax.tree.structure((sb, 0)), head.parts + (((rows, width), np.dtype(np.int32).str),))
        self._buf = runner._sample_buffer(self._packing)
        self.bitmask = self._buf[self._head.size:].reshape(rows, width)

    def __call__(self) -> SampleResult:
        self._buf[:self._head.size] = self._head
        args = (self._logits, self._prev, self._buf)
        runner = self._runner
        result, runner.last_tokens = runner._compiled(runner._sample, args, self._packing, self._flags)(*args)
        return result


def _as_last_tokens(tokens: jax.Array, prev_tokens: jax.Array) -> jax.Array:
    """A step's last sampled token per sequence, padded to the largest sequence bucket, where the next
    step reads them."""
    return jnp.zeros_like(prev_tokens).at[:tokens.shape[0]].set(tokens)


class ModelRunner:
    def __init__(self, config: ModelConfig, weights: Weights, cache: KVCache, buckets: Buckets,
                 ops: Ops, max_logprobs: int = 20, mesh=None, max_executables: int = 256, num_scheduler_steps: int = 1):
        self.config = config
        self.num_scheduler_steps = num_scheduler_steps  # decode steps one dispatch may run (``_multi_fn``)
        self.weights = weights
        self.cache = cache
        self.buckets = buckets
        self.max_logprobs = max_logprobs
        self.num_compilations = 0
        self.max_executables = max_executables
        self._sample_buffers: dict[Packing, np.ndarray] = {}  # ConstrainedSample's, by layout
        self._executables: collections.OrderedDict = collections.OrderedDict()  # LRU: key -> compiled step
        self._compiling: dict = {}  # key -> Future of a compilation under way (warm-up's thread or a step)
        self._lock = threading.Lock()  # guards both maps
        self._trace_lock = threading.Lock()  # tracing (Python, GIL-bound anyway) one step at a time
        self._background: threading.Thread | None = None
        self._stop_background = threading.Event()
        self.num_steps = 0  # steps dispatched; a token fed from the device is always from the last one
        self._ops = ops
        self._copy_ahead = jax.default_backend() != "cpu"  # see ``run``
        # On CPU whether a step is greedy is decided inside it (``sampling.sample(greedy_only=None)``):
        # greedy and sampled steps share one executable, which halved the CPU warm-up's compilations
        # at no cost per step (docs/benchmarks.md, issue 22). Elsewhere it is a static flag (so too for
        # GPU kernels lowered on a CPU host, as a test does: ``defer_kv_write`` is the CPU path's).
        self._greedy_in_step = jax.default_backend() == "cpu" and ops.defer_kv_write
        # Decode-only steps compile separately only where the backend has a kernel for them.
        self._decode_max_seqs = ops.decode_attention_max_seqs if ops.decode_attention is not None else 0
        # The last step's sampled tokens, padded to the largest sequence bucket, stay on device:
        # the next step reads its decode inputs from here instead of waiting for the host.
        self.last_tokens = jnp.zeros(buckets.seqs[-1], jnp.int32)
        # Over a mesh (``models.sharding``) the step takes its inputs' shardings (weights and cache
        # as placed, the rest replicated; jit refuses in_shardings with the static keyword flags) and
        # pins its outputs': the cache comes back as it went in, so the next step finds it as
        # compiled for (no recompilation, no resharding).
        step_shardings, swap_shardings, forward_shardings, sample_shardings = {}, {}, {}, {}
        if mesh is not None:
            rep, kv = sharding.replicated(mesh), sharding.cache_sharding(mesh, cache.quantized)
            self.last_tokens = jax.device_put(self.last_tokens, rep)
            step_shardings = dict(out_shardings=(rep, kv, rep))
            swap_shardings = dict(out_shardings=kv)
            forward_shardings, sample_shardings = dict(out_shardings=(rep, kv)), dict(out_shardings=(rep, rep))
        # Over several processes every one runs each step; process 0 sends them (``multihost``).
        self._multihost = mesh is not None and multihost.active()
        if self._multihost and multihost.is_leader():
            multihost.stop_followers_at_exit()
        # XLA's rematerialization pass budgets temporaries against device memory minus the step's
        # inputs; with the KV pool sized to fill memory it saw no room and recomputed the QKV
        # matmul three times per layer (8B batch-1 step on an H200: 5.73 -> 4.71 ms without it).
        # The pool already leaves `1 - kv_cache_memory_fraction` of memory for temporaries.
        # With ``ops.defer_kv_write`` the step only reads the cache and returns the new K/V, which
        # ``_write`` scatters into the donated cache (see ``decoder.forward``).
        self._step = jax.jit(self._step_fn, static_argnames=("packing", "greedy_only", "num_logprobs", "penalties"),
                             donate_argnums=() if ops.defer_kv_write else (1,),
                             compiler_options={"xla_disable_hlo_passes": "rematerialization"}, **step_shardings)
        # A step with constrained sequences (structured outputs) runs as these two, so the host can
        # fill its bitmask while the device runs the forward pass (``run_forward``).
        self._forward = jax.jit(self._forward_fn, static_argnames=("packing",),
                                donate_argnums=() if ops.defer_kv_write else (1,),
                                compiler_options={"xla_disable_hlo_passes": "rematerialization"}, **forward_shardings)
        # Several decode steps in one executable (``num_scheduler_steps``): it writes the cache itself.
        self._multi = jax.jit(self._multi_fn, static_argnames=("packing", "greedy_only", "num_logprobs", "penalties",
                                                               "num_steps"),
                              donate_argnums=(1,), compiler_options={"xla_disable_hlo_passes": "rematerialization"},
                              **step_shardings)
        self._sample = jax.jit(self._sample_fn, static_argnames=("packing", "greedy_only", "num_logprobs", "penalties"),
                               **sample_shardings)
        self._write = jax.jit(write_kv_layers, donate_argnums=(0,), **swap_shardings)
        self._swap_in = jax.jit(self._swap_in_fn, donate_argnums=(0,), **swap_shardings)
        self._gather = jax.jit(self._gather_fn)

    def _step_fn(self, weights, cache, prev_tokens, inputs, *, packing, greedy_only, num_logprobs, penalties):
        self.num_compilations += 1  # runs only while tracing, i.e. once per compiled shape
        tokens, positions, md, sb = unpack_inputs(inputs, packing)
        log.info("compiling step: tokens=%d seqs=%d pages=%d decode_only=%s greedy_only=%s logprobs=%s penalties=%s",
                 tokens.shape[0], md.page_table.shape[0], md.page_table.shape[1], md.decode_only, greedy_only,
                 num_logprobs, penalties)
        logits, cache = self._forward_tokens(weights, cache, prev_tokens, tokens, positions, md)
        kw = dict(greedy_only=greedy_only, num_logprobs=num_logprobs, penalties=penalties)
        if sb.proposals is not None:  # speculative: logits at every proposed position
            s = sb.proposals.shape[0]
            result = verify(logits.reshape(s, -1, logits.shape[-1]), sb, **kw)
            # the last token emitted: the next step's input where every proposal was accepted (where
            # one was not, the host discards what the next step computed for that sequence)
            last = jnp.take_along_axis(result.tokens, result.num_accepted[:, None], axis=1)[:, 0]
            return result, cache, _as_last_tokens(last, prev_tokens)
        result = sample(logits, sb, **kw)
        return result, cache, _as_last_tokens(result.tokens, prev_tokens)

    def _multi_fn(self, weights, cache, prev_tokens, inputs, *, packing, greedy_only, num_logprobs, penalties,
                  num_steps):
        """``num_steps`` decode steps of a decode-only batch in one executable (``num_scheduler_steps``):
        each iteration feeds every sequence one token, writes its K/V into the slot after the last
        (pages the scheduler reserved ahead: ``Scheduler.reserve``), samples the next token (output
        index ``step + i``: the same key as a step of its own would use) and feeds it to the next.
        Returns the tokens (and logprobs, if asked) with a ``num_steps`` axis after the sequences'.
        On a 2-core CPU the host's dispatch, input and output work of a batch-1 SmolLM2 step (~1 ms
        next to ~7.5 ms of step) is then paid once per ``num_steps`` tokens (docs/benchmarks.md,
        issue 22). Not with penalties (their counts would change inside the run)."""
        assert not penalties
        self.num_compilations += 1
        tokens, positions, md, sb = unpack_inputs(inputs, packing)
        log.info("compiling %d-step decode: tokens=%d seqs=%d pages=%d decode_only=%s greedy_only=%s", num_steps,
                 tokens.shape[0], md.page_table.shape[0], md.page_table.shape[1], md.decode_only, greedy_only)
        ps, n = cache.page_size, tokens.shape[0]
        live = md.slot_mapping < cache.num_pages * ps  # real tokens; padding keeps its dropped slot
        row = jnp.minimum(jnp.arange(n), md.page_table.shape[0] - 1)  # decode-only: token j is sequence j's
        fed = -1 - jnp.minimum(jnp.arange(n, dtype=jnp.int32), prev_tokens.shape[0] - 1)  # "row j's last sample"

        def one(i, carry):
            cache, prev, out = carry
            pos = positions + i
            slots = jnp.where(live, md.page_table[row, pos // ps] * ps + pos % ps, md.slot_mapping)
            md_i = dataclasses.replace(md, slot_mapping=slots, seq_lens=jnp.where(md.seq_lens > 0, md.seq_lens + i, 0))
            logits, new = self._forward_tokens(weights, cache, prev, jnp.where(i == 0, tokens, fed), pos, md_i)
            if self._ops.defer_kv_write:  # in place with the layers looped (not unrolled: the engine checks)
                new = write_kv_layers(cache, *new, slots)
            result = sample(logits, dataclasses.replace(sb, step=sb.step + i), greedy_only=greedy_only,
                            num_logprobs=num_logprobs)
            out = jax.tree.map(lambda o, r: o.at[:, i].set(r), out, result)
            return new, _as_last_tokens(result.tokens, prev), out

        rows = md.page_table.shape[0]
        out = jax.tree.map(lambda x: jnp.zeros((x.shape[0], num_steps, *x.shape[1:]), x.dtype),
                           jax.eval_shape(lambda: sample(jnp.zeros((rows, self.config.vocab_size)), sb,
                                                         greedy_only=True, num_logprobs=num_logprobs)))
        cache, last, out = jax.lax.fori_loop(0, num_steps, one, (cache, prev_tokens, out))
        return out, cache, last

    def _forward_tokens(self, weights, cache, prev_tokens, tokens, positions, md):
        tokens = jnp.where(tokens < 0, prev_tokens[-tokens - 1], tokens)  # -1 - row: sampled by the last step
        return forward(weights, tokens, positions, cache, md, self.config, self._ops)

    def _forward_fn(self, weights, cache, prev_tokens, inputs, *, packing):
        self.num_compilations += 1
        tokens, positions, md = unpack_inputs(inputs, packing)
        log.info("compiling forward: tokens=%d seqs=%d pages=%d decode_only=%s", tokens.shape[0],
                 md.page_table.shape[0], md.page_table.shape[1], md.decode_only)
        return self._forward_tokens(weights, cache, prev_tokens, tokens, positions, md)

    def _sample_fn(self, logits, prev_tokens, inputs, *, packing, greedy_only, num_logprobs, penalties):
        self.num_compilations += 1
        sb, bitmask = unpack_inputs(inputs, packing)
        result = sample(logits, sb, greedy_only=greedy_only, num_logprobs=num_logprobs, penalties=penalties,
                        bitmask=bitmask)
        return result, _as_last_tokens(result.tokens, prev_tokens)

    def prepare(self, batch: ScheduledBatch, num_speculative: int = 0):
        """Host arrays for one step, padded to the smallest buckets that hold it (vectorized over
        sequences: this runs every step and must stay small next to the device step).

        ``num_speculative > 0``: a verifying step; each sequence's proposals (``draft_token_ids``, at
        most ``num_speculative``) follow its last token and logits are taken at all of those positions,
        ``num_speculative + 1`` rows per sequence (a fixed count, so speculation adds one compiled
        variant per bucket, not one per proposal length)."""
        ps = self.cache.page_size
        seqs, counts = batch.seqs, np.asarray(batch.num_tokens, np.int32)
        n_seqs, n_real = len(seqs), int(counts.sum())
        t_pad = Buckets.pick(self.buckets.tokens, n_real)
        s_pad = Buckets.pick(self.buckets.seqs, n_seqs)
        p_pad = Buckets.pick(self.buckets.pages, max(len(s.page_table) for s in seqs))

        starts = np.fromiter((s.num_computed_tokens for s in seqs), np.int32, n_seqs)
        offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
        page_table = np.zeros((s_pad, p_pad), np.int32)
        for i, s in enumerate(seqs):
            page_table[i, :len(s.page_table)] = s.page_table
        seq_of = np.repeat(np.arange(n_seqs, dtype=np.int32), counts)
        pos = starts[seq_of] + np.arange(n_real, dtype=np.int32) - offsets[:-1][seq_of]

        tokens = np.zeros(t_pad, np.int32)
        ids = []
        for s, st, n in zip(seqs, starts.tolist(), counts.tolist()):
            fed = s.step_inputs(st, n)
            if SAMPLED in fed:  # the token the last step sampled, still on device
                j = fed.index(SAMPLED)
                assert st + j == s.num_tokens - 1 and s.pending_step == self.num_steps - 1
                fed[j] = -1 - s.pending_row
            ids += fed
        tokens[:n_real] = ids
        positions = np.zeros(t_pad, np.int32)
        positions[:n_real] = pos
        slots = np.full(t_pad, self.cache.num_pages * ps, np.int32)  # past the pool: writes dropped
        slots[:n_real] = page_table[seq_of, pos // ps] * ps + pos % ps
        seq_lens = np.zeros(s_pad, np.int32)
        seq_lens[:n_seqs] = starts + counts
        query_start = np.full(s_pad + 1, n_real, np.int32)
        query_start[:n_seqs] = offsets[:-1]
        logits_idx = np.zeros(s_pad, np.int32)
        logits_idx[:n_seqs] = offsets[1:] - 1
        proposals = None
        if num_speculative:
            # Rows j = 0..K of sequence i: its last known token's position, then each proposal's
            # (clamped to its last fed token where it proposed fewer; those rows go unused).
            k1 = num_speculative + 1
            num_props = np.fromiter((len(s.draft_token_ids) for s in seqs), np.int32, n_seqs)
            first = offsets[1:] - 1 - num_props
            rows = np.minimum(first[:, None] + np.arange(k1, dtype=np.int32)[None], (offsets[1:] - 1)[:, None])
            logits_idx = np.zeros((s_pad, k1), np.int32)
            logits_idx[:n_seqs] = rows
            logits_idx = logits_idx.reshape(-1)
            proposals = np.full((s_pad, num_speculative), -1, np.int32)
            for i, s in enumerate(seqs):
                proposals[i, :len(s.draft_token_ids)] = s.draft_token_ids
        md = BatchMetadata(slots, page_table, seq_lens, query_start, logits_idx,
                           decode_only=n_real == n_seqs and s_pad <= self._decode_max_seqs)

        def column(values, dtype, fill=0):
            out = np.full(s_pad, fill, dtype)
            out[:n_seqs] = values
            return out

        params = [s.params for s in seqs]
        pen_rows, pen_tokens, pen_counts = [], [], []
        for i, (s, p) in enumerate(zip(seqs, params)):
            if p.presence_penalty or p.frequency_penalty:
                ids, c = np.unique(np.asarray(s.output_token_ids, np.int32), return_counts=True)
                pen_rows += [i] * len(ids)
                pen_tokens += ids.tolist()
                pen_counts += c.tolist()
        k = Buckets.pick(geometric(_PENALTY_SLOTS, max(_PENALTY_SLOTS, len(pen_rows)), 2), max(1, len(pen_rows)))
        pad = [0] * (k - len(pen_rows))
        sb = SamplingBatch(
            temperature=column([p.temperature for p in params], np.float32),
            top_k=column([p.top_k for p in params], np.int32),
            top_p=column([p.top_p for p in params], np.float32, 1.0),
            min_p=column([p.min_p for p in params], np.float32),
            seed=column([s.seed & 0xFFFFFFFF for s in seqs], np.uint32),
            step=column([len(s.output_token_ids) + len(s.inflight) for s in seqs], np.int32),
            presence_penalty=column([p.presence_penalty for p in params], np.float32),
            frequency_penalty=column([p.frequency_penalty for p in params], np.float32),
            penalty_rows=np.asarray(pen_rows + pad, np.int32), penalty_tokens=np.asarray(pen_tokens + pad, np.int32),
            penalty_counts=np.asarray(pen_counts + pad, np.float32), proposals=proposals)
        flags = self.step_flags(all(p.temperature == 0 for p in params),
                                self.max_logprobs if any(p.logprobs is not None for p in params) else None,
                                bool(pen_rows))
        return tokens, positions, md, sb, flags

    def step_flags(self, greedy: bool, num_logprobs: int | None = None, penalties: bool = False) -> dict:
        """The static flags a step compiles for: whether every row is greedy (``None`` on CPU, where
        the step decides), the logprobs it returns and whether it applies penalties."""
        return dict(greedy_only=None if self._greedy_in_step else greedy, num_logprobs=num_logprobs,
                    penalties=penalties)

    def execute(self, tokens, positions, md: BatchMetadata, sb: SamplingBatch, flags: dict, feeds_next: bool = False,
                num_steps: int = 1):
        """The compiled step on ``prepare``'s arrays: ``(result, cache, last_tokens)``, not yet stored
        (``feeds_next``: whether they will be, which followers of a multi-process run mirror);
        ``num_steps > 1``: that many decode steps at once (``_multi_fn``; one process only), or one
        while a background warm-up has yet to compile them (the tokens then have no steps axis)."""
        inputs, packing = pack_inputs((tokens, positions, md, sb))
        if num_steps > 1:
            assert not self._multihost
            args = (self.weights, self.cache, self.last_tokens, inputs)
            # While a background warm-up runs, a multi-step decode it has not compiled yet runs as one
            # step rather than wait (a server's first requests; ``first_steps`` leaves them out).
            warming = self._background is not None and self._background.is_alive()
            multi = self._compiled(self._multi, args, packing, dict(flags, num_steps=num_steps), only_if_ready=warming)
            if multi is not None:
                return multi(*args)
        if self._multihost:
            shape = (tokens.shape[0], *md.page_table.shape, sb.penalty_rows.shape[0])
            multihost.send_step(inputs, shape, md.decode_only, flags, feeds_next)
        result, cache, last = self._compiled(self._step, (self.weights, self.cache, self.last_tokens, inputs), packing,
                                             flags)(self.weights, self.cache, self.last_tokens, inputs)
        if self._ops.defer_kv_write:
            cache = self._write(self.cache, *cache, md.slot_mapping)
        return result, cache, last

    @property
    def num_executables(self) -> int:
        return len(self._executables)

    def _compiled(self, fn, args, packing: Packing, flags: dict, only_if_ready: bool = False):
        """``fn`` (the step, or a constrained step's forward or sampling half) compiled for these
        arguments' layout and these flags: from the LRU, from a compilation already under way in
        another thread (waited for), or compiled now (through the persistent compilation cache when
        one is set), evicting the least recently used; ``only_if_ready``: from the LRU or None.
        Thread-safe: warm-up's background thread and the engine's steps both come here."""
        key = (fn, packing, tuple(sorted(flags.items())))
        with self._lock:
            exe = self._executables.get(key)
            if exe is not None:
                self._executables.move_to_end(key)
                return exe
            if only_if_ready:
                return None
            pending = self._compiling.get(key)
            if pending is None:
                pending = self._compiling[key] = concurrent.futures.Future()
                owner = True
            else:
                owner = False
        if not owner:
            return pending.result()
        try:
            with self._trace_lock:
                lowered = fn.lower(*args, packing=packing, **flags)
            exe = lowered.compile()  # XLA releases the GIL: steps run meanwhile
        except BaseException as e:
            with self._lock:
                del self._compiling[key]
            pending.set_exception(e)
            raise
        with self._lock:
            del self._compiling[key]
            self._executables[key] = exe
            evict = len(self._executables) > self.max_executables
            if evict:
                self._executables.popitem(last=False)
        if evict:
            jax.clear_caches()  # JAX's compilation caches hold a reference to every executable
        pending.set_result(exe)
        return exe

    def run(self, batch: ScheduledBatch, num_speculative: int = 0, num_steps: int = 1) -> SampleResult | VerifyResult:
        """Dispatch one step; the result stays on device until the caller reads it. Its last sampled
        tokens (a verifying step's, ``num_speculative``: each sequence's last emitted token) become
        ``last_tokens``, which the next step's in-flight inputs read. ``num_steps > 1``: that many
        decode steps of a decode-only batch at once (``_multi_fn``), tokens ``[S, num_steps]``.

        On an accelerator the copy of the sampled tokens (a verifying step's outcome too:
        ``VerifyResult.tokens``) to the host is queued now, behind the step, so the host finds them
        there once the step ends: on an H200 a copy started only when the host asked for it took
        ~0.3-0.45 ms per array after the step had finished, time a synchronous (speculating) step added
        to every step (docs/benchmarks.md). Not on CPU, where the array is already in host memory and
        queuing the copy cost ~75 us of host time per call."""
        result, self.cache, self.last_tokens = self.execute(*self.prepare(batch, num_speculative), feeds_next=True,
                                                            num_steps=num_steps)
        self.num_steps += 1
        if self._multihost:
            result = multihost.local_view(result)
        if self._copy_ahead:
            result.tokens.copy_to_host_async()
        return result

    def run_forward(self, batch: ScheduledBatch) -> ConstrainedSample:
        """Dispatch one step's forward pass only; returns its sampling half, dispatched once the host
        has written the step's token bitmask. Used by steps with constrained sequences: the host fills
        the bitmask while the device runs the forward pass (one process only: the engine refuses
        constrained requests over several)."""
        tokens, positions, md, sb, flags = self.prepare(batch)
        inputs, packing = pack_inputs((tokens, positions, md))
        args = (self.weights, self.cache, self.last_tokens, inputs)
        logits, cache = self._compiled(self._forward, args, packing, {})(*args)
        if self._ops.defer_kv_write:
            cache = self._write(self.cache, *cache, md.slot_mapping)
        self.cache = cache
        self.num_steps += 1
        return ConstrainedSample(self, logits, self.last_tokens, sb, flags, md.page_table.shape[0])

    def _sample_buffer(self, packing: Packing) -> np.ndarray:
        """The host transfer buffer of a sampling half with this layout, made once and reused: a new
        one per step cost a 1.5 MB fill and a 1.5 MB copy at 256 sequences (``ConstrainedSample``)."""
        buf = self._sample_buffers.get(packing)
        if buf is None:
            buf = self._sample_buffers[packing] = np.empty(sum(int(np.prod(s)) for s, _ in packing.parts), np.int32)
        return buf

    def follow(self) -> None:
        """A follower process of a multi-process run: run the steps process 0 sends until it stops."""
        while (step := multihost.receive_step()) is not None:
            inputs, (t, s, p, k), decode_only, flags, feeds_next = step
            md = BatchMetadata(np.zeros(t, np.int32), np.zeros((s, p), np.int32), np.zeros(s, np.int32),
                               np.zeros(s + 1, np.int32), np.zeros(s, np.int32), decode_only=decode_only)
            _, packing = pack_inputs((md.slot_mapping, md.slot_mapping, md, SamplingBatch.greedy(s, k)))
            args = (self.weights, self.cache, self.last_tokens, inputs)
            _, self.cache, last = self._compiled(self._step, args, packing, flags)(*args)
            if feeds_next:
                self.last_tokens = last

    def warmup_plan(self, shapes=None,
                    greedy_only: bool = False) -> list[tuple[tuple[int, int, int], bool, bool | None, int]]:
        """The steps ``warmup`` compiles: ``((tokens, seqs, pages), decode_only, greedy_only, steps)`` for
        every bucket, greedy and (unless ``greedy_only``) sampled, or on CPU one step that does both
        (``None``); the decode-only variant of the shapes a decode-only step can take; and with
        ``num_scheduler_steps > 1`` the multi-step decode (``steps``; else 1) of the shapes a batch of
        decodes takes (logprobs and penalties compile on first use)."""
        shapes = self.buckets.all_shapes() if shapes is None else shapes
        decode = {x for x in self.buckets.decode_shapes() if x[1] <= self._decode_max_seqs}
        steps = [(x, False) for x in shapes] + [(x, True) for x in shapes if x in decode]
        variants = (None,) if self._greedy_in_step else (True,) if greedy_only else (True, False)
        plan = [(x, d, g, 1) for x, d in steps for g in variants]
        if self.num_scheduler_steps > 1:  # a batch of decodes is decode-only where the backend has the kernel
            decodes = set(self.buckets.decode_shapes())
            plan += [(x, d, g, self.num_scheduler_steps) for x, d, g, _ in plan
                     if x in decodes and d == (x[1] <= self._decode_max_seqs)]
        return plan

    def warmup(self, shapes=None, greedy_only: bool = False, structured: bool = False,
               num_speculative: int = 0, background: bool = False) -> None:
        """Compile every step of ``warmup_plan`` ahead of time, without running any; ``structured``:
        also the forward and sampling halves that steps with constrained sequences run as;
        ``num_speculative``: also each step's verifying variant (``prepare(batch, num_speculative)``).

        ``background``: compile only ``first_steps`` now and the rest of the plan in a daemon thread
        (``wait_warmup`` joins it), so a server can answer while most shapes still compile: compiling
        every step was nearly all of the SmolLM2 server's start-up on the 2-core CPU (40 steps: 47 s
        from an empty compilation cache, 15 s from a filled one; docs/benchmarks.md, issue 22)."""
        plan = self.warmup_plan(shapes, greedy_only)
        single = [x for x in plan if x[3] == 1]  # the steps that have verifying and constrained variants
        count = len(plan) + (len(single) if num_speculative else 0) + (
            len({(x, d) for x, d, _, _ in single}) + len({(x[1], g) for x, _, g, _ in single}) if structured else 0)
        if count > self.max_executables:
            raise ValueError(f"warm-up would compile {count} steps but max_executables is "
                             f"{self.max_executables}: raise it or use fewer buckets")
        first = set(self.first_steps(plan)) if background else set(plan)
        # Shapes, not the arrays: steps replace (and may donate) the cache while the thread compiles.
        state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                             (self.cache, self.last_tokens))
        now = [x for x in plan if x in first]
        # XLA compiles one executable on one core: the steps are compiled side by side, a thread per core.
        with concurrent.futures.ThreadPoolExecutor(max(1, min(len(now), os.cpu_count() or 1))) as pool:
            list(tqdm(pool.map(lambda x: self._warm_step(x, state, structured, num_speculative), now),
                      total=len(now), desc="compiling buckets", unit="step"))
        if self._ops.defer_kv_write:  # the cache write of each token bucket: run, since its slots drop it
            c = self.config
            for t in sorted({t for (t, _, _), _, _, _ in plan}):
                new = jnp.zeros((c.num_layers, t, c.num_kv_heads, c.head_dim), self.cache.write_dtype)
                self.cache = self._write(self.cache, new, new, np.full(t, self.cache.num_pages * self.cache.page_size,
                                                                          np.int32))
        rest = sorted((x for x in plan if x not in first),
                      key=lambda x: (x[0][1], x[0][2], x[0][0], x[1], x[2] is False, x[3]))
        if rest:
            def compile_rest():
                for step in rest:
                    if self._stop_background.is_set():
                        return
                    try:
                        self._warm_step(step, state, structured, num_speculative)
                    except Exception:  # noqa: BLE001 - the step compiles on first use instead
                        log.exception("background compilation of %s failed", step)
                log.info("background warm-up done: %d more steps", len(rest))

            self._background = threading.Thread(target=compile_rest, name="warmup", daemon=True)
            self._background.start()

    def wait_warmup(self, stop: bool = False) -> None:
        """Return once a background warm-up (``warmup(background=True)``) has compiled its steps;
        ``stop``: once it has finished the step it is compiling, leaving the rest. A process must
        not exit while the thread is inside XLA (it aborts: "terminate called after throwing")."""
        if stop:
            self._stop_background.set()
        if self._background is not None:
            self._background.join()

    def first_steps(self, plan):
        """The steps of ``plan`` a single request meets first: one sequence at the smallest page
        bucket, decoding (the smallest token bucket) or prefilling at the token budget (the largest),
        greedy and sampled, one step at a time (a multi-step decode not yet compiled runs as single
        steps: ``execute``). What a background warm-up compiles before it returns."""
        b = self.buckets
        return [x for x in plan if x[0][1:] == (b.seqs[0], b.pages[0]) and x[0][0] in (b.tokens[0], b.tokens[-1])
                and x[3] == 1]

    def _warm_step(self, step, state, structured: bool, num_speculative: int) -> None:
        """Compile one step of ``warmup_plan`` (and, for a single step, its verifying and constrained
        variants if asked) for ``state``, the cache's and last tokens' shapes."""
        (t, s, p), decode_only, greedy, steps = step
        tokens = np.zeros(t, np.int32)
        slots = np.full(t, self.cache.num_pages * self.cache.page_size, np.int32)
        md = BatchMetadata(slots, np.zeros((s, p), np.int32), np.zeros(s, np.int32),
                           np.zeros(s + 1, np.int32), np.zeros(s, np.int32), decode_only=decode_only)
        sb, flags = SamplingBatch.greedy(s, _PENALTY_SLOTS), dict(greedy_only=greedy, num_logprobs=None,
                                                                   penalties=False)
        weights, (cache, last) = self.weights, state
        inputs, packing = pack_inputs((tokens, tokens, md, sb))
        if steps > 1:
            self._compiled(self._multi, (weights, cache, last, inputs), packing, dict(flags, num_steps=steps))
            return
        self._compiled(self._step, (weights, cache, last, inputs), packing, flags)
        if num_speculative:
            md_v = dataclasses.replace(md, logits_indices=np.zeros(s * (num_speculative + 1), np.int32))
            sb_v = dataclasses.replace(sb, proposals=np.full((s, num_speculative), -1, np.int32))
            inputs, packing = pack_inputs((tokens, tokens, md_v, sb_v))
            self._compiled(self._step, (weights, cache, last, inputs), packing, flags)
        if structured:
            inputs, packing = pack_inputs((tokens, tokens, md))
            forward = self._compiled(self._forward, (weights, cache, last, inputs), packing, {})
            inputs, packing = pack_inputs((sb, np.zeros((s, bitmask_width(self.config.vocab_size)), np.int32)))
            self._compiled(self._sample, (forward.out_info[0], last, inputs), packing, flags)

    # Swap copies are padded to a power-of-two page count so they compile O(log pages) times, not
    # once per count. Padding reads page 0 (and is cut off) and writes nowhere (dropped index).

    def swap_out(self, pages: list[int]):
        """Copy pages to host memory (for swap preemption): every leaf of the cache (a quantized one's
        scales travel with its codes)."""
        n = len(pages)
        return [np.asarray(x)[:, :n] for x in self._gather(self.cache, _padded_pages(pages, n, 0))]

    @staticmethod
    def _gather_fn(cache: KVCache, idx):
        return [x[:, idx] for x in jax.tree.leaves(cache)]

    @staticmethod
    def _swap_in_fn(cache: KVCache, saved, idx):
        leaves, treedef = jax.tree.flatten(cache)
        return jax.tree.unflatten(treedef, [x.at[:, idx].set(y, mode="drop") for x, y in zip(leaves, saved)])

    def swap_in(self, data, pages: list[int]) -> None:
        n = data[0].shape[1]
        if n:
            idx = _padded_pages(pages, n, self.cache.num_pages)  # out of range: dropped
            pad = [(0, 0), (0, len(idx) - n)]
            self.cache = self._swap_in(self.cache, [np.pad(x, pad + [(0, 0)] * (x.ndim - 2)) for x in data], idx)
