"""Benchmarks of the engine and of a running server, as vLLM's ``vllm bench latency|throughput|serve``
(its flag names where the meaning is the same):

    jaxinfer bench latency --input-len 32 --output-len 128 --batch-size 8 --num-iters 30
    jaxinfer bench throughput --model llama3-8b --load-format dummy --input-len 512 --output-len 256 \\
        --num-prompts 1000 --max-num-seqs 256 --output-json throughput.json
    jaxinfer serve &                              # then, once it answers /health:
    jaxinfer bench serve --dataset-name random --random-input-len 128 --random-output-len 64 \\
        --num-prompts 100 --request-rate 4 --save-result --result-dir results

latency times one batch of prompts end to end, --num-iters times (after --num-iters-warmup untimed
runs); throughput runs --num-prompts prompts through the offline engine at once, after compiling
every step shape (as the server does before /health answers); both take every engine option, as
``jaxinfer serve`` does (latency with prefix caching off by default: its batch repeats). serve
streams requests to a server (Poisson arrivals at --request-rate, at most --max-concurrency in
flight) and reports TTFT, TPOT, ITL and end-to-end latency. Prompts are random token ids drawn with
--seed (vLLM's random dataset), so their lengths are exact, and each generates exactly its output
length unless --no-ignore-eos. Results print as a table; --output-json (latency, throughput) or
--save-result (serve) writes them as JSON, keyed as vLLM keys its own.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

from jaxinfer.cli import dispatch, options
from jaxinfer.cli.options import Parser

BENCHMARKS = {
    "latency": ("jaxinfer.cli.bench:latency", "one batch of prompts end to end, several times: mean and percentiles"),
    "throughput": ("jaxinfer.cli.bench:throughput", "many prompts through the offline engine: requests/s, tokens/s"),
    "serve": ("jaxinfer.cli.bench:serve", "streamed requests to a running server: TTFT, TPOT, ITL, E2EL, tokens/s"),
}
LATENCY_PERCENTILES = (10, 25, 50, 75, 90, 99)  # vLLM's


def main(argv: list[str]) -> None:
    if argv and argv[0] in ("-h", "--help", "help"):
        sys.stdout.write(__doc__ + "\n")
    dispatch("jaxinfer bench", BENCHMARKS, argv, word="benchmark")


# ------------------------------------------------------------------------------------- latency


def latency_parser() -> Parser:
    p = Parser("jaxinfer bench latency", "The latency of one batch of --batch-size random prompts, from the first "
               "request queued to the last token, timed --num-iters times.\n\n" + __doc__)
    options.add_model_argument(p)
    g = p.add_argument_group("benchmark")
    p.option(g, "input-len", type=int, default=32, help="Prompt tokens of each request [default: 32].")
    p.option(g, "output-len", type=int, default=128, help="Tokens generated per request [default: 128].")
    p.option(g, "batch-size", type=int, default=8, help="Requests in the batch [default: 8].")
    p.option(g, "num-iters-warmup", type=int, default=10, help="Untimed runs first [default: 10].")
    p.option(g, "num-iters", type=int, default=30, help="Timed runs [default: 30].")
    _add_run_options(p, g)
    options.add_engine_options(p, defaults=dict(enable_prefix_caching=False))
    options.add_distributed_options(p)
    return p


def latency(argv: list[str]) -> None:
    import numpy as np
    from tqdm import tqdm

    from jaxinfer.bench.metrics import table

    p = latency_parser()
    args, model = options.parse_command(p, argv)
    _check_counts(p, args, "input_len", "output_len", "batch_size", "num_iters")
    _check_counts(p, args, "num_iters_warmup", least=0)
    loaded = _load(p, args, model, "jaxinfer bench latency")
    if loaded is None:
        return
    llm, params = loaded
    prompts = _prompts(llm, args, args.batch_size)

    def run() -> float:
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - t0

    for _ in tqdm(range(args.num_iters_warmup), desc="Warmup iterations", disable=args.disable_tqdm):
        run()
    latencies = np.array([run() for _ in tqdm(range(args.num_iters), desc="Bench iterations",
                                              disable=args.disable_tqdm)])
    percentiles = np.percentile(latencies, LATENCY_PERCENTILES)
    result = dict(avg_latency=float(latencies.mean()), std_latency=float(latencies.std()),
                  latencies=latencies.tolist(),
                  percentiles={str(q): float(v) for q, v in zip(LATENCY_PERCENTILES, percentiles)},
                  **_settings(args, model, "input_len", "output_len", "batch_size", "n", "num_iters"))
    print(table("Latency Benchmark Result", [
        ("Batch size:", args.batch_size), ("Input / output tokens:", f"{args.input_len} / {args.output_len}"),
        ("Iterations:", args.num_iters), ("Avg latency (ms):", result["avg_latency"] * 1e3),
        ("Std latency (ms):", result["std_latency"] * 1e3),
        *((f"P{q} latency (ms):", float(v) * 1e3) for q, v in zip(LATENCY_PERCENTILES, percentiles))]))
    _write_json(args.output_json, result)


# ---------------------------------------------------------------------------------- throughput


def throughput_parser() -> Parser:
    p = Parser("jaxinfer bench throughput", "Offline throughput: --num-prompts random prompts given to the engine "
               "at once, timed from the first queued to the last finished.\n\n" + __doc__)
    options.add_model_argument(p)
    g = p.add_argument_group("benchmark")
    _add_dataset_option(p, g)
    p.option(g, "input-len", type=int, default=128, help="Prompt tokens of each request [default: 128].")
    p.option(g, "output-len", type=int, default=128, help="Tokens generated per request [default: 128].")
    p.option(g, "num-prompts", type=int, default=100, help="Requests [default: 100; vLLM's 1000 suits a GPU].")
    _add_run_options(p, g)
    options.add_engine_options(p)
    options.add_distributed_options(p)
    return p


def throughput(argv: list[str]) -> None:
    from jaxinfer.bench.metrics import table

    p = throughput_parser()
    args, model = options.parse_command(p, argv)
    _check_counts(p, args, "input_len", "output_len", "num_prompts")
    loaded = _load(p, args, model, "jaxinfer bench throughput")
    if loaded is None:
        return
    llm, params = loaded
    prompts = _prompts(llm, args, args.num_prompts)
    compiling = llm.warmup(greedy_only=params.temperature == 0)
    print(f"[compiled every step shape in {compiling:.1f}s]", file=sys.stderr)
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=not args.disable_tqdm)
    elapsed = time.perf_counter() - t0
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    output_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    total = prompt_tokens + output_tokens
    result = dict(elapsed_time=elapsed, num_requests=len(outputs), total_num_tokens=total,
                  requests_per_second=len(outputs) / elapsed, tokens_per_second=total / elapsed,
                  total_prompt_tokens=prompt_tokens, total_output_tokens=output_tokens,
                  output_tokens_per_second=output_tokens / elapsed, warmup_s=compiling,
                  **_settings(args, model, "input_len", "output_len", "num_prompts", "n"))
    print(table("Throughput Benchmark Result", [
        ("Requests:", len(outputs)), ("Elapsed time (s):", elapsed),
        ("Total prompt tokens:", prompt_tokens), ("Total output tokens:", output_tokens),
        ("Request throughput (req/s):", result["requests_per_second"]),
        ("Output token throughput (tok/s):", result["output_tokens_per_second"]),
        ("Total token throughput (tok/s):", result["tokens_per_second"])]))
    _write_json(args.output_json, result)


# ------------------------------------------------------------------------------------ shared


def _add_dataset_option(p: Parser, group) -> None:
    p.option(group, "dataset-name", choices=("random",), default="random", help="Where prompts come from: random "
             "token ids drawn with --seed, of exactly the length asked [default: random].")


def _add_run_options(p: Parser, group) -> None:
    """The sampling and output flags latency and throughput share (the engine's --seed seeds the prompts too)."""
    p.option(group, "n", type=int, default=1, help="Completions per prompt [default: 1].")
    p.option(group, "temperature", type=float, default=1.0, help="Sampling temperature (top_p 1), 0 greedy "
             "[default: 1.0, vLLM's].")
    p.flag(group, "ignore-eos", default=True, help="Generate exactly --output-len tokens per completion.")
    p.option(group, "output-json", default=None, help="Write the results to this JSON file.")
    p.flag(group, "disable-tqdm", default=False, help="No progress bars.")


def _check_counts(p: Parser, args: argparse.Namespace, *names: str, least: int = 1) -> None:
    for name in names:
        if getattr(args, name) < least:
            p.error(f"--{name.replace('_', '-')} must be at least {least}, got {getattr(args, name)}")


def _load(p: Parser, args: argparse.Namespace, model: str, prog: str):
    """The ``LLM`` the engine flags describe and the requests' ``SamplingParams``; None in a follower
    process of a multi-process run (``generate.load``)."""
    from jaxinfer.cli.generate import load
    from jaxinfer.sampling_params import SamplingParams

    try:
        params = SamplingParams(max_tokens=args.output_len, n=args.n, temperature=args.temperature, top_p=1.0,
                                ignore_eos=args.ignore_eos)
    except (TypeError, ValueError) as e:
        p.error(str(e))
    llm = load(p, args, model, prog)
    if llm is None:
        return None
    limit = llm.engine.max_model_len
    if args.input_len + args.output_len > limit:
        p.error(f"--input-len {args.input_len} + --output-len {args.output_len} exceeds the model length {limit} "
                "(--max-model-len)")
    return llm, params


def _prompts(llm, args: argparse.Namespace, count: int) -> list[list[int]]:
    import numpy as np

    from jaxinfer.bench.prompts import random_prompts

    return random_prompts(np.random.default_rng(args.seed), [args.input_len] * count,
                          llm.engine.model_config.vocab_size)


def _settings(args: argparse.Namespace, model: str, *names: str) -> dict:
    return dict(model=model, **{name: getattr(args, name) for name in names})


def _write_json(path: str | None, result: dict) -> None:
    if path:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
        print(f"(results: {path})")


# -------------------------------------------------------------------------------------- serve


def serve_parser() -> Parser:
    from jaxinfer.bench.metrics import SERVING_METRICS

    p = Parser("jaxinfer bench serve", "Online serving: streamed requests to a running OpenAI-compatible server "
               "(jaxinfer serve, or any other that takes token-id prompts).\n\n" + __doc__)
    g = p.add_argument_group("server")
    p.option(g, "base-url", default=None, help="The server's address, e.g. http://127.0.0.1:8000 (default: "
             "http://HOST:PORT).")
    p.option(g, "host", default="127.0.0.1", help="The server's host, without --base-url [default: 127.0.0.1].")
    p.option(g, "port", type=int, default=8000, help="Its port, without --base-url [default: 8000].")
    p.option(g, "endpoint", choices=("/v1/completions",), default="/v1/completions", help="The API loaded: random "
             "prompts are token ids, which completions take [default: /v1/completions].")
    p.option(g, "model", default=None, help="The model name requests carry (default: the first the server lists "
             "at /v1/models).")
    p.option(g, "api-key", default=None, help="Bearer token, if the server wants one (default: $OPENAI_API_KEY).")
    g = p.add_argument_group("load")
    _add_dataset_option(p, g)
    p.option(g, "random-input-len", type=int, default=128, help="Prompt tokens of each request [default: 128].")
    p.option(g, "random-output-len", type=int, default=128, help="Tokens generated per request [default: 128].")
    p.option(g, "input-len", type=int, default=None, help="Sets --random-input-len.")
    p.option(g, "output-len", type=int, default=None, help="Sets --random-output-len.")
    p.option(g, "random-vocab-size", type=int, default=None, help="Prompt ids are drawn from [10, this - 10) "
             "(default: the served model's vocabulary, which jaxinfer serve's /openapi.json states; else 10000).")
    p.option(g, "num-prompts", type=int, default=100, help="Requests [default: 100; vLLM's 1000 suits a GPU].")
    p.option(g, "request-rate", type=float, default=float("inf"), help="Mean arrivals per second (a Poisson "
             "process); inf sends every request at once [default: inf].")
    p.option(g, "max-concurrency", type=int, default=None, help="Most requests in flight at a time (default: no "
             "limit).")
    p.option(g, "seed", type=int, default=0, help="Seed of the prompts and arrival times [default: 0].")
    p.flag(g, "ignore-eos", default=True, help="Generate exactly --random-output-len tokens per request.")
    p.option(g, "temperature", type=float, default=None, help="Sampling temperature sent (default: none, the "
             "server's).")
    g = p.add_argument_group("results")
    p.option(g, "percentile-metrics", default="ttft,tpot,itl,e2el", metavar="NAME,NAME",
             help=f"Metrics reported with percentiles, of {', '.join(SERVING_METRICS)} [default: ttft,tpot,itl,e2el].")
    p.option(g, "metric-percentiles", default="99", metavar="Q,Q", help="Their percentiles, e.g. 50,90,99 "
             "(mean and median always) [default: 99].")
    p.flag(g, "save-result", default=False, help="Write the results as JSON to --result-dir/--result-filename.")
    p.option(g, "result-dir", default=None, help="Directory of the JSON file (default: the current one).")
    p.option(g, "result-filename", default=None, help="Its name (default: jaxinfer-<rate>qps[-concurrency<N>]-"
             "<model>-<date>.json).")
    p.flag(g, "disable-tqdm", default=False, help="No progress bar.")
    return p


def serve(argv: list[str]) -> None:
    p = serve_parser()
    args = p.parse(argv)
    metrics, percentiles = _serving_metrics(p, args)
    input_len = args.input_len if args.input_len is not None else args.random_input_len
    output_len = args.output_len if args.output_len is not None else args.random_output_len
    args.random_input_len, args.random_output_len = input_len, output_len
    _check_counts(p, args, "random_input_len", "random_output_len", "num_prompts")
    if args.max_concurrency is not None:
        _check_counts(p, args, "max_concurrency")
    if not args.request_rate > 0:
        p.error(f"--request-rate must be positive, got {args.request_rate}")

    import httpx
    import numpy as np

    from jaxinfer.bench import client
    from jaxinfer.bench.metrics import serving_rows, serving_summary, table
    from jaxinfer.bench.prompts import random_prompts

    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    try:
        model = args.model or client.served_model(base_url, api_key)
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as e:
        sys.exit(f"jaxinfer bench serve: no model from {base_url}/v1/models ({type(e).__name__}: {e}): is the "
                 "server up? (or give --model)")
    vocab = args.random_vocab_size or client.served_vocab_size(base_url, api_key)
    if vocab is None:
        vocab = 10000
        print(f"the server does not state its vocabulary size: prompt ids below {vocab} (--random-vocab-size)")
    try:
        prompts = random_prompts(np.random.default_rng(args.seed), [input_len] * args.num_prompts, vocab)
    except ValueError as e:
        p.error(f"--random-vocab-size: {e}")
    load = client.Load(base_url, model, args.endpoint, output_len, args.ignore_eos, args.request_rate,
                       args.max_concurrency or len(prompts), args.seed, api_key=api_key, temperature=args.temperature,
                       progress=not args.disable_tqdm)
    print(f"{base_url}{args.endpoint}, model {model}: {len(prompts)} requests of {input_len} prompt tokens and "
          f"{output_len} output tokens; request rate {args.request_rate}, maximum concurrency "
          f"{args.max_concurrency or 'unlimited'}")
    results, duration = client.run_load(load, prompts)
    summary = serving_summary(results, duration, metrics, percentiles)
    print(table("Serving Benchmark Result", serving_rows(summary, metrics, percentiles, args.max_concurrency,
                                                         args.request_rate)))
    for error in summary["errors"]:
        print("error:", error, file=sys.stderr)
    now = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    result = dict(date=now, backend="openai", endpoint=args.endpoint, model_id=model, num_prompts=args.num_prompts,
                  random_input_len=input_len, random_output_len=output_len, ignore_eos=args.ignore_eos,
                  request_rate=args.request_rate if args.request_rate != float("inf") else "inf",
                  max_concurrency=args.max_concurrency, **summary)
    if args.save_result:
        concurrency = f"-concurrency{args.max_concurrency}" if args.max_concurrency is not None else ""
        name = (args.result_filename
                or f"jaxinfer-{args.request_rate}qps{concurrency}-{model.rstrip('/').split('/')[-1]}-{now}.json")
        _write_json(os.path.join(args.result_dir, name) if args.result_dir else name, result)
    if not summary["completed"]:
        sys.exit(1)


def _serving_metrics(p: Parser, args: argparse.Namespace) -> tuple[list[str], list[float]]:
    """--percentile-metrics and --metric-percentiles, checked."""
    from jaxinfer.bench.metrics import SERVING_METRICS

    metrics = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
    unknown = [m for m in metrics if m not in SERVING_METRICS]
    if unknown:
        p.error(f"--percentile-metrics: unknown {', '.join(unknown)}; known: {', '.join(SERVING_METRICS)}")
    try:
        percentiles = [float(q) for q in args.metric_percentiles.split(",") if q.strip()]
    except ValueError:
        p.error(f"--metric-percentiles: expected comma-separated numbers, got {args.metric_percentiles!r}")
    if not all(0 <= q <= 100 for q in percentiles):
        p.error(f"--metric-percentiles: each must be in [0, 100], got {args.metric_percentiles!r}")
    return metrics, percentiles
