"""The flags that choose and load the model, shared by ``jaxinfer serve``, ``jaxinfer generate`` and the
benchmarks (``benchmarks/benchmark.py``...) so that each means, defaults to and is checked the same
everywhere. Importing this module defines them; a command adopts them (``flags.adopt_module_key_flags``)
so that its ``--help`` lists them. It imports no JAX (the choices come from ``jaxinfer.formats``)."""

from __future__ import annotations

import sys

from absl import flags

from jaxinfer.formats import KV_CACHE_DTYPES, LOAD_FORMATS, QUANTIZATIONS

flags.DEFINE_string("model", "smollm2-135m", "Hugging Face Hub id (org/name, or org/name:file.gguf for one GGUF "
                    "file of a repo; fetched into the Hugging Face cache, HF_HUB_OFFLINE=1: the cache only, "
                    "HF_TOKEN: gated and private repos), local Hugging Face directory, .gguf file, or preset name "
                    "(e.g. llama3-8b, shapes only: with --load_format dummy).")
flags.DEFINE_string("revision", None, "Branch, tag or commit of a Hub id's repo (default: main).")
flags.DEFINE_string("download_dir", None, "Cache directory Hub ids are fetched into and found in (default: "
                    "$HF_HUB_CACHE, $HF_HOME/hub, ~/.cache/huggingface/hub).")
flags.DEFINE_string("gguf_file", None, "The .gguf file to load of a Hub repo or local directory (as "
                    "org/name:file.gguf).")
flags.DEFINE_enum("load_format", "auto", LOAD_FORMATS, "'auto' reads the weights; 'dummy' uses random "
                  "ones of the same shapes.")
flags.DEFINE_enum("dtype", "auto", ["auto", "float32", "bfloat16"], "Weights and KV cache dtype (auto: "
                  "float32 on CPU, bfloat16 on accelerators).")
flags.DEFINE_enum("quantization", "auto", ["auto", *QUANTIZATIONS],
                  "Weight quantization (auto: a .gguf file runs in its own blocks unless --dtype is given, on "
                  "CPU through a native kernel built once with the C++ compiler, float32 if there is none; a "
                  "directory written by jaxinfer convert --quantization as saved; gguf: those blocks; "
                  "none: full precision; int8/int4[-gN]/fp8: quantized at load).")
flags.DEFINE_enum("kv_cache_dtype", "auto", KV_CACHE_DTYPES,
                  "KV cache storage (vLLM's --kv-cache-dtype): auto: the model's dtype; int8 / fp8 (e4m3): "
                  "codes with a float32 scale per token and kv head, about half of bf16's bytes.")
flags.DEFINE_string("compilation_cache_dir", None, "Persistent XLA compilation cache (default: "
                    "$XDG_CACHE_HOME/jaxinfer/xla; '' turns it off): later runs skip "
                    "recompiling.")
flags.DEFINE_integer("tensor_parallel", 1, "Devices each model replica is split over (attention heads, MLP, "
                     "experts, vocabulary).")
flags.DEFINE_integer("data_parallel", 1, "Model replicas, each serving its share of the requests. Other than "
                     "1 x 1, data_parallel * tensor_parallel must be the device count (of all processes).")
flags.DEFINE_string("coordinator_address", None, "host:port of process 0 for a run over several processes or "
                    "hosts (jax.distributed); every process passes the same flags but its --process_id.")
flags.DEFINE_integer("num_processes", 1, "Processes of a multi-process run (with --coordinator_address).")
flags.DEFINE_integer("process_id", 0, "This process's index in [0, --num_processes); 0 runs the scheduler.")


def load_options() -> dict:
    """The engine options that choose how the weights are loaded."""
    f = flags.FLAGS
    return dict(load_format=f.load_format, dtype=f.dtype, quantization=f.quantization,
                kv_cache_dtype=f.kv_cache_dtype, compilation_cache_dir=f.compilation_cache_dir,
                revision=f.revision, download_dir=f.download_dir, gguf_file=f.gguf_file)


def model_argument(prog: str, args: list[str]) -> str:
    """The model to load: the one positional argument (``jaxinfer serve org/name``, as ``vllm serve``)
    or ``--model``; exits with one line if they disagree or there are several."""
    f = flags.FLAGS
    return choose_model(prog, args, f.model, f["model"].present > 0)


def choose_model(prog: str, args: list[str], flag: str, flag_given: bool) -> str:
    """``model_argument`` of positional ``args`` and the ``--model`` value ``flag`` (``flag_given``:
    set on the command line, not its default)."""
    if len(args) > 1:
        sys.exit(f"{prog}: give one model, got {len(args)} positional arguments: {' '.join(args)}")
    if not args:
        return flag
    if flag_given and args[0] != flag:
        sys.exit(f"{prog}: two models given, {args[0]!r} and --model={flag!r}: give one")
    return args[0]


def fetch_model(prog: str, model: str) -> None:
    """Resolve ``model`` as the engine will, before anything else loads: a Hub id is fetched into the
    Hugging Face cache now (with its progress bars), so the engine finds it there; a model that cannot
    be loaded exits with the one line that says why."""
    from jaxinfer.models.weights import check_has_weights, resolve_model

    f = flags.FLAGS
    try:
        source = resolve_model(model, revision=f.revision, download_dir=f.download_dir, gguf_file=f.gguf_file)
        check_has_weights(source, f.load_format)
    except ValueError as e:
        sys.exit(f"{prog}: {e}")


def parallel_options() -> dict:
    """The engine options these flags set."""
    return dict(tensor_parallel=flags.FLAGS.tensor_parallel, data_parallel=flags.FLAGS.data_parallel)


def init_distributed() -> bool:
    """Join the multi-process run the flags describe (before anything touches a device); returns
    whether this process is a follower, which runs the steps process 0 sends instead of the command
    (see ``jaxinfer.batching.multihost``)."""
    F = flags.FLAGS
    if F.coordinator_address is None:
        return False
    from jaxinfer.batching.multihost import initialize

    initialize(F.coordinator_address, F.num_processes, F.process_id)
    return F.process_id != 0
