#!/usr/bin/env bash
# Structured outputs' H200 overhead figures: 256 concurrent sequences, every one constrained, against the same
# requests unconstrained generating the same tokens (benchmarks/bench_structured.py), each adding $OUT/structured-h200-*.json.
#   bash benchmarks/bench_structured_h200.sh json_object   # the headline case: {"type": "json_object"} on every request
#   bash benchmarks/bench_structured_h200.sh schema        # a JSON schema that keeps every request going for 256 tokens
# Needs llguidance (no dependencies; cp39-abi3 manylinux_2_31 wheel, so any Python >= 3.9 on glibc >= 2.31).
# MODEL_DIR (default /tmp/llama3-8b-smollm2tok) is made on first use: llama3-8b shapes + SmolLM2's tokenizer.
# REPEATS (default 3): counted runs of each kind, medians reported; PROFILE=1 adds the host profile of each kind;
# NUM_PROMPTS (default 1024) requests per run.
source "$(dirname "$0")/gpu_model_dir.sh"
case "${1:?json_object or schema}" in
  json_object|schema) ;;
  *) echo "unknown workload $1" >&2; exit 2 ;;
esac
$PY benchmarks/bench_structured.py --model "$MODEL_DIR" --load-format dummy --max-model-len 1024 \
  --max-num-seqs 256 --max-num-batched-tokens 2048 --token-buckets 256,1024,2048 --seq-buckets 256 --page-buckets 64 \
  --num-prompts "${NUM_PROMPTS:-1024}" --output-len 256 --constraint "$1" --compilation-cache-dir /tmp/xla-cache \
  --repeats "${REPEATS:-3}" ${PROFILE:+--profile} \
  --out "$OUT/structured-h200-$1.json"
