"""Generate text from the command line, streamed as it is produced.

    jaxinfer generate --prompt "The capital of France is" --max-tokens 32 --temperature 0
    jaxinfer generate --chat "Write a haiku about the sea."
    XLA_FLAGS=--xla_force_host_platform_device_count=3 jaxinfer generate --tensor-parallel-size 3 --prompt "Hi"
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import time

from jaxinfer.cli import options
from jaxinfer.cli.options import Parser


def parser() -> Parser:
    p = Parser("jaxinfer generate", __doc__)
    options.add_model_argument(p)
    g = p.add_argument_group("generation")
    p.option(g, "prompt", default=None, help="Raw text prompt (completion).")
    p.option(g, "chat", default=None, help="A user message; the model's chat template is applied.")
    p.option(g, "system", default=None, help="Optional system message for --chat.")
    p.option(g, "max-tokens", type=int, default=128, help="Most tokens to generate [default: 128].")
    p.option(g, "temperature", type=float, default=0.7, help="Sampling temperature; 0 is greedy [default: 0.7].")
    p.option(g, "top-p", type=float, default=0.9, help="Nucleus sampling mass, in (0, 1] [default: 0.9].")
    p.option(g, "top-k", type=int, default=0, help="Keep only the k most likely tokens; 0 disables [default: 0].")
    p.option(g, "sampling-seed", type=int, default=None, help="Sampling seed, for reproducible output.")
    options.add_engine_options(p, defaults=dict(max_model_len=2048, max_num_seqs=1, max_num_batched_tokens=256))
    options.add_distributed_options(p)
    return p


def main(argv: list[str]) -> None:
    p = parser()
    args, model = options.parse_command(p, argv)
    if (args.prompt is None) == (args.chat is None):
        p.error("pass exactly one of --prompt or --chat")
    logging.basicConfig(level=logging.WARNING)  # keep compile logs out of the streamed text
    config = options.engine_config(p, args)
    if options.init_distributed(args):  # not process 0: run the steps it sends
        from jaxinfer.batching.factory import run_follower
        return run_follower(model, config)
    from jaxinfer.sampling_params import SamplingParams

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, seed=args.sampling_seed)
    except (TypeError, ValueError) as e:
        p.error(str(e))
    options.fetch_model("jaxinfer generate", model, config)  # a Hub id fetched now; a bad model in one line
    from jaxinfer import LLM
    from jaxinfer.tokenizer import apply_chat_template

    t0 = time.perf_counter()
    llm = LLM(model, **dataclasses.asdict(config))
    print(f"[loaded {model} in {time.perf_counter() - t0:.1f}s]", file=sys.stderr)
    if args.chat is not None:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": args.chat}]
        prompt = apply_chat_template(llm.tokenizer, messages)
    else:
        prompt = args.prompt
        print(prompt, end="", flush=True)
    engine = llm.engine
    engine.add_request("cli", prompt, params)
    t0, n = time.perf_counter(), 0
    while engine.has_unfinished():
        for out in engine.step():
            print(out.delta_text, end="", flush=True)
            n = len(out.token_ids)
    dt = time.perf_counter() - t0
    print(f"\n[{n} tokens in {dt:.1f}s, {n / dt:.1f} tok/s including compilation]", file=sys.stderr)
