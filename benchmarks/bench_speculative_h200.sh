#!/usr/bin/env bash
# Speculative decoding's H200 figures (benchmarks/bench_speculative.py), llama3-8b dummy weights, k = 4, each part one
# device call adding $OUT/spec-h200-*.json (split so that each stays under ten minutes with compilation):
#   bash benchmarks/bench_speculative_h200.sh verify     # one verify step of 4 proposals vs one decode step, batch 1/64/256
#   bash benchmarks/bench_speculative_h200.sh replay1    # end to end, batch 1: plain greedy vs replayed proposals (target >= 3x),
#                                                        # speculating steps overlapped (the default) and synchronous
#   bash benchmarks/bench_speculative_h200.sh replay64   # the same at batch 64
#   bash benchmarks/bench_speculative_h200.sh replay256  # the same at batch 256 (where speculation stops paying)
#   bash benchmarks/bench_speculative_h200.sh draft      # llama3.2-1b dummy proposing for llama3-8b: its cost per token
# No extra packages; the embedded GGUF is not needed (random prompts, dummy weights).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
PY=${PY:-python3}
mkdir -p "$OUT"
COMMON=(--model llama3-8b --load-format dummy --k 4 --prompt-len 128 --max-tokens 128 --compilation-cache-dir /tmp/xla-cache)
case "${1:?verify, replay1, replay64, replay256 or draft}" in
  verify) $PY benchmarks/bench_speculative.py "${COMMON[@]}" --workload verify --batch-sizes 1,64,256 \
            --out "$OUT/spec-h200-verify.json" ;;
  replay1|replay64|replay256) $PY benchmarks/bench_speculative.py "${COMMON[@]}" --workload replay \
            --batch-sizes "${1#replay}" --overlap on,off --out "$OUT/spec-h200-$1.json" ;;
  draft) $PY benchmarks/bench_speculative.py "${COMMON[@]}" --workload draft --draft-model llama3.2-1b \
            --batch-sizes 1 --out "$OUT/spec-h200-draft.json" ;;
  *) echo "unknown part $1" >&2; exit 2 ;;
esac
