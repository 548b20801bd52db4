"""Speculative decoding, measured side by side with plain decoding in one run; prints a table, writes JSON.

Workloads (``--workload``):
  cpu     the embedded model at batch 1, greedy, on the input-grounded prompts of
          tests/data/spec_prompts.json: decode tok/s without and with n-gram proposals (k =
          ``--k``), token identity checked, acceptance rate and mean accepted length.
  verify  one step alone at each ``--batch-sizes``: a plain decode step against a verify step
          (last token + k proposals per sequence). Memory-bound decode reads the weights once either way.
  replay  end-to-end tok/s at each ``--batch-sizes`` (random prompts): plain greedy against speculation
          by a replay proposer that proposes what the plain run produced (acceptance ~1, proposing free):
          the machinery's ceiling, and where speculation stops paying as the batch grows.
          ``--overlap on,off`` times the speculative run with verifying steps kept in flight and
          synchronous, one engine built per mode (``speculative_overlap``), each against its own
          plain run (``cpu`` takes it too).
  draft   the ``draft`` proposer (``--draft-model``) end to end at each ``--batch-sizes``: time spent
          proposing per proposed token against the target's step time (random weights make its
          acceptance meaningless; the cost is what this measures).

    python benchmarks/bench_speculative.py --workload cpu --out docs/results/cpu-speculative.json
    python benchmarks/bench_speculative.py --model llama3-8b --load-format dummy --workload verify,replay \\
        --batch-sizes 1,64,256 --out $OUT/spec-llama3-8b.json
    python benchmarks/bench_speculative.py --model llama3-8b --load-format dummy --workload draft \\
        --draft-model llama3.2-1b --batch-sizes 1 --out $OUT/spec-draft.json

The other engine options are ``jaxinfer serve``'s flags (jaxinfer/cli/options.py; --help lists them:
``--load-format``, ``--dtype``, ``--prompt-lookup-min``, ...), but those each workload sets itself
(sizes, the speculative method and its k, prefix caching off).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import os
import sys
import time

import numpy as np

from engine_probes import host_time, probe_step  # a benchmark's folder is on sys.path when it runs
from jaxinfer.batching.config import EngineConfig
from jaxinfer.cli import options
from jaxinfer.cli.options import Parser

# The engine options each workload sets (``make_llm``), so not flags of their own (``--k``,
# ``--draft-model``, ``--overlap`` set three of them).
SET_HERE = ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "enable_prefix_caching", "speculative_method",
            "speculative_model", "num_speculative_tokens", "speculative_max_num_seqs", "speculative_overlap")


def comma_list(text: str) -> list[str]:
    return [v.strip() for v in text.split(",") if v.strip()]


def parser() -> Parser:
    p = Parser("bench_speculative.py", __doc__)
    options.add_model_argument(p)
    g = p.add_argument_group("benchmark")
    p.option(g, "workload", type=comma_list, default=["cpu"], metavar="NAME,NAME",
             help="Comma-separated: cpu, verify, replay, draft [default: cpu].")
    p.option(g, "draft-model", default="llama3.2-1b", help="draft: the speculative_model [default: llama3.2-1b].")
    p.option(g, "k", type=int, default=4, help="num_speculative_tokens [default: 4].")
    p.option(g, "max-tokens", type=int, default=128, help="New tokens per request [default: 128].")
    p.option(g, "overlap", type=comma_list, default=["auto"], metavar="MODE,MODE",
             help="cpu/replay: the speculative runs' speculative_overlap, side by side (an engine each): auto (the "
                  "engine's default: on except on CPU), on, off [default: auto].")
    p.option(g, "replay-passes", type=int, default=16, help="replay: most passes to reach the fixpoint (see "
             "replay()) [default: 16].")
    p.option(g, "prompt-len", type=int, default=128, help="verify/replay: random prompt length [default: 128].")
    p.option(g, "batch-sizes", type=comma_list, default=["1"], metavar="N,N", help="verify/replay: batch sizes "
             "[default: 1].")
    p.option(g, "prompts", default=os.path.join(os.path.dirname(__file__), "..", "tests", "data", "spec_prompts.json"),
             help="cpu: the input-grounded prompts [default: tests/data/spec_prompts.json].")
    p.option(g, "out", default="results/speculative.json", help="Where to write the JSON results "
             "[default: results/speculative.json].")
    options.add_engine_options(p, exclude=SET_HERE)  # ngram_min (--prompt-lookup-min): cpu's, the engine's default
    return p


F = argparse.Namespace()  # the parsed flags (main sets them)
MODEL = ""
CONFIG = EngineConfig()  # the engine options of the command line; make_llm sets SET_HERE's
log = logging.getLogger("bench_speculative")


class ReplayProposer:
    """Proposes the tokens a plain greedy run of the same prompt produced: acceptance ~1 at no cost.
    Benchmark-only (it needs the answer)."""

    def __init__(self, answers: dict[tuple, list[int]]):
        self.answers = answers

    def propose(self, seqs, limits):
        out = []
        for s, k in zip(seqs, limits):
            context, skip = s.assumed_context()  # skip: the in-flight step's own token, known by position
            at = len(context) + skip - len(s.prompt_token_ids)
            out.append(self.answers[tuple(s.prompt_token_ids)][at:at + k])
        return out


# --overlap's modes as the engine's speculative_overlap option (None: the engine's default for the backend).
OVERLAP = {"auto": None, "on": True, "off": False}


def make_llm(max_num_seqs: int, method: str = "ngram", **engine_options):
    from jaxinfer import LLM
    budget = max(512, max_num_seqs * (F.k + 1))
    return LLM(MODEL, **{**dataclasses.asdict(CONFIG), **dict(
        speculative_method=method, num_speculative_tokens=F.k, speculative_max_num_seqs=max_num_seqs,
        max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
        enable_prefix_caching=False,  # each run of a prompt pays its whole prefill, as the first
        **engine_options)})


def verified_count(engine) -> int:
    """Verifications of proposals so far (each request's each verifying step): the scheduler's counter."""
    return engine.scheduler.counters["spec_verified"]


def timed_run(llm, prompts, proposer) -> dict:
    """All prompts at once, greedy; wall time, decode tok/s (after each request's first token) and tokens."""
    from jaxinfer import SamplingParams
    eng = llm.engine
    eng.proposer = proposer  # None: plain steps (the engine speculates only with a proposer)
    before, verified0 = eng.stats(), verified_count(eng)
    params = SamplingParams(max_tokens=F.max_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}-{time.monotonic_ns()}", p, params)
    first, last, out = {}, {}, {}
    while eng.has_unfinished():
        for o in eng.step():
            now = time.perf_counter()
            first.setdefault(o.request_id, now)
            last[o.request_id] = now
            if o.finished:
                out[o.request_id] = o.token_ids
    wall = time.perf_counter() - t0
    s = eng.stats()
    tokens = [out[r] for r in sorted(out, key=lambda r: int(r[1:].split("-")[0]))]
    decode_s = max(last.values()) - min(first.values())
    proposed = s["spec_proposed_tokens"] - before["spec_proposed_tokens"]
    accepted = s["spec_accepted_tokens"] - before["spec_accepted_tokens"]
    verified = verified_count(eng) - verified0
    steps = s["steps"] - before["steps"]
    return dict(wall_s=wall, tok_s=sum(map(len, tokens)) / wall, decode_s=decode_s,
                # the engine's own host work per step (not waiting for the device; engine.stats()'s host time)
                host_ms_per_step=(host_time(s) - host_time(before)) / max(1, steps) * 1e3,
                decode_tok_s=sum(len(t) - 1 for t in tokens) / max(decode_s, 1e-9),
                steps=steps, spec_steps=s["spec_steps"] - before["spec_steps"],
                discarded=s["spec_discarded"] - before["spec_discarded"],
                proposed=proposed, accepted=accepted, acceptance_rate=accepted / max(1, proposed),
                mean_accepted_length=(accepted + verified) / max(1, verified), tokens=tokens)


def cpu(results):
    data = json.load(open(F.prompts))
    for mode in F.overlap:  # an engine per mode: speculative_overlap is fixed when the engine is built
        llm = make_llm(1, speculative_overlap=OVERLAP[mode])
        prompts = [llm.engine.encode(p["prompt"]) for p in data["prompts"]]
        ngram = llm.engine.proposer  # the engine's, with its n-gram window sizes
        timed_run(llm, prompts[:1], None)  # compile both paths
        timed_run(llm, prompts[:1], ngram)
        results["cpu" if mode == F.overlap[0] else f"cpu-overlap-{mode}"] = cpu_rows(llm, prompts, data, ngram, mode)
        del llm  # before the next mode's engine claims the device's memory
        gc.collect()


def cpu_rows(llm, prompts, data, ngram, mode) -> dict:
    rows = []
    for p, meta in zip(prompts, data["prompts"]):
        plain = timed_run(llm, [p], None)
        spec = timed_run(llm, [p], ngram)
        rows.append(dict(kind=meta["kind"], prompt_tokens=len(p), new_tokens=len(plain["tokens"][0]),
                         identical=plain["tokens"] == spec["tokens"], plain_decode_tok_s=plain["decode_tok_s"],
                         spec_decode_tok_s=spec["decode_tok_s"], speedup=spec["decode_tok_s"] / plain["decode_tok_s"],
                         acceptance_rate=spec["acceptance_rate"],
                         spec_tokens_per_step=len(spec["tokens"][0]) / max(1, spec["steps"]),
                         # per step after the first token (the prefill's): plain steps, and speculating
                         # steps of which `spec_verify_steps` verified proposals (the rest were plain)
                         plain_step_ms=plain["decode_s"] / max(1, plain["steps"] - 1) * 1e3,
                         spec_step_ms=spec["decode_s"] / max(1, spec["steps"] - 1) * 1e3,
                         spec_steps=spec["steps"], spec_verify_steps=spec["spec_steps"],
                         spec_discarded=spec["discarded"], mean_accepted_length=spec["mean_accepted_length"]))
    plain_s = sum(r["new_tokens"] / r["plain_decode_tok_s"] for r in rows)
    spec_s = sum(r["new_tokens"] / r["spec_decode_tok_s"] for r in rows)
    total = sum(r["new_tokens"] for r in rows)
    return dict(rows=rows, plain_decode_tok_s=total / plain_s, spec_decode_tok_s=total / spec_s,
                speedup=plain_s / spec_s, all_identical=all(r["identical"] for r in rows),
                acceptance_rate=float(np.mean([r["acceptance_rate"] for r in rows])), k=F.k,
                ngram_min=ngram.ngram_min, ngram_max=ngram.ngram_max, overlap=mode,
                speculative_overlap=llm.engine.resolved.speculative.overlap)


def verify_cost(results):
    """A plain decode step and a verify step of k proposals per sequence, each alone on device."""
    from ceilings import timeit
    sizes = [int(b) for b in F.batch_sizes]
    llm = make_llm(max(sizes), max_model_len=F.prompt_len + F.max_tokens + F.k + 8)
    runner, vocab = llm.engine.runner, llm.engine.model_config.vocab_size
    rng = np.random.default_rng(0)
    out = {}
    for b in sizes:
        prompts = [rng.integers(10, vocab - 10, F.prompt_len).tolist() for _ in range(b)]
        times = {}
        for name, k in (("decode", 0), ("verify", F.k)):
            step_out = probe_step(llm, prompts, [rng.integers(10, vocab - 10, k).tolist() for _ in range(b)] if k
                                  else None)

            def step():
                return runner.execute(step_out)[0].tokens
            times[name] = timeit(step)
        out[b] = dict(decode_ms=times["decode"] * 1e3, verify_ms=times["verify"] * 1e3,
                      verify_over_decode=times["verify"] / times["decode"])
    results["verify"] = dict(k=F.k, by_batch=out)
    del llm


def replay(results):
    """Plain greedy, then speculation proposing what a greedy run produced. In float32 that is the plain
    run's output (acceptance 1, output identical). In bfloat16 on a GPU a 5-row verify step and a
    1-row decode step round differently, and random weights leave near-tied logits, so about one
    token in 20-30 flips and the replayed answer stops matching for the rest of the request
    (acceptance 0.04 measured). The replayed answer is then the speculative run's own output,
    iterated to a fixpoint: each pass reproduces the previous one's steps up to its first flip and
    moves that point on (the steps before it are the same shapes on the same inputs), so after a few
    passes acceptance is 1 and the timed run is the real machinery at its ceiling; its output then
    differs from the plain run's by those bf16 flips (``identical_to_plain``)."""
    sizes = [int(b) for b in F.batch_sizes]
    out = {}
    for mode in F.overlap:  # an engine per mode: speculative_overlap is fixed when the engine is built
        llm = make_llm(max(sizes), max_model_len=F.prompt_len + F.max_tokens + F.k + 8,
                       speculative_overlap=OVERLAP[mode])
        vocab = llm.engine.model_config.vocab_size
        rng = np.random.default_rng(1)  # the same prompts for every mode
        for b in sizes:
            prompts = [rng.integers(10, vocab - 10, F.prompt_len).tolist() for _ in range(b)]
            timed_run(llm, prompts, None)  # compile the plain shapes
            plain = timed_run(llm, prompts, None)
            answers, passes = plain["tokens"], 0
            while True:  # replay until the speculative run reproduces what it replays (see replay's docstring)
                spec = timed_run(llm, prompts, ReplayProposer({tuple(p): t for p, t in zip(prompts, answers)}))
                passes += 1
                if spec["tokens"] == answers or passes == F.replay_passes:
                    break
                answers = spec["tokens"]
            spec = timed_run(llm, prompts, ReplayProposer({tuple(p): t for p, t in zip(prompts, answers)}))
            same = sum(a == c for a, c in zip(plain["tokens"], spec["tokens"]))
            out[f"{b}/{mode}"] = dict(
                batch=b, overlap=mode, speculative_overlap=llm.engine.resolved.speculative.overlap,
                plain_tok_s=plain["tok_s"], spec_tok_s=spec["tok_s"], speedup=spec["tok_s"] / plain["tok_s"],
                plain_decode_tok_s=plain["decode_tok_s"], spec_decode_tok_s=spec["decode_tok_s"],
                decode_speedup=spec["decode_tok_s"] / plain["decode_tok_s"],
                plain_decode_ms_per_step=plain["decode_s"] / max(1, plain["steps"] - 1) * 1e3,
                spec_decode_ms_per_step=spec["decode_s"] / max(1, spec["steps"] - 1) * 1e3,
                plain_host_ms_per_step=plain["host_ms_per_step"], spec_host_ms_per_step=spec["host_ms_per_step"],
                spec_steps=spec["steps"], discarded=spec["discarded"],
                acceptance_rate=spec["acceptance_rate"], replay_passes=passes, identical_to_plain=f"{same}/{b}")
        del llm  # before the next mode's engine claims the device's memory
        gc.collect()
    results["replay"] = dict(k=F.k, by_batch=out)


def draft(results):
    sizes = [int(b) for b in F.batch_sizes]
    llm = make_llm(max(sizes), "draft", speculative_model=F.draft_model,
                   max_model_len=F.prompt_len + F.max_tokens + F.k + 8)
    proposer, vocab = llm.engine.proposer, llm.engine.model_config.vocab_size
    spent = [0.0]

    class Timed:
        def propose(self, seqs, limits):
            t = time.perf_counter()
            out = proposer.propose(seqs, limits)
            spent[0] += time.perf_counter() - t
            return out
    rng = np.random.default_rng(2)
    out = {}
    for b in sizes:
        prompts = [rng.integers(10, vocab - 10, F.prompt_len).tolist() for _ in range(b)]
        timed_run(llm, prompts, None)
        plain = timed_run(llm, prompts, None)
        timed_run(llm, prompts, Timed())
        spent[0] = 0.0
        spec = timed_run(llm, prompts, Timed())
        plain_step = plain["wall_s"] / plain["steps"]
        per_token = spent[0] / max(1, spec["proposed"])
        out[b] = dict(plain_tok_s=plain["tok_s"], draft_tok_s=spec["tok_s"], plain_step_ms=plain_step * 1e3,
                      propose_ms_per_step=spent[0] / spec["steps"] * 1e3, propose_ms_per_token=per_token * 1e3,
                      propose_token_over_target_step=per_token / plain_step, acceptance_rate=spec["acceptance_rate"])
    results["draft"] = dict(k=F.k, draft_model=F.draft_model, by_batch=out)


def print_table(results):
    print(f"{'workload':<10} {'case':<22} {'plain':>10} {'spec':>10} {'ratio':>7} {'accept':>7}")
    for name, c in results.items():
        if not name.startswith("cpu"):
            continue
        for r in c["rows"]:
            print(f"{'cpu':<10} {r['kind']:<22} {r['plain_decode_tok_s']:>10.2f} {r['spec_decode_tok_s']:>10.2f} "
                  f"{r['speedup']:>7.2f} {r['acceptance_rate']:>7.2f}{'' if r['identical'] else '  DIFFERS'}   "
                  f"ms/step {r['plain_step_ms']:.1f} / {r['spec_step_ms']:.1f}, {r['spec_verify_steps']} of "
                  f"{r['spec_steps']} steps verify, {r['mean_accepted_length']:.2f} tokens per verify, "
                  f"{r['spec_discarded']} discarded")
        print(f"{'cpu':<10} {'all (decode tok/s)':<22} {c['plain_decode_tok_s']:>10.2f} {c['spec_decode_tok_s']:>10.2f} "
              f"{c['speedup']:>7.2f} {c['acceptance_rate']:>7.2f}   overlap {c['overlap']} "
              f"({c['speculative_overlap']})")
    for b, r in results.get("verify", {}).get("by_batch", {}).items():
        print(f"{'verify':<10} {'batch ' + str(b) + ' (ms/step)':<22} {r['decode_ms']:>10.3f} {r['verify_ms']:>10.3f} "
              f"{r['verify_over_decode']:>7.2f}")
    for b, r in results.get("replay", {}).get("by_batch", {}).items():
        print(f"{'replay':<10} {'batch ' + b + ' (tok/s)':<22} {r['plain_tok_s']:>10.1f} {r['spec_tok_s']:>10.1f} "
              f"{r['speedup']:>7.2f} {r['acceptance_rate']:>7.2f}   decode {r['decode_speedup']:.2f}x, ms/step "
              f"{r['plain_decode_ms_per_step']:.3f} / {r['spec_decode_ms_per_step']:.3f}, host ms/step "
              f"{r['plain_host_ms_per_step']:.3f} / {r['spec_host_ms_per_step']:.3f}, overlap "
              f"{r['speculative_overlap']}, {r['discarded']} discarded")
    for b, r in results.get("draft", {}).get("by_batch", {}).items():
        print(f"{'draft':<10} {'batch ' + str(b) + ' (ms)':<22} {r['plain_step_ms']:>10.3f} "
              f"{r['propose_ms_per_token']:>10.3f} {r['propose_token_over_target_step']:>7.2f} "
              f"{r['acceptance_rate']:>7.2f}   (target step, draft per proposed token)")


def main(argv: list[str]) -> None:
    global F, MODEL, CONFIG
    p = parser()
    F = p.parse(argv)
    MODEL, CONFIG = options.model_of(p, F), options.engine_config(p, F)
    logging.basicConfig(level=logging.INFO)
    import jax
    results = dict(model=MODEL, backend=jax.default_backend(), device=str(jax.devices()[0].device_kind),
                   jax=jax.__version__, workloads=F.workload)
    for w in F.workload:
        {"cpu": cpu, "verify": verify_cost, "replay": replay, "draft": draft}[w](results)
        os.makedirs(os.path.dirname(os.path.abspath(F.out)), exist_ok=True)
        with open(F.out, "w") as f:  # after each workload, so a run cut short keeps its figures
            json.dump(results, f, indent=1, default=str)
    print_table(results)


if __name__ == "__main__":
    main(sys.argv[1:])
