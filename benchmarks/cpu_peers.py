"""The CPU peers of ``benchmark.py --workload cpu``, one per process: llama.cpp and transformers.

    python benchmarks/cpu_peers.py llama_cpp GGUF PROMPTS.json THREADS NEW         # a session: commands on stdin
    python benchmarks/cpu_peers.py transformers GGUF PROMPTS.json THREADS NEW RUNS  # prints one JSON line

``PROMPTS.json`` holds token-id lists; the first is the batch-1 prompt (transformers decodes it RUNS
times, the median reported), all of them the 8-request batch. llama.cpp runs under its own
interpreter (``llama-cpp-python`` built from its PyPI source distribution into a separate venv:
``python3 -m venv /work/peers-venv && /work/peers-venv/bin/pip install llama-cpp-python``), so this
file imports only the peer it runs. Both decode greedily with EOS
ignored, like the engine's run.
"""

from __future__ import annotations

import json
import statistics
import sys
import time


def llama_cpp(gguf: str, prompts: list[list[int]], threads: int, new: int) -> None:
    """llama.cpp through llama-cpp-python, ``--no-repack`` (no extra buffer types: the AMX repack
    path segfaulted on this CPU), as a session: it prints ``{"load_s": ...}`` once loaded, then
    answers each command read from stdin with one JSON line, so that ``benchmark.py`` can alternate
    its batch-1 runs with the engine's (one run of llama.cpp moved 111-141 tok/s between runs minutes
    apart): ``decode``, the first prompt alone (``decode_tok_s``, its ``tokens``); ``batch``, all of
    them (it serves one sequence at a time here, so one after another: ``batch_output_tok_s``)."""
    import llama_cpp as lc
    import llama_cpp.llama_cpp as low  # what Llama() takes its default model params from
    default = low.llama_model_default_params

    def params():
        p = default()
        p.use_extra_bufts = False
        return p
    low.llama_model_default_params = params
    t0 = time.perf_counter()
    llm = lc.Llama(model_path=gguf, n_threads=threads, n_threads_batch=threads, n_ctx=1024, n_batch=128,
                   verbose=False)
    load = time.perf_counter() - t0

    def run(prompt):
        llm.reset()
        out, first = [], None
        t = time.perf_counter()
        for tok in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
            out.append(tok)
            first = first or time.perf_counter()
            if len(out) == new:
                break
        end = time.perf_counter()
        return out, (end - first) / (new - 1), end - t
    run(prompts[0][:16])  # warm the threads and caches
    print(json.dumps(dict(load_s=load)), flush=True)
    for line in sys.stdin:
        if line.strip() == "decode":
            tokens, tpot, _ = run(prompts[0])
            print(json.dumps(dict(decode_tok_s=1 / tpot, tokens=tokens)), flush=True)
        elif line.strip() == "batch":
            wall = sum(run(p)[2] for p in prompts)
            print(json.dumps(dict(batch_output_tok_s=len(prompts) * new / wall)), flush=True)


def transformers(gguf: str, prompts: list[list[int]], threads: int, new: int, runs: int) -> dict:
    """transformers float32 on the same GGUF (dequantized by transformers), ``generate`` greedy: batch 1,
    then the 8 prompts as one batch (they have equal lengths, so no padding)."""
    import os
    import torch
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf),
                                                 dtype=torch.float32, local_files_only=True).eval()
    load = time.perf_counter() - t0
    kw = dict(do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        model.generate(torch.tensor([prompts[0][:16]]), max_new_tokens=4, min_new_tokens=4, **kw)
        ids = torch.tensor([prompts[0]])
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
        prefill = time.perf_counter() - t
        rates = []
        for _ in range(runs):
            t = time.perf_counter()
            out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, **kw)
            rates.append((new - 1) / (time.perf_counter() - t - prefill))
        t = time.perf_counter()
        model.generate(torch.tensor(prompts), max_new_tokens=new, min_new_tokens=new, **kw)
        wall = time.perf_counter() - t
    return dict(load_s=load, decode_tok_s=statistics.median(rates), decode_tok_s_runs=rates,
                batch_output_tok_s=len(prompts) * new / wall, tokens=out[0, ids.shape[1]:].tolist())


if __name__ == "__main__":
    peer, gguf, path, threads, new = sys.argv[1:6]
    with open(path) as f:
        prompts = json.load(f)
    if peer == "llama_cpp":
        llama_cpp(gguf, prompts, int(threads), int(new))
    else:
        print(json.dumps(transformers(gguf, prompts, int(threads), int(new), int(sys.argv[6]))))
