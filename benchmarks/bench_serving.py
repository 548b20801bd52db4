"""Load-test an OpenAI-compatible server (streamed requests, Poisson arrivals or a fixed concurrency), and
optionally the offline engine on the same requests in the same run, so the server-to-engine ratio is one command.

    jaxinfer serve &                                           # then, once /health answers 200:
    python benchmarks/bench_serving.py --num-prompts 64 --request-rate 4 --out bench.json
    # Everything in one run: start the server, load it, stop it, run the same requests offline.
    python benchmarks/bench_serving.py --launch --offline --model smollm2-135m --num-prompts 64 \\
        --max-concurrency 16 --max-num-seqs 16 --input-len 32 --output-len 32 --out bench.json

Reports throughput, TTFT, TPOT (per request: (latency - TTFT) / (tokens - 1)), inter-token latency
(gaps between streamed chunks) and end-to-end latency (E2EL) percentiles, and the number of failed
streams; the load generator and its figures (keyed as vLLM's) are ``jaxinfer bench serve``'s
(jaxinfer/bench/). Outputs are fixed-length (ignore_eos) and greedy by default so runs are
comparable. The engine options are the server's own flags, with its defaults (jaxinfer/cli/options.py;
--help lists them): with --launch the server gets them all (``options.command_line``), and --offline
builds the very same EngineConfig.
Requests are sent from --client-processes processes so that the client is not the bottleneck.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

from jaxinfer.bench import client
from jaxinfer.bench.metrics import distributions, serving_summary
from jaxinfer.bench.prompts import random_prompts
from jaxinfer.cli import options
from jaxinfer.cli.options import Parser
from jaxinfer.cli.serve import ENGINE_DEFAULTS
from server_launch import SERVE, free_port, wait_healthy  # a benchmark's folder is on sys.path when it runs


def parser() -> Parser:
    """This script's flags, and the engine options of ``jaxinfer serve`` with its defaults (the server's
    on a small CPU) but ``seed``: here the seed of the prompts and arrival times."""
    p = Parser("bench_serving.py", __doc__)
    options.add_model_argument(p)  # --launch / --offline; else the server's own
    g = p.add_argument_group("load")
    p.option(g, "base-url", default="http://127.0.0.1:8000", help="Server address (ignored with --launch).")
    p.flag(g, "launch", default=False, help="Start jaxinfer serve with this script's model and engine options, "
           "wait until it is healthy, and stop it after the load.")
    p.option(g, "launch-timeout", type=float, default=1800.0, help="--launch: seconds to wait for /health (warm-up "
             "compiles every shape) [default: 1800].")
    p.flag(g, "offline", default=False, help="Also run the same requests through the offline engine (same config, "
           "same concurrency) after the server run, and report server / offline throughput.")
    p.option(g, "endpoint", choices=("completions", "chat"), default="completions",
             help="Which API to load [default: completions].")
    p.option(g, "num-prompts", type=int, default=64, help="Requests to send [default: 64].")
    p.option(g, "input-len", type=int, default=None, help="Random prompts of exactly this many token ids (vLLM's "
             "random dataset); default: short text prompts (about 10 tokens).")
    p.option(g, "random-vocab", type=int, default=10000, help="--input-len: token ids are drawn from "
             "[10, random_vocab - 10) [default: 10000].")
    p.option(g, "output-len", type=int, default=None, help="Tokens to generate per request (alias of --max-tokens).")
    p.option(g, "max-tokens", type=int, default=64, help="Tokens to generate per request [default: 64].")
    p.option(g, "request-rate", type=float, default=float("inf"), help="Mean arrivals per second (Poisson); inf "
             "sends all at once [default: inf].")
    p.option(g, "max-concurrency", type=int, default=None, help="Most requests in flight at a time (default: "
             "unbounded).")
    p.option(g, "client-processes", type=int, default=1, help="Client processes sharing the requests (and the "
             "concurrency) [default: 1].")
    p.flag(g, "ignore-eos", default=True, help="Generate exactly --max-tokens tokens per request.")
    p.option(g, "temperature", type=float, default=0.0, help="Sampling temperature [default: 0].")
    p.option(g, "seed", dest="load_seed", type=int, default=0, metavar="SEED", help="Seed for prompts and arrival times "
             "[default: 0].")
    p.option(g, "response-format", default=None, help="Constrain every request's output: 'json_object', or a JSON "
             "schema file (chat sends response_format, completions vLLM's structured_outputs; offline: "
             "SamplingParams.structured). A constrained request stops when its JSON is complete.")
    p.option(g, "api-key", default=None, help="Bearer token, if the server wants one.")
    p.option(g, "name", default="serving", help="Name of this run in the JSON file [default: serving].")
    p.option(g, "out", default=None, help="JSON file to write the results to, under --name (other runs in it are "
             "kept).")
    options.add_engine_options(p, defaults=ENGINE_DEFAULTS, exclude=("seed",))
    return p


F = argparse.Namespace()  # the parsed flags (main sets them)
PERCENTILES = (50, 90, 99)  # reported beside the mean and median

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SUBJECTS = ["the sea", "a lighthouse keeper", "black holes", "sourdough bread", "the Roman empire", "a lost robot",
             "mountain weather", "prime numbers", "a city at night", "honeybees", "the first computer", "tea"]
_FORMS = ["Write a short story about {}.", "Explain {} to a child.", "List five facts about {}.",
          "Write a poem about {}.", "Describe {} in detail."]


def make_prompts(n: int, rng: np.random.Generator) -> list:
    if F.input_len:
        return random_prompts(rng, [F.input_len] * n, F.random_vocab)
    return [_FORMS[rng.integers(len(_FORMS))].format(_SUBJECTS[rng.integers(len(_SUBJECTS))]) for _ in range(n)]


def constraint_schema() -> dict | None:
    """--response-format as a JSON schema ({} for json_object), or None."""
    if F.response_format in (None, "json_object"):
        return None if F.response_format is None else {}
    with open(F.response_format) as f:
        return json.load(f)


def request_constraint(endpoint: str) -> dict | None:
    """The body fields that carry --response-format to the server."""
    schema = constraint_schema()
    if schema is None:
        return None
    if endpoint == "chat":
        return {"response_format": {"type": "json_schema", "json_schema": {"name": "bench", "schema": schema}}
                if schema else {"type": "json_object"}}
    return {"structured_outputs": {"json": schema} if schema else {"json_object": True}}


# ------------------------------------------------------------------------------------ the server


class LaunchedServer:
    """``jaxinfer serve`` with this run's model and engine options (every one, ``config``), on a free port."""

    def __init__(self, model: str, config, max_waiting: int):
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="serve-", suffix=".log", delete=False)
        cmd = [*SERVE, f"--model={model}", f"--port={port}", f"--max-waiting={max_waiting}",
               *options.command_line(config), *(["--warmup-structured"] if F.response_format else [])]
        print("launching:", " ".join(cmd), f"(log: {self.log.name})", flush=True)
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT)
        try:  # load + compile (or cache reads) until healthy
            self.startup_s = wait_healthy(self.proc, self.url, F.launch_timeout, self.tail)
        except RuntimeError:
            self.stop()
            raise
        print(f"server healthy after {self.startup_s:.1f}s", flush=True)

    def tail(self, n: int = 3000) -> str:
        with open(self.log.name) as f:
            return f.read()[-n:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# ----------------------------------------------------------------------------- the offline peer


def run_offline(model: str, config, prompts: list, concurrency: int) -> dict:
    """The same requests through ``LLMEngine`` in this process (``model``, the server's ``config``), at
    most ``concurrency`` in flight (as the clients keep the server), with per-request TTFT/TPOT from step
    timestamps. Compiles first."""
    import jax

    from jaxinfer import LLM, SamplingParams, StructuredOutputs

    t0 = time.perf_counter()
    llm = LLM(model, **dataclasses.asdict(config))
    schema = constraint_schema()
    structured = None if schema is None else StructuredOutputs(json=schema) if schema else \
        StructuredOutputs(json_object=True)
    warmup = llm.warmup(structured=structured is not None)
    startup = time.perf_counter() - t0
    print(f"offline engine ready after {startup:.1f}s (compiling {warmup:.1f}s)", flush=True)
    engine = llm.engine
    params = SamplingParams(max_tokens=F.max_tokens, temperature=F.temperature, ignore_eos=F.ignore_eos,
                            structured=structured)
    pending = list(enumerate(prompts))[::-1]
    live: dict[str, list] = {}  # request id -> [arrival, first token]
    ttft, tpot, e2e, out_tokens = [], [], [], 0
    t0 = time.perf_counter()
    while pending or live:
        while pending and len(live) < concurrency:
            i, prompt = pending.pop()
            engine.add_request(f"offline-{i}", prompt, params)
            live[f"offline-{i}"] = [time.perf_counter(), None]
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            times = live[out.request_id]
            if times[1] is None:
                times[1] = now
            if out.finished:
                del live[out.request_id]
                n = len(out.token_ids)
                out_tokens += n
                ttft.append(times[1] - times[0])
                e2e.append(now - times[0])
                if n > 1:
                    tpot.append((now - times[1]) / (n - 1))
    duration = time.perf_counter() - t0
    d = jax.devices()[0]
    return dict(duration=duration, output_throughput=out_tokens / duration, warmup_s=warmup, startup_s=startup,
                device=f"{d.device_kind} ({jax.default_backend()}, jax {jax.__version__})",
                **distributions({"ttft": ttft, "tpot": tpot, "e2el": e2e}, PERCENTILES))


# ----------------------------------------------------------------------------------------- main


def _print_row(name: str, s: dict) -> None:
    lat = "  ".join(f"{k.upper()} p50/p99 {s.get(f'p50_{k}_ms', float('nan')):7.1f}/"
                    f"{s.get(f'p99_{k}_ms', float('nan')):7.1f} ms" for k in ("ttft", "tpot", "itl"))
    print(f"{name:<8} {s['output_throughput']:10.1f} out tok/s  failed {s.get('failed', 0):4d}  {lat}")


def main(argv: list[str]) -> None:
    global F
    p = parser()
    F = p.parse(argv)
    model = options.model_of(p, F)
    config = options.engine_config(p, F)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if F.output_len is not None:
        F.max_tokens = F.output_len
    if F.input_len and F.endpoint == "chat":
        p.error("--input-len makes token-id prompts, which only --endpoint=completions takes")
    rng = np.random.default_rng(F.load_seed)
    prompts = make_prompts(F.num_prompts, rng)
    concurrency = F.max_concurrency or len(prompts)
    server = LaunchedServer(model, config, max_waiting=len(prompts)) if F.launch else None
    try:
        base_url = server.url if server else F.base_url
        load = client.Load(base_url, client.served_model(base_url, F.api_key),
                           client.CHAT if F.endpoint == "chat" else client.COMPLETIONS, F.max_tokens, F.ignore_eos,
                           F.request_rate, concurrency, F.load_seed, api_key=F.api_key, temperature=F.temperature,
                           extra_body=request_constraint(F.endpoint))
        results, duration = client.run_load(load, prompts, F.client_processes)
    finally:
        if server:
            server.stop()
    summary = serving_summary(results, duration, percentiles=PERCENTILES)
    summary["config"] = dict({k: getattr(F, k) for k in ("endpoint", "num_prompts", "input_len", "max_tokens",
                                                         "request_rate", "max_concurrency", "client_processes",
                                                         "ignore_eos", "temperature", "response_format")},
                             model=model, **dataclasses.asdict(config))
    summary["command"] = " ".join([os.path.basename(sys.executable), *sys.argv])
    summary["server_output_tok_s"] = summary["output_throughput"]
    if server:
        summary["server_startup_s"] = server.startup_s
    print(f"completed {summary['completed']}/{len(results)} in {duration:.1f}s: "
          f"{summary['request_throughput']:.2f} req/s, {summary['output_throughput']:.1f} output tok/s")
    _print_row("server", summary)
    if F.offline:
        offline = run_offline(model, config, prompts, concurrency)
        summary["offline"] = offline
        summary["offline_output_tok_s"] = offline["output_throughput"]
        summary["ratio"] = summary["server_output_tok_s"] / offline["output_throughput"]
        summary["device"] = offline["device"]
        _print_row("offline", offline)
        print(f"server / offline output tok/s: {summary['ratio']:.3f}")
        if "p50_itl_ms" in summary and "p50_tpot_ms" in offline:  # the batch-1 target: ITL vs engine per-token
            summary["itl_p50_over_offline_tpot_p50"] = summary["p50_itl_ms"] / offline["p50_tpot_ms"]
            print(f"server ITL p50 / offline TPOT p50: {summary['itl_p50_over_offline_tpot_p50']:.3f}")
    for error in summary["errors"]:
        print("error:", error, file=sys.stderr)
    if F.out:
        runs = {}
        if os.path.exists(F.out):
            with open(F.out) as f:
                runs = json.load(f)
        runs[F.name] = summary
        with open(F.out, "w") as f:
            json.dump(runs, f, indent=2)
    if not summary["completed"]:
        sys.exit(1)


if __name__ == "__main__":
    main(sys.argv[1:])
