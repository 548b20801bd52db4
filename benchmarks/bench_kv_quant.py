"""The quantized KV cache on one GPU: each ``kv_cache_dtype`` (auto = bf16, int8, fp8) in its own
``benchmarks/benchmark.py`` process (same flags otherwise, so the rows differ only in the cache), then one
table and one JSON of all the runs found in ``--out_dir``:

- batch-1 decode at a long context (``--latency-prompt-len``, default 4096, then 256 new tokens):
  ms/token, the attention kernels' share of it, bytes read per step (weights + KV);
- throughput, 1000 x (512 random prompt + 256 out) at 256 sequences: output tok/s, and the 256-sequence
  decode step (context 640) split into attention and the rest;
- the pool the same memory holds (``kv_cache_memory_fraction`` 0.9): pages, and how many
  sequences of 4,096 + 256 tokens (and of 512 + 256) fit at once.

One dtype per call keeps each under 10 minutes on an H200 (llama3-8b, dummy weights); runs already in
``--out-dir`` are kept, so the summary grows call by call:

    for kv in auto int8 fp8; do python benchmarks/bench_kv_quant.py --kv-cache-dtypes $kv --out-dir $OUT; done
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from jaxinfer.cli.options import Parser
from jaxinfer.formats import KV_CACHE_DTYPES


def kv_cache_dtypes(text: str) -> list[str]:
    values = [v.strip() for v in text.split(",") if v.strip()]
    bad = [v for v in values if v not in KV_CACHE_DTYPES]
    if bad:
        raise argparse.ArgumentTypeError(f"{', '.join(bad)}: not one of {', '.join(KV_CACHE_DTYPES)}")
    return values


def parser() -> Parser:
    p = Parser("bench_kv_quant.py", __doc__)
    p.option(None, "model", default="llama3-8b", help="Preset (dummy weights) [default: llama3-8b].")
    p.option(None, "kv-cache-dtypes", type=kv_cache_dtypes, default=["auto", "int8", "fp8"], metavar="DTYPE,DTYPE",
             help="KV cache dtypes to run, one process each [default: auto,int8,fp8].")
    p.option(None, "latency-prompt-len", type=int, default=4096, help="Prompt tokens of the batch-1 latency run "
             "[default: 4096].")
    p.option(None, "workloads", default="latency,throughput", help="benchmark.py workloads per dtype "
             "[default: latency,throughput].")
    p.option(None, "compilation-cache-dir", default="/tmp/xla-cache", help="Shared persistent compilation cache "
             "[default: /tmp/xla-cache].")
    p.option(None, "out-dir", default=os.environ.get("OUT", "results"), help="Where the per-dtype and summary "
             "JSON go [default: $OUT, else results].")
    return p


F = argparse.Namespace()  # the parsed flags (main sets them)

PAGE_SIZE = 16  # benchmark.py's engines use the default page size


def run_one(kv: str) -> None:
    out = os.path.join(F.out_dir, f"kvq-{F.model}-{kv}.json")
    cmd = [sys.executable, os.path.join(os.path.dirname(__file__), "benchmark.py"), "--model", F.model,
           "--load-format", "dummy", "--kv-cache-dtype", kv, "--workload", F.workloads,
           "--latency-prompt-len", str(F.latency_prompt_len), "--compilation-cache-dir", F.compilation_cache_dir,
           "--out", out]
    print(" ".join(cmd), flush=True)
    subprocess.run(cmd, check=False)  # a failed dtype leaves its partial JSON; the others still run


def summarize() -> dict:
    rows = []
    for kv in ("auto", "int8", "fp8"):
        path = os.path.join(F.out_dir, f"kvq-{F.model}-{kv}.json")
        if not os.path.exists(path):
            continue
        with open(path) as f:
            r = json.load(f)
        lat, thr = r.get("latency", {}), r.get("throughput", {})
        pages = thr.get("kv_pages")
        fit = (lambda n: pages // -(-n // PAGE_SIZE)) if pages else (lambda n: None)
        attention_key = next((k for k in thr if k.startswith("decode") and k.endswith("_attention_ms")), None)
        step_key = attention_key and attention_key.replace("_attention_ms", "_device_ms_per_step")
        rows.append(dict(
            kv_cache_dtype=kv, device=r.get("device"),
            latency_prompt_len=lat.get("prompt_len"), latency_ms_per_token=lat.get("ms_per_token"),
            latency_attention_ms=lat.get("attention_ms"), kv_bytes_per_token=lat.get("kv_bytes_per_token"),
            latency_bytes_per_step=lat.get("bytes_per_step"), latency_bw_fraction=lat.get("bw_fraction"),
            throughput_output_tok_s=thr.get("output_tok_s"), throughput_preemptions=thr.get("preemptions"),
            decode_step_attention_ms=thr.get(attention_key), decode_step_ms=thr.get(step_key),
            kv_pages=pages, max_seqs_4352_tokens=fit(4096 + 256), max_seqs_768_tokens=fit(512 + 256)))
    base = next((r for r in rows if r["kv_cache_dtype"] == "auto"), None)
    for r in rows:
        for k in ("latency_ms_per_token", "throughput_output_tok_s", "kv_pages"):
            if base and base.get(k) and r.get(k):
                r[f"{k}_vs_bf16"] = r[k] / base[k]
    return dict(model=F.model, load_format="dummy", rows=rows)


def main(argv: list[str]) -> None:
    global F
    F = parser().parse(argv)
    os.makedirs(F.out_dir, exist_ok=True)
    for kv in F.kv_cache_dtypes:
        run_one(kv)
    result = summarize()
    with open(os.path.join(F.out_dir, f"kv-quant-{F.model}.json"), "w") as f:
        json.dump(result, f, indent=2)
    fmt = lambda v, p=".3g": "" if v is None else format(v, p)  # noqa: E731
    print(f"\n{F.model}, dummy weights; latency: batch 1, {F.latency_prompt_len} prompt + 256 new\n")
    print("| KV cache | ms/token | vs bf16 | attention ms | KV bytes/token | output tok/s (256 seqs) | vs bf16 "
          "| 256-seq step ms (attention) | pages | seqs of 4352 | seqs of 768 |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in result["rows"]:
        print(f"| {r['kv_cache_dtype']} | {fmt(r['latency_ms_per_token'])} "
              f"| {fmt(r.get('latency_ms_per_token_vs_bf16'))} "
              f"| {fmt(r['latency_attention_ms'])} | {fmt(r['kv_bytes_per_token'], '.0f')} "
              f"| {fmt(r['throughput_output_tok_s'], '.0f')} | {fmt(r.get('throughput_output_tok_s_vs_bf16'))} "
              f"| {fmt(r['decode_step_ms'])} ({fmt(r['decode_step_attention_ms'])}) | {r['kv_pages']} "
              f"| {r['max_seqs_4352_tokens']} | {r['max_seqs_768_tokens']} |")
    print(f"(json: {os.path.join(F.out_dir, f'kv-quant-{F.model}.json')})")


if __name__ == "__main__":
    main(sys.argv[1:])
