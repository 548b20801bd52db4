"""The server under load: hundreds of concurrent streams, a client that stops reading, clients that hang
up mid-stream, and a kept-alive connection that idles. A tiny random model with SmolLM2's tokenizer
(benchmarks/make_dummy_model.py) makes steps cheap, so the HTTP side is what is exercised.
"""

import asyncio
import json
import socket
import time

import httpx
import pytest

from test_server import Server, wait_until_idle

PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "The three primary colors are",
           "My favourite food is", "In 1492,", "Water boils at", "The quick brown fox"]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def server(tiny_chat_model):
    srv = Server([f"--model={tiny_chat_model}", "--load_format=dummy", "--max_num_seqs=64", "--max_num_batched_tokens=64",
                  "--max_model_len=128", "--token_buckets=64", "--seq_buckets=64", "--page_buckets=8",
                  "--max_waiting=1024"])
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def alone(server):
    """Each prompt's greedy completion, run by itself."""
    body = dict(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    return {p: httpx.post(f"{server.url}/v1/completions", json={**body, "prompt": p}, timeout=120).json()
            ["choices"][0]["text"] for p in PROMPTS}


async def _stream(http, prompt, hang_up_after=None):
    """(text, finished) of one streamed completion; hangs up after that many events if asked."""
    body = dict(prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, stream=True)
    text, events = "", 0
    async with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                return text, True
            if line.startswith("data: "):
                event = json.loads(line[6:])
                assert "error" not in event, event
                text += event["choices"][0]["text"]
                events += 1
                if hang_up_after is not None and events >= hang_up_after:
                    return text, False
    return text, False


def _raw_request(sock, body: dict) -> None:
    data = json.dumps(body).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(data), data))


def _sse_text(raw: bytes) -> str:
    """The text of a chunked SSE response body (chunk framing lines are not 'data:' lines)."""
    return "".join(json.loads(line[6:])["choices"][0]["text"] for line in raw.decode().split("\r\n")
                   if line.startswith("data: {"))


def test_256_concurrent_streams_match_alone_and_a_stalled_reader_holds_nobody_back(server, alone):
    # One client sends its request and then reads nothing until the others are done.
    stalled = socket.create_connection(("127.0.0.1", server.port))
    stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    _raw_request(stalled, dict(prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True,
                               stream=True))

    async def run():
        limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as http:
            return await asyncio.gather(*(_stream(http, PROMPTS[i % len(PROMPTS)]) for i in range(256)))

    t0 = time.monotonic()
    results = asyncio.run(run())
    for i, (text, finished) in enumerate(results):
        assert finished and text == alone[PROMPTS[i % len(PROMPTS)]], (i, text)
    raw = b""
    stalled.settimeout(60)
    while not raw.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"):
        chunk = stalled.recv(65536)
        assert chunk, f"connection closed after {len(raw)} bytes, {time.monotonic() - t0:.0f}s"
        raw += chunk
    stalled.close()
    assert raw.startswith(b"HTTP/1.1 200") and _sse_text(raw) == alone[PROMPTS[0]]


def test_hang_ups_under_load_free_every_page(server, alone):
    async def run():
        limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as http:
            gate = asyncio.Semaphore(256)

            async def one(i):
                async with gate:
                    return await _stream(http, PROMPTS[i % len(PROMPTS)], hang_up_after=2 if i % 3 == 0 else None)
            return await asyncio.gather(*(one(i) for i in range(384)))

    results = asyncio.run(run())
    for i, (text, finished) in enumerate(results):
        if i % 3:
            assert finished and text == alone[PROMPTS[i % len(PROMPTS)]], (i, text)
    wait_until_idle(server.url)
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}


def test_idle_kept_alive_connection_is_reusable(server, alone):
    # uvicorn's default keep-alive (5 s) closed connections that busy pooling clients were about to
    # reuse; their next request on it then failed with a ReadError.
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.settimeout(60)
        for i in range(2):
            time.sleep(6 * i)
            _raw_request(sock, dict(prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = sock.recv(65536)
                assert chunk, "the server closed the kept-alive connection"
                head += chunk
            header, _, body = head.partition(b"\r\n\r\n")
            length = int(next(line.split(b":")[1] for line in header.split(b"\r\n")
                              if line.lower().startswith(b"content-length")))
            while len(body) < length:
                body += sock.recv(65536)
            assert header.startswith(b"HTTP/1.1 200") and json.loads(body)["choices"][0]["text"] == alone[PROMPTS[1]]
