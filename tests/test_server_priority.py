"""A request's ``priority`` reaches the scheduler: on a server started with ``--scheduling_policy=priority``
and one sequence at a time, a request sent last with a lower value finishes before the ones queued
ahead of it, while one of the same or a higher value waits its turn. A tiny random model with
SmolLM2's 49,152-token vocabulary serves: a sampled token takes ~25 ms on a 2-core CPU, so a request
of 1,000 tokens holds the one slot far longer than the others take to queue behind it.
"""

import asyncio
import re
import time

import httpx
import pytest

from jaxinfer.server.protocol import MAX_PRIORITY, APIError, CompletionRequest, parse
from jaxinfer.server.serving import OpenAIServing
from test_server import Server

ARGS = ["--load_format=dummy", "--max_num_seqs=1", "--max_num_batched_tokens=16", "--max_model_len=1024",
        "--token_buckets=16", "--seq_buckets=1", "--page_buckets=64", "--max_waiting=8",
        "--scheduling_policy=priority"]
BODY = {"prompt": [1, 2, 3], "max_tokens": 24, "ignore_eos": True, "temperature": 1.0, "seed": 1}
LONG = 1000  # tokens of the request that holds the one slot until its client hangs up


@pytest.fixture(scope="module")
def server(tiny_chat_model):
    srv = Server([f"--model={tiny_chat_model}", *ARGS], startup_timeout=120)
    yield srv
    srv.stop()


async def gauges(http) -> dict[str, float]:
    text = (await http.get("/metrics")).text
    return {k: float(v) for k, v in re.findall(r"^jaxinfer_num_requests_(\w+) (\S+)$", text, re.M)}


def finish_order(url: str, last_priority: int) -> list[str]:
    """Names in the order their requests finished: ``queued-1`` and ``queued-2`` (priority 0) wait
    behind a long request (priority 0) that holds the only slot when ``last`` (``last_priority``)
    arrives; once the engine holds all three, the long one's client hangs up, freeing the slot."""
    order = []

    async def one(http, name, priority):
        r = await http.post("/v1/completions", json={**BODY, "priority": priority})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == BODY["max_tokens"], r.text
        order.append(name)

    async def until(http, condition):
        deadline = time.monotonic() + 60
        while not condition(await gauges(http)):
            assert time.monotonic() < deadline, "the requests never reached the engine"
            await asyncio.sleep(0.05)

    async def run():
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            async with http.stream("POST", "/v1/completions", json={**BODY, "max_tokens": LONG, "stream": True}) as r:
                lines = r.aiter_lines()  # held: a dropped iterator's finalizer would close the stream
                async for line in lines:  # its first tokens: it is running
                    if line.startswith("data: {"):
                        break
                queued = []
                for i in (1, 2):  # one at a time, so they arrive in this order
                    queued.append(asyncio.create_task(one(http, f"queued-{i}", 0)))
                    await until(http, lambda g: g["waiting"] == i)
                last = asyncio.create_task(one(http, "last", last_priority))
                # Behind the long one (waiting), or running in its place (it is preempted), or done.
                await until(http, lambda g: g["waiting"] + g["preempted"] == 3 or "last" in order)
            await asyncio.gather(*queued, last)

    asyncio.run(run())
    return order


def test_a_lower_priority_value_runs_first(server):
    assert finish_order(server.url, -1) == ["last", "queued-1", "queued-2"]
    # Equal or higher values keep first come, first served: the one sent last finishes last.
    for priority in (0, 1):
        assert finish_order(server.url, priority) == ["queued-1", "queued-2", "last"], priority


def test_priority_bounds(server):
    for priority in (MAX_PRIORITY, -MAX_PRIORITY):
        r = httpx.post(f"{server.url}/v1/completions", json={**BODY, "max_tokens": 2, "priority": priority},
                       timeout=60)
        assert r.status_code == 200, r.text
    for priority in (MAX_PRIORITY + 1, -MAX_PRIORITY - 1, 1.5, "1"):
        r = httpx.post(f"{server.url}/v1/completions", json={**BODY, "priority": priority}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "priority", r.text


def test_priority_needs_the_priority_policy():
    """A server that schedules first come, first served refuses a priority it would ignore (as vLLM does);
    0, the default, is always accepted."""
    class Engine:
        scheduling_policy = "fcfs"

    serving = OpenAIServing(Engine(), "m")
    serving._check_common(parse(CompletionRequest, b'{"prompt": "hi", "priority": 0}'))
    with pytest.raises(APIError) as e:
        serving._check_common(parse(CompletionRequest, b'{"prompt": "hi", "priority": -3}'))
    assert e.value.status == 400 and e.value.param == "priority" and "--scheduling_policy" in e.value.message
