"""Generate text from the command line, streamed as it is produced.

    jaxinfer generate --prompt "The capital of France is" --max_tokens 32 --temperature 0
    jaxinfer generate --chat "Write a haiku about the sea."
    XLA_FLAGS=--xla_force_host_platform_device_count=3 jaxinfer generate --tensor_parallel 3 --prompt "Hi"
"""

from __future__ import annotations

import logging
import sys
import time

from absl import flags
from absl import logging as absl_logging

from jaxinfer.cli import model_flags

flags.adopt_module_key_flags(model_flags)
flags.DEFINE_string("prompt", None, "Raw text prompt (completion).")
flags.DEFINE_string("chat", None, "A user message; the model's chat template is applied.")
flags.DEFINE_string("system", None, "Optional system message for --chat.")
flags.DEFINE_integer("max_tokens", 128, "Most tokens to generate.")
flags.DEFINE_float("temperature", 0.7, "Sampling temperature; 0 is greedy.")
flags.DEFINE_float("top_p", 0.9, "Nucleus sampling mass, in (0, 1].")
flags.DEFINE_integer("top_k", 0, "Keep only the k most likely tokens; 0 disables.")
flags.DEFINE_integer("seed", None, "Sampling seed, for reproducible output.")
flags.DEFINE_integer("max_model_len", 2048, "Longest prompt plus output, in tokens.")
F = flags.FLAGS


def main(argv):
    del argv
    if (F.prompt is None) == (F.chat is None):
        sys.exit("pass exactly one of --prompt or --chat")
    logging.basicConfig(level=logging.WARNING)
    absl_logging.set_verbosity(absl_logging.WARNING)  # keep compile logs out of the streamed text
    from jaxinfer import LLM, SamplingParams
    from jaxinfer.tokenizer import apply_chat_template

    options = dict(max_model_len=F.max_model_len, max_num_seqs=1, max_num_batched_tokens=256,
                   **model_flags.load_options(), **model_flags.parallel_options())
    if model_flags.init_distributed():  # not process 0: run the steps it sends
        from jaxinfer.batching.config import EngineConfig
        from jaxinfer.batching.factory import run_follower
        return run_follower(F.model, EngineConfig.from_options(**options))
    model_flags.fetch_model("jaxinfer generate", F.model)  # a Hub id fetched now; a bad model in one line
    t0 = time.perf_counter()
    llm = LLM(F.model, **options)
    print(f"[loaded {F.model} in {time.perf_counter() - t0:.1f}s]", file=sys.stderr)
    if F.chat is not None:
        messages = ([{"role": "system", "content": F.system}] if F.system else []) + [
            {"role": "user", "content": F.chat}]
        prompt = apply_chat_template(llm.tokenizer, messages)
    else:
        prompt = F.prompt
        print(prompt, end="", flush=True)
    params = SamplingParams(max_tokens=F.max_tokens, temperature=F.temperature, top_p=F.top_p, top_k=F.top_k,
                            seed=F.seed)
    engine = llm.engine
    engine.add_request("cli", prompt, params)
    t0, n = time.perf_counter(), 0
    while engine.has_unfinished():
        for out in engine.step():
            print(out.delta_text, end="", flush=True)
            n = len(out.token_ids)
    dt = time.perf_counter() - t0
    print(f"\n[{n} tokens in {dt:.1f}s, {n / dt:.1f} tok/s including compilation]", file=sys.stderr)
