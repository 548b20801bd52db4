"""Building an engine: gather the facts (model, devices), resolve the configuration once
(``resolve.py``), then make each part from the resolved values: weights, KV cache, kernels, model
runner, scheduler with its KV cache manager, proposer, and the engine that joins them.

``create_engine`` is the one way to make an engine (``LLM`` and the server's engine core use it);
``run_follower`` is what every process but the first runs in a multi-process run.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import jax
import numpy as np

from jaxinfer import native
from jaxinfer.batching import multihost
from jaxinfer.batching.config import EngineConfig
from jaxinfer.batching.engine import LLMEngine
from jaxinfer.batching.kv_manager import KVCacheManager
from jaxinfer.batching.model_runner import ModelRunner
from jaxinfer.batching.replicas import ReplicatedEngine
from jaxinfer.batching.resolve import DeviceFacts, ModelFacts, ResolvedConfig, resolve, size_kv_pool
from jaxinfer.batching.scheduler import Scheduler, SchedulerConfig
from jaxinfer.batching.speculative import DraftProposer, NgramProposer, check_draft
from jaxinfer.batching.structured import Matchers
from jaxinfer.models import sharding
from jaxinfer.models.spec import cpu_matmul_layout, num_params
from jaxinfer.models.weights import (ModelSource, check_has_weights, load_config, load_model, resolve_model,
                                     saved_quantization)
from jaxinfer.paged.kv_cache import KVCache
from jaxinfer.tokenizer import check_has_tokenizer, load_tokenizer, tokenizer_source

log = logging.getLogger(__name__)


def create_engine(model: str, config: EngineConfig | None = None) -> LLMEngine | ReplicatedEngine:
    """The engine for ``config``: one ``LLMEngine``, or ``data_parallel`` replicas of it."""
    config = config or EngineConfig()
    if config.data_parallel > 1:
        return ReplicatedEngine([build_engine(model, config, replica=r) for r in range(config.data_parallel)])
    return build_engine(model, config)


def model_facts(model: str, source: ModelSource) -> ModelFacts:
    return ModelFacts(model, load_config(source), source.kind, saved_quantization(source))


def build_engine(model: str, config: EngineConfig, replica: int = 0) -> LLMEngine:
    """One engine replica: row ``replica`` of the ``data_parallel x tensor_parallel`` mesh."""
    # Resolved once (a Hub id is fetched here), so the config, weights and tokenizer come from one snapshot.
    source = resolve_model(model, **config.model_location())
    check_has_weights(source, config.load_format)  # before any work: a preset names only shapes
    tokenizer = tokenizer_source(source, config)
    if tokenizer is not None:
        check_has_tokenizer(tokenizer)
    facts = model_facts(model, source)
    mesh = sharding.replica_mesh(facts.config, config.tensor_parallel, config.data_parallel, replica)
    devices = jax.devices()[:1] if mesh is None else mesh.local_devices
    draft_source = draft = None
    if config.speculative_method == "draft":
        draft_source = resolve_model(config.speculative_model, download_dir=config.download_dir)
        check_has_weights(draft_source, config.load_format)
        draft = model_facts(config.speculative_model, draft_source)
    resolved = resolve(config, facts, DeviceFacts.gather(devices), draft)
    return _build(resolved, source, tokenizer, config, mesh, devices, draft_source)


def _build(resolved: ResolvedConfig, source: ModelSource, tokenizer_from: ModelSource | None, config: EngineConfig,
           mesh, devices, draft_source: ModelSource | None = None) -> LLMEngine:
    _use_compilation_cache(resolved.compilation_cache_dir)
    backend = resolved.backend
    sources = backend.native_sources(resolved.attention_backend, resolved.quantization != "none", mesh is not None)
    native.prebuild(*sources)  # the native kernels this engine will call, built while the weights load
    t0 = time.perf_counter()
    mc, weights = load_model(source, dtype=resolved.dtype, load_format=resolved.load_format,
                             seed=resolved.seed, layer_loop=resolved.layer_loop, mesh=mesh,
                             quantization=resolved.quantization)
    if backend.platform == "cpu" and mesh is None:
        weights = cpu_matmul_layout(weights, mc)  # [in, out]: what XLA:CPU's matmuls read
    log.info("loaded %s (%s, quantization %s, %.1fM params, %.1f MB) in %.1fs", resolved.model, resolved.dtype,
             resolved.quantization, num_params(mc) / 1e6, sum(x.nbytes for x in jax.tree.leaves(weights)) / 1e6,
             time.perf_counter() - t0)
    tokenizer = None if tokenizer_from is None else load_tokenizer(tokenizer_from)
    mc = mc.for_context(resolved.max_model_len)
    multi = jax.process_count() > 1
    resolved = size_kv_pool(resolved, mc, DeviceFacts.gather(devices), config.kv_cache_memory_fraction,
                            config.cpu_kv_cache_gib)
    if multi and config.num_pages is None:  # every process must build the same pool: the smallest fits all
        from jax.experimental import multihost_utils
        pages = int(np.min(multihost_utils.process_allgather(np.int64(resolved.num_pages))))
        resolved = dataclasses.replace(resolved, num_pages=pages)
    kv_dtype = resolved.kv_storage_dtype
    if mesh is None:
        cache = KVCache.zeros(mc.num_layers, resolved.num_pages, resolved.page_size, mc.num_kv_heads, mc.head_dim,
                              kv_dtype)
    else:
        cache = sharding.zeros_cache(mc, mesh, resolved.num_pages, resolved.page_size, kv_dtype)
    ops = backend.ops(resolved.attention_backend, mc.head_dim, resolved.kv_cache_dtype != "auto")
    if mesh is not None:
        ops = sharding.sharded_ops(ops, mc, mesh)
    leader = mesh is not None and multi and multihost.is_leader()
    if leader:
        multihost.stop_followers_at_exit()
    runner = ModelRunner(resolved, mc, weights, cache, ops, mesh, on_dispatch=multihost.send_step if leader else None)
    scheduler = Scheduler(
        SchedulerConfig(resolved.max_num_seqs, resolved.max_num_batched_tokens, resolved.prefill_chunk_size,
                        resolved.max_model_len, resolved.scheduling_policy, resolved.preemption_mode,
                        resolved.buckets.tokens, num_scheduler_steps=resolved.num_scheduler_steps,
                        num_speculative_tokens=resolved.speculative.num_tokens if resolved.speculative else 0,
                        eos_token_ids=tuple(mc.eos_token_ids)),
        KVCacheManager(resolved.num_pages, resolved.page_size, resolved.enable_prefix_caching),
        Matchers(tokenizer, mc.vocab_size, mc.eos_token_ids, config.structured_outputs_whitespace) if tokenizer is not None else None,
        swap_out=runner.swap_out, swap_in=runner.swap_in)
    engine = LLMEngine(config, resolved, mc, tokenizer, runner, scheduler, multihost=multi)
    spec = resolved.speculative
    if spec is not None:
        if spec.method == "ngram":
            engine.proposer = NgramProposer(spec.ngram_min, spec.ngram_max)
        else:
            draft = _build(spec.draft, draft_source, None if config.skip_tokenizer_init else draft_source, config,
                           None, jax.devices()[:1])
            check_draft(engine, draft)
            engine.proposer = DraftProposer(draft)
    log.info("KV cache: %d pages x %d tokens (%.2f GiB), buckets tokens=%s seqs=%s pages=%s", resolved.num_pages,
             resolved.page_size, sum(x.nbytes for x in jax.tree.leaves(cache)) / 2**30, resolved.buckets.tokens,
             resolved.buckets.seqs, resolved.buckets.pages)
    if mesh is not None:
        log.info("mesh %s: %.2f GiB of weights per device", dict(mesh.shape),
                 max(sharding.per_device_bytes(weights).values()) / 2**30)
    log.info("resolved engine configuration: %s", resolved.summary())
    return engine


def _use_compilation_cache(cache_dir: str) -> None:
    """XLA's persistent compilation cache in ``cache_dir`` (``""``: off), so a restart loads the steps."""
    if cache_dir and cache_dir != jax.config.jax_compilation_cache_dir:
        from jax._src import compilation_cache  # JAX opens its cache once; a new directory needs a reset
        jax.config.update("jax_compilation_cache_dir", cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        compilation_cache.reset_cache()


def run_follower(model: str, config: EngineConfig) -> None:
    """A follower process of a multi-process run: build the engine process 0 builds and run the steps
    it sends until it stops (``multihost``)."""
    multihost.follow(build_engine(model, config).runner)
