"""Engine options: one frozen dataclass, validated when built, so bad options fail before any work."""

from __future__ import annotations

import dataclasses

from jaxinfer.batching.backend import ATTENTION_BACKENDS
from jaxinfer.batching.speculative import MAX_SPECULATIVE_TOKENS, METHODS
from jaxinfer.formats import KV_CACHE_DTYPES
from jaxinfer.models.weights import LOAD_FORMATS, QUANTIZATIONS
from jaxinfer.sampling_params import MAX_LOGPROBS
from jaxinfer.user_cache import user_cache_dir

_CHOICES = {
    "dtype": ("auto", "float32", "bfloat16"),
    "load_format": LOAD_FORMATS,
    "quantization": ("auto", *QUANTIZATIONS),
    "kv_cache_dtype": KV_CACHE_DTYPES,
    "scheduling_policy": ("fcfs", "priority"),
    "preemption_mode": ("recompute", "swap"),
    "attention_backend": ATTENTION_BACKENDS,
    "layer_loop": ("auto", "scan", "unroll", "indexed"),
}


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """What a user of vLLM would pass to ``LLM(...)``; ``None`` means "derive a default".

    - ``revision``, ``download_dir``, ``gguf_file`` (vLLM's): where a model named by Hugging Face Hub
      id (``org/name``) comes from: its branch, tag or commit (default ``main``); the cache directory
      it is fetched into or found in (default ``$HF_HUB_CACHE``, ``$HF_HOME/hub``,
      ``~/.cache/huggingface/hub``); the one ``.gguf`` file of the repo (or of a local directory) to
      load, as ``org/name:file.gguf`` does. ``HF_HUB_OFFLINE=1`` reads only the cache, ``HF_TOKEN``
      opens gated and private repos (``models.weights.hub``). ``speculative_model`` is fetched into
      the same ``download_dir``, at its ``main``.
    - ``num_pages``: KV pool size; by default sized from ``kv_cache_memory_fraction`` of device
      memory on accelerators, and to hold ``max_num_seqs`` full-length sequences (at most
      ``cpu_kv_cache_gib``) on CPU.
    - ``max_model_len``: defaults to the model's context length.
    - ``prefill_chunk_size``: most prompt tokens one request feeds per step (default: the budget).
    - ``token_buckets``/``seq_buckets``/``page_buckets``: the padded shapes steps compile for
      (default on CPU: tokens 1, 8, 16, x4..., sequences 1, 4, 8, 16, x4..., pages 16, x4..., each up to its limit,
      measured to lose little to padding there while compiling few shapes; elsewhere powers of two).
    - ``compilation_cache_dir``: XLA's persistent compilation cache, so a restart loads the steps
      instead of compiling them; default ``$XDG_CACHE_HOME/jaxinfer/xla`` (``~/.cache/...``), ``""``
      turns it off.
    - ``max_executables``: most compiled steps kept alive (least recently used evicted); bounds the
      memory mappings compiled code holds, so a long-running process meeting many shapes cannot
      exhaust ``vm.max_map_count``. Warm-up refuses to plan more than this.
    - ``dtype="auto"``: float32 on CPU, bfloat16 on accelerators.
    - ``layer_loop="auto"``: unrolled on GPU (measured faster), "indexed" on CPU (one loop body, so
      it compiles far faster than unrolled, and its matmuls read each layer's weights in place: the
      batch-1 SmolLM2 step took 29.6 ms against the scan's 43.1 on a quiet 2-core CPU), scanned over
      a mesh.
    - ``quantization="auto"``: a GGUF file runs in its own blocks unless ``dtype`` is given (then
      it is dequantized to that dtype at load); on CPU through a native kernel built on first use,
      so only where a C++ compiler is found (else float32, with a warning); a directory written by
      ``jaxinfer convert --quantization Q`` as it was saved; other sources in full
      precision (``"gguf"`` asks for the blocks explicitly). ``"int8"``,
      ``"int4[-g32|-g64|-g128]"``, ``"fp8"``: quantized at load (``jaxinfer.quant``).
    - ``tensor_parallel``/``data_parallel``: the model split over ``tensor_parallel`` devices, in
      ``data_parallel`` replicas (``jaxinfer.models.sharding``); other than ``1 x 1`` their product
      must be the device count (checked against the model when the engine is built). Quantized
      weights are split with their scales (``models.sharding``); ``quantization="auto"`` keeps a
      GGUF in full precision over a mesh.
    - ``kv_cache_dtype`` (vLLM's ``--kv-cache-dtype``): ``"auto"`` stores K/V in the model's dtype;
      ``"int8"`` and ``"fp8"`` (float8_e4m3fn) store codes with a float32 scale per token and kv head
      (``jaxinfer.paged.kv_cache``): about half of bf16's bytes, so the default pool holds about twice
      the pages. The reference and ``pallas_gpu`` backends read them; not yet with the TPU kernel nor
      with ``tensor_parallel > 1``.
    - ``speculative_method``: ``None`` (off), ``"ngram"`` (prompt lookup, ``batching.speculative``) or
      ``"draft"`` (greedy proposals of ``speculative_model``, a model with the target's tokenizer, run in
      its own engine with this config's sizes, dtype, load format and seed):
      up to ``num_speculative_tokens`` (1..16) proposed tokens per sequence are verified in one step,
      matched against the last ``ngram_min..ngram_max`` tokens (``ngram_min=None``: 2 on CPU, 1 elsewhere;
      see ``batching.speculative.default_ngram_min``). Outputs are those without speculation
      (greedy: token-identical; sampling: the same distribution). Speculation is off for a step when
      more than ``speculative_max_num_seqs`` sequences run (where the step stops being memory-bound).
      ``speculative_overlap``: whether a step that verifies proposals stays in flight while the next is
      proposed and dispatched (``LLMEngine.step``); ``None``: on with the ``ngram`` proposer except on
      CPU (``batching.speculative.default_overlap`` says why).
    - ``num_scheduler_steps`` (vLLM's multi-step scheduling): a batch in which every sequence decodes
      runs this many steps in one dispatch, the tokens streaming in runs of as many; ``None``: 4 on
      CPU, 1 elsewhere (``batching.engine.default_scheduler_steps`` says why). Runs one step at a time
      while a request waits for a free slot or is preempted, a prefill is in the batch, or penalties,
      speculation or structured outputs are on; tokens past a stop within a run are computed and
      dropped.
    """

    page_size: int = 16
    num_pages: int | None = None
    kv_cache_memory_fraction: float = 0.9
    cpu_kv_cache_gib: float = 2.0
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
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

    def __post_init__(self):
        for name, allowed in _CHOICES.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        for name in ("page_size", "max_num_seqs", "max_num_batched_tokens", "max_executables", "tensor_parallel",
                     "data_parallel"):
            _positive(name, getattr(self, name))
        _check_speculative(self)
        for name in ("revision", "download_dir", "gguf_file"):
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
    if c.speculative_method is not None and c.speculative_method not in METHODS:
        raise ValueError(f"speculative_method must be None or one of {METHODS}, got {c.speculative_method!r}")
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
