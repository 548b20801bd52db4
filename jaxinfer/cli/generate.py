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
    add_sampling_options(p, g)
    options.add_engine_options(p, defaults=ENGINE_DEFAULTS)
    options.add_distributed_options(p)
    return p


# One request at a time, streamed: small sizes compile few shapes.
ENGINE_DEFAULTS = dict(max_model_len=2048, max_num_seqs=1, max_num_batched_tokens=256)


def add_sampling_options(p: Parser, group) -> None:
    p.option(group, "max-tokens", type=int, default=128, help="Most tokens to generate [default: 128].")
    p.option(group, "temperature", type=float, default=0.7, help="Sampling temperature; 0 is greedy [default: 0.7].")
    p.option(group, "top-p", type=float, default=0.9, help="Nucleus sampling mass, in (0, 1] [default: 0.9].")
    p.option(group, "top-k", type=int, default=0, help="Keep only the k most likely tokens; 0 disables [default: 0].")
    p.option(group, "sampling-seed", type=int, default=None, help="Sampling seed, for reproducible output.")


def sampling_params(p: Parser, args):
    from jaxinfer.sampling_params import SamplingParams

    try:
        return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                              top_k=args.top_k, seed=args.sampling_seed)
    except (TypeError, ValueError) as e:
        p.error(str(e))


def load(p: Parser, args, model: str, prog: str):
    """The ``LLM`` the flags describe (its load time on stderr), or None in a follower process of a
    multi-process run, which has run the steps process 0 sent by the time it returns."""
    logging.basicConfig(level=logging.WARNING)  # keep compile logs out of the streamed text
    config = options.engine_config(p, args)
    if options.init_distributed(args):  # not process 0: run the steps it sends
        from jaxinfer.batching.factory import run_follower
        run_follower(model, config)
        return None
    options.fetch_model(prog, model, config)  # a Hub id fetched now; a bad model in one line
    from jaxinfer import LLM

    t0 = time.perf_counter()
    llm = LLM(model, **dataclasses.asdict(config))
    print(f"[loaded {model} in {time.perf_counter() - t0:.1f}s]", file=sys.stderr)
    return llm


def stream(llm, prompt, params, out=sys.stdout) -> str:
    """Generate for ``prompt`` (text or token ids), writing the text to ``out`` as it comes (its token
    rate on stderr); returns the text."""
    engine = llm.engine
    engine.add_request(f"cli-{time.monotonic_ns()}", prompt, params)
    t0, n, text = time.perf_counter(), 0, ""
    while engine.has_unfinished():
        for o in engine.step():
            out.write(o.delta_text)
            out.flush()
            n, text = len(o.token_ids), o.text
    dt = time.perf_counter() - t0
    print(f"\n[{n} tokens in {dt:.1f}s, {n / dt:.1f} tok/s]", file=sys.stderr)
    return text


def main(argv: list[str]) -> None:
    p = parser()
    args, model = options.parse_command(p, argv)
    if (args.prompt is None) == (args.chat is None):
        p.error("pass exactly one of --prompt or --chat")
    params = sampling_params(p, args)
    llm = load(p, args, model, "jaxinfer generate")
    if llm is None:
        return
    from jaxinfer.tokenizer import apply_chat_template

    if args.chat is not None:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": args.chat}]
        prompt = apply_chat_template(llm.tokenizer, messages)
    else:
        prompt = args.prompt
        print(prompt, end="", flush=True)
    stream(llm, prompt, params)
