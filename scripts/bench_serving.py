"""Load-test a running OpenAI-compatible server: Poisson arrivals (or a fixed concurrency), streamed requests.

    python scripts/serve.py &                                  # wait for /health
    python scripts/bench_serving.py --num_prompts 64 --request_rate 4 --out bench.json
    python scripts/bench_serving.py --max_concurrency 16 --endpoint chat

Reports throughput plus TTFT, TPOT (per request: (latency - TTFT) / (tokens - 1)) and inter-token
latency (gaps between streamed chunks) percentiles. Outputs are fixed-length (ignore_eos) by default
so runs are comparable.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import sys
import time

import httpx
import numpy as np
from absl import app, flags
from tqdm.auto import tqdm

flags.DEFINE_string("base_url", "http://127.0.0.1:8000", "Server address.")
flags.DEFINE_string("model", None, "Model id to send (default: the first one /v1/models lists).")
flags.DEFINE_enum("endpoint", "completions", ["completions", "chat"], "Which API to load.")
flags.DEFINE_integer("num_prompts", 64, "Requests to send.")
flags.DEFINE_float("request_rate", float("inf"), "Mean arrivals per second (Poisson); inf sends all at once.")
flags.DEFINE_integer("max_concurrency", None, "Most requests in flight at a time (default: unbounded).")
flags.DEFINE_integer("max_tokens", 64, "Tokens to generate per request.")
flags.DEFINE_boolean("ignore_eos", True, "Generate exactly --max_tokens tokens per request.")
flags.DEFINE_float("temperature", 0.0, "Sampling temperature.")
flags.DEFINE_integer("seed", 0, "Seed for prompts and arrival times.")
flags.DEFINE_string("api_key", None, "Bearer token, if the server wants one.")
flags.DEFINE_string("out", None, "Write the results as JSON here.")
F = flags.FLAGS

_SUBJECTS = ["the sea", "a lighthouse keeper", "black holes", "sourdough bread", "the Roman empire", "a lost robot",
             "mountain weather", "prime numbers", "a city at night", "honeybees", "the first computer", "tea"]
_FORMS = ["Write a short story about {}.", "Explain {} to a child.", "List five facts about {}.",
          "Write a poem about {}.", "Describe {} in detail."]


@dataclasses.dataclass
class Result:
    ok: bool
    latency: float = 0.0
    ttft: float | None = None
    itl: list[float] = dataclasses.field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    error: str = ""


def make_prompts(n: int, rng: np.random.Generator) -> list[str]:
    return [_FORMS[rng.integers(len(_FORMS))].format(_SUBJECTS[rng.integers(len(_SUBJECTS))]) for _ in range(n)]


async def one_request(http: httpx.AsyncClient, model: str, prompt: str) -> Result:
    body = dict(model=model, max_tokens=F.max_tokens, temperature=F.temperature, ignore_eos=F.ignore_eos,
                stream=True, stream_options={"include_usage": True})
    if F.endpoint == "chat":
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": prompt}]
    else:
        path, body["prompt"] = "/v1/completions", prompt
    t0 = time.perf_counter()
    res, last = Result(ok=False), None
    try:
        async with http.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    res.error = event["error"]["message"]
                    return res
                if event.get("usage"):
                    res.output_tokens = event["usage"]["completion_tokens"]
                    res.prompt_tokens = event["usage"]["prompt_tokens"]
                if not any(_content(c) for c in event["choices"]):
                    continue
                now = time.perf_counter()
                if res.ttft is None:
                    res.ttft = now - t0
                else:
                    res.itl.append(now - last)
                last = now
    except httpx.HTTPError as e:
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.latency = time.perf_counter() - t0
    res.ok = True
    return res


def _content(choice: dict) -> str:
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


async def run(prompts: list[str], rng: np.random.Generator) -> tuple[list[Result], float]:
    headers = {"Authorization": f"Bearer {F.api_key}"} if F.api_key else {}
    limits = httpx.Limits(max_connections=F.max_concurrency or len(prompts))
    async with httpx.AsyncClient(base_url=F.base_url, headers=headers, timeout=None, limits=limits) as http:
        model = F.model or (await http.get("/v1/models")).json()["data"][0]["id"]
        gate = asyncio.Semaphore(F.max_concurrency or len(prompts))
        bar = tqdm(total=len(prompts), desc="requests", unit="req")

        async def gated(prompt):
            async with gate:
                res = await one_request(http, model, prompt)
            bar.update()
            return res

        t0 = time.perf_counter()
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.create_task(gated(prompt)))
            if F.request_rate != float("inf"):
                await asyncio.sleep(rng.exponential(1.0 / F.request_rate))
        results = await asyncio.gather(*tasks)
        bar.close()
        return results, time.perf_counter() - t0


def summarize(results: list[Result], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    summary = dict(
        completed=len(ok), failed=len(results) - len(ok), duration_s=duration,
        request_throughput=len(ok) / duration, output_token_throughput=out_tokens / duration,
        total_token_throughput=(out_tokens + sum(r.prompt_tokens for r in ok)) / duration,
        errors=sorted({r.error for r in results if not r.ok})[:5])
    samples = {
        "ttft": [r.ttft for r in ok if r.ttft is not None],
        "tpot": [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok
                 if r.ttft is not None and r.output_tokens > 1],
        "itl": [x for r in ok for x in r.itl],
        "e2e": [r.latency for r in ok]}
    for name, xs in samples.items():
        if xs:
            summary[f"mean_{name}_ms"] = float(np.mean(xs) * 1e3)
            for q in (50, 90, 99):
                summary[f"p{q}_{name}_ms"] = float(np.percentile(xs, q) * 1e3)
    return summary


def main(argv):
    del argv
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request would bury the progress bar
    rng = np.random.default_rng(F.seed)
    results, duration = asyncio.run(run(make_prompts(F.num_prompts, rng), rng))
    summary = summarize(results, duration)
    summary["config"] = {k: F[k].value for k in ("base_url", "endpoint", "num_prompts", "request_rate",
                                                 "max_concurrency", "max_tokens", "ignore_eos", "temperature")}
    print(f"completed {summary['completed']}/{len(results)} in {duration:.1f}s: "
          f"{summary['request_throughput']:.2f} req/s, {summary['output_token_throughput']:.1f} output tok/s, "
          f"{summary['total_token_throughput']:.1f} total tok/s")
    for name in ("ttft", "tpot", "itl", "e2e"):
        if f"p50_{name}_ms" in summary:
            print(f"{name.upper():>5} ms  " + "  ".join(f"{stat} {summary[f'{stat}_{name}_ms']:8.1f}"
                                                          for stat in ("mean", "p50", "p90", "p99")))
    for error in summary["errors"]:
        print("error:", error, file=sys.stderr)
    if F.out:
        with open(F.out, "w") as f:
            json.dump(summary, f, indent=2)
    if not summary["completed"]:
        sys.exit(1)


if __name__ == "__main__":
    app.run(main)
