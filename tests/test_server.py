"""The OpenAI-compatible server over real HTTP: a real ``jaxinfer serve`` process per fixture.

SmolLM2-135M answers the correctness tests (small limits and few buckets keep its warm-up short), served
with SmolLM2's template extended with tools (its own output without tools is unchanged);
a tiny random model, which starts in seconds, answers auth, queue-full and SIGTERM.
"""

import asyncio
import base64
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import types
from typing import Literal

import httpx
import numpy as np
import openai
import pydantic
import pytest

from jaxinfer import LLM
from jaxinfer.batching.config import EngineConfig
from jaxinfer.server.async_engine import AsyncEngine
from jaxinfer.server.constraints import ToolPlan, tool_call_schema
from jaxinfer.server.protocol import APIError, ChatCompletionRequest, EmbeddingRequest, parse
from jaxinfer.server.serving import OpenAIServing
from jaxinfer.tokenizer import apply_chat_template

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SERVE = [sys.executable, "-m", "jaxinfer", "serve"]  # the server's entry point, its flags to follow
MODEL = "smollm2-135m"
# No --chat_template: the embedded model's own renders tools (the tool tests below rely on it).
SMOLLM2_ARGS = ["--max_num_seqs=8", "--max_num_batched_tokens=64", "--max_model_len=512", "--token_buckets=8,64",
                "--seq_buckets=8", "--page_buckets=8,32", "--max_waiting=64", "--max_request_bytes=65536",
                "--allowed_origins=https://app.example"]
TINY_ARGS = ["--model=tiny-llama3", "--load_format=dummy", "--max_num_seqs=1", "--max_num_batched_tokens=16",
             "--max_model_len=256", "--max_waiting=1", "--api_key=sekret", "--shutdown_timeout=20", "--max_logprobs=4"]


class Server:
    def __init__(self, args, startup_timeout=300, env=None):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        self.proc = subprocess.Popen([*SERVE, f"--port={self.port}", *args], cwd=ROOT,
                                     stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        deadline = time.monotonic() + startup_timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"server exited early:\n{self.tail()}"
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise AssertionError(f"server not healthy after {startup_timeout}s:\n{self.tail()}")

    def tail(self, n=4000):
        with open(self.log.name) as f:
            return f.read()[-n:]

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        os.unlink(self.log.name)


@pytest.fixture(scope="module")
def server():
    srv = Server(SMOLLM2_ARGS)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tiny():
    srv = Server(TINY_ARGS, startup_timeout=120)
    yield srv
    srv.stop()


def metrics(url, headers=None) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", headers=headers).text
    return {m[0]: float(m[1]) for m in re.findall(r"^(jaxinfer_\w+) (\S+)$", text, re.M)}


def wait_until_idle(url, timeout=20, headers=None) -> dict[str, float]:
    """The metrics once no KV page is held and nothing runs (aborts settle a step later), asserting
    that this happens within ``timeout`` seconds and that nothing waits either."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = metrics(url, headers)
        if m["jaxinfer_kv_cache_pages_used"] == 0 and m["jaxinfer_num_requests_running"] == 0:
            break
        time.sleep(0.2)
    assert m["jaxinfer_kv_cache_pages_used"] == 0 and m["jaxinfer_num_requests_running"] == 0, m
    assert m["jaxinfer_num_requests_waiting"] == 0
    return m


def post(url, path, body=None, content=None, headers=None, **kw):
    headers = {"Content-Type": "application/json", **(headers or {})}
    return httpx.post(f"{url}{path}", json=body, content=content, timeout=120, headers=headers, **kw)


PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "The three primary colors are"]
CHAT = [{"role": "user", "content": "Name three fruits."}]


# --------------------------------------------------------------------------------- SmolLM2 server


def test_health_models_and_warmup(server):
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    models = httpx.get(f"{server.url}/v1/models").json()
    assert models["data"][0]["id"] == MODEL and models["data"][0]["max_model_len"] == 512
    # what the engine resolved and runs with (its defaults for this CPU included)
    config = httpx.get(f"{server.url}/version").json()["config"]
    assert config["max_model_len"] == 512 and config["max_num_seqs"] == 8 and config["platform"] == "cpu"
    assert config["dtype"] == "float32" and config["quantization"] == "gguf" and config["num_scheduler_steps"] == 4
    assert "ready in" in server.tail(100_000)


def test_openai_client_completions(client, smollm2_tokenizer):
    prompt = PROMPTS[0]
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    assert out.choices[0].finish_reason == "length" and out.choices[0].text
    assert out.usage.prompt_tokens == len(smollm2_tokenizer.encode(prompt))
    assert out.usage.completion_tokens == 12 and out.usage.total_tokens == out.usage.prompt_tokens + 12
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == out.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == out.usage.model_dump()


def test_openai_client_chat(client, smollm2_tokenizer):
    out = client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=24, temperature=0)
    msg = out.choices[0].message
    assert msg.role == "assistant" and msg.content
    assert out.usage.prompt_tokens == len(apply_chat_template(smollm2_tokenizer, CHAT))
    stream = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24, temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == msg.content
    assert chunks[-1].choices[0].finish_reason == out.choices[0].finish_reason


def test_logprobs_and_stop(client):
    out = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=8, temperature=0, logprobs=2)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == out.usage.completion_tokens == 8
    assert all(len(top) >= 2 and max(top.values()) <= 0 for top in lp.top_logprobs)
    assert "".join(lp.tokens) == out.choices[0].text
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=0, logprobs=True,
                                          top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(c.top_logprobs) == 3 and c.logprob <= 0 for c in content)
    # Greedy: the sampled token is the most likely one.
    assert all(c.token == c.top_logprobs[0].token for c in content)
    full = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0).choices[0].text
    stop = full.split()[1]
    cut = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].text == full[:full.index(stop)]


def test_n_and_seed(client):
    kw = dict(model=MODEL, prompt=PROMPTS[1], max_tokens=8, temperature=1.0, n=3)
    a = client.completions.create(seed=7, **kw)
    b = client.completions.create(seed=7, **kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert a.usage.completion_tokens == 24
    unseeded = client.completions.create(**kw)
    assert len({c.text for c in unseeded.choices}) > 1


def test_vllm_sampling_fields(server, client, smollm2_tokenizer):
    """vLLM's request fields take effect: ``logit_bias`` forces a token, ``min_tokens`` holds a stop
    string back, ``repetition_penalty`` is accepted; an unknown field is named in ``X-Ignored-Fields``."""
    yes = smollm2_tokenizer.encode(" yes")
    assert len(yes) == 1
    forced = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0,
                                       logit_bias={str(yes[0]): 100})
    assert forced.choices[0].text == " yes" * 4
    body = {"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0, "stop": [" "]}
    cut = post(server.url, "/v1/completions", body)
    assert cut.json()["usage"]["completion_tokens"] < 8 and "x-ignored-fields" not in cut.headers
    held = post(server.url, "/v1/completions", {**body, "min_tokens": 8, "repetition_penalty": 1.3, "foo": 1})
    assert held.status_code == 200 and held.headers["x-ignored-fields"] == "foo"
    assert held.json()["usage"]["completion_tokens"] == 8  # the stop string waited for the 8th token
    assert held.json()["choices"][0]["text"].startswith(cut.json()["choices"][0]["text"] + " ")


def test_special_tokens_and_the_stop_kept_in_the_text(client):
    """vLLM's ``skip_special_tokens=False`` with ``include_stop_str_in_output``: the reply ends with the EOS
    that ended it, streamed the same; the default leaves it out."""
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "What is the capital of France? Answer in one word."}],
              max_tokens=16, temperature=0)
    kept = {"skip_special_tokens": False, "include_stop_str_in_output": True}
    default = client.chat.completions.create(**kw).choices[0]
    whole = client.chat.completions.create(**kw, extra_body=kept).choices[0]
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        **kw, extra_body=kept, stream=True))
    assert default.finish_reason == whole.finish_reason == "stop" and "<|im_end|>" not in default.message.content
    assert whole.message.content == streamed == default.message.content + "<|im_end|>"


def test_concurrent_streams_match_alone(server, client):
    alone = {p: client.completions.create(model=MODEL, prompt=p, max_tokens=16, temperature=0).choices[0].text
             for p in PROMPTS}

    async def one(http, prompt):
        text, done = "", False
        body = dict(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stream=True)
        async with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    text += json.loads(line[6:])["choices"][0]["text"]
        return prompt, text, done

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as http:
            return await asyncio.gather(*(one(http, PROMPTS[i % len(PROMPTS)]) for i in range(32)))

    for prompt, text, done in asyncio.run(run()):
        assert done and text == alone[prompt], prompt


def test_one_request_never_hurts_another(server, client):
    """Plain completions in flight (4 decode steps a dispatch, the CPU's default) are joined by a
    constrained request and by one whose grammar fails inside the step (llguidance refuses a row of
    more than 2,000 items only when a token arrives): the failing one alone gets a 400 naming the
    cause, the constrained one its choice, and the plain ones the text they have alone."""
    alone = {p: client.completions.create(model=MODEL, prompt=p, max_tokens=16, temperature=0).choices[0].text
             for p in PROMPTS[:2]}
    huge = "start: " + " | ".join(f'"w{i}"' for i in range(2500))

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as http:
            plain = [asyncio.create_task(http.post("/v1/completions", json=dict(
                prompt=p, max_tokens=16, temperature=0))) for p in PROMPTS[:2]]
            await asyncio.sleep(1.0)  # the plain ones are decoding by now
            joined = await asyncio.gather(
                http.post("/v1/completions", json=dict(prompt="Is the sky blue?", max_tokens=4, temperature=0,
                                                       guided_choice=["yes", "no"])),
                http.post("/v1/completions", json=dict(prompt="Pick a word:", max_tokens=4, temperature=0,
                                                       guided_grammar=huge)))
            return [await t for t in plain], joined

    plain, (choice, failing) = asyncio.run(run())
    for p, r in zip(PROMPTS, plain):
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == alone[p]
    assert choice.status_code == 200 and choice.json()["choices"][0]["text"] in ("yes", "no")
    assert failing.status_code == 400 and "2000" in failing.json()["error"]["message"], failing.text
    wait_until_idle(server.url)


def test_disconnects_free_pages(server):
    body = dict(model=MODEL, prompt=PROMPTS[2], max_tokens=400, temperature=0, stream=True, ignore_eos=True)
    generated = metrics(server.url)["jaxinfer_generation_tokens_total"]
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for _ in range(3):
            with http.stream("POST", "/v1/completions", json=body) as r:
                next(r.iter_lines())  # one chunk, then hang up
        with pytest.raises(httpx.ReadTimeout):  # a non-streamed request whose client gives up
            http.post("/v1/completions", json={**body, "stream": False}, timeout=2)
    m = wait_until_idle(server.url)
    # The 4 requests of 400 tokens were cut short.
    assert m["jaxinfer_generation_tokens_total"] - generated < 400


BAD = [
    # (path, body or raw bytes, status, param, words the message must contain)
    ("/v1/completions", b'{"prompt": "hi", ', 400, None, "not valid JSON"),
    ("/v1/completions", b'[1, 2]', 400, None, "JSON object"),
    ("/v1/completions", {"max_tokens": 4}, 400, "prompt", "required"),
    ("/v1/completions", {"prompt": 5}, 400, "prompt", "string"),
    ("/v1/completions", {"prompt": "\u0004\u0006"}, 400, "prompt", "encodes to no tokens"),  # bytes SmolLM2 lacks
    ("/v1/completions", {"prompt": "hi", "max_tokens": "4"}, 400, "max_tokens", "integer"),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, 400, "temperature", "number"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-9"}, 404, "model", "gpt-9"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt", "empty"),
    ("/v1/completions", {"prompt": []}, 400, "prompt", "empty"),
    ("/v1/completions", {"prompt": "hi " * 600}, 400, "prompt", "512"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 600}, 400, "max_tokens", "600"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens", ">= 1"),
    ("/v1/completions", {"prompt": "hi", "n": 2, "best_of": 2}, 400, "best_of", "<= 1"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature", "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p", "top_p"),
    ("/v1/completions", {"prompt": "hi", "top_k": -5}, 400, "top_k", "top_k"),
    ("/v1/completions", {"prompt": "hi", "min_p": 2}, 400, "min_p", "min_p"),
    ("/v1/completions", {"prompt": "hi", "presence_penalty": 3}, 400, "presence_penalty", "presence_penalty"),
    ("/v1/completions", {"prompt": "hi", "frequency_penalty": -9}, 400, "frequency_penalty", "frequency_penalty"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, 400, "logprobs", "logprobs"),
    ("/v1/completions", {"prompt": "hi", "seed": -1}, 400, "seed", "seed"),
    ("/v1/completions", {"prompt": "hi", "stop": [""]}, 400, "stop", "stop"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, 400, "n", "n must be"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"999999": 1}}, 400, "logit_bias", "vocabulary size 49152"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": 101}}, 400, "logit_bias", "<= 100"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "min_tokens": 5}, 400, "min_tokens", "[0, 4]"),
    ("/v1/completions", {"prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty", "> 0"),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 21}, 400, "prompt_logprobs", "<= 20"),
    ("/v1/chat/completions", {"messages": CHAT, "prompt_logprobs": -1}, 400, "prompt_logprobs", ">= 0"),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 1, "stream": True}, 400, "prompt_logprobs", "stream"),
    ("/v1/chat/completions", {"messages": CHAT, "prompt_logprobs": 1, "stream": True}, 400, "prompt_logprobs",
     "stream"),
    ("/v1/completions", {"prompt": "hi", "echo": True, "max_tokens": 0}, 400, "max_tokens", ">= 1"),
    ("/v1/completions", {"prompt": "hi", "skip_special_tokens": "no"}, 400, "skip_special_tokens", "boolean"),
    ("/v1/chat/completions", {"messages": CHAT, "audio": {"voice": "alloy"}}, 400, "audio", "not supported"),
    ("/v1/completions", {"prompt": [1, 99999999]}, 400, "prompt", "token ids"),
    ("/v1/completions", {"prompt": "hi", "stream": True, "top_p": 5}, 400, "top_p", "top_p"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages", "non-empty"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, 400, "messages", "text"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages", "role"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages", "list"),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 1000}, 400, "max_completion_tokens", "512"),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, 400, "top_logprobs", "logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 30}, 400, "top_logprobs", "20"),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": 3}, 400, "logprobs", "bool"),
    ("/v1/completions", {"prompt": "x" * 70000}, 413, None, "limit"),
    # constraints and tools
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "strict": True, "schema": {"type": "object", "not": {}}}}}, 400, "response_format", "'not'"),
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "strict": True, "schema": {"type": "array", "uniqueItems": True}}}}, 400, "response_format",
     "uniqueItems"),
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x"}}}, 400, "response_format", "schema"),
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "xml"}}, 400, "response_format", "json"),
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "strict": True, "schema": {"type": "object", "additionalProperties": True}}}},
     400, "response_format", "additionalProperties must be false"),
    ("/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "function", "function": {
        "name": "f", "strict": True, "parameters": {"type": "object", "properties": {"o": {
            "type": "object", "additionalProperties": {"type": "string"}}}}}}]},
     400, "tools", "additionalProperties must be false"),
    ("/v1/completions", {"prompt": "hi", "guided_regex": "[a-"}, 400, "guided_regex", "regex"),
    ("/v1/completions", {"prompt": "hi", "guided_grammar": "start: undefined_rule"}, 400, "guided_grammar", "grammar"),
    ("/v1/completions", {"prompt": "hi", "guided_json": "{not json"}, 400, "guided_json", "json"),
    ("/v1/completions", {"prompt": "hi", "guided_choice": []}, 400, "guided_choice", "non-empty"),
    ("/v1/completions", {"prompt": "hi", "guided_regex": "a", "guided_choice": ["b"]}, 400, "guided_choice", "one"),
    ("/v1/completions", {"prompt": "hi", "structured_outputs": {}}, 400, "structured_outputs", "exactly one"),
    ("/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "function", "function": {"name": "f"}}],
                              "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400, "tool_choice", "'g'"),
    ("/v1/chat/completions", {"messages": CHAT, "tool_choice": "required"}, 400, "tool_choice", "needs tools"),
    ("/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "function"}]}, 400, "tools", "function"),
    ("/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "function", "function": {"name": "f"}}],
                              "tool_choice": "required", "response_format": {"type": "json_object"}},
     400, "tools", "one output constraint"),
    # bounds a step could not run, refused before anything is queued
    ("/v1/completions", {"prompt": "hi", "top_k": 2**31}, 400, "top_k", "2147483647"),
    ("/v1/completions", {"prompt": "hi", "guided_choice": [f"c{i}" for i in range(1100)]}, 400, "guided_choice",
     "1024"),
    ("/v1/completions", {"prompt": "hi", "guided_regex": "(a{1000}){1000}"}, 400, "guided_regex", "too complex"),
    ("/v1/completions", {"prompt": "hi", "guided_json": {"$ref": "#"}}, 400, "guided_json", "admits no output"),
    ("/v1/completions", {"prompt": "hi", "guided_json": {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {
        "$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}}, 400, "guided_json", "admits no output"),
    # /v1/responses: what is not served is named, and the chat path's errors name the Responses fields
    ("/v1/responses", {"input": ""}, 400, "input", "non-empty"),
    ("/v1/responses", {"input": []}, 400, "input", "non-empty"),
    ("/v1/responses", {"input": [{"type": "function_call_output", "call_id": "c", "output": ""}]}, 400, "input",
     "some text"),
    ("/v1/responses", {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     400, "input", "input_text"),
    ("/v1/responses", {"input": "hi", "tools": [{"type": "web_search"}]}, 400, "tools", "web_search"),
    ("/v1/responses", {"input": "hi", "previous_response_id": "resp_1"}, 400, "previous_response_id", "stores no"),
    ("/v1/responses", {"input": "hi", "conversation": "conv_1"}, 400, "conversation", "stores no"),
    ("/v1/responses", {"input": "hi", "background": True}, 400, "background", "background"),
    ("/v1/responses", {"input": "hi", "reasoning": {"effort": "high"}}, 400, "reasoning", "not supported"),
    ("/v1/responses", {"input": "hi", "include": ["web_search_call.results"]}, 400, "include", "logprobs"),
    ("/v1/responses", {"input": "hi", "truncation": "auto"}, 400, "truncation", "disabled"),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 600}, 400, "max_output_tokens", "max_output_tokens is 600"),
    ("/v1/responses", {"input": "hi " * 600}, 400, "input", "512"),
    ("/v1/responses", {"input": "hi", "tool_choice": {"type": "function", "name": "f"}}, 400, "tool_choice", "'f'"),
    ("/v1/responses", {"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "strict": True,
                                                          "schema": {"type": "object", "additionalProperties": True}}}},
     400, "text", "text.format: with strict"),
    ("/v1/responses", {"input": "hi", "text": {"format": {"type": "json_object"}}, "tool_choice": "required",
                       "tools": [{"type": "function", "name": "f"}]}, 400, "tools", "one output constraint"),
    ("/v1/responses", {"input": "hi", "model": "gpt-9"}, 404, "model", "gpt-9"),
]


@pytest.mark.parametrize("path,body,status,param,words", BAD, ids=[f"{i}" for i in range(len(BAD))])
def test_bad_input(server, path, body, status, param, words):
    raw = body if isinstance(body, bytes) else None
    r = post(server.url, path, None if raw else body, content=raw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param, err
    assert words.lower() in err["message"].lower(), err


def test_still_correct_after_bad_input(server, client):
    first = client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=10, temperature=0).choices[0].text
    post(server.url, "/v1/completions", content=b"{nope")
    post(server.url, "/v1/completions", {"prompt": "hi", "top_p": 7})
    again = client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=10, temperature=0).choices[0].text
    assert again == first
    assert httpx.get(f"{server.url}/v1/nope").status_code == 404


def test_metrics(server):
    shared = "Here is a long preamble that every request repeats word for word. " * 4
    for question in ("Why?", "How?"):
        assert post(server.url, "/v1/completions", {"prompt": shared + question, "max_tokens": 2}).status_code == 200
    m = metrics(server.url)
    for name in ("time_to_first_token_seconds_count", "time_per_output_token_seconds_count",
                 "e2e_request_latency_seconds_count", "prompt_tokens_total", "generation_tokens_total"):
        assert m[f"jaxinfer_{name}"] > 0, name
    for name in ("num_requests_preempted", "kv_cache_usage_ratio", "prefix_cache_hit_rate", "preemptions_total"):
        assert f"jaxinfer_{name}" in m
    assert m["jaxinfer_prefix_cache_hits_total"] > 0 and m["jaxinfer_prefix_cache_hit_rate"] > 0


# ------------------------------------------------------------------------- structured output, tools

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather forecast for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a time zone",
    "parameters": {"type": "object", "properties": {"tz": {"type": "string", "enum": ["UTC", "CET", "PST"]}},
                   "required": ["tz"], "additionalProperties": False}}}
TOOLS = [WEATHER, CLOCK]
ASK = [{"role": "user", "content": "What will the weather be in Paris over the next 3 days?"}]
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "pets": {"type": "array", "items": {"$ref": "#/$defs/pet"}, "maxItems": 2}},
    "required": ["name", "age", "pets"], "additionalProperties": False,
    "$defs": {"pet": {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}}, "required": ["kind"],
                      "additionalProperties": False}}}


def chat(client, stream, **kw):
    """(content, [(name, arguments text)], finish_reason) of one chat choice, streamed or not."""
    kw = {"model": MODEL, "messages": ASK, "max_completion_tokens": 96, "temperature": 0, **kw}
    if not stream:
        choice = client.chat.completions.create(**kw).choices[0]
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or ()]
        assert all(c.type == "function" and c.id for c in choice.message.tool_calls or ())
        return choice.message.content, calls, choice.finish_reason
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or ():
            if tc.id is not None:  # OpenAI's opening delta of a call: id, type, name, arguments ""
                assert tc.index not in calls and tc.type == "function" and tc.function.arguments == ""
                calls[tc.index] = (tc.function.name, "")
            else:  # then pieces of the arguments as they are generated
                assert tc.function.name is None and tc.function.arguments
                calls[tc.index] = (calls[tc.index][0], calls[tc.index][1] + tc.function.arguments)
                STREAMED_PIECES[tc.index] = STREAMED_PIECES.get(tc.index, 0) + 1
        finish = chunk.choices[0].finish_reason or finish
    return content or None, [calls[k] for k in sorted(calls)], finish


STREAMED_PIECES: dict[int, int] = {}  # argument deltas per call index, over the streamed chat() calls


def chat_both_ways(client, **kw):
    """chat() not streamed and streamed; the same greedy reply, the streamed arguments piece by piece."""
    STREAMED_PIECES.clear()
    whole, streamed = chat(client, False, **kw), chat(client, True, **kw)
    assert streamed == whole
    assert sorted(STREAMED_PIECES) == list(range(len(whole[1])))  # every call's arguments came as pieces
    return whole


def check_calls(calls, names=("get_weather", "get_time")):
    jsonschema = pytest.importorskip("jsonschema")
    assert calls
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for name, args in calls:
        assert name in names
        jsonschema.validate(json.loads(args), schemas[name])


def test_response_format(client):
    jsonschema = pytest.importorskip("jsonschema")
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    content, calls, finish = chat(client, False, response_format=fmt,
                                  messages=[{"role": "user", "content": "Describe a person as JSON."}])
    assert finish == "stop" and not calls
    jsonschema.validate(json.loads(content), PERSON)
    flag = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
            "additionalProperties": False}
    content, _, finish = chat(client, True, extra_body={"guided_json": flag})  # vLLM's field, streamed
    assert finish == "stop" and json.loads(content) in ({"ok": True}, {"ok": False})


def test_tool_choice_required_and_named(client):
    """Required, then named: calls valid under their tool's schema, streamed as OpenAI streams them
    and adding up to the same calls as not streamed."""
    content, calls, finish = chat_both_ways(client, tools=TOOLS, tool_choice="required")
    assert finish == "tool_calls" and not content
    # Pieces as tokens are generated (fewer only if this client read slower than the engine steps).
    assert STREAMED_PIECES[0] > 1, STREAMED_PIECES
    check_calls(calls)
    content, calls, finish = chat_both_ways(client, tools=TOOLS, parallel_tool_calls=False,
                                            tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert finish == "tool_calls" and not content and len(calls) == 1
    check_calls(calls, names=("get_time",))


def test_tool_choice_auto_parses_the_models_format(client):
    """Under "auto" the model writes Hermes tool calls itself. The 135M model rarely chooses to, so a
    regex holds its text to that format: what is tested is the parsing, content before the calls,
    and the reply's shape, streamed (arguments as they are written) and not."""
    call = r'<tool_call>\n\{"name": "get_time", "arguments": \{"tz": "(UTC|CET)"\}\}\n</tool_call>'
    content, calls, finish = chat_both_ways(client, tools=TOOLS, extra_body={"guided_regex": "One moment\\." + call})
    assert (content, finish) == ("One moment.", "tool_calls")
    check_calls(calls, names=("get_time",))
    # No call: all content, "<b" held back until it cannot be "<tool_call>", then sent.
    content, calls, finish = chat(client, True, tools=TOOLS, extra_body={"guided_regex": "Sunny <b>today</b>"})
    assert (content, calls, finish) == ("Sunny <b>today</b>", [], "stop")


class Address(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=12)
    zip: str = pydantic.Field(pattern=r"^[0-9]{5}$")


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=16)
    home: Address
    pet: Literal["cat", "dog", "none"]


class Depot(pydantic.BaseModel):  # named "Address" in its tool's $defs, unlike Person's
    street: str = pydantic.Field(max_length=20)


class Order(pydantic.BaseModel):
    to: Depot
    quantity: int = pydantic.Field(ge=1, le=9)


def pydantic_tools() -> list[dict]:
    """Two tools whose parameters pydantic wrote: nested models as $defs and $refs, both named Address."""
    order = json.loads(json.dumps(Order.model_json_schema()).replace("Depot", "Address"))
    return [{"type": "function", "function": {"name": "add_person", "description": "Add a person",
                                              "parameters": Person.model_json_schema()}},
            {"type": "function", "function": {"name": "ship_order", "description": "Ship an order",
                                              "parameters": order}}]


def test_forced_tool_call_schema_keeps_each_tools_references():
    """Nested under 'arguments', a tool's '#/$defs/...' references would point at nothing: each tool's
    definitions move to the root (the second Address renamed) with its references rewritten, so the
    built schema takes exactly the calls each tool's own schema takes."""
    jsonschema = pytest.importorskip("jsonschema")
    tools = pydantic_tools()
    person = {"name": "Ann", "home": {"city": "Oslo", "zip": "12345"}, "pet": "cat"}
    calls = [{"name": "add_person", "arguments": person}, {"name": "ship_order", "arguments": {
        "to": {"street": "Main St"}, "quantity": 2}}]
    wrong = [{"name": "add_person", "arguments": {**person, "home": {"street": "Main St"}}},
             {"name": "ship_order", "arguments": {"to": {"city": "Oslo", "zip": "12345"}, "quantity": 2}}]
    for parallel in (True, False):
        schema = tool_call_schema(ToolPlan("required", tools, parallel=parallel))
        for call, bad in zip(calls, wrong):
            jsonschema.validate([call] if parallel else call, schema)
            with pytest.raises(jsonschema.ValidationError):
                jsonschema.validate([bad] if parallel else bad, schema)


def test_forced_call_of_a_pydantic_tool(client):
    """tool_choice 'required' over a pydantic-written tool (one: two would not fit this server's
    context): the call parses and its arguments validate against the tool's own schema."""
    jsonschema = pytest.importorskip("jsonschema")
    tool = pydantic_tools()[0]
    content, calls, finish = chat(client, False, tools=[tool], tool_choice="required", parallel_tool_calls=False,
                                  max_completion_tokens=96,
                                  messages=[{"role": "user", "content": "Add Ann from Oslo, who has a cat."}])
    assert finish == "tool_calls" and not content and len(calls) == 1, (content, calls, finish)
    assert calls[0][0] == "add_person"
    jsonschema.validate(json.loads(calls[0][1]), tool["function"]["parameters"])


def test_guided_fields_on_completions(client):
    out = client.completions.create(model=MODEL, prompt="My favourite colour is", max_tokens=8,
                                    extra_body={"guided_choice": ["red", "green", "blue"]})
    assert out.choices[0].text in ("red", "green", "blue") and out.choices[0].finish_reason == "stop"
    out = client.completions.create(model=MODEL, prompt="A year:", max_tokens=8,
                                    extra_body={"structured_outputs": {"regex": "(19|20)[0-9]{2}"}})
    assert re.fullmatch(r"(19|20)[0-9]{2}", out.choices[0].text)


# ---------------------------------------------------------------------------------- /v1/responses

QUESTION = "What is the capital of France?"  # its greedy replies end within 16 tokens, with or without SYSTEM
SYSTEM = "Answer in one word."


def test_responses_match_chat(client):
    """A Responses request is the chat completion of the same messages: the same greedy text and token
    counts (``instructions`` a system message first), streamed in OpenAI's event order, the client's
    stream helper accumulating the same text; a length cut is ``incomplete``."""
    chat = client.chat.completions.create(model=MODEL, max_completion_tokens=16, temperature=0, messages=[
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}])
    out = client.responses.create(model=MODEL, input=QUESTION, instructions=SYSTEM, max_output_tokens=16,
                                  temperature=0)
    assert out.object == "response" and out.id.startswith("resp_") and out.model == MODEL
    assert out.output_text == chat.choices[0].message.content
    assert [item.type for item in out.output] == ["message"] and out.output[0].role == "assistant"
    assert out.usage.input_tokens == chat.usage.prompt_tokens and out.usage.output_tokens == chat.usage.completion_tokens
    assert out.usage.total_tokens == chat.usage.total_tokens and out.usage.output_tokens_details.reasoning_tokens == 0
    assert chat.choices[0].finish_reason == "stop" and out.status == "completed" and out.incomplete_details is None
    assert out.instructions == SYSTEM and out.max_output_tokens == 16 and out.tools == [] and out.tool_choice == "auto"

    plain = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                           max_completion_tokens=16, temperature=0)
    kw = dict(model=MODEL, input=[{"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}],
              max_output_tokens=16, temperature=0)
    with client.responses.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert final.output_text == plain.choices[0].message.content == "".join(
        e.delta for e in events if e.type == "response.output_text.delta")
    types = " ".join(e.type for e in events)
    assert re.fullmatch(r"response\.created response\.in_progress response\.output_item\.added "
                        r"response\.content_part\.added( response\.output_text\.delta)+ response\.output_text\.done "
                        r"response\.content_part\.done response\.output_item\.done response\.completed",
                        types), types
    assert [e.sequence_number for e in events] == list(range(len(events)))
    created = [e for e in client.responses.create(stream=True, **kw)]  # the raw events, without the helper
    assert [e.type for e in created] == [e.type for e in events]
    assert created[-1].response.output_text == final.output_text

    cut = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=3, temperature=0,
                                  include=["message.output_text.logprobs"], top_logprobs=2)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.usage.output_tokens == 3 and cut.output[0].status == "incomplete"
    logprobs = cut.output[0].content[0].logprobs
    assert len(logprobs) == 3 and all(len(lp.top_logprobs) == 2 and lp.logprob <= 0 for lp in logprobs)
    assert "".join(lp.token for lp in logprobs) == cut.output_text


def test_responses_structured_output_and_function_calls(client):
    """``text.format`` constrains the reply as ``response_format`` does; a forced function call is a
    ``function_call`` item (streamed: its arguments in pieces), and sending it back with its output
    continues the conversation."""
    jsonschema = pytest.importorskip("jsonschema")
    forecast = WEATHER["function"]["parameters"]
    out = client.responses.create(model=MODEL, input=ASK[0]["content"], max_output_tokens=48, temperature=0,
                                  text={"format": {"type": "json_schema", "name": "forecast", "schema": forecast,
                                                   "strict": True}})
    assert out.status == "completed" and out.text.format.type == "json_schema"
    jsonschema.validate(json.loads(out.output_text), forecast)

    weather = {"type": "function", **WEATHER["function"]}
    kw = dict(model=MODEL, input=ASK[0]["content"], tools=[weather], max_output_tokens=48, temperature=0,
              tool_choice={"type": "function", "name": "get_weather"})
    out = client.responses.create(**kw)
    assert out.status == "completed" and [item.type for item in out.output] == ["function_call"]
    call = out.output[0]
    assert call.name == "get_weather" and call.call_id and call.id.startswith("fc_") and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER["function"]["parameters"])
    with client.responses.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(pieces) > 1 and "".join(pieces) == final.output[0].arguments == call.arguments
    assert [e.type for e in events][-3:] == ["response.function_call_arguments.done", "response.output_item.done",
                                            "response.completed"]

    follow = client.responses.create(model=MODEL, tools=[weather], max_output_tokens=8, temperature=0, input=[
        {"role": "user", "content": ASK[0]["content"]}, call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": '{"forecast": "sunny"}'}])
    assert follow.output and follow.usage.input_tokens > out.usage.input_tokens


def test_response_events_from_chat_deltas():
    """The events of a reply with text, then two calls (``tool_choice: "auto"``), from the chat
    renderer's deltas: each item closed before the next opens, the final object holding what the
    deltas built; an error is an ``error`` event."""
    from jaxinfer.server import responses

    req = parse(responses.ResponsesRequest, json.dumps({"input": "hi", "tools": [
        {"type": "function", "name": "f"}, {"type": "function", "name": "g"}]}).encode())
    events = responses.ResponseEvents(responses.ResponseShape("resp_1", req, MODEL))
    chunk = lambda delta, finish=None: {"index": 0, "delta": delta, "logprobs": None,  # noqa: E731
                                        "finish_reason": finish}
    sent = events.start()
    for delta in ({"content": "One"}, {"content": " moment."},
                  {"tool_calls": [{"index": 0, "id": "call_a", "type": "function",
                                   "function": {"name": "f", "arguments": ""}}]},
                  {"tool_calls": [{"index": 0, "function": {"arguments": '{"x": '}}]},
                  {"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]},
                  {"tool_calls": [{"index": 1, "id": "call_b", "type": "function",
                                   "function": {"name": "g", "arguments": ""}}]},
                  {"tool_calls": [{"index": 1, "function": {"arguments": "{}"}}]}):
        sent += events.delta(chunk(delta))
    sent += events.finish("tool_calls", {"input_tokens": 1})
    sent.append(events.error(APIError(504, "too slow", code="request_timeout")))
    parsed = [(e.split("\n")[0].removeprefix("event: "), json.loads(e.split("\n")[1].removeprefix("data: ")))
              for e in sent]
    assert all(name == data["type"] for name, data in parsed)
    assert [data["sequence_number"] for _, data in parsed] == list(range(len(parsed)))
    assert [(name, data.get("output_index")) for name, data in parsed] == [
        ("response.created", None), ("response.in_progress", None),
        ("response.output_item.added", 0), ("response.content_part.added", 0),
        ("response.output_text.delta", 0), ("response.output_text.delta", 0), ("response.output_text.done", 0),
        ("response.content_part.done", 0), ("response.output_item.done", 0),
        ("response.output_item.added", 1), ("response.function_call_arguments.delta", 1),
        ("response.function_call_arguments.delta", 1), ("response.function_call_arguments.done", 1),
        ("response.output_item.done", 1),
        ("response.output_item.added", 2), ("response.function_call_arguments.delta", 2),
        ("response.function_call_arguments.done", 2), ("response.output_item.done", 2),
        ("response.completed", None), ("error", None)]
    final = parsed[-2][1]["response"]
    assert final["status"] == "completed" and final["usage"] == {"input_tokens": 1}
    assert [(o["type"], o["status"]) for o in final["output"]] == [
        ("message", "completed"), ("function_call", "completed"), ("function_call", "completed")]
    assert final["output"][0]["content"][0]["text"] == "One moment."
    assert [(o["call_id"], o["name"], o["arguments"]) for o in final["output"][1:]] == [
        ("call_a", "f", '{"x": 1}'), ("call_b", "g", "{}")]
    assert parsed[-1][1] == {"type": "error", "sequence_number": len(parsed) - 1, "code": "request_timeout",
                             "message": "too slow", "param": None}


# ------------------------------------------------------------------------------- routes and docs


def test_tokenize_and_detokenize(server, client, smollm2_tokenizer):
    """vLLM's shapes: a prompt's ids are the tokenizer's, messages' are as many as a chat request's prompt
    (its usage says), and /detokenize gives the text back; bad bodies are 400s naming the field."""
    text = "Hello world, café: ünïcode and 12345."
    r = post(server.url, "/tokenize", {"prompt": text})
    assert r.status_code == 200, r.text
    tok = r.json()
    assert tok["tokens"] == smollm2_tokenizer.encode(text) and tok["count"] == len(tok["tokens"])
    assert tok["max_model_len"] == 512
    back = post(server.url, "/detokenize", {"tokens": tok["tokens"], "model": MODEL})
    assert back.status_code == 200 and back.json() == {"prompt": text}
    chat = post(server.url, "/tokenize", {"messages": CHAT}).json()
    usage = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1).usage
    assert chat["count"] == usage.prompt_tokens == len(chat["tokens"])
    assert post(server.url, "/detokenize", {"tokens": chat["tokens"]}).json()["prompt"].endswith("assistant\n")
    for path, body, status, param in (("/tokenize", {"prompt": text, "messages": CHAT}, 400, "prompt"),
                                      ("/tokenize", {}, 400, "prompt"),
                                      ("/tokenize", {"messages": [{"role": "user", "content": ""}]}, 400,
                                       "messages"),
                                      ("/tokenize", {"prompt": text, "model": "other"}, 404, "model"),
                                      ("/detokenize", {"tokens": [smollm2_tokenizer.vocab_size + 5]}, 400, "tokens"),
                                      ("/detokenize", {"tokens": "12"}, 400, "tokens")):
        r = post(server.url, path, body)
        assert r.status_code == status and r.json()["error"]["param"] == param, (path, body, r.text)


def test_embeddings(server, client, smollm2_tokenizer):
    """/v1/embeddings in OpenAI's shape: one unit vector per input, in order, the prompt tokens counted as
    /tokenize counts them; base64 (the OpenAI client's default) is the same float32 vectors; bad bodies
    are 400s naming the field (another model: 404)."""
    texts = ["The capital of France is Paris.", "Once upon a time"]
    r = post(server.url, "/v1/embeddings", {"input": texts, "model": MODEL, "user": "ignored"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] == MODEL
    assert [(d["object"], d["index"]) for d in body["data"]] == [("embedding", 0), ("embedding", 1)]
    vectors = np.array([d["embedding"] for d in body["data"]], np.float32)
    assert vectors.shape == (2, 576) and np.allclose(np.linalg.norm(vectors, axis=1), 1, atol=1e-5)
    tokens = sum(post(server.url, "/tokenize", {"prompt": t}).json()["count"] for t in texts)
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    b64 = post(server.url, "/v1/embeddings", {"input": texts, "encoding_format": "base64", "dimensions": 576}).json()
    decoded = np.array([np.frombuffer(base64.b64decode(d["embedding"]), "<f4") for d in b64["data"]])
    np.testing.assert_array_equal(decoded, vectors)
    sdk = client.embeddings.create(model=MODEL, input=texts)
    np.testing.assert_array_equal(np.array([d.embedding for d in sdk.data], np.float32), vectors)
    for body, status, param in (({"input": ""}, 400, "input"), ({"input": []}, 400, "input"), ({}, 400, "input"),
                                ({"input": [[1, 2], [smollm2_tokenizer.vocab_size + 5]]}, 400, "input"),
                                ({"input": "word " * 600}, 400, "input"),
                                ({"input": "hi", "dimensions": 8}, 400, "dimensions"),
                                ({"input": "hi", "encoding_format": "hex"}, 400, "encoding_format"),
                                ({"input": "hi", "model": "other"}, 404, "model")):
        r = post(server.url, "/v1/embeddings", body)
        assert r.status_code == status and r.json()["error"]["param"] == param, (body, r.text)


def test_embeddings_wait_for_the_engine():
    """Before the engine is ready an embedding request is a 503 (another model's: a 404 first)."""
    serving = OpenAIServing(AsyncEngine("tiny-llama3", EngineConfig(), max_waiting=1), "tiny")
    for body, status in (({"input": "hi", "model": "other"}, 404), ({"input": [1, 2]}, 503)):
        with pytest.raises(APIError) as e:
            asyncio.run(serving.embeddings(parse(EmbeddingRequest, json.dumps(body).encode())))
        assert e.value.status == status


@pytest.fixture(scope="module")
def smollm2_llm():
    """The oracle of the server's passes over prompts: an engine of the same model and max_model_len (the
    pass's token buckets) in this process."""
    return LLM(MODEL, max_num_seqs=1, max_num_batched_tokens=64, max_model_len=512, token_buckets=(64,),
               seq_buckets=(1,), page_buckets=(32,))


def check_prompt_logprobs(got, ids, k, want, tokenizer):
    """``got`` (a response's prompt_logprobs) is vLLM's shape of ``want`` (``LLMEngine.prompt_logprobs``
    of ``ids`` with ``k``): null first, then per token its own and the top k's logprob (within 1e-4),
    rank (the top k: 1..k; the token, where not among them: past k) and decoded text."""
    assert len(got) == len(want) == len(ids) and got[0] is None
    for entry, wanted, token in zip(got[1:], want[1:], ids[1:]):
        assert list(entry) == [str(t) for t in wanted] and list(entry)[0] == str(token)  # the token first
        for t, lp in wanted.items():
            assert abs(entry[str(t)]["logprob"] - lp) < 1e-4 and entry[str(t)]["decoded_token"] == tokenizer.decode([t])
        ordered = sorted(entry, key=lambda t: -entry[t]["logprob"])
        assert [entry[t]["rank"] for t in ordered[:k]] == list(range(1, k + 1))
        assert len(entry) == k or (ordered[-1] == str(token) and entry[str(token)]["rank"] > k)


def test_prompt_logprobs(server, smollm2_llm, smollm2_tokenizer):
    """vLLM's prompt_logprobs: on a completion each choice carries its prompt's (scored once for n=2), on a
    chat completion the response does, equal to ``LLMEngine.prompt_logprobs`` of the same ids. (Every
    prompt here and in test_echo is at most 16 tokens with k=3: one compiled pass.)"""
    ids = smollm2_tokenizer.encode(PROMPTS[0])
    r = post(server.url, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 2, "n": 2, "prompt_logprobs": 3})
    assert r.status_code == 200, r.text
    a, b = r.json()["choices"]
    assert a["prompt_logprobs"] == b["prompt_logprobs"] and a["text"]
    check_prompt_logprobs(a["prompt_logprobs"], ids, 3, smollm2_llm.engine.prompt_logprobs(ids, 3), smollm2_tokenizer)
    short = [{"role": "system", "content": "Hi"}, {"role": "user", "content": "Hi"}]
    chat = post(server.url, "/v1/chat/completions", {"messages": short, "max_tokens": 1, "prompt_logprobs": 3}).json()
    chat_ids = apply_chat_template(smollm2_tokenizer, short)
    assert chat["usage"]["prompt_tokens"] == len(chat_ids) and "prompt_logprobs" not in chat["choices"][0]
    check_prompt_logprobs(chat["prompt_logprobs"], chat_ids, 3, smollm2_llm.engine.prompt_logprobs(chat_ids, 3),
                          smollm2_tokenizer)
    assert "prompt_logprobs" not in post(server.url, "/v1/chat/completions", {"messages": short, "max_tokens": 1}).json()


def test_echo(server, client, smollm2_tokenizer):
    """Completions' echo: each choice's text starts with the prompt (a token-id prompt's decoded), and with
    logprobs its logprobs start with the prompt tokens' (the first null); streamed, the prompt is the first
    chunk. Chat's (vLLM's): the reply continues a last assistant message."""
    ids = smollm2_tokenizer.encode(PROMPTS[1])
    plain = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=4, temperature=0).choices[0].text
    out = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=4, temperature=0, echo=True,
                                    logprobs=3)
    choice = out.choices[0]
    assert choice.text == PROMPTS[1] + plain
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(ids) + 4 and "".join(lp.tokens) == choice.text
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and lp.text_offset[:2] == [0, len(lp.tokens[0])]
    scored = choice.model_extra["prompt_logprobs"]
    assert len(scored) == len(ids) and lp.token_logprobs[1:len(ids)] == [
        scored[i][str(t)]["logprob"] for i, t in enumerate(ids) if i]
    assert all(len(top) in (3, 4) for top in lp.top_logprobs[1:])
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0, echo=True)
    assert by_ids.choices[0].text == smollm2_tokenizer.decode(ids) + plain and by_ids.choices[0].logprobs is None
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=4, temperature=0, echo=True,
                                            stream=True))
    assert chunks[0].choices[0].text == PROMPTS[1] and "".join(c.choices[0].text for c in chunks) == choice.text

    kw = dict(model=MODEL, max_tokens=2, temperature=0)
    messages = [*CHAT, {"role": "assistant", "content": "Apples,"}]
    reply = client.chat.completions.create(messages=messages, extra_body={"echo": True}, **kw).choices[0].message.content
    assert reply == "Apples," + client.chat.completions.create(messages=messages, **kw).choices[0].message.content
    stream = client.chat.completions.create(messages=messages, stream=True, extra_body={"echo": True}, **kw)
    assert "".join(c.choices[0].delta.content or "" for c in stream) == reply
    unechoed = client.chat.completions.create(messages=CHAT, extra_body={"echo": True}, **kw)  # the user's is last
    assert unechoed.choices[0].message.content == client.chat.completions.create(messages=CHAT, **kw).choices[
        0].message.content


def test_cors_allows_only_the_allowed_origins(server):
    """--allowed_origins: a browser's preflight from an allowed origin passes, from another fails, and
    the allowed origin's requests carry the header that lets its page read the answer."""
    ask = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}
    ok = httpx.options(f"{server.url}/v1/chat/completions", headers={"Origin": "https://app.example", **ask})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "https://app.example"
    assert "POST" in ok.headers["access-control-allow-methods"]
    bad = httpx.options(f"{server.url}/v1/chat/completions", headers={"Origin": "https://evil.example", **ask})
    assert bad.status_code == 400 and "access-control-allow-origin" not in bad.headers
    r = post(server.url, "/tokenize", {"prompt": "hi"}, headers={"Origin": "https://app.example"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
    r = post(server.url, "/tokenize", {"prompt": "hi"}, headers={"Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in r.headers


def _openai_error_shape(response) -> None:
    assert response.status_code < 500, f"{response.status_code} {response.request.method} " \
                                       f"{response.request.url}\n{response.request.body!r}\n{response.text[:2000]}"
    if response.status_code >= 400:
        body = response.json()
        assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
        assert isinstance(body["error"]["message"], str) and body["error"]["message"]


def test_unknown_routes_methods_and_docs(server):
    for method, path in (("GET", "/v2/nothing"), ("DELETE", "/v1/models"), ("GET", "/v1/completions")):
        r = httpx.request(method, f"{server.url}{path}")
        assert r.status_code in (404, 405)
        _openai_error_shape(r)
    assert "swagger" in httpx.get(f"{server.url}/docs").text.lower()


def test_template_without_tools_is_a_400(smollm2_tokenizer):
    """SmolLM2's own template (the GGUF's; the embedded model is served with one that lists tools)
    ignores tools, so the model would never see them: a 400, not a silent drop."""
    from jaxinfer.models.weights import resolve_model
    from jaxinfer.models.weights.gguf_file import gguf_file

    own = gguf_file(resolve_model(MODEL).path).metadata["tokenizer.chat_template"]
    engine = types.SimpleNamespace(tokenizer=smollm2_tokenizer, max_model_len=512)
    serving = OpenAIServing(engine, MODEL, chat_template=own)
    req = parse(ChatCompletionRequest, json.dumps({"messages": CHAT, "tools": [WEATHER]}).encode())
    with pytest.raises(APIError) as e:
        serving.prepare_chat(req)
    assert e.value.status == 400 and e.value.param == "tools" and "template" in e.value.message


# ------------------------------------------------------------------------------------ tiny server


def test_api_key(tiny):
    body = {"prompt": [1, 2, 3], "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
        r = post(tiny.url, "/v1/completions", body, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{tiny.url}/v1/models").status_code == 401
    assert httpx.get(f"{tiny.url}/health").status_code == 200
    r = post(tiny.url, "/v1/completions", body, headers={"Authorization": "Bearer sekret"})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_embeddings_match_llm_embed_and_need_the_key(tiny):
    """The server's vectors are ``LLM.embed``'s for the same model and engine limits (the engine core runs
    the same pass); inputs past max_model_len or text without a tokenizer are 400s naming ``input``."""
    prompts = [[1, 2, 3], list(range(5, 45))]
    assert post(tiny.url, "/v1/embeddings", {"input": prompts}).status_code == 401
    key = {"Authorization": "Bearer sekret"}
    r = post(tiny.url, "/v1/embeddings", {"input": prompts}, headers=key)
    assert r.status_code == 200, r.text
    assert r.json()["usage"] == {"prompt_tokens": 43, "total_tokens": 43}
    llm = LLM("tiny-llama3", load_format="dummy", max_num_seqs=1, max_num_batched_tokens=16, max_model_len=256)
    want = [o.outputs.embedding for o in llm.embed(prompts)]
    np.testing.assert_allclose([d["embedding"] for d in r.json()["data"]], want, rtol=0, atol=1e-6)
    for body in ({"input": [list(range(3, 260))]}, {"input": "no tokenizer"}):
        r = post(tiny.url, "/v1/embeddings", body, headers=key)
        assert r.status_code == 400 and r.json()["error"]["param"] == "input", r.text


def test_logprobs_past_max_logprobs_name_the_field(tiny):
    """Above the server's --max-logprobs (4 here), prompt_logprobs and logprobs are 400s naming the field."""
    key = {"Authorization": "Bearer sekret"}
    for field in ("prompt_logprobs", "logprobs"):
        r = post(tiny.url, "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 1, field: 5}, headers=key)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
        assert "max_logprobs" in r.json()["error"]["message"]
    r = post(tiny.url, "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 1, "prompt_logprobs": 4}, headers=key)
    assert r.status_code == 200 and len(r.json()["choices"][0]["prompt_logprobs"]) == 3, r.text


def test_queue_full_answers_503(tiny):
    body = {"prompt": [1, 2, 3], "max_tokens": 240, "ignore_eos": True}

    async def run():
        async with httpx.AsyncClient(base_url=tiny.url, headers={"Authorization": "Bearer sekret"},
                                     timeout=120) as http:
            async def one():
                t0 = time.monotonic()
                r = await http.post("/v1/completions", json=body)
                return r, time.monotonic() - t0
            return await asyncio.gather(*(one() for _ in range(6)))

    results = asyncio.run(run())
    codes = sorted(r.status_code for r, _ in results)
    assert 200 in codes and 503 in codes and set(codes) <= {200, 503}, codes
    for r, seconds in results:
        if r.status_code == 503:
            assert r.json()["error"]["code"] == "queue_full" and "max_waiting=1" in r.json()["error"]["message"]
            assert seconds < 1.0
        else:
            assert r.json()["usage"]["completion_tokens"] == 240


def test_sigterm_finishes_running_and_exits_0(tiny):
    # logprobs: a chunk per engine step, whose tokens it lists (this model has no tokenizer, so no text
    # to stream; on CPU a step decodes up to ``num_scheduler_steps`` tokens).
    body = {"prompt": [1, 2, 3], "max_tokens": 240, "ignore_eos": True, "stream": True, "logprobs": 0}
    with httpx.Client(base_url=tiny.url, headers={"Authorization": "Bearer sekret"}, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            next(lines)
            tiny.proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]"
    events = [json.loads(line[6:]) for line in rest if line.startswith("data: {")]
    streamed = sum(len(e["choices"][0]["logprobs"]["tokens"]) for e in events)
    assert streamed > 200 and events[-1]["choices"][0]["finish_reason"] == "length"
    assert tiny.proc.wait(60) == 0, tiny.tail()
    assert "Finished server process" in tiny.tail()


# vLLM's request fields beyond OpenAI's (its CompletionRequest / ChatCompletionRequest extras).
VLLM_EXTRAS = {
    "both": ["best_of", "use_beam_search", "top_k", "min_p", "repetition_penalty", "length_penalty", "stop_token_ids",
             "include_stop_str_in_output", "ignore_eos", "min_tokens", "skip_special_tokens",
             "spaces_between_special_tokens", "truncate_prompt_tokens", "prompt_logprobs", "allowed_token_ids",
             "bad_words", "guided_json", "guided_regex", "guided_choice", "guided_grammar", "structural_tag",
             "guided_decoding_backend", "guided_whitespace_pattern", "structured_outputs", "priority", "request_id",
             "logits_processors", "return_tokens_as_token_ids", "return_token_ids", "cache_salt",
             "kv_transfer_params", "vllm_xargs", "add_special_tokens"],
    "completions": ["echo", "response_format", "prompt_embeds"],
    "chat": ["echo", "add_generation_prompt", "continue_final_message", "chat_template", "chat_template_kwargs",
             "documents", "mm_processor_kwargs"],
}


def test_every_openai_and_vllm_request_field_is_served_or_refused():
    """No field is silently dropped: every field of the ``openai`` client's request types and vLLM's
    extras is declared by the server's request models, so it is honoured or, where it would change the
    output and is not served, refused by name (a value other than its default is a 400); an unknown field
    is named in X-Ignored-Fields (test_vllm_sampling_fields)."""
    import typing

    from openai.types import completion_create_params, embedding_create_params
    from openai.types.chat import completion_create_params as chat_create_params
    from openai.types.responses import response_create_params

    from jaxinfer.server import protocol

    def declared(model):
        return {f.alias or name for name, f in model.model_fields.items()}

    openai_fields = {
        protocol.CompletionRequest: typing.get_type_hints(completion_create_params.CompletionCreateParamsBase),
        protocol.ChatCompletionRequest: typing.get_type_hints(chat_create_params.CompletionCreateParamsBase),
        protocol.EmbeddingRequest: typing.get_type_hints(embedding_create_params.EmbeddingCreateParams),
        protocol.ResponsesRequest: typing.get_type_hints(response_create_params.ResponseCreateParamsBase)}
    vllm = {protocol.CompletionRequest: VLLM_EXTRAS["both"] + VLLM_EXTRAS["completions"],
            protocol.ChatCompletionRequest: VLLM_EXTRAS["both"] + VLLM_EXTRAS["chat"], protocol.EmbeddingRequest: [],
            protocol.ResponsesRequest: []}
    for model, fields in openai_fields.items():
        streamed = {"stream"} if model is not protocol.EmbeddingRequest else set()
        missing = (set(fields) | streamed | set(vllm[model])) - declared(model)
        assert not missing, f"{model.__name__} drops {sorted(missing)}"
    # vLLM's text options are honoured: any value reaches the request's SamplingParams
    text_options = {"skip_special_tokens": False, "spaces_between_special_tokens": False,
                    "include_stop_str_in_output": True}
    for model, body in ((protocol.CompletionRequest, {"prompt": "hi"}),
                        (protocol.ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}]})):
        params = protocol.sampling_params(protocol.parse(model, json.dumps({**body, **text_options}).encode()), 4, None)
        assert {name: getattr(params, name) for name in text_options} == text_options
    # a refused field: its default passes, another value is a 400 naming it
    for field, value in [("length_penalty", 2.0), ("suffix", "s"), ("cache_salt", "s")]:
        body = json.dumps({"prompt": "hi", field: value}).encode()
        with pytest.raises(protocol.APIError) as e:
            protocol.parse(protocol.CompletionRequest, body)
        assert e.value.status == 400 and e.value.param == field and "not supported" in e.value.message


def test_relaxed_schema_warns_in_body_and_header(server):
    """A schema keyword the grammar cannot enforce (uniqueItems) is relaxed, not refused: the response
    says so in its ``warnings`` and the ``X-Structured-Output-Warnings`` header; output compact."""
    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "uniqueItems": True,
              "maxItems": 4}
    r = post(server.url, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 32, "temperature": 0,
                                                  "response_format": {"type": "json_schema", "json_schema": {
                                                      "name": "x", "schema": schema}}})
    assert r.status_code == 200, r.text
    body = r.json()
    assert "uniqueItems" in body["warnings"][0]
    assert json.loads(r.headers["X-Structured-Output-Warnings"]) == body["warnings"]
    text = body["choices"][0]["message"]["content"]
    assert " " not in text
    doc = json.loads(text)
    assert (len(set(doc)) < len(doc)) == any("violates" in w for w in body["warnings"]), body
    # streamed, the same warnings come on the last chunk, and only there
    r = post(server.url, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 32, "temperature": 0, "stream": True,
                                                  "response_format": {"type": "json_schema", "json_schema": {
                                                      "name": "x", "schema": schema}}})
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert chunks[-1]["warnings"] == body["warnings"], chunks[-1]
    assert not any("warnings" in c for c in chunks[:-1])
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == text
