"""The load generator of ``jaxinfer bench serve`` and benchmarks/bench_serving.py: streamed requests to
an OpenAI-compatible server (``/v1/completions`` or ``/v1/chat/completions``), arriving as a Poisson
process of ``request_rate`` per second or all at once, at most ``max_concurrency`` in flight, sent
from one process or several so that the client is not the bottleneck. Each request's time to its
first streamed text, the gaps between the chunks that follow, its latency and its token counts (the
stream's usage chunk) are recorded (``Result``); ``metrics.serving_summary`` sums them up."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import multiprocessing
import time

import httpx
import numpy as np

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


@dataclasses.dataclass
class Result:
    """One request: ``ok`` once its stream ended with its usage chunk, else ``error`` says why."""

    ok: bool
    latency: float = 0.0
    ttft: float | None = None
    itl: list[float] = dataclasses.field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    error: str = ""


@dataclasses.dataclass(frozen=True)
class Load:
    """What a client process sends (plain data: it travels to the other processes)."""

    base_url: str
    model: str
    endpoint: str  # COMPLETIONS or CHAT
    max_tokens: int
    ignore_eos: bool
    request_rate: float
    max_concurrency: int
    seed: int  # of the arrival times
    api_key: str | None = None
    temperature: float | None = None  # None: the server's default
    extra_body: dict | None = None  # fields added to every request body
    progress: bool = False  # a progress bar of the requests done


def headers(api_key: str | None) -> dict:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def served_model(base_url: str, api_key: str | None = None) -> str:
    """The first model the server lists at /v1/models."""
    r = httpx.get(f"{base_url}/v1/models", headers=headers(api_key), timeout=30)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


def served_vocab_size(base_url: str, api_key: str | None = None) -> int | None:
    """The vocabulary size of the model ``jaxinfer serve`` serves: its /openapi.json bounds a
    completion prompt's token ids by it. None where the server does not say."""
    try:
        r = httpx.get(f"{base_url}/openapi.json", headers=headers(api_key), timeout=30)
        prompt = r.json()["components"]["schemas"]["CompletionRequest"]["properties"]["prompt"]
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None
    bounds = []

    def walk(node):
        if isinstance(node, dict):
            if isinstance(node.get("maximum"), int):
                bounds.append(node["maximum"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)
    walk(prompt)
    return max(bounds) + 1 if bounds else None


async def one_request(http: httpx.AsyncClient, load: Load, prompt) -> Result:
    """Stream one completion of ``prompt`` (text or token ids; chat: the user message)."""
    body = dict(model=load.model, max_tokens=load.max_tokens, ignore_eos=load.ignore_eos, stream=True,
                stream_options={"include_usage": True})
    if load.temperature is not None:
        body["temperature"] = load.temperature
    if load.endpoint == CHAT:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    body.update(load.extra_body or {})
    t0 = time.perf_counter()
    res, last = Result(ok=False), None
    try:
        async with http.stream("POST", load.endpoint, json=body) as r:
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
    res.ok = bool(res.output_tokens)  # a stream that ended without its usage chunk did not complete
    if not res.ok:
        res.error = "the stream ended without a usage chunk"
    return res


def _content(choice: dict) -> str:
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


async def _client(load: Load, prompts: list) -> tuple[list[Result], float, float]:
    from tqdm import tqdm

    limits = httpx.Limits(max_connections=load.max_concurrency, max_keepalive_connections=load.max_concurrency)
    rng = np.random.default_rng(load.seed)
    bar = tqdm(total=len(prompts), disable=not load.progress)
    async with httpx.AsyncClient(base_url=load.base_url, headers=headers(load.api_key), timeout=None,
                                 limits=limits) as http:
        gate = asyncio.Semaphore(load.max_concurrency)

        async def gated(prompt):
            async with gate:
                result = await one_request(http, load, prompt)
            bar.update()
            return result

        t0 = time.time()
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.create_task(gated(prompt)))
            if load.request_rate != float("inf"):
                await asyncio.sleep(rng.exponential(1.0 / load.request_rate))
        results = await asyncio.gather(*tasks)
        t1 = time.time()
    bar.close()
    return results, t0, t1


def client_process(load: Load, prompts: list) -> tuple[list[Result], float, float]:
    """Send ``prompts`` as ``load`` says; the results in order, and the wall-clock start and end."""
    return asyncio.run(_client(load, prompts))


def run_load(load: Load, prompts: list, processes: int = 1) -> tuple[list[Result], float]:
    """The results of ``prompts`` in order and the seconds from the first request to the last answer.
    Over several ``processes``, the prompts (round-robin), the concurrency and the rate are split
    among them (no progress bar)."""
    k = max(1, min(processes, len(prompts)))
    if k == 1:
        results, t0, t1 = client_process(load, prompts)
        return results, t1 - t0
    shares = [dataclasses.replace(load, max_concurrency=max(1, load.max_concurrency // k), progress=False,
                                  request_rate=load.request_rate / k, seed=load.seed + i) for i in range(k)]
    with concurrent.futures.ProcessPoolExecutor(k, mp_context=multiprocessing.get_context("spawn")) as pool:
        parts = list(pool.map(client_process, shares, [prompts[i::k] for i in range(k)]))
    results = [None] * len(prompts)
    for i, (res, _, _) in enumerate(parts):
        results[i::k] = res
    return results, max(p[2] for p in parts) - min(p[1] for p in parts)
