"""JSONSchemaBench (github.com/guidance-ai/jsonschemabench, pinned at ba103c73) through jaxinfer's
structured-output policy (jaxinfer/batching/structured.py).

``compile``: every schema of every set (data/<Set>/*.json) through the constraint compile step alone,
each in a child process with a time limit: compiled (enforced whole) / relaxed / refused / crashed per
set, compile time p50/p99, and mask time per token p50/p99 over the first tokens of a valid instance
(maskbench/data/<Set>---<name>.json "tests"), beside MaskBench's published llguidance figures
(maskbench/README.md: 11,306 schemas, 8,909 passing, 2,377 compile errors, llguidance 0.7.10; overall
only, the per-set file maskbench/metainfo/all_stats.json is not in the snapshot).

``e2e``: a seeded sample through a running ``jaxinfer serve`` (``--url``; launch it with the embedded
model): max_tokens 768, temperature 0; valid / invalid-finished / truncated / refused / server-error
per set.

  python benchmarks/bench_jsonschemabench.py compile [--data DIR] [--out FILE] [--per-set 300] [--limit 30]
  python benchmarks/bench_jsonschemabench.py e2e --url http://127.0.0.1:8000 [--n 100] [--seed 0] [--concurrency 8]

Without ``--data`` the repository's tarball at the pinned commit is downloaded into the user cache.
"""

from __future__ import annotations

import argparse
import glob
import io
import json
import multiprocessing as mp
import os
import random
import tarfile
import time
import urllib.request

import numpy as np

from jaxinfer.user_cache import user_cache_dir

COMMIT = "ba103c73"
MASKBENCH_LLG = {"schemas": 11306, "passing": 8909, "compile error": 2377, "llguidance": "0.7.10"}


def data_dir(given: str | None) -> str:
    if given:
        return given
    root = user_cache_dir("jsonschemabench", COMMIT)
    if not os.path.isdir(os.path.join(root, "data")):
        url = f"https://github.com/guidance-ai/jsonschemabench/archive/{COMMIT}.tar.gz"
        with urllib.request.urlopen(url, timeout=120) as r:
            tar = tarfile.open(fileobj=io.BytesIO(r.read()))
        os.makedirs(root, exist_ok=True)
        for m in tar.getmembers():
            parts = m.name.split("/", 1)
            if len(parts) == 2 and parts[1].startswith(("data/", "maskbench/")):
                m.name = parts[1]
                tar.extract(m, root)
    return root


def _one(args):
    """(status, compile s, [mask s], message) of one schema, in a child process."""
    path, tests_path = args
    from jaxinfer.batching.structured import compiler_for
    from jaxinfer.sampling_params import StructuredOutputs
    tok = _tokenizer()
    try:
        schema = json.load(open(path))
        so = StructuredOutputs(json=schema)
    except Exception as e:  # noqa: BLE001 - data that is not a schema
        return "refused", None, [], str(e)[:200]
    comp = compiler_for(tok)
    t0 = time.perf_counter()
    try:
        template = comp.compile(so)
    except ValueError as e:
        return "refused", None, [], str(e)[:200]
    seconds = time.perf_counter() - t0
    relaxed = comp.relaxations(so)
    masks = []
    instance = None
    if tests_path and os.path.exists(tests_path):
        valid = [t["data"] for t in json.load(open(tests_path)).get("tests", []) if t.get("valid")]
        instance = valid[0] if valid else None
    if instance is not None:
        import llguidance.numpy
        m = template.deep_copy()
        ids = tok.encode(json.dumps(instance, separators=(",", ":")), add_special_tokens=False)[:16]
        mask = np.zeros((1, (len(tok) + 31) // 32), np.int32)
        for t in ids:
            t1 = time.perf_counter()
            llguidance.numpy.fill_next_token_bitmask(m, mask, 0)
            masks.append(time.perf_counter() - t1)
            if not m.consume_token(t):
                break
    return ("relaxed" if relaxed else "compiled"), seconds, masks, "; ".join(relaxed)[:200]


_TOK = None


def _tokenizer():
    global _TOK
    if _TOK is None:
        from jaxinfer.batching.config import EngineConfig
        from jaxinfer.tokenizer import load_tokenizer, tokenizer_source
        _TOK = load_tokenizer(tokenizer_source("smollm2-135m", EngineConfig()))
    return _TOK


def compile_mode(root: str, limit: float, per_set: int | None = None, seed: int = 0) -> dict:
    """``per_set``: a seeded sample of at most that many schemas of each set (all of them when None)."""
    sets = sorted(d for d in os.listdir(os.path.join(root, "data")) if os.path.isdir(os.path.join(root, "data", d)))
    results = {}
    with mp.get_context("spawn").Pool(1, maxtasksperchild=200) as pool:
        for s in sets:
            counts = dict(compiled=0, relaxed=0, refused=0, crashed=0)
            comp_t, mask_t = [], []
            paths = sorted(glob.glob(os.path.join(root, "data", s, "*.json")))
            if per_set is not None and len(paths) > per_set:
                paths = sorted(random.Random(seed).sample(paths, per_set))
            for path in paths:
                tests = os.path.join(root, "maskbench", "data", f"{s}---{os.path.basename(path)}")
                job = pool.apply_async(_one, ((path, tests),))
                try:
                    status, sec, masks, _ = job.get(limit)
                except Exception:  # noqa: BLE001 - timeout or a crashed child
                    status, sec, masks = "crashed", None, []
                    pool.terminate()
                    pool = mp.get_context("spawn").Pool(1, maxtasksperchild=200)
                counts[status] += 1
                if sec is not None:
                    comp_t.append(sec)
                mask_t += masks
            pct = lambda xs, q: float(np.percentile(xs, q)) if xs else None  # noqa: E731
            results[s] = {**counts, "compile_ms_p50": pct(comp_t, 50) and pct(comp_t, 50) * 1e3,
                          "compile_ms_p99": pct(comp_t, 99) and pct(comp_t, 99) * 1e3,
                          "mask_us_p50": pct(mask_t, 50) and pct(mask_t, 50) * 1e6,
                          "mask_us_p99": pct(mask_t, 99) and pct(mask_t, 99) * 1e6, "of": len(paths)}
            print(s, results[s], flush=True)
    return {"sets": results, "per_set": per_set, "seed": seed, "limit_s": limit,
            "maskbench_llguidance": MASKBENCH_LLG}


def e2e_mode(root: str, url: str, n: int, seed: int, concurrency: int = 1, max_tokens: int = 768) -> dict:
    """``concurrency`` requests in flight at once (the server batches them)."""
    import httpx
    from concurrent.futures import ThreadPoolExecutor
    paths = sorted(glob.glob(os.path.join(root, "data", "*", "*.json")))
    sample = random.Random(seed).sample(paths, n)

    def one(path: str) -> str:
        schema = json.load(open(path))
        body = {"model": "smollm2-135m", "max_tokens": max_tokens, "temperature": 0,
                "messages": [{"role": "user", "content": "Write a JSON document for this schema."}],
                "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
        try:
            r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=1800)
        except httpx.HTTPError:
            return "server_error"
        if r.status_code == 400:
            return "refused"
        if r.status_code != 200:
            return "server_error"
        out = r.json()
        choice = out["choices"][0]
        print(path.split(os.sep)[-2], os.path.basename(path), choice["finish_reason"], out.get("warnings", [])[:1],
              flush=True)
        if choice["finish_reason"] == "length":
            return "truncated"
        if any("violates" in w or "repeats" in w for w in out.get("warnings", [])):
            return "invalid_finished"
        try:
            json.loads(choice["message"]["content"])
            return "valid"
        except ValueError:
            return "invalid_finished"

    results: dict[str, dict[str, int]] = {}
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        for path, status in zip(sample, pool.map(one, sample)):
            row = results.setdefault(path.split(os.sep)[-2], dict(valid=0, invalid_finished=0, truncated=0,
                                                                  refused=0, server_error=0))
            row[status] += 1
    return {"sets": dict(sorted(results.items())), "n": n, "seed": seed, "max_tokens": max_tokens,
            "concurrency": concurrency, "seconds": round(time.perf_counter() - t0, 1)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=("compile", "e2e"))
    ap.add_argument("--data", help="a local copy of the repository (with data/ and maskbench/)")
    ap.add_argument("--limit", type=float, default=30.0, help="seconds per schema (compile)")
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--per-set", type=int, default=None, help="compile: a seeded sample of this many per set")
    ap.add_argument("--n", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--concurrency", type=int, default=1, help="e2e: requests in flight at once")
    ap.add_argument("--max-tokens", type=int, default=768, help="e2e")
    ap.add_argument("--out", default=None, help="JSON results file")
    args = ap.parse_args()
    root = data_dir(args.data)
    res = (compile_mode(root, args.limit, args.per_set, args.seed) if args.mode == "compile"
           else e2e_mode(root, args.url, args.n, args.seed, args.concurrency, args.max_tokens))
    res.update(mode=args.mode, commit=COMMIT, date=time.strftime("%Y-%m-%d"))
    rows = res["sets"]
    cols = list(next(iter(rows.values())).keys())
    print("| set | " + " | ".join(cols) + " |")
    for s, r in rows.items():
        print(f"| {s} | " + " | ".join("-" if v is None else f"{v:.3g}" if isinstance(v, float) else str(v)
                                       for v in r.values()) + " |")
    if args.out:  # one file for both modes, each under its name
        both = json.load(open(args.out)) if os.path.exists(args.out) else {}
        both[args.mode] = res
        with open(args.out, "w") as f:
            json.dump(both, f, indent=1)


if __name__ == "__main__":
    main()
