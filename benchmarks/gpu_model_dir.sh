# Sourced by bench_serving_h200.sh and bench_structured_h200.sh: the repository's root as the working folder,
# $OUT (default /tmp/out) made, $PY (default python), and $MODEL_DIR (default /tmp/llama3-8b-smollm2tok: llama3-8b
# shapes with SmolLM2's tokenizer and chat template, random weights) made on first use.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-/tmp/out}
MODEL_DIR=${MODEL_DIR:-/tmp/llama3-8b-smollm2tok}
PY=${PY:-python}
mkdir -p "$OUT"
[ -f "$MODEL_DIR/config.json" ] || $PY benchmarks/make_dummy_model.py --shapes llama3-8b --out "$MODEL_DIR"
