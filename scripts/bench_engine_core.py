"""Host time per step of the server's engine core against the offline engine loop, without HTTP.

The server's throughput on a fast device is bounded by how long its engine core's loop keeps the
host busy per step (schedule, dispatch, read tokens, detokenize, build and send the step message,
take commands); offline, only the engine's own loop runs. This drives the engine core process
through ``AsyncEngine`` (the API process's handle, minus HTTP) and then the offline engine on the
same requests at the same concurrency, and reports each loop's host time per step (its wall time
less the waits for the device and, in the core, for commands while idle) and its thread's CPU time
per step (on a small shared CPU the wall time also counts the cores other processes take).

    python scripts/bench_engine_core.py --model /tmp/tiny-smoltok --load_format dummy \\
        --max_num_seqs 64 --max_num_batched_tokens 256 --max_model_len 256 --token_buckets 64,256 \\
        --seq_buckets 64 --page_buckets 16 --num_prompts 512 --max_concurrency 64 --output_len 64
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import sys
import time

from absl import app, flags

from jaxinfer.cli import engine_flags, model_flags

flags.adopt_module_key_flags(model_flags)
flags.adopt_module_key_flags(engine_flags)
flags.DEFINE_integer("num_prompts", 512, "Requests to run.")
flags.DEFINE_integer("max_concurrency", 64, "Requests in flight at a time.")
flags.DEFINE_integer("output_len", 64, "Tokens to generate per request (ignore_eos, greedy).")
flags.DEFINE_list("modes", ["core", "offline"], "Which loops to run, in this order (core, offline).")
flags.DEFINE_string("out", None, "JSON file to write the results to.")
F = flags.FLAGS

_PROMPTS = ["Write a short story about the sea.", "Explain black holes to a child.", "List five facts about tea.",
            "Write a poem about a lost robot.", "Describe a city at night in detail."]


def _params():
    from jaxinfer import SamplingParams

    return SamplingParams(max_tokens=F.output_len, temperature=0.0, ignore_eos=True)


def run_core() -> dict:
    from jaxinfer.server.async_engine import AsyncEngine

    async def main():
        engine = AsyncEngine(F.model, engine_flags.engine_config(), max_waiting=F.num_prompts)
        engine.start()
        await asyncio.get_running_loop().run_in_executor(None, engine.ready.wait)
        prompts = [engine.encode(_PROMPTS[i % len(_PROMPTS)]) for i in range(F.num_prompts)]
        params, todo, tokens = _params(), list(range(F.num_prompts))[::-1], 0

        async def worker():
            nonlocal tokens
            while todo:
                i = todo.pop()
                engine.admit(1, "prompt")
                sub = engine.submit(f"r{i}", f"r{i}", [prompts[i]], [params])
                while not sub.done:
                    for out in await sub.next():
                        tokens += len(out.delta_token_ids)
                engine.release(sub)

        s0 = dict(engine._stats)
        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(F.max_concurrency)))
        duration = time.perf_counter() - t0
        s1 = dict(engine._stats)
        engine.shutdown(60)
        steps = s1["steps"] - s0["steps"]
        return dict(duration_s=duration, output_tok_s=tokens / duration, steps=steps,
                    loop_host_ms_per_step=1e3 * s1["loop_host_time_per_step"],
                    loop_cpu_ms_per_step=1e3 * s1["loop_cpu_time_per_step"],
                    engine_host_ms_per_step=1e3 * s1["host_time_per_step"])

    return asyncio.run(main())


def run_offline() -> dict:
    from jaxinfer import LLM

    llm = LLM(F.model, **dataclasses.asdict(engine_flags.engine_config()))
    llm.warmup()
    engine = llm.engine
    prompts = [engine.encode(_PROMPTS[i % len(_PROMPTS)]) for i in range(F.num_prompts)]
    params, pending, live, tokens = _params(), list(range(F.num_prompts))[::-1], set(), 0
    steps0, host0 = engine.counters["steps"], engine.counters["host_time"]
    loop_host = loop_cpu = 0.0
    t0 = time.perf_counter()
    while pending or live:
        t, c = time.perf_counter(), time.thread_time()
        while pending and len(live) < F.max_concurrency:
            i = pending.pop()
            engine.add_request(f"r{i}", prompts[i], params)
            live.add(f"r{i}")
        h0, s0 = engine.counters["host_time"], time.perf_counter()
        outputs = engine.step()
        loop_host -= (time.perf_counter() - s0) - (engine.counters["host_time"] - h0)
        for out in outputs:
            tokens += len(out.delta_token_ids)
            if out.finished:
                live.discard(out.request_id)
        loop_host += time.perf_counter() - t
        loop_cpu += time.thread_time() - c
    duration = time.perf_counter() - t0
    steps = engine.counters["steps"] - steps0
    return dict(duration_s=duration, output_tok_s=tokens / duration, steps=steps,
                loop_host_ms_per_step=1e3 * loop_host / steps, loop_cpu_ms_per_step=1e3 * loop_cpu / steps,
                engine_host_ms_per_step=1e3 * (engine.counters["host_time"] - host0) / steps)


def main(argv):
    del argv
    results = {}
    for mode in F.modes:
        results[mode] = {"core": run_core, "offline": run_offline}[mode]()
        r = results[mode]
        print(f"{mode:<8} {r['output_tok_s']:9.1f} out tok/s  {r['steps']:5d} steps  loop host "
              f"{r['loop_host_ms_per_step']:6.3f} ms/step (engine's own {r['engine_host_ms_per_step']:6.3f}), "
              f"loop thread CPU {r['loop_cpu_ms_per_step']:6.3f} ms/step",
              flush=True)
    if "core" in results and "offline" in results:
        extra = results["core"]["loop_host_ms_per_step"] - results["offline"]["loop_host_ms_per_step"]
        extra_cpu = results["core"]["loop_cpu_ms_per_step"] - results["offline"]["loop_cpu_ms_per_step"]
        results["core_extra_host_ms_per_step"], results["core_extra_cpu_ms_per_step"] = extra, extra_cpu
        print(f"the core's loop costs {extra:+.3f} ms of host time ({extra_cpu:+.3f} ms of its thread's CPU) per "
              "step more than offline's")
    results["command"] = " ".join([os.path.basename(sys.executable), *sys.argv])
    if F.out:
        with open(F.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    app.run(main)
