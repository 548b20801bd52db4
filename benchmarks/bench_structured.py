"""Structured outputs: what constrained decoding costs, side by side in one run.

1. Output throughput of ``--max-num-seqs`` concurrent sequences (``--num-prompts`` requests kept
   queued so every slot stays busy), every one constrained (``--constraint``: ``schema``, a JSON
   schema of a record list long enough to fill ``--output-len``; or ``json_object``), against the
   same requests unconstrained, each generating exactly as many tokens as it did constrained
   (``ignore_eos``): the same work, so the ratio is the constraint's cost. Each run goes once
   uncounted (it compiles what it meets), then ``--repeats`` times counted, constrained and free
   alternating, and the medians are reported (a shared machine's load drifts between runs).
   Reported: output tok/s of each, their ratio (target >= 0.85), the engine's host time per step
   (its own work, not waiting for the device) against wall time per step (when host ~ wall, the
   host is the bottleneck), compilations during the counted runs; ``--profile``: where the host
   time of a counted run goes (cProfile, top functions by own time).
2. Constraint compile time over the schemas shipped in tests/data/json_schemas.json (p50/p99, each
   compiled cold in a fresh compiler), and the cache: compiling them all again must hit every time.

    python benchmarks/bench_structured.py                                   # CPU, embedded SmolLM2
    python benchmarks/bench_structured.py --model DIR --load-format dummy ... --repeats 5 --profile  # host overhead
    bash benchmarks/bench_structured_h200.sh json_object                    # H200: llama3-8b dummy, 256 sequences

The engine options are ``jaxinfer serve``'s flags with its defaults (jaxinfer/cli/options.py; --help
lists them): ``--max-num-seqs``, ``--max-model-len``, ``--token-buckets``, ...
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import time

import jax
import numpy as np

from engine_probes import host_time, steps_done  # a benchmark's folder is on sys.path when it runs
from jaxinfer.cli import options
from jaxinfer.cli.options import Parser
from jaxinfer.cli.serve import ENGINE_DEFAULTS


def parser() -> Parser:
    """This script's flags, and the engine options of ``jaxinfer serve`` with its defaults."""
    p = Parser("bench_structured.py", __doc__)
    options.add_model_argument(p)
    g = p.add_argument_group("benchmark")
    p.option(g, "num-prompts", type=int, default=48, help="Requests per run (queued, so all max_num_seqs slots "
             "stay busy) [default: 48].")
    p.option(g, "output-len", type=int, default=128, help="Most tokens per request [default: 128].")
    p.option(g, "constraint", choices=("schema", "json_object"), default="schema",
             help="What every constrained request asks for [default: schema].")
    p.option(g, "repeats", type=int, default=1, help="Counted runs of each kind (alternating); medians are "
             "reported [default: 1].")
    p.flag(g, "profile", default=False, help="Profile the host side of one more run of each kind (cProfile): "
           "the functions with the most own time, printed and in the JSON.")
    p.option(g, "out", default="results/structured.json", help="Where to write the JSON results "
             "[default: results/structured.json].")
    options.add_engine_options(p, defaults=ENGINE_DEFAULTS)
    return p


SCHEMAS = os.path.join(os.path.dirname(__file__), "..", "tests", "data", "json_schemas.json")
# Enough records that the constraint does not complete before --output-len: the run measures decode
# under the constraint, not shorter requests.
RECORDS = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20},
    "records": {"type": "array", "minItems": 64, "items": {
        "type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9999},
                                         "kind": {"enum": ["alpha", "beta", "gamma"]},
                                         "note": {"type": "string", "maxLength": 12}},
        "required": ["id", "kind", "note"], "additionalProperties": False}}},
    "required": ["name", "records"], "additionalProperties": False}
TOPICS = ["customers", "cities", "products", "books", "sensors", "games", "recipes", "planets"]


def run(llm, prompts, params) -> tuple[dict, list]:
    """One counted generation (compiled before: see ``main``)."""
    eng = llm.engine
    s0, compilations = eng.stats(), eng.num_compilations
    t0 = time.perf_counter()
    outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    wall = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in outs)
    s1 = eng.stats()
    steps = s1["steps"] - s0["steps"]
    return dict(wall_s=wall, output_tokens=tokens, output_tok_s=tokens / wall, steps=steps,
                host_ms_per_step=1e3 * (host_time(s1) - host_time(s0)) / max(1, steps),
                wall_ms_per_step=1e3 * wall / max(1, steps), compilations=eng.num_compilations - compilations,
                finish_reasons={r: sum(o.finish_reason == r for o in outs) for r in {o.finish_reason for o in outs}}
                ), outs


def median_run(runs: list[dict]) -> dict:
    """Each figure's median over the runs (the work, hence tokens and steps, is the same in each),
    with every run's throughput and host time."""
    med = {k: float(np.median([r[k] for r in runs])) for k in ("wall_s", "output_tok_s", "host_ms_per_step",
                                                                 "wall_ms_per_step")}
    return dict(runs[0], **med, compilations=sum(r["compilations"] for r in runs),
                runs_output_tok_s=[r["output_tok_s"] for r in runs],
                runs_host_ms_per_step=[r["host_ms_per_step"] for r in runs])


def profile(llm, prompts, params, top: int = 15) -> list[dict]:
    """cProfile over one generation: the ``top`` functions by own time, in ms per engine step."""
    import cProfile
    import pstats

    steps0 = steps_done(llm.engine)
    prof = cProfile.Profile()
    prof.runcall(llm.generate, prompts, params)
    steps = max(1, steps_done(llm.engine) - steps0)
    stats = pstats.Stats(prof).stats  # (file, line, name) -> (calls, primitive calls, own s, cumulative s, callers)
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    return [dict(function=f"{os.path.basename(f)}:{line}({name})" if line else name, calls_per_step=v[0] / steps,
                 own_ms_per_step=1e3 * v[2] / steps, cumulative_ms_per_step=1e3 * v[3] / steps)
            for (f, line, name), v in rows]


def compile_times(tokenizer, vocab_size, eos) -> dict:
    from jaxinfer import StructuredOutputs
    from jaxinfer.batching.structured import ConstraintCompiler

    schemas = [StructuredOutputs(json=c["schema"]) for c in json.load(open(SCHEMAS))]
    cold = []
    for s in schemas:  # a fresh compiler each time: nothing cached
        comp = ConstraintCompiler(tokenizer, vocab_size, eos)
        comp.compile(s)
        cold.append(comp.compile_seconds[-1])
    comp = ConstraintCompiler(tokenizer, vocab_size, eos)
    for s in schemas + schemas:
        comp.compile(s)
    ms = 1e3 * np.asarray(cold)
    return dict(schemas=len(schemas), compile_ms_p50=float(np.percentile(ms, 50)),
                compile_ms_p99=float(np.percentile(ms, 99)), compile_ms_max=float(ms.max()),
                cache_hits=comp.hits, cache_misses=comp.misses)


def main(argv: list[str]) -> None:
    p = parser()
    args = p.parse(argv)
    model = options.model_of(p, args)
    config = options.engine_config(p, args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from jaxinfer import LLM, SamplingParams, StructuredOutputs

    llm = LLM(model, **dataclasses.asdict(config))
    mc = llm.engine.model_config
    structured = StructuredOutputs(json=RECORDS) if args.constraint == "schema" else StructuredOutputs(json_object=True)
    prompts = [f"A JSON list of {TOPICS[i % len(TOPICS)]} (#{i}):" for i in range(args.num_prompts)]
    results = dict(device=f"{jax.devices()[0].device_kind} ({jax.default_backend()}, jax {jax.__version__})",
                   model=model, max_num_seqs=config.max_num_seqs,
                   num_prompts=args.num_prompts, output_len=args.output_len, constraint=args.constraint)
    constrained = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True, structured=structured)
    _, outs = run(llm, prompts, constrained)  # compiles what it meets; fixes each request's length
    free = [SamplingParams(max_tokens=len(o.token_ids), temperature=0.0, ignore_eos=True) for o in outs]
    expected = {"constrained": [o.token_ids for o in outs], "free": [o.token_ids for o in run(llm, prompts, free)[1]]}
    runs = {"constrained": [], "free": []}
    for _ in range(args.repeats):
        for kind, params in (("constrained", constrained), ("free", free)):
            r, got = run(llm, prompts, params)
            if [o.token_ids for o in got] != expected[kind]:  # greedy: every run the same tokens
                raise RuntimeError(f"a counted {kind} run generated other tokens than its first run")
            runs[kind].append(r)
    for kind in runs:
        results[kind] = median_run(runs[kind])
    results["throughput_ratio"] = results["constrained"]["output_tok_s"] / results["free"]["output_tok_s"]
    if args.profile:
        results["profile"] = {"constrained": profile(llm, prompts, constrained), "free": profile(llm, prompts, free)}
    results["compile"] = compile_times(llm.tokenizer, mc.vocab_size, mc.eos_token_ids)
    results["command"] = "python benchmarks/bench_structured.py " + " ".join(argv)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    if args.profile:
        for kind, rows in results["profile"].items():
            print(f"\nhost profile, {kind} run (ms per step; cProfile slows Python down):")
            print(f"{'own':>7} {'cumul':>7} {'calls':>7}  function")
            for r in rows:
                print(f"{r['own_ms_per_step']:>7.3f} {r['cumulative_ms_per_step']:>7.3f} {r['calls_per_step']:>7.1f}  "
                      f"{r['function']}")
    print(f"\nmedian of {args.repeats} counted run(s) each:")
    print(f"{'run':<12} {'output tok/s':>12} {'tokens':>8} {'steps':>6} {'host ms/step':>13} {'wall ms/step':>13} "
          f"{'compiles':>8}  finish")
    for k in ("free", "constrained"):
        r = results[k]
        print(f"{k:<12} {r['output_tok_s']:>12.1f} {r['output_tokens']:>8} {r['steps']:>6} "
              f"{r['host_ms_per_step']:>13.2f} {r['wall_ms_per_step']:>13.2f} {r['compilations']:>8}  "
              f"{r['finish_reasons']}")
    c = results["compile"]
    print(f"throughput ratio constrained/free: {results['throughput_ratio']:.3f} (target >= 0.85)")
    print(f"compile over {c['schemas']} schemas: p50 {c['compile_ms_p50']:.2f} ms, p99 {c['compile_ms_p99']:.2f} ms, "
          f"max {c['compile_ms_max']:.2f} ms; compiling them twice: {c['cache_hits']} hits, "
          f"{c['cache_misses']} misses")
    print(f"(json: {args.out})")


if __name__ == "__main__":
    main(sys.argv[1:])
