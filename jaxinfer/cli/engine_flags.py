"""The engine flags of the server (sizes, buckets, KV pool), shared by ``jaxinfer serve`` and
``benchmarks/bench_serving.py`` so that a benchmark's server and its offline peer run exactly the same
``EngineConfig``. Importing this module defines them (next to model_flags'); a command adopts them with
``flags.adopt_module_key_flags``. It imports no JAX.

The defaults are sized for a small CPU: every step shape is compiled before the server is ready.
Unset bucket flags leave the buckets to the engine, which picks them per backend (few, coarse ones
on CPU; ``batching.backend``).
"""

from __future__ import annotations

from absl import flags

from jaxinfer.cli import model_flags  # defines --model, --load_format, --dtype, --compilation_cache_dir, parallel sizes

flags.DEFINE_integer("max_num_seqs", 16, "Most sequences computed together in one step.")
flags.DEFINE_integer("max_num_batched_tokens", 128, "Token budget of one step (prefill chunks plus decodes).")
flags.DEFINE_integer("max_model_len", 1024, "Longest prompt plus completion, in tokens.")
flags.DEFINE_integer("page_size", 16, "Tokens per KV cache page.")
flags.DEFINE_integer("num_pages", None, "KV pool size in pages (default: derived from memory).")
flags.DEFINE_float("kv_cache_memory_fraction", 0.9, "Fraction of accelerator memory for weights plus KV cache.")
flags.DEFINE_boolean("enable_prefix_caching", True, "Reuse KV pages of shared prompt prefixes.")
flags.DEFINE_enum("scheduling_policy", "fcfs", ["fcfs", "priority"], "Order of admission: 'fcfs' first come first "
                  "served; 'priority' by each request's priority (lower first, ties first come first served), "
                  "preempting running requests of a later priority.")
flags.DEFINE_list("token_buckets", None, "Padded token counts steps compile for (default: the engine's; on CPU "
                  "1, 8, 16, x4, ... up to --max_num_batched_tokens).")
flags.DEFINE_list("seq_buckets", None, "Padded sequence counts (default: the engine's; on CPU 1, 4, 8, 16, x4, "
                  "... up to --max_num_seqs).")
flags.DEFINE_list("page_buckets", None, "Padded pages per sequence (default: the engine's; on CPU one, "
                  "max_model_len / page_size: its attention reads only the context a batch fills).")
flags.DEFINE_enum("speculative_method", None, ["ngram", "draft"], "Speculative decoding (off by default): 'ngram' "
                  "proposes the tokens that followed the sequence's last n-gram in its own prompt and output; "
                  "'draft' the greedy continuation of --speculative_model.")
flags.DEFINE_string("speculative_model", None, "draft: a smaller model with the target's tokenizer (preset, Hugging "
                    "Face directory or .gguf), loaded like the target.")
flags.DEFINE_integer("num_speculative_tokens", 4, "Tokens proposed per sequence and step (1..16).")
flags.DEFINE_integer("ngram_min", None, "Shortest n-gram the ngram proposer matches (default: the engine's, "
                     "2 on CPU and 1 elsewhere).")
flags.DEFINE_integer("ngram_max", 4, "Longest n-gram the ngram proposer matches (tried first).")
flags.DEFINE_integer("speculative_max_num_seqs", 16, "Speculation pauses while more sequences than this run.")
flags.DEFINE_boolean("speculative_overlap", None, "Keep verifying steps in flight while the next is proposed and "
                     "dispatched (default: the engine's, on with ngram except on CPU).")
flags.DEFINE_integer("num_scheduler_steps", None, "Decode steps one dispatch runs for a batch of decodes (default: "
                     "the engine's, 4 on CPU and 1 elsewhere); tokens then stream in runs of this many.")
F = flags.FLAGS

# The flags that pass through unchanged to ``jaxinfer serve`` when a benchmark launches it.
NAMES = ("model", "load_format", "dtype", "quantization", "kv_cache_dtype", "compilation_cache_dir", "max_num_seqs",
         "max_num_batched_tokens", "max_model_len", "page_size", "num_pages", "kv_cache_memory_fraction",
         "enable_prefix_caching", "scheduling_policy", "token_buckets", "seq_buckets", "page_buckets", "tensor_parallel", "data_parallel",
         "speculative_method", "speculative_model", "num_speculative_tokens", "ngram_min", "ngram_max", "speculative_max_num_seqs",
         "speculative_overlap", "num_scheduler_steps", "revision", "download_dir", "gguf_file")


def buckets(values: list[str] | None) -> tuple[int, ...] | None:
    """The given sizes, or None: the engine's defaults for its backend."""
    return tuple(int(v) for v in values) if values else None


def engine_config():
    """The EngineConfig the flags describe."""
    from jaxinfer.batching.config import EngineConfig

    return EngineConfig(
        page_size=F.page_size, num_pages=F.num_pages, kv_cache_memory_fraction=F.kv_cache_memory_fraction,
        max_num_seqs=F.max_num_seqs, max_num_batched_tokens=F.max_num_batched_tokens,
        max_model_len=F.max_model_len, enable_prefix_caching=F.enable_prefix_caching,
        scheduling_policy=F.scheduling_policy,
        token_buckets=buckets(F.token_buckets), seq_buckets=buckets(F.seq_buckets),
        page_buckets=buckets(F.page_buckets), speculative_method=F.speculative_method,
        speculative_model=F.speculative_model, num_speculative_tokens=F.num_speculative_tokens, ngram_min=F.ngram_min, ngram_max=F.ngram_max,
        speculative_max_num_seqs=F.speculative_max_num_seqs, speculative_overlap=F.speculative_overlap,
        num_scheduler_steps=F.num_scheduler_steps,
        **model_flags.load_options(),
        **model_flags.parallel_options())


def command_line() -> list[str]:
    """These flags as ``jaxinfer serve`` arguments (those left at None are left out)."""
    args = []
    for name in NAMES:
        value = F[name].value
        if value is None:
            continue
        if isinstance(value, list):
            value = ",".join(value)
        args.append(f"--{name}={str(value).lower() if isinstance(value, bool) else value}")
    return args
