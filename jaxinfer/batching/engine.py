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
import numpy as np

from jaxinfer.batching import multihost
from jaxinfer.batching.config import EngineConfig, default_compilation_cache_dir
from jaxinfer.batching.model_runner import Buckets, ModelRunner, default_buckets
from jaxinfer.batching.structured import Matchers, compiler_for
from jaxinfer.batching.scheduler import Scheduler, SchedulerConfig
from jaxinfer.batching.sequence import SAMPLED, Sequence, Status
from jaxinfer.batching.speculative import (DraftProposer, NgramProposer, Proposer, check_draft, default_ngram_min,
                                           default_overlap)
from jaxinfer import native
from jaxinfer.models import sharding
from jaxinfer.models.layers import Ops
from jaxinfer.models.weights import load_config, load_model, resolve_model, saved_quantization
from jaxinfer.models.spec import cpu_matmul_layout, num_params
from jaxinfer.paged import cpu_attention
from jaxinfer.paged.block_manager import BlockManager
from jaxinfer.paged.kv_cache import KVCache, kv_storage_dtype
from jaxinfer.pallas_kernels import get_kernels
from jaxinfer.quant import cpu_kernel
from jaxinfer.sampling import SampleResult, VerifyResult
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


def default_scheduler_steps(backend: str) -> int:
    """Decode steps one dispatch runs by default (``EngineConfig.num_scheduler_steps``). 4 on CPU:
    the host's work per dispatch (~1 ms on the 2-core box) took the cores from a SmolLM2 batch-1
    step of ~7.5 ms, and 4 steps per dispatch took batch-1 decode from 0.88x to 1.06x llama.cpp's
    (docs/benchmarks.md, issue 22); more than 4 saved little more and streams coarser. 1 elsewhere:
    an accelerator's steps are dispatched ahead of the device, which hides the host's work while a
    step outlasts its dispatch. Below that (llama3-8b int4 at batch 1 on an H100, ~2.5 ms a step) 4
    measured 1.11x (issue 25); it stays opt-in there until the throughput and serving workloads
    are measured with it (a request arriving mid-run waits up to that many steps for its prefill)."""
    return 4 if backend == "cpu" else 1


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
            # On CPU through the native kernel (quant.cpu_kernel), which needs a C++ compiler: the
            # embedded SmolLM2's batch-1 step 2.1x faster than its float32 weights, same float32
            # arithmetic (docs/benchmarks.md, issue 25); without one, float32 (XLA alone decodes the
            # blocks into a float copy every step, 2.5-4x slower). Not over a mesh (EngineConfig
            # refuses an explicit quantization there).
            in_blocks = (self.source.kind == "gguf" and config.dtype == "auto" and config.load_format != "dummy"
                         and self.mesh is None)
            if in_blocks and backend == "cpu" and not cpu_kernel.available():
                log.warning("no C++ compiler for the CPU quantized-matmul kernel: running %s in float32 "
                            "(install g++ to run its GGUF blocks natively, about 2x faster)", model)
                in_blocks = False
            # a directory written by scripts/convert_checkpoint.py: as it was saved
            quantization = "gguf" if in_blocks else saved_quantization(self.source)
        if backend == "cpu" and self.mesh is None:  # the native kernels this engine will call, built meanwhile
            native.prebuild(*([cpu_attention.SOURCE] if config.attention_backend in ("auto", "cpu") else []),
                            *([cpu_kernel.SOURCE] if quantization != "none" else []))
        t0 = time.perf_counter()
        self.model_config, weights = load_model(model, dtype=dtype, load_format=config.load_format, seed=config.seed,
                                                layer_loop=layer_loop, mesh=self.mesh, quantization=quantization)
        if backend == "cpu" and self.mesh is None:
            weights = cpu_matmul_layout(weights, self.model_config)  # [in, out]: what XLA:CPU's matmuls read
        log.info("loaded %s (%s, quantization %s, %.1fM params, %.1f MB) in %.1fs", model, dtype, quantization,
                 num_params(self.model_config) / 1e6, sum(x.nbytes for x in jax.tree.leaves(weights)) / 1e6,
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
        kv_dtype = kv_storage_dtype(config.kv_cache_dtype, dtype)
        num_pages = config.num_pages or self._default_num_pages(kv_dtype, pages_per_seq)
        if num_pages < pages_per_seq:
            raise ValueError(f"the KV pool ({num_pages} pages of {ps} tokens) cannot hold one sequence of "
                             f"max_model_len={self.max_model_len}; raise num_pages"
                             f"{'' if config.num_pages else ' (or kv_cache_memory_fraction)'} or lower max_model_len")
        if self.mesh is None:
            cache = KVCache.zeros(mc.num_layers, num_pages, ps, mc.num_kv_heads, mc.head_dim, kv_dtype)
        else:
            cache = sharding.zeros_cache(mc, self.mesh, num_pages, ps, kv_dtype)
        budget = config.max_num_batched_tokens
        default = default_buckets(backend, budget, config.max_num_seqs, pages_per_seq)
        if config.speculative_method is not None and config.num_speculative_tokens < budget:
            # a batch-1 verify step (last token + k proposals) in its own bucket, not padded to the next
            default = dataclasses.replace(default, tokens=tuple(sorted({*default.tokens,
                                                                        config.num_speculative_tokens + 1})))
        buckets = Buckets(tokens=config.token_buckets or default.tokens, seqs=config.seq_buckets or default.seqs,
                          pages=config.page_buckets or default.pages)
        if buckets.tokens[-1] < budget or buckets.seqs[-1] < config.max_num_seqs or buckets.pages[-1] < pages_per_seq:
            raise ValueError(f"the largest buckets {(buckets.tokens[-1], buckets.seqs[-1], buckets.pages[-1])} must "
                             f"cover max_num_batched_tokens={budget}, max_num_seqs={config.max_num_seqs} and "
                             f"max_model_len/page_size={pages_per_seq}")
        ops = Ops(**get_kernels(config.attention_backend, mc.head_dim, config.kv_cache_dtype != "auto"))
        if self.mesh is not None:
            ops = sharding.sharded_ops(ops, mc, self.mesh)
        # Unrolled layers whose K/V are written after the step (``ops.defer_kv_write``, the CPU's) would
        # copy the whole pool at every step of a multi-step decode: XLA:CPU cannot order the write after
        # the unrolled layers' reads inside its loop (its optimized HLO has the copies).
        unsafe = "over several processes" if multihost.active() else (
            "with layer_loop='unroll' on this backend" if layer_loop == "unroll" and ops.defer_kv_write else None)
        steps = config.num_scheduler_steps or (1 if unsafe else default_scheduler_steps(backend))
        if steps > 1 and unsafe:
            raise ValueError(f"num_scheduler_steps must be 1 {unsafe}, got {steps}")
        self.runner = ModelRunner(mc, weights, cache, buckets, ops, max_logprobs=config.max_logprobs, mesh=self.mesh,
                                  max_executables=config.max_executables, num_scheduler_steps=steps)
        self.blocks = BlockManager(num_pages, ps, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, budget, config.prefill_chunk_size or budget,
                            config.scheduling_policy, config.preemption_mode, buckets.tokens),
            self.blocks, swap_out=self.runner.swap_out, swap_in=self.runner.swap_in)
        self.requests: dict[str, Sequence] = {}
        self._trackers: dict[str, _Tracker] = {}
        self._rng = np.random.default_rng(config.seed)
        self._arrivals = itertools.count()
        self._inflight = None  # (batch, device result, sampled rows) of the step last dispatched
        self._matchers: Matchers | None = None  # structured outputs: made on the first constrained request
        self.counters = dict(prompt_tokens=0, generation_tokens=0, computed_prompt_tokens=0, steps=0,
                             step_tokens=0, host_time=0.0, spec_steps=0, spec_verified=0, spec_proposed=0,
                             spec_accepted=0, spec_discarded=0)
        self.proposer: Proposer | None = None
        if config.speculative_method is not None:
            if multihost.active():
                raise ValueError("speculative_method is not supported over several processes yet")
            if config.speculative_method == "ngram":
                self.proposer = NgramProposer(config.ngram_min or default_ngram_min(backend, config.ngram_max),
                                              config.ngram_max)
            else:
                draft = LLMEngine(config.speculative_model, dataclasses.replace(
                    config, speculative_method=None, speculative_model=None, max_model_len=self.max_model_len,
                    num_pages=config.num_pages or pages_per_seq * min(config.max_num_seqs, 64), token_buckets=None,
                    page_buckets=None, quantization="auto", tensor_parallel=1, data_parallel=1,
                    enable_prefix_caching=True))
                check_draft(self, draft)
                self.proposer = DraftProposer(draft)
        self._speculating = self.proposer is not None
        self.speculative_overlap = (config.speculative_overlap if config.speculative_overlap is not None
                                    else default_overlap(backend, config.speculative_method))
        log.info("KV cache: %d pages x %d tokens (%.2f GiB), buckets tokens=%s seqs=%s pages=%s", num_pages, ps,
                 sum(x.nbytes for x in jax.tree.leaves(cache)) / 2**30, buckets.tokens, buckets.seqs, buckets.pages)
        if self.mesh is not None:
            log.info("mesh %s: %.2f GiB of weights per device", dict(self.mesh.shape),
                     max(sharding.per_device_bytes(weights).values()) / 2**30)

    def _default_num_pages(self, dtype, pages_per_seq: int) -> int:
        """Pages of element ``dtype`` (with their scales, if quantized) that fit every device of the
        replica (each holds its KV heads of every page)."""
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

        Steps that verify proposals (``_propose``) stay in flight the same way where
        ``speculative_overlap`` is on: the new step's proposals follow the context that assumes the
        step in flight accepts all of its own, and where it turns out to have rejected one, what the
        new step computed for that sequence is discarded (``_roll_back``). On an H200 dispatching a
        batch-1 llama3-8b verify step from an idle device cost ~1-1.2 ms next to its 4.9 ms on device
        (docs/benchmarks.md, issue 26). Without it, the step in flight is read before proposing.
        """
        t0 = time.perf_counter()
        outputs = []
        speculate = self.proposer is not None and self._speculate_now()
        if self._inflight is not None and (
                (speculate and not self.speculative_overlap)  # proposals from known tokens only
                or (not speculate and isinstance(self._inflight[1], VerifyResult))  # see ``_roll_back``
                or any(s.inflight and (s.params.presence_penalty or s.params.frequency_penalty)  # penalties need
                       for s in self.scheduler.running)):  # every generated token on the host
            inflight, self._inflight = self._inflight, None
            outputs += self._read(*inflight)  # counts its own host time
            t0 = time.perf_counter()
        if speculate:
            self._propose()
        batch = self.scheduler.schedule()
        inflight, self._inflight = self._inflight, None
        if batch.seqs and self._matchers and any(s.request_id in self._matchers for s in batch.seqs):
            # Constrained rows need their bitmask, which needs the last step's tokens: dispatch the
            # forward pass; read the last step while it runs, its matchers advancing first so that the
            # bitmask fills (off the GIL) while its tokens are turned into outputs; then sample.
            sample = self.runner.run_forward(batch)
            sampled = self._dispatched(batch)
            filling = None

            def fill():  # every earlier step's tokens are read by now: the bitmask's buffer is free
                nonlocal filling
                rows = [(i, seq.request_id) for i in sampled if (seq := batch.seqs[i]).status is not Status.FINISHED
                        and seq.request_id in self._matchers]
                free = np.ones(sample.rows, bool)
                free[[i for i, _ in rows]] = False
                sample.bitmask[free] = -1  # every token allowed: rows of free requests, padding, prefill chunks
                filling = self._matchers.fill(sample.bitmask, rows)

            host = time.perf_counter() - t0
            if inflight is not None:
                outputs += self._read(*inflight, advanced=fill)  # counts its own host time
                inflight = None
            t0 = time.perf_counter()
            if filling is None:
                fill()
            filling.result()
            self._inflight = (batch, sample(), sampled)
            host += time.perf_counter() - t0
        else:
            if batch.seqs:
                k = self.config.num_speculative_tokens if any(s.draft_token_ids for s in batch.seqs) else 0
                result = self.runner.run(batch, k, self._num_steps(batch))
                steps = result.tokens.shape[1] if isinstance(result, SampleResult) and result.tokens.ndim == 2 else 1
                self._inflight = (batch, result, self._dispatched(batch, steps))
                self.counters["spec_steps"] += bool(k)
            if speculate:
                for seq in self.scheduler.running:  # proposals of sequences the budget left out of this step
                    seq.draft_token_ids = []
            host = time.perf_counter() - t0
        if inflight is not None:
            outputs += self._read(*inflight)
        self.counters["host_time"] += host
        return outputs

    def _num_steps(self, batch) -> int:
        """How many decode steps ``batch`` runs in one dispatch: ``num_scheduler_steps`` where every
        sequence decodes (one token) without penalties, has room for that many tokens within
        ``max_model_len``, and the pool has their pages (``Scheduler.reserve``), while no request
        that a free slot could take waits to be admitted (it would wait for all of them), none is
        preempted, and nothing speculates or is constrained; else one. Tokens past a request's end
        (EOS, a stop, ``max_tokens``) within the run are computed and dropped: waiting for the request
        nearest its ``max_tokens`` instead would run most steps of a batch one at a time."""
        n, s = self.runner.num_scheduler_steps, self.scheduler
        admissible = s.waiting and len(s.running) < s.config.max_num_seqs
        if n == 1 or admissible or s.preempted or self.proposer is not None or self._matchers:
            return 1
        for seq, k in zip(batch.seqs, batch.num_tokens):
            p = seq.params
            if (k != 1 or seq.num_remaining != 1 or p.presence_penalty or p.frequency_penalty
                    or seq.num_tokens + n > self.max_model_len):
                return 1
        return n if s.reserve(batch, n) else 1

    def _speculate_now(self) -> bool:
        """Whether this step speculates: not above ``speculative_max_num_seqs`` running sequences, where
        verifying k more tokens per sequence stops being free next to reading the weights, and not while
        a request with structured outputs is live (its bitmask would be needed at every proposed position)."""
        on = len(self.scheduler.running) <= self.config.speculative_max_num_seqs and not self._matchers
        if on != self._speculating:
            log.info("speculative decoding %s: %d sequences running (speculative_max_num_seqs=%d)",
                     "resumed" if on else "paused", len(self.scheduler.running),
                     self.config.speculative_max_num_seqs)
            self._speculating = on
        return on

    def _propose(self) -> None:
        """Proposals (``draft_token_ids``) for the running sequences that may speculate this step, each
        to follow its tokens as if its step in flight accepts every proposal (``Sequence.assumed_context``),
        at most k and leaving room for the step's own token within ``max_tokens`` and ``max_model_len``.
        A sequence a step would verify proposals for advances by the number accepted plus one
        (``_read_verified``); a step in which none has proposals is a plain step (the verifying variant
        would still take ``k + 1`` logits rows per sequence: on XLA:CPU the lm_head of 5 rows cost a
        batch-1 SmolLM2 step ~25% more than that of one)."""
        k, eligible, limits = self.config.num_speculative_tokens, [], []
        for seq in self.scheduler.running:
            p = seq.params
            if seq.is_prefill or seq.held or p.presence_penalty or p.frequency_penalty:
                continue  # penalties would need the proposals counted at each later position
            limit = min(k, p.max_tokens - len(seq.output_token_ids) - len(seq.inflight) - 1,
                        self.max_model_len - seq.num_tokens - 1)
            if limit > 0:
                eligible.append(seq)
                limits.append(limit)
        for seq, draft in zip(eligible, self.proposer.propose(eligible, limits) if eligible else []):
            seq.draft_token_ids = list(draft)

    def _commit(self, seq: Sequence) -> None:
        """Publish the pages filled by tokens whose K/V exist and whose ids are known on the host (an
        in-flight token's and a proposal's are not yet)."""
        known = min(seq.num_computed_tokens, len(seq.prompt_token_ids) + len(seq.output_token_ids))
        if known // self.blocks.page_size > seq.committed_pages:
            seq.committed_pages, seq.committed_key = self.blocks.commit(
                seq.page_table, seq.token_ids, known, seq.committed_pages, seq.committed_key)

    def _dispatched(self, batch, steps: int = 1) -> list[int]:
        """Advance host state as if the step had run and accepted every proposal (``Sequence.inflight``);
        returns the rows that sample a token (``steps`` tokens each where it runs that many decode
        steps: ``_num_steps``).

        A sequence is held (not scheduled until this step is read) when these tokens would end it, or
        when it verifies proposals after a verification that rejected one: with
        ``speculative_overlap`` the step after a rejected one is discarded, so going ahead from a
        proposal pays only when it is likely to be accepted whole (on an H200 a discarded batch-1
        llama3-8b step wastes ~4.9 ms of device time where going ahead saves the ~1.7 ms dispatch gap:
        docs/benchmarks.md, issue 26)."""
        sampled = []
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_tokens)):
            self.counters["computed_prompt_tokens"] += max(0, min(n, len(seq.prompt_token_ids)
                                                                  - seq.num_computed_tokens))
            seq.num_computed_tokens += n + steps - 1
            self._commit(seq)
            proposed = seq.draft_token_ids
            if seq.num_computed_tokens < seq.num_tokens + len(proposed) + steps - 1:
                continue  # a prefill chunk that is not the last: nothing sampled
            seq.inflight += proposed + [SAMPLED] * steps
            seq.draft_token_ids = []
            seq.pending_row, seq.pending_step = i, self.runner.num_steps - 1
            seq.held = (len(seq.output_token_ids) + len(seq.inflight) >= seq.params.max_tokens
                        or seq.num_tokens >= self.max_model_len or (bool(proposed) and seq.rejected))
            sampled.append(i)
        self.counters["steps"] += steps
        self.counters["step_tokens"] += sum(batch.num_tokens) * steps
        return sampled

    @staticmethod
    def _take(seq: Sequence, n: int) -> None:
        """The oldest step in flight read for ``seq``: its ``n`` in-flight entries are known now."""
        assert seq.inflight[n - 1] == SAMPLED
        del seq.inflight[:n]
        if not seq.inflight:
            seq.held = False

    def _roll_back(self, seq: Sequence, computed: int) -> None:
        """``seq``'s oldest step in flight rejected a proposal: forget every in-flight token. The K/V
        written from position ``computed`` on (the rejected proposals', and whatever the step
        dispatched after it computed from them) are no longer counted, so later steps overwrite them;
        the sequence leaves that later step's sampled rows (its tokens there are never read); a
        swapped-out copy keeps only its counted pages. Pages left empty are freed by the caller once
        the accepted tokens are appended. The later step is always ``self._inflight`` here: a
        verifying step in flight is read before any other kind of step is dispatched (``step``).

        Sampling stays exact: each output index draws from its own key (seed, index), and whether the
        later step is discarded depends only on the keys of the indices this step emitted, so the keys
        the discarded step used are independent of that decision and serve the same indices again."""
        if seq.inflight.count(SAMPLED) > 1:  # in the step dispatched last too
            assert seq.pending_step == self.runner.num_steps - 1
            self._inflight[2].remove(seq.pending_row)
            self.counters["spec_discarded"] += 1
        seq.inflight = []
        seq.held = False
        seq.num_computed_tokens = min(seq.num_computed_tokens, computed)
        if seq.swapped is not None:
            seq.swapped = [x[:, :self.blocks.pages_needed(seq.num_computed_tokens)] for x in seq.swapped]

    def _read(self, batch, result, sampled: list[int], advanced=None) -> list[RequestOutput]:
        """Turn a finished step's sampled tokens into outputs (blocks until the device has them);
        ``advanced`` is called once the constrained requests' matchers have taken their tokens."""
        if isinstance(result, VerifyResult):
            return self._read_verified(batch, result, sampled, advanced)
        tokens = np.asarray(result.tokens)
        t0 = time.perf_counter()
        logprobs, top_ids, top_lps = self._host_logprobs(batch, result, sampled)
        # Constrained requests' matchers take their tokens; "complete": nothing but EOS may follow.
        complete = set() if not self._matchers else self._matchers.advance(
            [(batch.seqs[i].request_id, int(tokens[i])) for i in sampled if batch.seqs[i].status is not Status.FINISHED])
        if advanced is not None:
            advanced()
        outputs = []
        for i in sampled:
            seq = batch.seqs[i]
            if seq.status is Status.FINISHED:
                continue  # finished or aborted after this step was dispatched
            several = tokens.ndim == 2  # several decode steps: [S, steps]
            new = tokens[i].tolist() if several else [int(tokens[i])]
            self._take(seq, len(new))
            tops = self._tops(seq, new, logprobs, top_ids, top_lps, np.s_[i] if several else np.s_[i:i + 1])
            outputs.append(self._append_tokens(seq, new, tops, seq.request_id in complete))
        self.counters["host_time"] += time.perf_counter() - t0
        return outputs

    def _read_verified(self, batch, result, sampled: list[int], advanced=None) -> list[RequestOutput]:
        """A verifying step's outcome: each sampled sequence keeps its accepted proposals plus the
        target's next token. Where every proposal was accepted, the step dispatched after this one
        went on from the right tokens; where one was rejected, ``_roll_back`` discards the rejected
        positions and what came after them, pages left empty are freed, and pages are published to the
        prefix cache only up to accepted tokens. (No constrained request ever proposes.)"""
        tokens = np.asarray(result.tokens)
        accepted = (tokens >= 0).sum(axis=1) - 1  # -1 follows the emitted tokens (``VerifyResult``)
        t0 = time.perf_counter()
        if advanced is not None:
            advanced()
        logprobs, top_ids, top_lps = self._host_logprobs(batch, result, sampled)
        outputs, c = [], self.counters
        for i in sampled:
            seq = batch.seqs[i]
            if seq.status is Status.FINISHED:
                continue  # finished or aborted after this step was dispatched
            proposed, a = seq.inflight.index(SAMPLED), int(accepted[i])
            if proposed:
                c["spec_verified"] += 1
                c["spec_proposed"] += proposed
                c["spec_accepted"] += a
                seq.rejected = a < proposed
            if a < proposed:
                self._roll_back(seq, len(seq.prompt_token_ids) + len(seq.output_token_ids) + a)
            else:
                self._take(seq, proposed + 1)
            new = tokens[i, :a + 1].tolist()
            tops = self._tops(seq, new, logprobs, top_ids, top_lps, np.s_[i, :a + 1])
            outputs.append(self._append_tokens(seq, new, tops))
            if seq.status is Status.RUNNING:
                keep = self.blocks.pages_needed(seq.num_tokens)
                self.blocks.free_pages(seq.page_table[keep:])
                del seq.page_table[keep:]
                self._commit(seq)
        self.counters["host_time"] += time.perf_counter() - t0
        return outputs

    @staticmethod
    def _host_logprobs(batch, result, sampled: list[int]):
        """A step's logprobs and top logprobs on the host (the logprobs only if a sampled row asked)."""
        want_lp = any(batch.seqs[i].params.logprobs is not None for i in sampled)
        logprobs = np.asarray(result.logprobs) if want_lp else None
        top_ids = None if result.top_tokens is None else np.asarray(result.top_tokens)
        top_lps = None if result.top_logprobs is None else np.asarray(result.top_logprobs)
        return logprobs, top_ids, top_lps

    @staticmethod
    def _tops(seq: Sequence, new: list[int], logprobs, top_ids, top_lps, rows) -> list:
        """The logprob entry of each new token of ``seq`` (None without ``logprobs``): its own logprob
        plus the step's top ``logprobs`` alternatives. ``rows`` picks the sequence's positions from the
        step's arrays (one row of a plain step, the accepted positions of a verifying one)."""
        n = seq.params.logprobs
        if n is None:
            return [None] * len(new)
        tops = [{t: float(lp)} for t, lp in zip(new, logprobs[rows])]
        if n and top_ids is not None:
            for top, ids, lps in zip(tops, top_ids[rows], top_lps[rows]):
                top.update(zip(ids[:n].tolist(), lps[:n].tolist()))
        return tops

    def _append_tokens(self, seq: Sequence, tokens: list[int], tops: list, complete: bool = False) -> RequestOutput:
        """Append a step's new tokens (one, or several from a verifying step) up to the first that ends
        the request; one output for them all. ``complete``: the last token completes the request's
        structured output."""
        p = seq.params
        tr = self._trackers[seq.request_id]
        stop_cut = False
        for j, (token, top) in enumerate(zip(tokens, tops)):
            self.counters["generation_tokens"] += 1
            if (token in self.model_config.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids:
                seq.finish_reason = "stop"
                break
            seq.output_token_ids.append(token)
            if top is not None:
                seq.output_top_logprobs.append(top)
            if tr.detok is not None:
                tr.text += tr.detok.add(token)
            if p.stop and self._find_stop(tr, p.stop):
                seq.finish_reason = "stop"
                stop_cut = True  # the text ends before the stop string: nothing left to flush
                break
            if complete and j == len(tokens) - 1:
                seq.finish_reason = "stop"
                break
            if len(seq.output_token_ids) >= p.max_tokens or (
                    len(seq.prompt_token_ids) + len(seq.output_token_ids) >= self.max_model_len):
                seq.finish_reason = "length"
                break
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

    def warmup(self, shapes=None, greedy_only: bool = False, structured: bool = False,
               background: bool = False) -> float:
        """Compile every step shape now (or the given ``(tokens, seqs, pages)`` ones); returns seconds.
        ``structured``: also what steps with constrained requests run (else compiled on first use).
        ``background``: only the steps a single request meets first now, the rest in a background
        thread (``ModelRunner.warmup``; ``wait_warmup`` joins it)."""
        t0 = time.perf_counter()
        self.runner.warmup(shapes, greedy_only, structured,
                           self.config.num_speculative_tokens if self.proposer is not None else 0, background)
        if isinstance(self.proposer, DraftProposer):  # proposals are greedy
            self.proposer.engine.warmup(greedy_only=True)
        return time.perf_counter() - t0

    def wait_warmup(self, stop: bool = False) -> None:
        """Block until a background warm-up has compiled the rest of its plan (``stop``: until it
        has stopped, after the step under way)."""
        self.runner.wait_warmup(stop)

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
            spec_steps=c["spec_steps"], spec_proposed_tokens=c["spec_proposed"],
            spec_accepted_tokens=c["spec_accepted"],
            spec_acceptance_rate=c["spec_accepted"] / max(1, c["spec_proposed"]),
            # sequences' parts of steps dispatched ahead of a verification that then rejected a proposal
            spec_discarded=c["spec_discarded"],
            # tokens a sequence gained per verification of its proposals (1 without speculation)
            spec_mean_accepted_length=(c["spec_accepted"] + c["spec_verified"]) / max(1, c["spec_verified"]),
        )
