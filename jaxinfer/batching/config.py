"""Engine options: one frozen dataclass, validated when built, so bad options fail before any work, and
what each option means (``OPTIONS``), from which the command line makes its flags (``cli.options``).

This module imports no JAX, so ``jaxinfer serve --help`` lists every option at once."""

from __future__ import annotations

import dataclasses

from jaxinfer.formats import KV_CACHE_DTYPES, LOAD_FORMATS, QUANTIZATIONS
from jaxinfer.sampling_params import MAX_LOGPROBS
from jaxinfer.user_cache import user_cache_dir

ATTENTION_BACKENDS = ("auto", "reference", "cpu", "pallas_gpu", "pallas_tpu", "interpret")  # ``batching.backend``
SPECULATIVE_METHODS = ("ngram", "draft")  # ``batching.speculative``
MAX_SPECULATIVE_TOKENS = 16  # a verify step feeds 1 + k tokens per sequence and keeps k + 1 logits rows

_CHOICES = {
    "dtype": ("auto", "float32", "bfloat16"),
    "load_format": LOAD_FORMATS,
    "quantization": ("auto", *QUANTIZATIONS),
    "kv_cache_dtype": KV_CACHE_DTYPES,
    "scheduling_policy": ("fcfs", "priority"),
    "preemption_mode": ("recompute", "swap"),
    "attention_backend": ATTENTION_BACKENDS,
    "layer_loop": ("auto", "scan", "unroll", "indexed"),
    "structured_outputs_whitespace": ("compact", "default", "flexible"),  # ``batching.structured``
}


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """What a user of vLLM would pass to ``LLM(...)``; ``None`` means "derive a default". What each
    field does is in ``OPTIONS`` (the ``--help`` of ``jaxinfer serve``, which makes a flag of each)."""

    page_size: int = 16
    num_pages: int | None = None
    kv_cache_memory_fraction: float = 0.9
    cpu_kv_cache_gib: float = 2.0
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    structured_outputs_whitespace: str = "compact"
    prefill_chunk_size: int | None = None
    max_model_len: int | None = None
    dtype: str = "auto"
    load_format: str = "auto"
    quantization: str = "auto"
    kv_cache_dtype: str = "auto"
    seed: int = 0
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"
    preemption_mode: str = "recompute"
    attention_backend: str = "auto"
    layer_loop: str = "auto"
    token_buckets: tuple[int, ...] | None = None
    seq_buckets: tuple[int, ...] | None = None
    page_buckets: tuple[int, ...] | None = None
    compilation_cache_dir: str | None = None
    max_executables: int = 256
    max_logprobs: int = MAX_LOGPROBS
    tensor_parallel: int = 1
    data_parallel: int = 1
    speculative_method: str | None = None
    speculative_model: str | None = None
    num_speculative_tokens: int = 4
    ngram_min: int | None = None
    ngram_max: int = 4
    speculative_max_num_seqs: int = 16
    speculative_overlap: bool | None = None
    num_scheduler_steps: int | None = None
    revision: str | None = None
    download_dir: str | None = None
    gguf_file: str | None = None
    skip_tokenizer_init: bool = False
    tokenizer: str | None = None

    def __post_init__(self):
        for name, allowed in _CHOICES.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        for name in ("page_size", "max_num_seqs", "max_num_batched_tokens", "max_executables", "tensor_parallel",
                     "data_parallel"):
            _positive(name, getattr(self, name))
        _check_speculative(self)
        for name in ("revision", "download_dir", "gguf_file", "tokenizer"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name} must be None or a non-empty string, got {value!r}")
        for name in ("num_pages", "prefill_chunk_size", "max_model_len", "num_scheduler_steps"):
            if getattr(self, name) is not None:
                _positive(name, getattr(self, name))
        if isinstance(self.max_logprobs, bool) or not isinstance(self.max_logprobs, int) or \
                not 0 <= self.max_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"max_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.max_logprobs!r}")
        if not 0 < self.kv_cache_memory_fraction <= 1:
            raise ValueError(f"kv_cache_memory_fraction must be in (0, 1], got {self.kv_cache_memory_fraction}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                             f"({self.max_num_seqs}): every running sequence needs one token per step")
        for name in ("token_buckets", "seq_buckets", "page_buckets"):
            value = getattr(self, name)
            if value is not None:
                value = tuple(sorted(value))
                if not value or any(not isinstance(v, int) or v < 1 for v in value):
                    raise ValueError(f"{name} must be positive integers, got {value!r}")
                object.__setattr__(self, name, value)

    def model_location(self) -> dict:
        """``resolve_model``'s keywords for the model these options load (not the draft model, which
        takes only ``download_dir``)."""
        return dict(revision=self.revision, download_dir=self.download_dir, gguf_file=self.gguf_file)

    @classmethod
    def from_options(cls, **options) -> "EngineConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - names)
        if unknown:
            raise TypeError(f"unknown engine option(s) {unknown}; valid options: {sorted(names)}")
        return cls(**options)


def default_compilation_cache_dir() -> str:
    """``$XDG_CACHE_HOME/jaxinfer/xla``, or ``~/.cache/jaxinfer/xla``."""
    return user_cache_dir("xla")


def _positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _check_speculative(c: EngineConfig) -> None:
    if c.speculative_method is not None and c.speculative_method not in SPECULATIVE_METHODS:
        raise ValueError(f"speculative_method must be None or one of {SPECULATIVE_METHODS}, got {c.speculative_method!r}")
    for name in ("num_speculative_tokens", "ngram_max", "speculative_max_num_seqs"):
        _positive(name, getattr(c, name))
    if c.ngram_min is not None:
        _positive("ngram_min", c.ngram_min)
    if c.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
        raise ValueError(f"num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], "
                         f"got {c.num_speculative_tokens}")
    if (c.speculative_method == "draft") != (c.speculative_model is not None):
        raise ValueError("speculative_model must be given with speculative_method='draft', and only then; got "
                         f"speculative_method={c.speculative_method!r}, speculative_model={c.speculative_model!r}")
    if c.ngram_min is not None and c.ngram_min > c.ngram_max:
        raise ValueError(f"ngram_min ({c.ngram_min}) must be <= ngram_max ({c.ngram_max})")


@dataclasses.dataclass(frozen=True)
class Option:
    """What an ``EngineConfig`` field means: its help text and, where vLLM names the same option
    otherwise, vLLM's flag (``jaxinfer serve`` accepts both spellings, with dashes or underscores)."""

    help: str
    vllm: str | None = None


# Every field of EngineConfig, in the order ``--help`` lists them.
OPTIONS = {
    "max_model_len": Option("Longest prompt plus completion, in tokens (default: the model's context length)."),
    "max_num_seqs": Option("Most sequences computed together in one step."),
    "max_num_batched_tokens": Option("Token budget of one step: prefill chunks plus one token per decoding "
                                     "sequence (>= max_num_seqs)."),
    "prefill_chunk_size": Option("Most prompt tokens one request feeds per step (default: the step budget).",
                                 "long_prefill_token_threshold"),
    "dtype": Option("Weights and KV cache dtype; auto: float32 on CPU, bfloat16 on accelerators."),
    "load_format": Option("auto reads the weights; dummy uses random ones of the same shapes (benchmarks)."),
    "quantization": Option(
        "Weights: auto: a GGUF runs in its own blocks unless --dtype is given (on CPU through a native kernel "
        "built once with the C++ compiler; float32 without one), a jaxinfer convert directory as saved, other "
        "sources in full precision; none: full precision; gguf: a GGUF's blocks; int8, int4[-gN] (N: 32, 64, "
        "128; plain int4: the largest dividing the model's matrices), fp8: quantized at load."),
    "kv_cache_dtype": Option("KV cache storage: auto: the model's dtype; int8 / fp8 (e4m3): codes with a float32 "
                             "scale per token and kv head, about half of bf16's bytes (not with the TPU kernel or "
                             "tensor parallelism)."),
    "seed": Option("Seed of requests that give none (each draws its own from it), and of dummy weights."),
    "page_size": Option("Tokens per KV cache page.", "block_size"),
    "structured_outputs_whitespace": Option(
        "Whitespace of JSON generated under a schema: compact (no whitespace: ',' and ':'), default (', ' and "
        "': ', as json.dumps writes it) or flexible (any whitespace: the model's own style, which may run to "
        "max_tokens in newlines)."),
    "num_pages": Option("KV pool size in pages (default: kv_cache_memory_fraction of accelerator memory; on CPU "
                        "max_num_seqs full-length sequences, at most cpu_kv_cache_gib).", "num_gpu_blocks_override"),
    "kv_cache_memory_fraction": Option("Fraction of accelerator memory for the weights plus the KV cache.",
                                       "gpu_memory_utilization"),
    "cpu_kv_cache_gib": Option("Most GiB the default KV pool takes on CPU."),
    "enable_prefix_caching": Option("Reuse the KV pages of shared prompt prefixes."),
    "scheduling_policy": Option("Order of admission: fcfs, first come first served; priority: by each request's "
                                "priority (lower first), preempting running requests of a later priority."),
    "preemption_mode": Option("A preempted request's KV: recompute it when resumed, or swap it to host memory."),
    "tensor_parallel": Option("Devices each model replica is split over (attention heads, MLP, experts, "
                              "vocabulary); the first data_parallel x tensor_parallel devices are used.",
                              "tensor_parallel_size"),
    "data_parallel": Option("Model replicas, each serving its share of the requests.", "data_parallel_size"),
    "speculative_method": Option("Speculative decoding (off by default): ngram proposes the tokens that followed "
                                 "the sequence's last n-gram in its own prompt and output; draft the greedy "
                                 "continuation of speculative_model. Outputs are those without it."),
    "speculative_model": Option("draft: a smaller model with the target's tokenizer, loaded like the target."),
    "num_speculative_tokens": Option(f"Tokens proposed per sequence and step (1..{MAX_SPECULATIVE_TOKENS})."),
    "ngram_min": Option("Shortest n-gram the ngram proposer matches (default: 2 on CPU, 1 elsewhere).",
                        "prompt_lookup_min"),
    "ngram_max": Option("Longest n-gram the ngram proposer matches (tried first).", "prompt_lookup_max"),
    "speculative_max_num_seqs": Option("Speculation pauses while more sequences than this run (where a step stops "
                                       "being memory-bound)."),
    "speculative_overlap": Option("Keep a verifying step in flight while the next is proposed and dispatched "
                                  "(default: on with ngram except on CPU)."),
    "num_scheduler_steps": Option("Decode steps one dispatch runs for a batch of decodes (default: 4 on CPU, 1 "
                                  "elsewhere); tokens then stream in runs of this many."),
    "attention_backend": Option("Attention kernels: auto picks per device (cpu on CPU, pallas_gpu / pallas_tpu); "
                                "reference is the jnp oracle; interpret runs the Pallas kernels interpreted."),
    "layer_loop": Option("How the layers are looped: auto: unrolled on GPU, indexed on CPU (one loop body reading "
                         "each layer's weights in place), scanned over a mesh."),
    "token_buckets": Option("Padded token counts steps compile for, comma-separated (default per backend: on CPU "
                            "1, 8, 16, x4..., up to max_num_batched_tokens)."),
    "seq_buckets": Option("Padded sequence counts (default per backend: on CPU 1, 4, 8, 16, x4..., up to "
                          "max_num_seqs)."),
    "page_buckets": Option("Padded pages per sequence (default per backend: on CPU max_model_len / page_size)."),
    "compilation_cache_dir": Option("XLA's persistent compilation cache, so a restart loads the steps instead of "
                                    "compiling them (default $XDG_CACHE_HOME/jaxinfer/xla; empty turns it off)."),
    "max_executables": Option("Most compiled steps kept alive (least recently used evicted), which bounds the "
                              "memory mappings compiled code holds."),
    "max_logprobs": Option(f"Most top logprobs a request may ask for per token (0..{MAX_LOGPROBS})."),
    "revision": Option("Branch, tag or commit of a model named by Hugging Face Hub id (default main)."),
    "download_dir": Option("Cache directory Hub models are fetched into and found in (default $HF_HUB_CACHE, "
                           "$HF_HOME/hub, ~/.cache/huggingface/hub)."),
    "gguf_file": Option("The one .gguf file of a Hub repo or local directory to load (as org/name:file.gguf)."),
    "tokenizer": Option("The tokenizer, where not the model's own: a directory of Hugging Face tokenizer files or "
                        "a Hub id (only its tokenizer files are fetched), or a .gguf file."),
    "skip_tokenizer_init": Option("Load no tokenizer (a checkpoint without tokenizer files): prompts must be token "
                                  "ids, and outputs have token ids but no text."),
}
