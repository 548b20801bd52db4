"""Greedy tokens of the embedded model (float32) on one machine against those of another.

The GPU kernels' end-to-end check: write the CPU reference's tokens, carry the JSON to the GPU
machine, compare there with the Pallas backend under both layer loops (a static and a traced layer
index). Eight prompts run as one continuous batch, so steps mix prefill chunks and decodes.

    python scripts/compare_greedy.py --write greedy_cpu.json          # CPU: attention_backend=reference
    python scripts/compare_greedy.py --compare greedy_cpu.json        # GPU: attention_backend=auto
"""

from __future__ import annotations

import argparse
import json
import sys

from jaxinfer import LLM, SamplingParams

PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "def fibonacci(n):",
           "List three prime numbers:", "Once upon a time, in a small village,", "1, 2, 3, 4,",
           "The quick brown fox", "Explain what a GPU is in one sentence."]


def greedy_ids(max_tokens: int, **options) -> list[list[int]]:
    llm = LLM(dtype="float32", max_num_seqs=len(PROMPTS), **options)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [out.token_ids for out in llm.generate(PROMPTS, params)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", metavar="JSON", help="generate with the reference attention, save the ids")
    mode.add_argument("--compare", metavar="JSON", help="generate with --attention_backend, compare to the ids")
    ap.add_argument("--attention_backend", default="auto")
    ap.add_argument("--max_tokens", type=int, default=48)
    args = ap.parse_args()
    if args.write:
        with open(args.write, "w") as f:
            json.dump(greedy_ids(args.max_tokens, attention_backend="reference"), f)
        print(f"wrote {args.write}")
        return 0
    with open(args.compare) as f:
        want = json.load(f)
    ok = True
    for loop in ("unroll", "scan"):
        got = greedy_ids(len(want[0]), attention_backend=args.attention_backend, layer_loop=loop)
        first_diff = [next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), None) for g, w in zip(got, want)]
        same = sum(d is None for d in first_diff)
        print(f"{loop}: {same}/{len(want)} prompts token-identical over {len(want[0])} tokens; "
              f"first differing index per prompt: {first_diff}")
        ok &= same == len(want)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
