"""Perplexity of one model under each weight quantization and KV cache dtype, on the held public-domain
text (tests/data/held_text.txt), with resident parameter bytes and how often each run's greedy next
token agrees with the first run's: the quality tables of docs/benchmarks.md.

    python scripts/perplexity.py                                  # the embedded SmolLM2, all schemes
    python scripts/perplexity.py --schemes none,int8 --max_tokens 1024
    python scripts/perplexity.py --schemes none --kv_cache_dtypes auto,int8,fp8 --max_tokens 1024
"""

from __future__ import annotations

import json
import os
import sys
import time

import jax
from absl import app, flags

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from jaxinfer.models.perplexity import score  # noqa: E402
from jaxinfer.models.weights import load_model, resolve_model  # noqa: E402
from jaxinfer.tokenizer import load_tokenizer  # noqa: E402

TEXT = os.path.join(os.path.dirname(__file__), "..", "tests", "data", "held_text.txt")
flags.DEFINE_string("model", "smollm2-135m", "Preset name, .gguf file or Hugging Face directory.")
flags.DEFINE_list("schemes", ["none", "gguf", "int8", "int4-g32", "int4-g64", "fp8"],
                  "Quantizations to compare (the first is the reference).")
flags.DEFINE_list("kv_cache_dtypes", ["auto"], "KV cache dtypes to run each scheme with (auto, int8, fp8).")
flags.DEFINE_integer("max_tokens", 0, "Tokens of the text to score (0: all of it).")
flags.DEFINE_string("out", "results/perplexity.json", "Where to write the JSON results.")
F = flags.FLAGS


def main(argv):
    del argv
    tokenizer = load_tokenizer(resolve_model(F.model))
    with open(TEXT) as f:
        ids = tokenizer.encode(f.read())
    ids = ids[:F.max_tokens] if F.max_tokens else ids
    rows, greedy = [], []
    for scheme in F.schemes:
        config, weights = load_model(F.model, quantization=scheme)
        for kv in F.kv_cache_dtypes:
            t0 = time.perf_counter()
            s = score(weights, config, ids, kv_cache_dtype=kv)
            greedy.append(s.greedy)
            rows.append(dict(quantization=scheme, kv_cache_dtype=kv, perplexity=s.perplexity,
                             greedy_agreement=float((s.greedy == greedy[0]).mean()),
                             seconds=time.perf_counter() - t0,
                             param_bytes=sum(x.nbytes for x in jax.tree.leaves(weights))))
            print(rows[-1], flush=True)
        del weights
    ref = rows[0]["perplexity"]
    for r in rows:
        r["vs_reference"] = r["perplexity"] / ref - 1
    result = dict(command=" ".join(["python"] + sys.argv), model=F.model, tokens=len(ids),
                  device=f"{jax.devices()[0].device_kind} (jax {jax.__version__})", rows=rows)
    os.makedirs(os.path.dirname(F.out) or ".", exist_ok=True)
    with open(F.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"\n{F.model}, {len(ids)} tokens of tests/data/held_text.txt\n")
    first = f"{rows[0]['quantization']}, KV {rows[0]['kv_cache_dtype']}"
    print(f"| quantization | KV cache | perplexity | vs {first} | greedy agreement | parameter MB |")
    print("|---|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['quantization']} | {r['kv_cache_dtype']} | {r['perplexity']:.3f} | {r['vs_reference']:+.2%} | "
              f"{r['greedy_agreement']:.2%} | {r['param_bytes'] / 1e6:.1f} |")


if __name__ == "__main__":
    app.run(main)
