#!/usr/bin/env bash
# The three serving workloads on one GPU: each launches the server, loads it, stops it, and runs
# the same requests offline with the same engine options, adding a run to $OUT/serving-h200.json.
#   bash benchmarks/bench_serving_h200.sh short      # ~10-token prompts x 256 tokens, 1000 requests, concurrency 256
#   bash benchmarks/bench_serving_h200.sh long       # 512-token prompts x 256 tokens, 1000 requests, concurrency 256
#   bash benchmarks/bench_serving_h200.sh batch1     # 16 sequential requests x 256 tokens, latency buckets
# Each prints the server's and the offline engine's start-up (load + compile) and records them in the JSON.
# short and long share every compiled shape: run long after short on the same machine (same
# /tmp/xla-cache) and both of its engines read their executables from the cache.
# MODEL_DIR (default /tmp/llama3-8b-smollm2tok) is made on first use: llama3-8b shapes + SmolLM2's tokenizer.
source "$(dirname "$0")/gpu_model_dir.sh"
COMMON=(--launch --offline --model "$MODEL_DIR" --load-format dummy --max-model-len 1024 --output-len 256
        --compilation-cache-dir /tmp/xla-cache --out "$OUT/serving-h200.json")
THROUGHPUT=(--max-num-seqs 256 --max-num-batched-tokens 2048 --token-buckets 256,1024,2048 --seq-buckets 256
            --page-buckets 64 --num-prompts 1000 --max-concurrency 256 --client-processes 8)
case "${1:?short, long or batch1}" in
  short)  $PY benchmarks/bench_serving.py "${COMMON[@]}" "${THROUGHPUT[@]}" --name short-x256 ;;
  long)   $PY benchmarks/bench_serving.py "${COMMON[@]}" "${THROUGHPUT[@]}" --input-len 512 --name in512-x256 ;;
  batch1) $PY benchmarks/bench_serving.py "${COMMON[@]}" --max-num-seqs 1 --max-num-batched-tokens 128 \
            --token-buckets 1,128 --seq-buckets 1 --page-buckets 64 --num-prompts 16 --max-concurrency 1 --name batch1 ;;
  *) echo "unknown workload $1" >&2; exit 2 ;;
esac
