"""What a varied workload compiles after ``LLM.warmup(structured=True)``, counted from JAX's own compile
events: prompts of 1-300 tokens arriving between steps, greedy and seeded sampling, a stop token, a
constrained (``choice``) request, an abort, and one step that fails as a whole (the KV pool deleted, as
a device error would leave it) so that the recovery's steps are counted too. Prints and writes JSON;
exits 1 if anything compiled. ``tests/test_cpu_compilation.py`` checks the same on CPU; this runs it
on any device:

    python3 benchmarks/compiles_after_warmup.py --model /tmp/tiny-smoltok --out $OUT/compiles.json

(``--model``: a directory from ``make_dummy_model.py``, served with random weights.)
"""

import json
import sys
import time

import jax
import numpy as np
from jax._src import monitoring

from jaxinfer import LLM, SamplingParams, StructuredOutputs
from jaxinfer.cli.options import Parser

PROMPT_LENGTHS = (1, 5, 17, 33, 60, 100, 9, 2, 200, 300)
FAIL_AT_STEP = 9


def varied_workload(llm, prompt_lengths=PROMPT_LENGTHS, most_tokens: int = 24) -> dict:
    """Run the workload on ``llm`` (already warmed up) and return what JAX compiled meanwhile
    (``compiled``), whether the injected failure ran (``failed``) and each request's finish reason.
    ``tests/test_cpu_compilation.py`` runs it on the embedded model."""
    compiled = []

    def listen(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiled.append(kwargs.get("fun_name"))

    eng, rng = llm.engine, np.random.default_rng(3)
    execute, failed, finished = eng.runner.execute, [], {}

    def fail_once(output):  # as a device error would, taking the donated pool with it
        if not failed and eng.stats()["steps"] >= FAIL_AT_STEP:
            failed.append(True)
            for leaf in jax.tree.leaves(eng.runner.cache):
                leaf.delete()
            raise RuntimeError("injected device failure")
        return execute(output)

    def step():
        for out in eng.step():
            if out.finished:
                finished[out.request_id] = out.finish_reason

    monitoring.register_event_duration_secs_listener(listen)
    eng.runner.execute = fail_once
    try:
        for i, n in enumerate(prompt_lengths):
            max_tokens = int(rng.integers(3, most_tokens))
            params = (SamplingParams(max_tokens=max_tokens, temperature=0.9, seed=i) if i % 2 else
                      SamplingParams(max_tokens=max_tokens, temperature=0.0, stop_token_ids=(13,)))
            eng.add_request(f"r{i}", rng.integers(3, 40000, n).tolist(), params)
            if i == 5:
                eng.add_request("choice", "Is the sky blue? Answer:", SamplingParams(
                    max_tokens=4, temperature=0.0, structured=StructuredOutputs(choice=("yes", "no"))))
            for _ in range(i % 3 + 1):
                step()
            if i == 6:
                eng.abort("r4")
        while eng.has_unfinished():
            step()
    finally:
        monitoring.unregister_event_duration_listener(listen)
        eng.runner.execute = execute
    return dict(compiled=compiled, failed=bool(failed), finished=finished)


def run(model: str) -> dict:
    llm = LLM(model, load_format="dummy", max_num_seqs=8, max_num_batched_tokens=256, max_model_len=512,
              token_buckets=(8, 64, 256), seq_buckets=(8,), page_buckets=(8, 32), max_executables=512)
    t0 = time.perf_counter()
    llm.warmup(structured=True)
    warmup_s = time.perf_counter() - t0
    seen = varied_workload(llm)
    return dict(device=str(jax.devices()[0]), warmup_s=warmup_s, compiled_after_warmup=seen["compiled"],
                failed_step_injected=seen["failed"], finished=seen["finished"], stats=llm.engine.stats())


def parser() -> Parser:
    p = Parser("compiles_after_warmup.py", __doc__)
    p.option(None, "model", required=True, help="A model directory with a tokenizer (random weights are used).")
    p.option(None, "out", default="compiles_after_warmup.json", help="Where the JSON goes "
             "[default: compiles_after_warmup.json].")
    return p


def main(argv: list[str]) -> None:
    args = parser().parse(argv)
    result = run(args.model)
    print(json.dumps({k: v for k, v in result.items() if k != "stats"}, indent=1, default=str))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1, default=str)
    sys.exit(1 if result["compiled_after_warmup"] else 0)


if __name__ == "__main__":
    main(sys.argv[1:])
