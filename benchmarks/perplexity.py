"""Perplexity of one model under each weight quantization and KV cache dtype, on the held public-domain
text (tests/data/held_text.txt), with resident parameter bytes and how often each run's greedy next
token agrees with the first run's, and each scheme's perplexity on each source the text is made of
(scored in the whole text's context): the quality tables of docs/benchmarks.md.

    python benchmarks/perplexity.py                                  # the embedded SmolLM2, all schemes
    python benchmarks/perplexity.py --schemes none,int8 --max-tokens 1024
    python benchmarks/perplexity.py --schemes none --kv-cache-dtypes auto,int8,fp8 --max-tokens 1024
"""

from __future__ import annotations

import json
import os
import sys
import time

import jax
import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from jaxinfer.cli.options import Parser  # noqa: E402
from jaxinfer.models.perplexity import score  # noqa: E402
from jaxinfer.models.weights import load_model, resolve_model  # noqa: E402
from jaxinfer.tokenizer import load_tokenizer  # noqa: E402

TEXT = os.path.join(os.path.dirname(__file__), "..", "tests", "data", "held_text.txt")


def comma_list(text: str) -> list[str]:
    return [v.strip() for v in text.split(",") if v.strip()]


def parser() -> Parser:
    p = Parser("perplexity.py", __doc__)
    p.option(None, "model", default="smollm2-135m", help="Preset name, .gguf file or Hugging Face directory "
             "[default: smollm2-135m].")
    p.option(None, "schemes", type=comma_list, default=["none", "gguf", "int8", "int4-g32", "int4-g64", "fp8"],
             metavar="SCHEME,SCHEME", help="Quantizations to compare (the first is the reference) "
             "[default: none,gguf,int8,int4-g32,int4-g64,fp8].")
    p.option(None, "kv-cache-dtypes", type=comma_list, default=["auto"], metavar="DTYPE,DTYPE",
             help="KV cache dtypes to run each scheme with (auto, int8, fp8) [default: auto].")
    p.option(None, "max-tokens", type=int, default=0, help="Tokens of the text to score (0: all of it) "
             "[default: 0].")
    p.option(None, "out", default="results/perplexity.json", help="Where to write the JSON results "
             "[default: results/perplexity.json].")
    return p

# The held text's sources, in order, by the words each one opens with.
PASSAGES = {"Austen": "It is a truth universally", "Dickens": "It was the best of times", "Melville": "Call me Ishmael",
            "Lincoln": "Four score and seven", "Declaration": "When in the Course", "Carroll": "Alice was beginning"}


def passage_starts(tokenizer, text: str, total: int, n: int) -> dict[str, tuple[int, int]]:
    """Each source's ``[start, end)`` in the text's ``total`` tokens (the tokens of the text before it;
    sources open a line, so the count does not depend on what follows), clipped to the ``n`` scored."""
    starts = [len(tokenizer.encode(text[:text.index(opening)])) for opening in PASSAGES.values()]
    bounds = zip(starts, starts[1:] + [total])
    return {name: (a, min(b, n)) for name, (a, b) in zip(PASSAGES, bounds) if a < n - 1}


def main(argv: list[str]) -> None:
    F = parser().parse(argv)
    tokenizer = load_tokenizer(resolve_model(F.model))
    with open(TEXT) as f:
        text = f.read()
    all_ids = tokenizer.encode(text)
    ids = all_ids[:F.max_tokens] if F.max_tokens else all_ids
    passages = passage_starts(tokenizer, text, len(all_ids), len(ids))
    rows, greedy = [], []
    for scheme in F.schemes:
        config, weights = load_model(F.model, quantization=scheme)
        for kv in F.kv_cache_dtypes:
            t0 = time.perf_counter()
            s = score(weights, config, ids, kv_cache_dtype=kv)
            greedy.append(s.greedy)
            # Position i predicts token i + 1: a source's tokens after its first are predicted at a .. b - 2.
            by_source = {name: float(np.exp(s.nll[max(a - 1, 0):b - 1].mean())) for name, (a, b) in passages.items()}
            rows.append(dict(quantization=scheme, kv_cache_dtype=kv, perplexity=s.perplexity, passages=by_source,
                             greedy_agreement=float((s.greedy == greedy[0]).mean()),
                             seconds=time.perf_counter() - t0,
                             param_bytes=sum(x.nbytes for x in jax.tree.leaves(weights))))
            print(rows[-1], flush=True)
        del weights
    ref = rows[0]["perplexity"]
    for r in rows:
        r["vs_reference"] = r["perplexity"] / ref - 1
        r["passages_vs_reference"] = {k: v / rows[0]["passages"][k] - 1 for k, v in r["passages"].items()}
    result = dict(command=" ".join(["python"] + sys.argv), model=F.model, tokens=len(ids), passage_tokens=passages,
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
    print(f"\nBy source (tokens {passages}): perplexity, and vs {first}\n")
    print("| quantization | KV cache | " + " | ".join(passages) + " |")
    print("|---|---|" + "---:|" * len(passages))
    for r in rows:
        cells = [f"{r['passages'][k]:.2f} ({r['passages_vs_reference'][k]:+.1%})" for k in passages]
        print(f"| {r['quantization']} | {r['kv_cache_dtype']} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
