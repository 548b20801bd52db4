"""Engine configuration resolved once: what the user asked (``EngineConfig``), the model's own
config and the facts of the devices, turned into every value the engine runs with
(``ResolvedConfig``). Each "auto" and each derived value is decided here and nowhere else; the
factory builds the engine from the result, which the engine logs once and the server reports.

``resolve`` is a pure function of its inputs. The KV pool's size on an accelerator depends on how
much memory the weights leave, so the factory measures that after loading them and completes the
resolved config with ``size_kv_pool``.
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp

from jaxinfer.batching.backend import Backend, backend_for
from jaxinfer.batching.buckets import Buckets
from jaxinfer.batching.config import EngineConfig, default_compilation_cache_dir
from jaxinfer.models.config import ModelConfig
from jaxinfer.models.weights import model_quantization
from jaxinfer.paged.kv_cache import KVCache, kv_storage_dtype

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class DeviceFacts:
    """What the devices of one replica are: their platform and, where the platform reports them,
    each device's memory limit and use; how many processes run the engine together."""

    platform: str
    num_processes: int = 1
    memory: tuple[tuple[int, int], ...] = ()  # (bytes_limit, bytes_in_use) per device; () where unknown (CPU)

    @classmethod
    def gather(cls, devices) -> "DeviceFacts":
        platform = jax.default_backend()
        memory = ()
        if platform != "cpu":
            stats = [d.memory_stats() for d in devices]
            if stats and all(s and "bytes_limit" in s for s in stats):
                memory = tuple((s["bytes_limit"], s.get("bytes_in_use", 0)) for s in stats)
        return cls(platform, jax.process_count(), memory)


@dataclasses.dataclass(frozen=True)
class ModelFacts:
    """What the model is, before its weights load: its config, where it comes from and how a
    converted checkpoint was saved."""

    name: str
    config: ModelConfig
    source_kind: str  # "preset", "hf", "gguf" or "orbax" (``models.weights.ModelSource``)
    saved_quantization: str = "none"


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    method: str  # "ngram" or "draft"
    num_tokens: int  # most proposals verified per request and step
    ngram_min: int
    ngram_max: int
    max_num_seqs: int  # speculation pauses above this many running requests
    overlap: bool  # a verifying step stays in flight while the next is proposed
    draft: "ResolvedConfig | None" = None  # method "draft": the draft model's engine


@dataclasses.dataclass(frozen=True)
class ResolvedConfig:
    model: str
    platform: str
    attention_backend: str
    dtype: str
    layer_loop: str
    quantization: str
    kv_cache_dtype: str
    load_format: str
    seed: int
    max_model_len: int
    page_size: int
    num_pages: int | None  # None until ``size_kv_pool``
    buckets: Buckets
    max_num_seqs: int
    max_num_batched_tokens: int
    prefill_chunk_size: int
    scheduling_policy: str
    preemption_mode: str
    enable_prefix_caching: bool
    num_scheduler_steps: int
    max_logprobs: int
    max_executables: int
    tensor_parallel: int
    data_parallel: int
    compilation_cache_dir: str  # "" when off
    speculative: SpeculativeConfig | None

    @property
    def pages_per_seq(self) -> int:
        return -(-self.max_model_len // self.page_size)

    @property
    def sharded(self) -> bool:
        return self.tensor_parallel * self.data_parallel > 1

    @property
    def backend(self) -> Backend:
        return backend_for(self.platform)

    @property
    def kv_storage_dtype(self) -> jnp.dtype:
        """The cache's element dtype: the model's, or int8/fp8 codes (``kv_cache_dtype``)."""
        return kv_storage_dtype(self.kv_cache_dtype, self.dtype)

    def summary(self) -> dict:
        """The resolved values as plain JSON (the draft's nested), for the log and ``/version``."""
        out = dataclasses.asdict(self)
        out["buckets"] = dataclasses.asdict(self.buckets)
        return out


def resolve(config: EngineConfig, model: ModelFacts, facts: DeviceFacts,
            draft: ModelFacts | None = None) -> ResolvedConfig:
    """Every value the engine runs with (``num_pages`` left None where device memory decides it);
    ``draft``: the draft model's facts when ``config.speculative_method == "draft"``."""
    backend = backend_for(facts.platform)
    multihost = facts.num_processes > 1
    sharded = config.tensor_parallel * config.data_parallel > 1
    if multihost and (config.data_parallel > 1 or config.preemption_mode == "swap"):
        raise ValueError("over several processes, data_parallel must be 1 and preemption_mode 'recompute' "
                         "(replicas and swapped pages stay within one process)")
    if multihost and config.speculative_method is not None:
        raise ValueError("speculative_method is not supported over several processes yet")
    mc = model.config
    dtype = config.dtype if config.dtype != "auto" else backend.dtype
    attention = backend.attention_backend(config.attention_backend, mc.head_dim)
    backend.ops(attention, mc.head_dim, config.kv_cache_dtype != "auto")  # refuses what the kernels cannot run
    writes_after = backend.writes_after_layers(attention, sharded)
    layer_loop = config.layer_loop if config.layer_loop != "auto" else backend.layer_loop(sharded, writes_after)
    if layer_loop == "unroll" and writes_after:
        # XLA copied the whole KV pool twice per step to write it after unrolled layers that read it.
        raise ValueError(f"layer_loop='unroll' does not go with attention_backend={attention!r}, which writes every "
                         "layer's K/V after the layer loop: use layer_loop 'indexed' or 'scan' (or 'auto')")
    quantization = config.quantization
    if quantization == "auto":
        # A GGUF runs in its own blocks unless a dtype is asked for (then dequantized at load); a
        # directory written by jaxinfer convert as it was saved; other sources in full precision.
        in_blocks = (model.source_kind == "gguf" and config.dtype == "auto" and config.load_format != "dummy"
                     and not sharded)
        if in_blocks and not backend.gguf_in_blocks():
            log.warning("no C++ compiler for the CPU quantized-matmul kernel: running %s in float32 (install g++ "
                        "to run its GGUF blocks natively, about 2x faster)", model.name)
            in_blocks = False
        quantization = "gguf" if in_blocks else model.saved_quantization
    quantization = model_quantization(quantization, mc)  # plain "int4": the group that fits the model
    max_model_len = config.max_model_len or mc.max_position_embeddings
    if max_model_len > mc.max_position_embeddings:
        raise ValueError(f"max_model_len ({max_model_len}) exceeds the model's context length "
                         f"({mc.max_position_embeddings})")
    budget = config.max_num_batched_tokens
    pages_per_seq = -(-max_model_len // config.page_size)
    default = backend.buckets(budget, config.max_num_seqs, pages_per_seq)
    spec = config.speculative_method is not None
    if spec and config.num_speculative_tokens < budget:
        # a batch-1 verify step (last token + k proposals) in its own bucket, not padded to the next
        default = dataclasses.replace(default, tokens=tuple(sorted({*default.tokens, config.num_speculative_tokens + 1})))
    buckets = Buckets(tokens=config.token_buckets or default.tokens, seqs=config.seq_buckets or default.seqs,
                      pages=config.page_buckets or default.pages)
    if buckets.tokens[-1] < budget or buckets.seqs[-1] < config.max_num_seqs or buckets.pages[-1] < pages_per_seq:
        raise ValueError(f"the largest buckets {(buckets.tokens[-1], buckets.seqs[-1], buckets.pages[-1])} must "
                         f"cover max_num_batched_tokens={budget}, max_num_seqs={config.max_num_seqs} and "
                         f"max_model_len/page_size={pages_per_seq}")
    steps = config.num_scheduler_steps or (1 if multihost else backend.scheduler_steps)
    if steps > 1 and multihost:
        raise ValueError(f"num_scheduler_steps must be 1 over several processes, got {steps}")
    speculative = None
    if spec:
        speculative = SpeculativeConfig(
            config.speculative_method, config.num_speculative_tokens,
            config.ngram_min or min(config.ngram_max, backend.ngram_min), config.ngram_max,
            config.speculative_max_num_seqs,
            config.speculative_overlap if config.speculative_overlap is not None else (
                backend.ngram_overlap and config.speculative_method == "ngram"),
            _resolve_draft(config, draft, facts, max_model_len, pages_per_seq) if config.speculative_method == "draft"
            else None)
    cache_dir = default_compilation_cache_dir() if config.compilation_cache_dir is None else \
        config.compilation_cache_dir
    return ResolvedConfig(
        model=model.name, platform=facts.platform, attention_backend=attention, dtype=dtype, layer_loop=layer_loop,
        quantization=quantization, kv_cache_dtype=config.kv_cache_dtype, load_format=config.load_format,
        seed=config.seed, max_model_len=max_model_len, page_size=config.page_size, num_pages=config.num_pages,
        buckets=buckets, max_num_seqs=config.max_num_seqs, max_num_batched_tokens=budget,
        prefill_chunk_size=config.prefill_chunk_size or budget, scheduling_policy=config.scheduling_policy,
        preemption_mode=config.preemption_mode, enable_prefix_caching=config.enable_prefix_caching,
        num_scheduler_steps=steps, max_logprobs=config.max_logprobs, max_executables=config.max_executables,
        tensor_parallel=config.tensor_parallel, data_parallel=config.data_parallel, compilation_cache_dir=cache_dir,
        speculative=speculative)


def _resolve_draft(config: EngineConfig, draft: ModelFacts | None, facts: DeviceFacts, max_model_len: int,
                   pages_per_seq: int) -> ResolvedConfig:
    """The draft model's engine: the target's sizes, dtype, load format and seed, on one device, its own
    default buckets and quantization, prefix caching on (it re-reads each request's tokens every step),
    and a pool of ``pages_per_seq`` pages for up to 64 requests unless ``num_pages`` is given."""
    if draft is None:
        raise ValueError("speculative_method='draft' needs the draft model's facts")
    return resolve(dataclasses.replace(
        config, speculative_method=None, speculative_model=None, max_model_len=max_model_len,
        num_pages=config.num_pages or pages_per_seq * min(config.max_num_seqs, 64), token_buckets=None,
        page_buckets=None, quantization="auto", tensor_parallel=1, data_parallel=1, enable_prefix_caching=True),
        draft, facts)


def size_kv_pool(resolved: ResolvedConfig, mc: ModelConfig, facts: DeviceFacts, kv_memory_fraction: float,
                 cpu_kv_cache_gib: float) -> ResolvedConfig:
    """``resolved`` with its KV pool's page count: as given, else the pages of the cache's element dtype
    (with their scales, if quantized) that fit the memory every device of the replica has left after
    the weights (``facts`` measured then; each device holds its KV heads of every page), or on CPU
    enough for ``max_num_seqs`` full-length sequences within ``cpu_kv_cache_gib``."""
    pages = resolved.num_pages
    if pages is None:
        tp = resolved.tensor_parallel
        per_page = KVCache.bytes_per_page(mc.num_layers, resolved.page_size, max(mc.num_kv_heads, tp) // tp,
                                          mc.head_dim, resolved.kv_storage_dtype)
        if resolved.backend.pool_from_device_memory and facts.memory:
            free = min(limit * kv_memory_fraction - used for limit, used in facts.memory)
            pages = max(1, int(free // per_page))
        else:
            want = resolved.max_num_seqs * resolved.pages_per_seq
            pages = max(resolved.pages_per_seq, min(want, int(cpu_kv_cache_gib * 2**30 // per_page)))
    if pages < resolved.pages_per_seq:
        raise ValueError(f"the KV pool ({pages} pages of {resolved.page_size} tokens) cannot hold one sequence of "
                         f"max_model_len={resolved.max_model_len}; raise num_pages"
                         f"{'' if resolved.num_pages else ' (or kv_cache_memory_fraction)'} or lower max_model_len")
    return dataclasses.replace(resolved, num_pages=pages)
