"""Soak: the server's promise that one request never hurts another, held under load for minutes.

    python tests/soak.py --minutes 10 --clients 32 --out soak.json

starts a server on the embedded SmolLM2 (``test_server.Server`` with ``test_server.SMOLLM2_ARGS``,
scheduling by priority and with room queued for every client's largest request) and runs
``--clients`` concurrent clients for ``--minutes``, each looping over a random mix of

- **valid** requests whose output is known: greedy completions and chat completions, ``n`` > 1 with a
  seed, stop strings, logprobs, guided choice / regex / JSON schema, forced tool calls (a pydantic tool
  with ``$defs`` among them), every sampling bound at its limit, a body of exactly the size limit, a
  prompt plus ``max_tokens`` of exactly the context; streamed or not, with a random ``priority``.
  The oracle is the same server answering each request alone before the load starts (every
  response is compared with it: text, finish reason, tool calls, logprob tokens, usage); the
  server's outputs equal the offline engine's by ``tests/test_server.py`` and ``bench_serving.py
  --offline``, not by this harness;
- **sampled** requests (no seed), whose text is unknown: checked for shape only;
- **invalid** requests: every bound just beyond its limit, hostile constraints (unsatisfiable and
  mutually recursive schemas, ``(a{1000}){1000}``, a grammar that fails inside the step, nesting past
  the parser's limit, unsatisfiable tool schemas), malformed JSON, wrong types, wrong Content-Type,
  oversize bodies, an unknown model, unknown routes: each must get its own 4xx with OpenAI's error shape;
- **disconnects**: streams dropped after their first or a few chunks, non-streamed requests whose
  client gives up after a random fraction of a second.

A separate process polls ``/health`` every 50 ms (its latency) and reads the server's and the engine
core's RSS from ``/proc`` once a second. At the end the server must be idle (no KV page held, nothing
running or waiting) and the engine core's RSS must have stopped growing (``MAX_RSS_GROWTH``). The
summary goes to ``--out`` (JSON) and a table to stdout; the exit status is 1 if anything failed.
``tests/test_soak.py`` runs it for a minute or so; ``run()`` is its entry point.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import copy
import dataclasses
import json
import multiprocessing
import os
import random
import re
import statistics
import sys
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from jaxinfer.sampling_params import (MAX_CHOICES, MAX_LOGPROBS, MAX_N, MAX_PENALTY, MAX_REGEX_SIZE,  # noqa: E402
                                      MAX_SEED, MAX_STOP_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS,
                                      MAX_TEMPERATURE, MAX_TOP_K)
from jaxinfer.server.protocol import MAX_PRIORITY  # noqa: E402
from test_server import (ASK, CHAT, CLOCK, PERSON, PROMPTS, SMOLLM2_ARGS, TOOLS, Server,  # noqa: E402
                         pydantic_tools)

MAX_MODEL_LEN = 512  # SMOLLM2_ARGS'
MAX_REQUEST_BYTES = 65536  # SMOLLM2_ARGS'
VOCAB = 49152  # SmolLM2's
HEALTH_P99 = 0.1  # seconds: /health answers at once whatever else the server does
HEALTH_EVERY = 0.05
IDLE_TIMEOUT = 60.0  # seconds after the last client stops for every page and slot to be free
VALID_TIMEOUT = 600.0  # a valid request unanswered after this long counts as lost
# Memory: over the second half of the load, the engine core's RSS may grow by MAX_RSS_GROWTH_MIB, plus
# RSS_PER_COMPILE_MIB for each step shape compiled in that half, and the server's by MAX_RSS_GROWTH_MIB.
# A step variant meets its first batch at random (logprobs x penalties x token, page buckets x decode
# only: under a hundred here, so the LRU of 256 executables never evicts); each compile added up to
# 75 MiB when the oracle ran each kind alone (its code, and XLA's and LLVM's arenas, which glibc keeps),
# and constraints compiled by llguidance up to 42 MiB (a cache of 512 >> the ~15 in the mix). Past them
# the RSS plateaus (+7 MiB over the last 100 s of a 3-minute run); a leak of 2 KB per request (one
# prompt's tokens) would show as ~20 MiB per 10,000 requests, so it takes the long run to see one.
MAX_RSS_GROWTH_MIB = 64
RSS_PER_COMPILE_MIB = 96

KINDS = ("valid", "sampled", "invalid", "disconnect")
# Copies of each case in a client's deck, by kind: a deck of ~140 requests, half valid by count (most
# of the time, since an invalid request is answered in milliseconds).
DECK = {"valid": 2, "sampled": 2, "invalid": 1, "disconnect": 3}
PRIORITIES = (None, None, -1, 0, 1, 5, MAX_PRIORITY, -MAX_PRIORITY)  # None: the field left out

# The server: SMOLLM2_ARGS (8 sequences at once), scheduling by priority (lower first, preempting), and
# enough room queued that a full queue (503, by design) never answers: every client's largest request
# (n = MAX_N) at once, plus the prompt list that asks for one more than the whole room.
MAX_WAITING = 4096


def server_args(model: str | None = None) -> list[str]:
    """The server's flags: the embedded SmolLM2, or ``model`` (a directory with SmolLM2's tokenizer and
    chat template, such as ``benchmarks/make_dummy_model.py`` writes) with random weights."""
    chosen = [] if model is None else [f"--model={model}", "--load_format=dummy"]
    return [*chosen, *(a for a in SMOLLM2_ARGS if not a.startswith("--max_waiting=")), f"--max_waiting={MAX_WAITING}",
            "--scheduling_policy=priority"]


@dataclasses.dataclass
class Case:
    name: str
    kind: str  # one of KINDS
    path: str = "/v1/completions"
    body: dict | None = None
    raw: bytes | None = None  # sent as is, with these headers (malformed or exact-size bodies)
    headers: dict | None = None
    method: str = "POST"
    status: int = 200  # invalid: the expected status
    param: str | None = "-"  # invalid: the error's expected param ("-": not checked)
    words: str = ""  # invalid: words the error message contains
    stream: bool | None = None  # None: drawn per send
    stop_from: str | None = None  # valid: stop at the third word of this case's oracle text


def _bytes_of_size(body: dict, size: int) -> bytes:
    """``body`` as JSON of exactly ``size`` bytes, padded with a ``user`` field (which is ignored)."""
    data = json.dumps({**body, "user": ""}).encode()
    return json.dumps({**body, "user": "x" * (size - len(data))}).encode()


def _nested(depth: int) -> dict:
    schema = {"type": "string", "maxLength": 3}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"], "additionalProperties": False}
    return schema


def cases() -> list[Case]:
    """Every request the clients draw from."""
    C, CH = "/v1/completions", "/v1/chat/completions"
    g = dict(temperature=0)  # greedy
    ids_508 = [1000 + i % 700 for i in range(MAX_MODEL_LEN - 4)]
    person = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    flag = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
            "additionalProperties": False}
    mutual = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
    stops = ["".join(chr(0x4e00 + (i * 7 + j) % 500) for j in range(MAX_STOP_CHARS)) for i in range(MAX_STOP_STRINGS)]
    choices = [f"option {i}" for i in range(MAX_CHOICES)]
    at_regex = "a" * 10 + "{%d}" % (MAX_REGEX_SIZE - 9)  # regex_size: exactly MAX_REGEX_SIZE
    over_regex = "a" * 10 + "{%d}" % (MAX_REGEX_SIZE - 8)
    grammar_2500 = "start: " + " | ".join(f'"w{i}"' for i in range(2500))
    unsat_tool = [{"type": "function", "function": {"name": "f", "parameters": {"$ref": "#"}}}]
    mutual_tool = [{"type": "function", "function": {"name": "f", "parameters": mutual}}]

    valid = [
        *(Case(f"cmpl-greedy-{i}", "valid", C, {"prompt": p, "max_tokens": 16, **g}) for i, p in enumerate(PROMPTS)),
        Case("cmpl-token-ids", "valid", C, {"prompt": [504, 3458, 314, 4649, 30], "max_tokens": 12, **g}),
        Case("cmpl-two-prompts", "valid", C, {"prompt": PROMPTS[:2], "max_tokens": 10, **g}),
        Case("cmpl-n3-seed", "valid", C, {"prompt": PROMPTS[1], "max_tokens": 12, "temperature": 0.8, "n": 3,
                                          "seed": 7}),
        Case("cmpl-stop", "valid", C, {"prompt": PROMPTS[0], "max_tokens": 16, **g}, stop_from="cmpl-greedy-0"),
        Case("cmpl-logprobs", "valid", C, {"prompt": PROMPTS[2], "max_tokens": 8, "logprobs": 3, **g}),
        Case("cmpl-guided-choice", "valid", C, {"prompt": "Is the sky blue? Answer:", "max_tokens": 4,
                                                "guided_choice": ["yes", "no", "maybe"], **g}),
        Case("cmpl-guided-regex", "valid", C, {"prompt": "A year:", "max_tokens": 8,
                                               "structured_outputs": {"regex": "(19|20)[0-9]{2}"}, **g}),
        Case("cmpl-huge-enum", "valid", C, {"prompt": "Pick:", "max_tokens": 8,
                                            "guided_json": {"enum": [f"v{i}" for i in range(5000)]}, **g}),
        Case("cmpl-nested-60", "valid", C, {"prompt": "JSON:", "max_tokens": 12, "guided_json": _nested(60), **g}),
        *(Case(f"chat-greedy-{i}", "valid", CH, {"messages": m, "max_completion_tokens": 16, **g})
          for i, m in enumerate((CHAT, ASK))),
        Case("chat-logprobs", "valid", CH, {"messages": CHAT, "max_tokens": 6, "logprobs": True, "top_logprobs": 2,
                                            **g}),
        Case("chat-json-schema", "valid", CH, {"messages": [{"role": "user", "content": "Describe a person as JSON."}],
                                               "max_completion_tokens": 64, "response_format": person, **g}),
        Case("chat-guided-json", "valid", CH, {"messages": ASK, "max_completion_tokens": 16, "guided_json": flag, **g}),
        # one call: the random-weight model writes calls on and on, and a reply cut inside one is plain
        # content when not streamed (the chat renderer's rule), so it would differ from its stream
        Case("chat-tool-required", "valid", CH, {"messages": ASK, "max_completion_tokens": 64, "tools": TOOLS,
                                                 "tool_choice": "required", "parallel_tool_calls": False, **g}),
        Case("chat-tool-named", "valid", CH, {"messages": ASK, "max_completion_tokens": 32, "tools": [CLOCK],
                                              "tool_choice": {"type": "function", "function": {"name": "get_time"}},
                                              **g}),
        Case("chat-tool-pydantic", "valid", CH, {"messages": [{"role": "user", "content": "Add Ann from Oslo, who "
                                                               "has a cat."}], "max_completion_tokens": 64,
                                                 "tools": pydantic_tools()[:1], "tool_choice": "required",
                                                 "parallel_tool_calls": False, **g}),
        # every bound at its limit: accepted, and deterministic (greedy or seeded)
        Case("at-top-k", "valid", C, {"prompt": PROMPTS[3], "max_tokens": 8, "top_k": MAX_TOP_K, "temperature": 1.0,
                                      "seed": 3}),
        Case("at-logprobs", "valid", C, {"prompt": PROMPTS[0], "max_tokens": 4, "logprobs": MAX_LOGPROBS, **g}),
        Case("at-n", "valid", C, {"prompt": PROMPTS[2], "max_tokens": 1, "n": MAX_N, "temperature": 1.0, "seed": 11}),
        Case("at-seed-temperature", "valid", C, {"prompt": PROMPTS[1], "max_tokens": 6, "seed": MAX_SEED,
                                                 "temperature": MAX_TEMPERATURE}),
        Case("at-penalties-min-p", "valid", C, {"prompt": PROMPTS[3], "max_tokens": 10, "min_p": 1.0, "top_p": 1.0,
                                                "presence_penalty": MAX_PENALTY, "frequency_penalty": -MAX_PENALTY,
                                                "temperature": 1.0, "seed": 5}),
        Case("at-stop", "valid", C, {"prompt": PROMPTS[0], "max_tokens": 8, "stop": stops,
                                     "stop_token_ids": list(range(40000, 40000 + MAX_STOP_TOKEN_IDS)), **g}),
        Case("at-choices", "valid", C, {"prompt": "Pick an option:", "max_tokens": 8, "guided_choice": choices, **g}),
        Case("at-regex-size", "valid", C, {"prompt": "Say a:", "max_tokens": 6, "guided_regex": at_regex, **g}),
        Case("at-context", "valid", C, {"prompt": ids_508, "max_tokens": MAX_MODEL_LEN - len(ids_508), **g}),
        Case("at-body-size", "valid", C, raw=_bytes_of_size({"prompt": PROMPTS[1], "max_tokens": 8, **g},
                                                            MAX_REQUEST_BYTES), stream=False),
    ]
    sampled = [
        Case("sampled-cmpl", "sampled", C, {"prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0.9, "top_p": 0.95}),
        Case("sampled-chat", "sampled", CH, {"messages": CHAT, "max_tokens": 12, "temperature": 1.0, "n": 2}),
    ]

    def bad(name, body, status=400, param="-", words="", path=C, **kw):
        return Case(name, "invalid", path, body, status=status, param=param, words=words, **kw)

    hi = {"prompt": "hi", "max_tokens": 4}
    invalid = [
        # every bound just beyond its limit
        bad("over-top-k", {**hi, "top_k": MAX_TOP_K + 1}, param="top_k"),
        bad("over-logprobs", {**hi, "logprobs": MAX_LOGPROBS + 1}, param="logprobs"),
        bad("over-top-logprobs", {"messages": CHAT, "logprobs": True, "top_logprobs": MAX_LOGPROBS + 1}, path=CH,
            param="top_logprobs"),
        bad("over-n", {**hi, "n": MAX_N + 1}, param="n"),
        bad("over-stop-count", {**hi, "stop": [f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]}, param="stop"),
        bad("over-stop-length", {**hi, "stop": ["y" * (MAX_STOP_CHARS + 1)]}, param="stop"),
        bad("over-stop-token-ids", {**hi, "stop_token_ids": list(range(MAX_STOP_TOKEN_IDS + 1))},
            param="stop_token_ids"),
        bad("over-stop-token-id", {**hi, "stop_token_ids": [MAX_TOP_K + 1]}, param="stop_token_ids"),
        bad("over-choices", {**hi, "guided_choice": choices + ["one more"]}, param="guided_choice", words="1024"),
        bad("over-regex-size", {**hi, "guided_regex": over_regex}, param="guided_regex", words="too complex"),
        bad("over-temperature", {**hi, "temperature": MAX_TEMPERATURE + 0.5}, param="temperature"),
        bad("under-temperature", {**hi, "temperature": -0.1}, param="temperature"),
        bad("over-top-p", {**hi, "top_p": 1.01}, param="top_p"),
        bad("under-top-p", {**hi, "top_p": 0}, param="top_p"),
        bad("over-min-p", {**hi, "min_p": 1.01}, param="min_p"),
        bad("over-presence", {**hi, "presence_penalty": MAX_PENALTY + 0.01}, param="presence_penalty"),
        bad("under-frequency", {**hi, "frequency_penalty": -MAX_PENALTY - 0.01}, param="frequency_penalty"),
        bad("over-seed", {**hi, "seed": MAX_SEED + 1}, param="seed"),
        bad("under-seed", {**hi, "seed": -1}, param="seed"),
        bad("under-max-tokens", {**hi, "max_tokens": 0}, param="max_tokens"),
        bad("over-context", {"prompt": ids_508, "max_tokens": MAX_MODEL_LEN - len(ids_508) + 1}, param="max_tokens",
            words=str(MAX_MODEL_LEN)),
        bad("over-priority", {**hi, "priority": MAX_PRIORITY + 1}, param="priority"),
        bad("under-priority", {**hi, "priority": -MAX_PRIORITY - 1}, param="priority"),
        bad("over-token-id", {"prompt": [1, VOCAB]}, param="prompt"),
        bad("over-token-id-int32", {"prompt": [1, MAX_TOP_K + 1]}, param="prompt"),
        bad("over-sequences", {"prompt": ["ab"] * (8 + MAX_WAITING + 1), "max_tokens": 1}, param="prompt",
            words="sequences"),
        bad("over-body-size", None, status=413, raw=_bytes_of_size(hi, MAX_REQUEST_BYTES + 1)),
        # hostile constraints
        bad("schema-self-ref", {**hi, "guided_json": {"$ref": "#"}}, param="guided_json", words="admits no output"),
        bad("schema-mutual-defs", {**hi, "guided_json": mutual}, param="guided_json", words="admits no output"),
        bad("regex-nested-counts", {**hi, "guided_regex": "(a{1000}){1000}"}, param="guided_regex",
            words="too complex"),
        bad("grammar-2500-in-step", {"prompt": "Pick a word:", "max_tokens": 4, "temperature": 0,
                                     "guided_grammar": grammar_2500}, param=None, words="2000"),
        bad("schema-nested-95", {**hi, "guided_json": _nested(95)}, param="guided_json"),
        bad("body-nested-100", {**hi, "guided_json": _nested(100)}, param=None, words="recursion"),
        bad("regex-syntax", {**hi, "guided_regex": "[a-"}, param="guided_regex"),
        bad("grammar-undefined", {**hi, "guided_grammar": "start: nowhere"}, param="guided_grammar"),
        bad("schema-not", {"messages": CHAT, "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "strict": True, "schema": {"type": "object", "not": {}}}}}, path=CH, param="response_format"),
        bad("tool-self-ref-in-step", {"messages": CHAT, "max_tokens": 64, "tools": unsat_tool,
                                      "tool_choice": "required", "temperature": 0}, path=CH, words="constraint"),
        bad("tool-mutual-defs-in-step", {"messages": CHAT, "max_tokens": 64, "tools": mutual_tool,
                                         "tool_choice": "required", "temperature": 0}, path=CH, words="constraint"),
        bad("tool-unknown-name", {"messages": CHAT, "tools": TOOLS, "tool_choice": {"type": "function", "function": {
            "name": "nope"}}}, path=CH, param="tool_choice"),
        bad("two-constraints", {**hi, "guided_regex": "a", "guided_choice": ["b"]}, param="guided_choice"),
        # malformed bodies, wrong types, media types, models, routes
        bad("json-truncated", None, raw=b'{"prompt": "hi", ', words="not valid JSON"),
        bad("json-array", None, raw=b"[1, 2]", words="JSON object"),
        bad("json-empty", None, raw=b""),
        bad("json-not-utf8", None, raw=b'{"prompt": "\xff\xfe"}'),
        bad("json-nan", None, raw=b'{"prompt": "hi", "temperature": NaN}'),
        bad("type-prompt", {"prompt": 5}, param="prompt"),
        bad("type-max-tokens", {**hi, "max_tokens": "4"}, param="max_tokens"),
        bad("type-n", {**hi, "n": 1.5}, param="n"),
        bad("type-stream", {**hi, "stream": "yes"}, param="stream"),
        bad("type-messages", {"messages": "hi"}, path=CH, param="messages"),
        bad("type-tools", {"messages": CHAT, "tools": "x"}, path=CH, param="tools"),
        bad("missing-prompt", {"max_tokens": 4}, param="prompt", words="required"),
        bad("empty-messages", {"messages": []}, path=CH, param="messages"),
        bad("logit-bias-past-vocabulary", {**hi, "logit_bias": {"999999": 5}}, param="logit_bias"),
        bad("unsupported-suffix", {**hi, "suffix": "and so on"}, param="suffix"),
        bad("unsupported-best-of", {**hi, "n": 2, "best_of": 2}, param="best_of"),
        bad("content-type-text", None, status=415, raw=json.dumps(hi).encode(), headers={"Content-Type": "text/plain"}),
        bad("content-type-form", None, status=415, raw=b"prompt=hi",
            headers={"Content-Type": "application/x-www-form-urlencoded"}),
        bad("content-type-none", None, status=415, raw=json.dumps(hi).encode(), headers={}),
        bad("unknown-model", {**hi, "model": "gpt-9"}, status=404, param="model"),
        bad("unknown-route", None, status=404, path="/v1/nothing", method="GET"),
        bad("wrong-method", None, status=405, path=C, method="GET"),
    ]
    long = {"prompt": PROMPTS[2], "max_tokens": 256, "ignore_eos": True, "temperature": 0}
    disconnect = [
        Case("drop-stream-first", "disconnect", C, long, stream=True),
        Case("drop-stream-later", "disconnect", C, long, stream=True),
        Case("drop-stream-constrained", "disconnect", CH, {"messages": ASK, "max_completion_tokens": 64,
                                                           "tools": TOOLS, "tool_choice": "required",
                                                           "temperature": 0}, stream=True),
        Case("drop-waiting-non-streamed", "disconnect", C, long, stream=False),
    ]
    return valid + sampled + invalid + disconnect


# ------------------------------------------------------------------------------------ responses


def canonical(path: str, data: dict) -> dict:
    """What a non-streamed response says, in a form a stream reassembles to as well: per choice its
    text (chat: content, None as ""), finish reason, tool calls (name, arguments) and logprobs (the
    tokens, their logprobs, and each position's alternatives); the usage."""
    out = {"choices": [], "usage": _usage(data.get("usage"))}
    for c in sorted(data["choices"], key=lambda c: c["index"]):
        if path.endswith("/chat/completions"):
            m = c["message"]
            calls = [[t["function"]["name"], t["function"]["arguments"]] for t in m.get("tool_calls") or ()]
            lp = c.get("logprobs")
            logprobs = None if lp is None else _chat_logprobs(lp["content"])
            out["choices"].append({"text": m.get("content") or "", "finish_reason": c["finish_reason"],
                                   "tool_calls": calls, "logprobs": logprobs})
        else:
            lp = c.get("logprobs")
            logprobs = None if lp is None else {"tokens": lp["tokens"], "logprobs": lp["token_logprobs"],
                                                "top": [sorted(t) for t in lp["top_logprobs"]]}
            out["choices"].append({"text": c["text"], "finish_reason": c["finish_reason"], "tool_calls": [],
                                   "logprobs": logprobs})
    return out


def _usage(usage: dict | None) -> dict | None:
    return None if usage is None else {k: usage[k] for k in ("prompt_tokens", "completion_tokens")}


def _chat_logprobs(content: list[dict]) -> dict:
    return {"tokens": [e["token"] for e in content], "logprobs": [e["logprob"] for e in content],
            "top": [sorted(t["token"] for t in e["top_logprobs"]) for e in content]}


class Reassembly:
    """A stream's events reassembled into ``canonical``'s form."""

    def __init__(self, path: str):
        self.chat = path.endswith("/chat/completions")
        self.choices: dict[int, dict] = {}
        self.calls: dict[int, dict[int, list[str]]] = {}
        self.usage = None
        self.done = False
        self.error = None
        self.events = 0

    def line(self, line: str) -> None:
        if not line.startswith("data: "):
            return
        if line == "data: [DONE]":
            self.done = True
            return
        event = json.loads(line[6:])
        self.events += 1
        if "error" in event:
            self.error = event["error"]
            return
        if event.get("usage"):
            self.usage = _usage(event["usage"])
        for c in event["choices"]:
            choice = self.choices.setdefault(c["index"], {"text": "", "finish_reason": None, "tool_calls": [],
                                                          "logprobs": None})
            if c.get("finish_reason"):
                choice["finish_reason"] = c["finish_reason"]
            lp = c.get("logprobs")
            if self.chat:
                delta = c["delta"]
                choice["text"] += delta.get("content") or ""
                for t in delta.get("tool_calls") or ():
                    calls = self.calls.setdefault(c["index"], {})
                    if t.get("id") is not None:
                        calls[t["index"]] = [t["function"]["name"], t["function"]["arguments"]]
                    else:
                        calls[t["index"]][1] += t["function"]["arguments"]
                piece = None if lp is None else _chat_logprobs(lp["content"])
            else:
                choice["text"] += c["text"]
                piece = None if lp is None else {"tokens": lp["tokens"], "logprobs": lp["token_logprobs"],
                                                 "top": [sorted(t) for t in lp["top_logprobs"]]}
            if piece is not None:
                if choice["logprobs"] is None:
                    choice["logprobs"] = {"tokens": [], "logprobs": [], "top": []}
                for k in piece:
                    choice["logprobs"][k] += piece[k]

    def result(self) -> dict:
        for i, calls in self.calls.items():
            self.choices[i]["tool_calls"] = [calls[k] for k in sorted(calls)]
        return {"choices": [self.choices[i] for i in sorted(self.choices)], "usage": self.usage}


LOGPROB_TOLERANCE = 1e-3  # the same tokens' logprobs, computed in batches of other shapes


def differences(got: dict, want: dict) -> list[str]:
    """How ``got`` differs from the oracle ``want`` (both ``canonical``), as short phrases; [] if equal.
    Usage is compared only where ``got`` has it (a stream without include_usage has none)."""
    out = []
    if got["usage"] is not None and got["usage"] != want["usage"]:
        out.append(f"usage {got['usage']} != {want['usage']}")
    if len(got["choices"]) != len(want["choices"]):
        return out + [f"{len(got['choices'])} choices != {len(want['choices'])}"]
    for i, (g, w) in enumerate(zip(got["choices"], want["choices"])):
        for key in ("text", "finish_reason", "tool_calls"):
            if g[key] != w[key]:
                out.append(f"choice {i} {key} {_short(g[key])} != {_short(w[key])}")
        gl, wl = g["logprobs"], w["logprobs"]
        if (gl is None) != (wl is None):
            out.append(f"choice {i} logprobs {'missing' if gl is None else 'unexpected'}")
        elif gl is not None:
            if gl["tokens"] != wl["tokens"] or gl["top"] != wl["top"]:
                out.append(f"choice {i} logprob tokens differ")
            elif any(abs(a - b) > LOGPROB_TOLERANCE for a, b in zip(gl["logprobs"], wl["logprobs"])):
                out.append(f"choice {i} logprobs differ by more than {LOGPROB_TOLERANCE}")
    return out


def _short(value, limit: int = 80) -> str:
    text = json.dumps(value)
    return text if len(text) <= limit else text[:limit] + "..."


def error_problems(r: httpx.Response, case: Case) -> list[str]:
    """How an invalid request's answer misses its expectation: the status, OpenAI's error shape
    ``{"error": {"message", "type", "param", "code"}}``, the param, the words."""
    if r.status_code != case.status:
        return [f"status {r.status_code} != {case.status}: {r.text[:200]}"]
    try:
        body = r.json()
        err = body["error"]
        assert set(body) == {"error"} and set(err) == {"message", "type", "param", "code"}
        assert isinstance(err["message"], str) and err["message"]
    except (ValueError, KeyError, TypeError, AssertionError):
        return [f"not OpenAI's error shape: {r.text[:200]}"]
    out = []
    if case.param != "-" and err["param"] != case.param:
        out.append(f"param {err['param']!r} != {case.param!r}")
    if case.words.lower() not in err["message"].lower():
        out.append(f"message lacks {case.words!r}: {err['message'][:200]}")
    return out


# --------------------------------------------------------------------------------- the clients


class Tally:
    """Every request's outcome, by case; the problems found (the first few of each case in full)."""

    def __init__(self):
        self.sent = collections.Counter()
        self.statuses: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.checked = collections.Counter()  # valid: compared with the oracle and equal
        self.streamed = collections.Counter()
        self.outcomes: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)  # disconnects
        self.problems: list[str] = []
        self.problem_counts = collections.Counter()
        self.seconds: dict[str, list[float]] = collections.defaultdict(list)

    def problem(self, case: Case, what: str) -> None:
        self.problem_counts[case.name] += 1
        if self.problem_counts[case.name] <= 3:
            self.problems.append(f"{case.name}: {what}")


class Soak:
    def __init__(self, url: str, all_cases: list[Case], seed: int):
        self.url, self.cases, self.seed = url, all_cases, seed
        self.oracle: dict[str, dict] = {}
        self.oracle_seconds: dict[str, float] = {}
        self.oracle_rss: dict[str, float] = {}  # the engine core's RSS (MiB) after each oracle request
        self.engine_pid: int | None = None
        self.tally = Tally()
        self.by_kind = {k: [c for c in all_cases if c.kind == k] for k in KINDS}

    # --------------------------------------------------------------------------- the oracle

    def compute_oracle(self) -> None:
        """Each valid case sent alone, not streamed, in order: what it answers under load too."""
        with httpx.Client(base_url=self.url, timeout=VALID_TIMEOUT) as http:
            for case in self.by_kind["valid"]:
                if case.stop_from is not None:
                    words = self.oracle[case.stop_from]["choices"][0]["text"].split()
                    case.body = {**case.body, "stop": [" " + words[2]]}
                t0 = time.monotonic()
                r = self._send_sync(http, case)
                self.oracle_seconds[case.name] = round(time.monotonic() - t0, 2)
                if self.engine_pid is not None:
                    self.oracle_rss[case.name] = round((_rss_kib(self.engine_pid) or 0) / 1024, 1)
                if r.status_code != 200:
                    raise RuntimeError(f"oracle: {case.name} answered {r.status_code}: {r.text[:500]}")
                self.oracle[case.name] = canonical(case.path, r.json())
                if case.stop_from is not None and self.oracle[case.name]["choices"][0]["finish_reason"] != "stop":
                    raise RuntimeError(f"oracle: {case.name} did not stop at {case.body['stop']}")

    def check_invalid_alone(self) -> None:
        """Each invalid case sent alone once, before the load: a wrong expectation shows here as such
        (its problems are prefixed "alone"), not as something the load did."""
        with httpx.Client(base_url=self.url, timeout=VALID_TIMEOUT) as http:
            for case in self.by_kind["invalid"]:
                for p in error_problems(self._send_sync(http, case), case):
                    self.tally.problems.append(f"{case.name}: alone: {p}")

    def _send_sync(self, http: httpx.Client, case: Case) -> httpx.Response:
        if case.raw is not None:
            return http.request(case.method, case.path, content=case.raw,
                                headers={"Content-Type": "application/json"} if case.headers is None else case.headers)
        if case.body is None:
            return http.request(case.method, case.path)
        return http.request(case.method, case.path, json=case.body)

    # --------------------------------------------------------------------------- under load

    def draws(self, i: int, clients: int):
        """Client ``i``'s cases, endlessly: first its share of one shuffled deck (``DECK`` copies of
        each case; the clients start at evenly spaced points of it, so together they send every case
        early), then decks of its own order."""
        deck = [c for c in self.cases for _ in range(DECK[c.kind])]
        random.Random(self.seed).shuffle(deck)
        start = i * len(deck) // clients
        yield from deck[start:] + deck[:start]
        rng = random.Random(self.seed * 1000 + i)
        while True:
            rng.shuffle(deck)
            yield from deck

    async def client(self, i: int, clients: int, deadline: float) -> None:
        rng = random.Random(self.seed * 1000 + i + 1)
        limits = httpx.Limits(max_connections=4, max_keepalive_connections=2)
        async with httpx.AsyncClient(base_url=self.url, timeout=VALID_TIMEOUT, limits=limits) as http:
            for case in self.draws(i, clients):
                if time.monotonic() >= deadline:
                    return
                self.tally.sent[case.name] += 1
                t0 = time.monotonic()
                try:
                    await getattr(self, case.kind)(http, case, rng)
                except Exception as e:  # noqa: BLE001 - a lost request is a finding, not a crash of the harness
                    self.tally.statuses[case.name]["exception"] += 1
                    self.tally.problem(case, f"{type(e).__name__}: {str(e)[:200]}")
                self.tally.seconds[case.name].append(time.monotonic() - t0)

    def _request(self, case: Case, rng: random.Random, stream: bool) -> dict:
        """httpx keyword arguments for one send of ``case``: a random priority, include_usage at random."""
        if case.raw is not None:
            return dict(content=case.raw,
                        headers={"Content-Type": "application/json"} if case.headers is None else case.headers)
        if case.body is None:
            return {}
        body = copy.copy(case.body)
        if case.kind != "invalid":
            priority = rng.choice(PRIORITIES)
            if priority is not None:
                body["priority"] = priority
            if stream:
                body["stream"] = True
                if rng.random() < 0.5:
                    body["stream_options"] = {"include_usage": True}
        return dict(json=body)

    async def valid(self, http: httpx.AsyncClient, case: Case, rng: random.Random) -> None:
        got = await self._complete(http, case, rng)
        if got is not None:
            problems = differences(got, self.oracle[case.name])
            if problems:
                self.tally.problem(case, "changed: " + "; ".join(problems))
            else:
                self.tally.checked[case.name] += 1

    async def sampled(self, http: httpx.AsyncClient, case: Case, rng: random.Random) -> None:
        got = await self._complete(http, case, rng)
        if got is None:
            return
        n = case.body.get("n", 1)
        if len(got["choices"]) != n or any(c["finish_reason"] not in ("stop", "length") for c in got["choices"]):
            self.tally.problem(case, f"bad shape: {_short(got, 300)}")
        elif got["usage"] is not None and got["usage"]["completion_tokens"] > n * case.body["max_tokens"]:
            self.tally.problem(case, f"more tokens than max_tokens: {got['usage']}")
        else:
            self.tally.checked[case.name] += 1

    async def _complete(self, http, case: Case, rng: random.Random) -> dict | None:
        """The response, reassembled if streamed; None (a problem recorded) if it was not a 200."""
        stream = case.stream if case.stream is not None else rng.random() < 0.5
        kw = self._request(case, rng, stream)
        if not stream:
            r = await http.request(case.method, case.path, **kw)
            self.tally.statuses[case.name][r.status_code] += 1
            if r.status_code != 200:
                self.tally.problem(case, f"status {r.status_code}: {r.text[:300]}")
                return None
            return canonical(case.path, r.json())
        self.tally.streamed[case.name] += 1
        async with http.stream(case.method, case.path, **kw) as r:
            self.tally.statuses[case.name][r.status_code] += 1
            if r.status_code != 200:
                self.tally.problem(case, f"status {r.status_code}: {(await r.aread())[:300]!r}")
                return None
            events = Reassembly(case.path)
            async for line in r.aiter_lines():
                events.line(line)
        if events.error is not None or not events.done:
            self.tally.problem(case, f"stream ended with {events.error or 'no [DONE]'}")
            return None
        return events.result()

    async def invalid(self, http: httpx.AsyncClient, case: Case, rng: random.Random) -> None:
        r = await http.request(case.method, case.path, **self._request(case, rng, False))
        self.tally.statuses[case.name][r.status_code] += 1
        for p in error_problems(r, case):
            self.tally.problem(case, p)

    async def disconnect(self, http: httpx.AsyncClient, case: Case, rng: random.Random) -> None:
        outcome = self.tally.outcomes[case.name]
        if not case.stream:
            try:
                r = await http.request(case.method, case.path, timeout=rng.uniform(0.2, 3.0),
                                       **self._request(case, rng, False))
            except httpx.TimeoutException:
                outcome["gave up"] += 1
                return
            self.tally.statuses[case.name][r.status_code] += 1
            outcome["answered first"] += 1
            if r.status_code != 200:
                self.tally.problem(case, f"status {r.status_code}: {r.text[:300]}")
            return
        events = 1 if case.name == "drop-stream-first" else rng.randint(2, 6)
        async with http.stream(case.method, case.path, **self._request(case, rng, True)) as r:
            self.tally.statuses[case.name][r.status_code] += 1
            if r.status_code != 200:
                self.tally.problem(case, f"status {r.status_code}: {(await r.aread())[:300]!r}")
                return
            stream = Reassembly(case.path)
            async for line in r.aiter_lines():
                stream.line(line)
                if stream.error is not None:
                    self.tally.problem(case, f"stream error {stream.error}")
                    return
                if stream.events >= events or stream.done:
                    break
        outcome["finished first" if stream.done else "hung up"] += 1


# -------------------------------------------------------------------------- the health poller


def _rss_kib(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            return int(re.search(r"^VmRSS:\s+(\d+) kB", f.read(), re.M).group(1))
    except (OSError, AttributeError):
        return None


def _poll(url: str, pids: dict[str, int], stop, conn) -> None:
    """In its own process, so the clients' work never delays it: /health every HEALTH_EVERY seconds
    as (seconds since start, status, latency), and once a second each pid's RSS (KiB) and the steps
    compiled so far."""
    health, rss = [], []
    t0 = next_rss = time.monotonic()
    with httpx.Client(timeout=30) as http:
        while not stop.is_set():
            start = time.monotonic()
            try:
                status = http.get(f"{url}/health").status_code
            except httpx.HTTPError as e:
                status = type(e).__name__
            end = time.monotonic()
            health.append((start - t0, status, end - start))
            if end >= next_rss:
                sample = {name: _rss_kib(pid) for name, pid in pids.items()}
                try:
                    text = http.get(f"{url}/metrics").text
                    sample["compilations"] = float(re.search(r"^jaxinfer_compilations_total (\S+)$", text, re.M)[1])
                except (httpx.HTTPError, TypeError):
                    sample["compilations"] = None
                rss.append((end - t0, sample))
                next_rss = end + 1.0
            time.sleep(max(0.0, HEALTH_EVERY - (time.monotonic() - end)))
    conn.send((health, rss))
    conn.close()


def engine_core_pid(server: Server) -> int:
    """The engine core process of ``server``: the server's child that multiprocessing spawned."""
    match = re.search(r"engine core process (\d+)", server.tail(1_000_000))
    if match:
        return int(match.group(1))
    for task in os.listdir(f"/proc/{server.proc.pid}/task"):
        with open(f"/proc/{server.proc.pid}/task/{task}/children") as f:
            for pid in f.read().split():
                with open(f"/proc/{pid}/cmdline", "rb") as c:
                    if b"spawn_main" in c.read():
                        return int(pid)
    raise RuntimeError("the server's engine core process was not found")


def metrics(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {m[0]: float(m[1]) for m in re.findall(r"^(jaxinfer_\w+) (\S+)$", text, re.M)}


def wait_idle(url: str, timeout: float) -> tuple[dict[str, float], float]:
    """The metrics once no page is held and nothing runs or waits (or at the timeout), and the seconds it took."""
    t0 = time.monotonic()
    while True:
        m = metrics(url)
        if (m["jaxinfer_kv_cache_pages_used"] == m["jaxinfer_num_requests_running"] ==
                m["jaxinfer_num_requests_waiting"] == m["jaxinfer_num_requests_preempted"] == 0):
            return m, time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            return m, time.monotonic() - t0
        time.sleep(0.25)


def pids_of(rss) -> list[str]:
    return [k for k in (rss[0][1] if rss else {}) if k != "compilations"]


def _percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


# ---------------------------------------------------------------------------------------- run


def run(minutes: float, clients: int, out: str | None = None, seed: int = 0, url: str | None = None,
        break_oracle: str | None = None, model: str | None = None, log=print) -> dict:
    """Start a server (unless ``url`` names a running one, whose engine core's memory is then not
    watched), compute the oracle, run ``clients`` clients for ``minutes``, and return the summary
    (also written to ``out``); its ``problems`` list is empty if every promise held.
    ``break_oracle``: change that case's oracle text before the load (to see a changed output caught);
    ``model``: as ``server_args``."""
    all_cases, flags = cases(), server_args(model)
    started = time.monotonic()
    load_start = os.getloadavg()
    server = None
    if url is None:
        server = Server(flags)
        url = server.url
    try:
        log(f"server up at {url} in {time.monotonic() - started:.0f}s; computing the oracle")
        soak = Soak(url, all_cases, seed)
        pids = {} if server is None else {"server": server.proc.pid, "engine_core": engine_core_pid(server)}
        soak.engine_pid = pids.get("engine_core")
        t0 = time.monotonic()
        soak.compute_oracle()
        oracle_seconds = time.monotonic() - t0
        soak.check_invalid_alone()
        if break_oracle is not None:
            soak.oracle[break_oracle]["choices"][0]["text"] += "!"
        log(f"oracle: {len(soak.oracle)} valid cases alone in {oracle_seconds:.0f}s; "
            f"{clients} clients for {minutes:g} min")
        before = metrics(url)
        ctx = multiprocessing.get_context("spawn")
        stop, (receive, send) = ctx.Event(), ctx.Pipe(duplex=False)
        poller = ctx.Process(target=_poll, args=(url, pids, stop, send), daemon=True)
        poller.start()
        t0, load_wall = time.monotonic(), time.time()

        async def load():
            deadline = time.monotonic() + minutes * 60
            await asyncio.gather(*(soak.client(i, clients, deadline) for i in range(clients)))

        asyncio.run(load())
        load_seconds = time.monotonic() - t0
        idle, idle_seconds = wait_idle(url, IDLE_TIMEOUT)
        stop.set()
        health, rss = receive.recv()
        poller.join(30)
        alive = server is None or server.proc.poll() is None
        log_text = server.tail(100_000_000) if server is not None else ""
        if out and log_text:
            with open(out + ".server.log", "w") as f:
                f.write(log_text)
    finally:
        if server is not None:
            server.stop()
    summary = summarize(soak, minutes=minutes, clients=clients, seed=seed, load_seconds=load_seconds,
                        oracle_seconds=oracle_seconds, before=before, idle=idle, idle_seconds=idle_seconds,
                        health=health, rss=rss, alive=alive, log_text=log_text,
                        loadavg=(load_start, os.getloadavg()), external=server is None, load_wall=load_wall,
                        flags=flags)
    if out:
        with open(out, "w") as f:
            json.dump(summary, f, indent=1)
    log(table(summary))
    return summary


def summarize(soak: Soak, *, minutes, clients, seed, load_seconds, oracle_seconds, before, idle, idle_seconds,
              health, rss, alive, log_text, loadavg, external, load_wall, flags) -> dict:
    t = soak.tally
    problems = list(t.problems)
    by_case = {}
    for case in soak.cases:
        statuses = t.statuses.get(case.name, {})
        by_case[case.name] = {"kind": case.kind, "sent": t.sent[case.name], "checked": t.checked[case.name],
                              "streamed": t.streamed[case.name], "problems": t.problem_counts[case.name],
                              "statuses": {str(k): v for k, v in sorted(statuses.items(), key=str)},
                              **({"outcomes": dict(t.outcomes[case.name])} if case.kind == "disconnect" else {}),
                              "p50_s": round(statistics.median(t.seconds[case.name]), 3)
                              if t.seconds[case.name] else None}
    by_kind = {}
    for kind in KINDS:
        rows = [v for v in by_case.values() if v["kind"] == kind]
        statuses = collections.Counter()
        for v in rows:
            statuses.update(v["statuses"])
        by_kind[kind] = {"sent": sum(v["sent"] for v in rows), "checked": sum(v["checked"] for v in rows),
                         "streamed": sum(v["streamed"] for v in rows), "problems": sum(v["problems"] for v in rows),
                         "statuses": dict(sorted(statuses.items()))}
    all_statuses = collections.Counter()
    for v in by_case.values():
        all_statuses.update(v["statuses"])
    count_5xx = sum(n for s, n in all_statuses.items() if s.isdigit() and int(s) >= 500)
    if count_5xx:
        problems.append(f"{count_5xx} responses were 5xx")
    for kind in ("valid", "sampled"):
        lost = by_kind[kind]["sent"] - by_kind[kind]["checked"]
        if lost:
            problems.append(f"{lost} {kind} requests lost or changed")
    unsent = [name for name, v in by_case.items() if not v["sent"]]

    latencies = [lat for _, status, lat in health]
    bad_health = [(round(at, 2), status) for at, status, _ in health if status != 200]
    health_summary = {"polls": len(health), "non_200": len(bad_health),
                      "p50_ms": round(_percentile(latencies, 0.5) * 1000, 1),
                      "p99_ms": round(_percentile(latencies, 0.99) * 1000, 1),
                      "max_ms": round(max(latencies, default=float("nan")) * 1000, 1)}
    if bad_health:
        problems.append(f"/health answered other than 200 {len(bad_health)} times, first {bad_health[:5]}")
    if not latencies or _percentile(latencies, 0.99) >= HEALTH_P99:
        problems.append(f"/health p99 {health_summary['p99_ms']} ms is not below {HEALTH_P99 * 1000:.0f} ms")

    idle_summary = {"seconds_to_idle": round(idle_seconds, 1),
                    "pages_used": idle["jaxinfer_kv_cache_pages_used"],
                    "running": idle["jaxinfer_num_requests_running"],
                    "waiting": idle["jaxinfer_num_requests_waiting"],
                    "preempted": idle["jaxinfer_num_requests_preempted"]}
    if any(idle_summary[k] for k in ("pages_used", "running", "waiting", "preempted")):
        problems.append(f"not idle {IDLE_TIMEOUT:.0f}s after the load: {idle_summary}")

    rss_summary = {}
    half = [sample for at, sample in rss if at >= load_seconds / 2]
    for name in pids_of(rss):
        series = [(at, kib / 1024) for at, sample in rss if (kib := sample.get(name)) is not None]
        if not series:
            problems.append(f"the {name}'s RSS could not be read")
            continue
        mid = next((mib for at, mib in series if at >= load_seconds / 2), series[-1][1])
        compiled = ((half[-1]["compilations"] or 0) - (half[0]["compilations"] or 0)) if half else 0
        bound = MAX_RSS_GROWTH_MIB + (RSS_PER_COMPILE_MIB * compiled if name == "engine_core" else 0)
        rss_summary[name] = {"start_mib": round(series[0][1], 1), "mid_mib": round(mid, 1),
                             "end_mib": round(series[-1][1], 1), "max_mib": round(max(m for _, m in series), 1),
                             "second_half_growth_mib": round(series[-1][1] - mid, 1), "bound_mib": bound}
        if name == "engine_core":
            rss_summary[name]["compiled_in_second_half"] = compiled
        if series[-1][1] - mid > bound:
            problems.append(f"the {name}'s RSS grew {series[-1][1] - mid:.0f} MiB over the second half of the "
                            f"load (bound {bound} MiB)")
    if not rss_summary and not external:
        problems.append("no RSS samples")
    if not alive:
        problems.append("the server exited")
    tracebacks = log_text.count("Traceback")
    if tracebacks:
        problems.append(f"the server logged {tracebacks} tracebacks")

    compiles = []  # (seconds into the load, what) of each step compiled while the clients ran
    for stamp, what in re.findall(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) INFO engine-core: (compiling .*)$", log_text,
                                  re.M):
        at = time.mktime(time.strptime(stamp[:19], "%Y-%m-%d %H:%M:%S")) + int(stamp[20:]) / 1000 - load_wall
        if 0 <= at <= load_seconds:
            compiles.append((round(at, 1), what))
    generated = idle["jaxinfer_generation_tokens_total"] - before["jaxinfer_generation_tokens_total"]
    return {
        "config": {"minutes": minutes, "clients": clients, "seed": seed, "server_args": flags,
                   "deck": DECK, "cases": len(soak.cases)},
        "seconds": {"oracle": round(oracle_seconds, 1), "load": round(load_seconds, 1),
                    "oracle_by_case": soak.oracle_seconds},
        "oracle_rss_mib": soak.oracle_rss,
        "loadavg": {"start": [round(x, 2) for x in loadavg[0]], "end": [round(x, 2) for x in loadavg[1]]},
        "by_kind": by_kind,
        "statuses": dict(sorted(all_statuses.items())),
        "count_5xx": count_5xx,
        "health": health_summary,
        "idle": idle_summary,
        "rss": rss_summary,
        "engine": {"generated_tokens": generated,
                   "preemptions": idle["jaxinfer_preemptions_total"] - before["jaxinfer_preemptions_total"],
                   "compilations": idle["jaxinfer_compilations_total"] - before["jaxinfer_compilations_total"]},
        "server_log_tracebacks": tracebacks,
        "compiles_under_load": compiles,
        "rss_series": [(round(at, 1), {k: v if v is None or k == "compilations" else round(v / 1024, 1)
                                       for k, v in sample.items()}) for at, sample in rss],
        "unsent": unsent,
        "oracle": soak.oracle,
        "problems": problems,
        "by_case": by_case,
    }


def table(s: dict) -> str:
    lines = [f"{'kind':<12}{'sent':>8}{'checked':>9}{'streamed':>9}{'problems':>9}  statuses"]
    for kind, v in s["by_kind"].items():
        lines.append(f"{kind:<12}{v['sent']:>8}{v['checked']:>9}{v['streamed']:>9}{v['problems']:>9}  "
                     f"{' '.join(f'{k}:{n}' for k, n in v['statuses'].items())}")
    lines.append("")
    lines.append(f"{'case':<28}{'kind':<11}{'sent':>6}{'checked':>8}{'p50 s':>7}  statuses / outcomes")
    for name, v in s["by_case"].items():
        extra = " ".join(f"{k}:{n}" for k, n in v["statuses"].items())
        if "outcomes" in v:
            extra += "  " + " ".join(f"{k}:{n}" for k, n in v["outcomes"].items())
        lines.append(f"{name:<28}{v['kind']:<11}{v['sent']:>6}{v['checked']:>8}"
                     f"{'' if v['p50_s'] is None else v['p50_s']:>7}  {extra}")
    h, i = s["health"], s["idle"]
    lines += ["", f"5xx: {s['count_5xx']}   /health: {h['polls']} polls, p50 {h['p50_ms']} ms, p99 {h['p99_ms']} ms, "
                  f"max {h['max_ms']} ms, non-200 {h['non_200']}",
              f"idle after {i['seconds_to_idle']} s: pages {i['pages_used']:g}, running {i['running']:g}, "
              f"waiting {i['waiting']:g}, preempted {i['preempted']:g}",
              "RSS MiB: " + "; ".join(f"{k} start {v['start_mib']} mid {v['mid_mib']} end {v['end_mib']} max "
                                      f"{v['max_mib']} (second half +{v['second_half_growth_mib']}, bound "
                                      f"{v['bound_mib']})" for k, v in s["rss"].items()),
              f"engine: {s['engine']}   load average start {s['loadavg']['start']} end {s['loadavg']['end']}",
              f"cases never sent under load: {', '.join(s['unsent']) or 'none'}",
              f"problems: {len(s['problems'])}"]
    lines += [f"  {p}" for p in s["problems"][:40]]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--out", default=None, help="where the JSON summary goes")
    parser.add_argument("--seed", type=int, default=0, help="the clients' random choices")
    parser.add_argument("--url", default=None, help="a running server (started with soak's server_args()) "
                        "instead of starting one; its memory is not watched")
    parser.add_argument("--break_oracle", default=None, help="a valid case whose oracle text is changed, to "
                        "see the check catch it")
    parser.add_argument("--model", default=None, help="a model directory with SmolLM2's tokenizer, served with "
                        "random weights (default: the embedded SmolLM2)")
    args = parser.parse_args(argv)
    summary = run(args.minutes, args.clients, args.out, args.seed, args.url, args.break_oracle, args.model)
    return 1 if summary["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
