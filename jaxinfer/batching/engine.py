"""The engine loop: processor -> scheduler -> KV cache manager -> model runner -> output processor.

``add_request`` tokenizes and validates; each ``step`` schedules one iteration, runs one compiled
step on device, and turns sampled tokens into incremental outputs (detokenized text, stop checks).
All host state lives here and in the scheduler; the model and the cache are pure device pytrees.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from typing import Sequence as Seq

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.batching import multihost
from jaxinfer.batching.config import EngineConfig, default_compilation_cache_dir
from jaxinfer.batching.model_runner import Buckets, ModelRunner, default_buckets
from jaxinfer.batching.structured import Matchers, bitmask_width, compiler_for
from jaxinfer.batching.scheduler import Scheduler, SchedulerConfig
from jaxinfer.batching.sequence import Sequence, Status
from jaxinfer.models import sharding
from jaxinfer.models.layers import Ops
from jaxinfer.models.weights import load_config, load_model, resolve_model
from jaxinfer.paged.block_manager import BlockManager
from jaxinfer.paged.kv_cache import KVCache
from jaxinfer.pallas_kernels import get_kernels
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.tokenizer import IncrementalDetokenizer, load_tokenizer

log = logging.getLogger(__name__)


@dataclasses.dataclass
class RequestOutput:
    """A request's state after a step: the whole text so far plus what is new since the last one."""

    request_id: str
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    delta_text: str = ""
    delta_token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    num_cached_tokens: int = 0


@dataclasses.dataclass
class _Tracker:
    """Output-side state of one request: detokenizer, emitted text, stop-string hold-back."""

    detok: IncrementalDetokenizer | None
    text: str = ""
    emitted: int = 0  # characters of `text` already reported
    emitted_tokens: int = 0


def encode_prompt(prompt: str | Seq[int], tokenizer, vocab_size: int, max_model_len: int) -> list[int]:
    """Token ids of a prompt (text or ids), checked against the vocabulary and ``max_model_len``.

    A free function so that a front end in another process (the server's) validates prompts exactly
    as the engine does, without holding the engine.
    """
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt must not be empty")
        if tokenizer is None:
            raise ValueError("this model has no tokenizer (dummy weights): pass prompts as token ids")
        ids = list(tokenizer.encode(prompt))
    else:
        ids = list(prompt)
        if any(isinstance(t, bool) or not isinstance(t, (int, np.integer)) for t in ids):
            raise TypeError("a token-id prompt must be a list of integers")
        ids = [int(t) for t in ids]
        if not ids:
            raise ValueError("prompt must not be empty")
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt token ids must be in [0, {vocab_size}), got {bad[:5]}")
    if len(ids) >= max_model_len:
        raise ValueError(f"prompt has {len(ids)} tokens but max_model_len is {max_model_len} "
                         "(the prompt must leave room for at least one generated token)")
    return ids


class LLMEngine:
    """One model replica: ``config.tensor_parallel`` devices (the ``replica``-th row of the
    ``data_parallel x tensor_parallel`` mesh); ``data_parallel`` replicas are run side by side by
    ``batching.replicas.ReplicatedEngine``."""

    def __init__(self, model: str, config: EngineConfig | None = None, replica: int = 0):
        self.config = config = config or EngineConfig()
        cache_dir = default_compilation_cache_dir() if config.compilation_cache_dir is None else \
            config.compilation_cache_dir
        if cache_dir and cache_dir != jax.config.jax_compilation_cache_dir:
            from jax._src import compilation_cache  # JAX opens its cache once; a new directory needs a reset
            jax.config.update("jax_compilation_cache_dir", cache_dir)
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
            compilation_cache.reset_cache()
        backend = jax.default_backend()
        dtype = config.dtype if config.dtype != "auto" else ("float32" if backend == "cpu" else "bfloat16")
        self.source = resolve_model(model)
        self.mesh = sharding.replica_mesh(load_config(self.source), config.tensor_parallel, config.data_parallel,
                                          replica)
        layer_loop = config.layer_loop if config.layer_loop != "auto" else (
            "unroll" if backend == "gpu" else "scan" if self.mesh is not None else "indexed")
        if multihost.active() and (config.data_parallel > 1 or config.preemption_mode == "swap"):
            raise ValueError("over several processes, data_parallel must be 1 and preemption_mode 'recompute' "
                             "(replicas and swapped pages stay within one process)")
        quantization = config.quantization
        if quantization == "auto":
            # Not on CPU: XLA:CPU decodes the blocks into a float copy every step, 2.5-4x slower per
            # decode step than float32 weights for SmolLM2 (docs/benchmarks.md); --quantization gguf opts in.
            # Not over a mesh either (EngineConfig refuses an explicit quantization there).
            native = (self.source.kind == "gguf" and config.dtype == "auto" and config.load_format != "dummy"
                      and backend != "cpu" and self.mesh is None)
            quantization = "gguf" if native else "none"
        t0 = time.perf_counter()
        self.model_config, weights = load_model(model, dtype=dtype, load_format=config.load_format, seed=config.seed,
                                                layer_loop=layer_loop, mesh=self.mesh, quantization=quantization)
        log.info("loaded %s (%s, quantization %s, %.1fM params, %.1f MB) in %.1fs", model, dtype, quantization,
                 self.model_config.num_params() / 1e6, sum(x.nbytes for x in jax.tree.leaves(weights)) / 1e6,
                 time.perf_counter() - t0)
        self.tokenizer = load_tokenizer(self.source)
        mc = self.model_config
        self.max_model_len = config.max_model_len or mc.max_position_embeddings
        if self.max_model_len > mc.max_position_embeddings:
            raise ValueError(f"max_model_len ({self.max_model_len}) exceeds the model's context length "
                             f"({mc.max_position_embeddings})")
        self.model_config = mc = mc.for_context(self.max_model_len)
        ps = config.page_size
        pages_per_seq = -(-self.max_model_len // ps)
        num_pages = config.num_pages or self._default_num_pages(dtype, pages_per_seq)
        if num_pages < pages_per_seq:
            raise ValueError(f"the KV pool ({num_pages} pages of {ps} tokens) cannot hold one sequence of "
                             f"max_model_len={self.max_model_len}; raise num_pages or lower max_model_len")
        if self.mesh is None:
            cache = KVCache.zeros(mc.num_layers, num_pages, ps, mc.num_kv_heads, mc.head_dim, jnp.dtype(dtype))
        else:
            cache = sharding.zeros_cache(mc, self.mesh, num_pages, ps, jnp.dtype(dtype))
        budget = config.max_num_batched_tokens
        default = default_buckets(backend, budget, config.max_num_seqs, pages_per_seq)
        buckets = Buckets(tokens=config.token_buckets or default.tokens, seqs=config.seq_buckets or default.seqs,
                          pages=config.page_buckets or default.pages)
        if buckets.tokens[-1] < budget or buckets.seqs[-1] < config.max_num_seqs or buckets.pages[-1] < pages_per_seq:
            raise ValueError(f"the largest buckets {(buckets.tokens[-1], buckets.seqs[-1], buckets.pages[-1])} must "
                             f"cover max_num_batched_tokens={budget}, max_num_seqs={config.max_num_seqs} and "
                             f"max_model_len/page_size={pages_per_seq}")
        ops = Ops(**get_kernels(config.attention_backend, mc.head_dim))
        if self.mesh is not None:
            ops = sharding.sharded_ops(ops, mc, self.mesh)
        self.runner = ModelRunner(mc, weights, cache, buckets, ops, max_logprobs=config.max_logprobs, mesh=self.mesh,
                                  max_executables=config.max_executables)
        self.blocks = BlockManager(num_pages, ps, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, budget, config.prefill_chunk_size or budget,
                            config.scheduling_policy, config.preemption_mode),
            self.blocks, swap_out=self.runner.swap_out, swap_in=self.runner.swap_in)
        self.requests: dict[str, Sequence] = {}
        self._trackers: dict[str, _Tracker] = {}
        self._rng = np.random.default_rng(config.seed)
        self._arrivals = itertools.count()
        self._inflight = None  # (batch, device result, sampled rows) of the step last dispatched
        self._matchers: Matchers | None = None  # structured outputs: made on the first constrained request
        self.counters = dict(prompt_tokens=0, generation_tokens=0, computed_prompt_tokens=0, steps=0,
                             step_tokens=0, host_time=0.0)
        log.info("KV cache: %d pages x %d tokens (%.2f GiB), buckets tokens=%s seqs=%s pages=%s", num_pages, ps,
                 cache.k.nbytes * 2 / 2**30, buckets.tokens, buckets.seqs, buckets.pages)
        if self.mesh is not None:
            log.info("mesh %s: %.2f GiB of weights per device", dict(self.mesh.shape),
                     max(sharding.per_device_bytes(weights).values()) / 2**30)

    def _default_num_pages(self, dtype: str, pages_per_seq: int) -> int:
        """Pages that fit every device of the replica (each holds its KV heads of every page)."""
        mc, tp = self.model_config, sharding.tp_size(self.mesh)
        per_page = KVCache.bytes_per_page(mc.num_layers, self.config.page_size, sharding.kv_heads(mc, tp) // tp,
                                          mc.head_dim, dtype)
        devices = jax.devices()[:1] if self.mesh is None else self.mesh.local_devices
        stats = [d.memory_stats() for d in devices] if jax.default_backend() != "cpu" else []
        if stats and all(s and "bytes_limit" in s for s in stats):
            free = min(s["bytes_limit"] * self.config.kv_cache_memory_fraction - s.get("bytes_in_use", 0)
                       for s in stats)
            pages = max(1, int(free // per_page))
            if multihost.active():  # every process must build the same pool: the smallest fits all
                from jax.experimental import multihost_utils
                pages = int(np.min(multihost_utils.process_allgather(np.int64(pages))))
            return pages
        want = self.config.max_num_seqs * pages_per_seq
        return max(pages_per_seq, min(want, int(self.config.cpu_kv_cache_gib * 2**30 // per_page)))

    # ----------------------------------------------------------------------------------- input side

    def encode(self, prompt: str | Seq[int]) -> list[int]:
        """Token ids of a prompt (text or ids), checked against the vocabulary and ``max_model_len``."""
        return encode_prompt(prompt, self.tokenizer, self.model_config.vocab_size, self.max_model_len)

    def add_request(self, request_id: str, prompt: str | Seq[int], params: SamplingParams | None = None,
                    priority: int = 0) -> None:
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise TypeError(f"priority must be an integer, got {priority!r}")
        ids = self.encode(prompt)
        if params.structured is not None:
            if multihost.active():
                raise ValueError("structured outputs are not supported over several processes")
            if self._matchers is None:
                self._matchers = Matchers(compiler_for(self.tokenizer, self.model_config.vocab_size,
                                                       self.model_config.eos_token_ids))
            self._matchers.add(request_id, params.structured)  # ValueError for a bad constraint
        seed = params.seed if params.seed is not None else int(self._rng.integers(2**32))
        seq = Sequence(request_id, ids, params, seed, priority=priority, arrival_index=next(self._arrivals))
        self.requests[request_id] = seq
        detok = IncrementalDetokenizer(self.tokenizer, ids) if self.tokenizer is not None else None
        self._trackers[request_id] = _Tracker(detok)
        self.counters["prompt_tokens"] += len(ids)
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> bool:
        """Stop a request wherever it is; its pages are freed at once. False if it is unknown."""
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return False
        self._trackers.pop(request_id, None)
        if self._matchers is not None:
            self._matchers.remove(request_id)
        self.scheduler.remove(seq)
        seq.finish_reason = "abort"
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()  # a request whose last token is in flight is still running

    # ---------------------------------------------------------------------------------- the step

    def step(self) -> list[RequestOutput]:
        """Dispatch the next step, then read the previous one's tokens while the device works.

        Decode inputs of the new step come from the previous step's sampled tokens on device, so
        the host never waits for them before dispatching; outputs therefore lag one step. A request
        that turns out to have finished in the previous step wastes its slot in the new one.
        """
        t0 = time.perf_counter()
        outputs = []
        if self._inflight is not None and any(  # penalties need every generated token on the host
                s.pending and (s.params.presence_penalty or s.params.frequency_penalty) for s in self.scheduler.running):
            outputs += self._read(*self._inflight)
            self._inflight = None
        batch = self.scheduler.schedule()
        inflight, self._inflight = self._inflight, None
        if batch.seqs and self._matchers and any(s.request_id in self._matchers for s in batch.seqs):
            # Constrained rows need their bitmask, which needs the last step's tokens: dispatch the
            # forward pass, read the last step while it runs, then fill the bitmask and sample.
            rows, sample_with = self.runner.run_forward(batch)
            sampled = self._dispatched(batch)
            host = time.perf_counter() - t0
            if inflight is not None:
                outputs += self._read(*inflight)  # counts its own host time
                inflight = None
            t0 = time.perf_counter()
            bitmask = np.full((rows, bitmask_width(self.model_config.vocab_size)), -1, np.int32)
            self._matchers.fill(bitmask, [(i, batch.seqs[i].request_id) for i in sampled
                                          if batch.seqs[i].status is not Status.FINISHED])
            self._inflight = (batch, sample_with(bitmask), sampled)
            host += time.perf_counter() - t0
        else:
            if batch.seqs:
                self._inflight = (batch, self.runner.run(batch), self._dispatched(batch))
            host = time.perf_counter() - t0
        if inflight is not None:
            outputs += self._read(*inflight)
        self.counters["host_time"] += host
        return outputs

    def _dispatched(self, batch) -> list[int]:
        """Advance host state as if the step had run; returns the rows that sample a token."""
        sampled = []
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_tokens)):
            self.counters["computed_prompt_tokens"] += max(0, min(n, len(seq.prompt_token_ids)
                                                                  - seq.num_computed_tokens))
            seq.num_computed_tokens += n
            if seq.num_computed_tokens // self.blocks.page_size > seq.committed_pages:  # a page filled up
                seq.committed_pages, seq.committed_key = self.blocks.commit(
                    seq.page_table, seq.token_ids, seq.num_computed_tokens, seq.committed_pages, seq.committed_key)
            if seq.num_computed_tokens < seq.num_tokens:
                continue  # a prefill chunk that is not the last: nothing sampled
            seq.pending += 1
            seq.pending_row, seq.pending_step = i, self.runner.num_steps - 1
            known = len(seq.output_token_ids) + seq.pending
            seq.final_pending = known >= seq.params.max_tokens or seq.num_tokens >= self.max_model_len
            sampled.append(i)
        self.counters["steps"] += 1
        self.counters["step_tokens"] += sum(batch.num_tokens)
        return sampled

    def _read(self, batch, result, sampled: list[int]) -> list[RequestOutput]:
        """Turn a finished step's sampled tokens into outputs (blocks until the device has them)."""
        tokens = np.asarray(result.tokens)
        t0 = time.perf_counter()
        want_lp = any(batch.seqs[i].params.logprobs is not None for i in sampled)
        logprobs = np.asarray(result.logprobs) if want_lp else None
        top_ids = None if result.top_tokens is None else np.asarray(result.top_tokens)
        top_lps = None if result.top_logprobs is None else np.asarray(result.top_logprobs)
        # Constrained requests' matchers take their tokens; "complete": nothing but EOS may follow.
        complete = set() if not self._matchers else self._matchers.advance(
            [(batch.seqs[i].request_id, int(tokens[i])) for i in sampled if batch.seqs[i].status is not Status.FINISHED])
        outputs = []
        for i in sampled:
            seq = batch.seqs[i]
            if seq.status is Status.FINISHED:
                continue  # finished or aborted after this step was dispatched
            seq.pending -= 1
            top = None
            if seq.params.logprobs is not None:
                top = {int(tokens[i]): float(logprobs[i])}
                if seq.params.logprobs and top_ids is not None:
                    top.update(zip(top_ids[i, :seq.params.logprobs].tolist(),
                                   top_lps[i, :seq.params.logprobs].tolist()))
            outputs.append(self._append_token(seq, int(tokens[i]), top, seq.request_id in complete))
        self.counters["host_time"] += time.perf_counter() - t0
        return outputs

    def _append_token(self, seq: Sequence, token: int, top: dict[int, float] | None,
                      complete: bool = False) -> RequestOutput:
        p = seq.params
        tr = self._trackers[seq.request_id]
        stop_cut = False
        self.counters["generation_tokens"] += 1
        if (token in self.model_config.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids:
            seq.finish_reason = "stop"
        else:
            seq.output_token_ids.append(token)
            if top is not None:
                seq.output_top_logprobs.append(top)
            if tr.detok is not None:
                tr.text += tr.detok.add(token)
            if p.stop and self._find_stop(tr, p.stop):
                seq.finish_reason = "stop"
                stop_cut = True  # the text ends before the stop string: nothing left to flush
            elif complete:
                seq.finish_reason = "stop"
            elif len(seq.output_token_ids) >= p.max_tokens or (
                    len(seq.prompt_token_ids) + len(seq.output_token_ids) >= self.max_model_len):
                seq.finish_reason = "length"
        finished = seq.finish_reason is not None
        if finished and tr.detok is not None and not stop_cut:
            tr.text += tr.detok.flush()  # a character cut off by the end of generation
        if finished:
            self.requests.pop(seq.request_id, None)
            self._trackers.pop(seq.request_id, None)
            if self._matchers is not None:
                self._matchers.remove(seq.request_id)
            self.scheduler.remove(seq)
        # Hold back a tail that may still turn out to start a stop string.
        hold = 0 if finished or not p.stop else max(len(s) for s in p.stop) - 1
        visible = max(tr.emitted, len(tr.text) - hold)
        delta, tr.emitted = tr.text[tr.emitted:visible], visible
        new_ids = seq.output_token_ids[tr.emitted_tokens:]
        tr.emitted_tokens = len(seq.output_token_ids)
        return RequestOutput(seq.request_id, seq.prompt_token_ids, tr.text, list(seq.output_token_ids), finished,
                             seq.finish_reason, delta, new_ids,
                             list(seq.output_top_logprobs) if p.logprobs is not None else None,
                             seq.num_cached_tokens)

    @staticmethod
    def _find_stop(tr: _Tracker, stops: tuple[str, ...]) -> bool:
        window = max(len(s) for s in stops) + 16
        start = max(0, min(tr.emitted, len(tr.text) - window))
        hits = [i for i in (tr.text.find(s, start) for s in stops) if i >= 0]
        if hits:
            tr.text = tr.text[:min(hits)]
        return bool(hits)

    # ------------------------------------------------------------------------------- introspection

    def warmup(self, shapes=None, greedy_only: bool = False, structured: bool = False) -> float:
        """Compile every step shape now (or the given ``(tokens, seqs, pages)`` ones); returns seconds.
        ``structured``: also what steps with constrained requests run (else compiled on first use)."""
        t0 = time.perf_counter()
        self.runner.warmup(shapes, greedy_only, structured)
        return time.perf_counter() - t0

    @property
    def num_compilations(self) -> int:
        return self.runner.num_compilations

    def stats(self) -> dict:
        s, b = self.scheduler, self.blocks
        stored = sum(q.num_computed_tokens for q in s.running)
        slots = sum(len(q.page_table) for q in s.running) * b.page_size
        c = self.counters
        return dict(
            running=len(s.running), waiting=len(s.waiting), preempted=len(s.preempted),
            kv_pages_used=b.num_used, kv_pages_total=b.num_pages, prefix_cache_pages=len(b.cached),
            kv_utilization=stored / slots if slots else 1.0,
            prefix_cache_queries=b.prefix_queries, prefix_cache_hits=b.prefix_hits,
            preemptions=s.num_preemptions, compilations=self.num_compilations,
            prompt_tokens=c["prompt_tokens"], generation_tokens=c["generation_tokens"],
            computed_prompt_tokens=c["computed_prompt_tokens"], steps=c["steps"],
            tokens_per_step=c["step_tokens"] / max(1, c["steps"]),
            host_time_per_step=c["host_time"] / max(1, c["steps"]),
        )
