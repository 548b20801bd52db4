"""Schemathesis against the live server's /openapi.json: requests drawn from the description, valid
ones and (for bodies) invalid ones, each response checked against it: no 5xx, only documented
statuses, content types, headers and bodies, every invalid request refused and every valid one
accepted.

A tiny random model with SmolLM2's tokenizer and chat template serves (tests/fuzz_openapi.py's, with its
flags), so chat, constraints and text prompts all run, and a step costs milliseconds. What the
description cannot say is told to Schemathesis by tests/openapi_hooks.py; here, also that prompts stay
within the context: ``max_tokens`` and ``n`` are cut to what this small server holds. The default-budget
run of Schemathesis's own command is ``python tests/fuzz_openapi.py``.
"""


import httpx
import pytest

from fuzz_openapi import FUZZ_ARGS
from test_server import Server, wait_until_idle

schemathesis = pytest.importorskip("schemathesis")
hypothesis = pytest.importorskip("hypothesis")
import openapi_hooks  # noqa: E402,F401  (registers its hooks with Schemathesis)
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import (content_type_conformance, negative_data_rejection,  # noqa: E402
                                               positive_data_acceptance, response_headers_conformance,
                                               response_schema_conformance, status_code_conformance)

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_headers_conformance,
          response_schema_conformance, negative_data_rejection, positive_data_acceptance]
EXAMPLES = {"positive": 10, "negative": 25}  # per route and mode
MAX_TOKENS, MAX_N = 1, 4  # generation is not what is fuzzed: one token each, from the prompt's step
# Left out of valid requests: the engine compiles a step with logit terms anew for each request (seconds
# each); min_tokens must also stay within the clamped max_tokens.
LOGIT_TERMS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens")


@pytest.fixture(scope="module")
def server(tiny_chat_model):
    srv = Server([f"--model={tiny_chat_model}", *FUZZ_ARGS])
    yield srv
    srv.stop()


@pytest.mark.parametrize("mode", list(EXAMPLES))
def test_fuzz_every_route(server, mode):
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} == {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health",
                                              "/metrics", "/version", "/tokenize", "/detokenize", "/v1/embeddings",
                                              "/v1/responses"}
    statuses = []
    for op in operations:
        if mode == "negative" and op.method.upper() == "GET":
            continue  # nothing to get wrong: the GET routes take no parameters

        @hypothesis.settings(max_examples=EXAMPLES[mode], deadline=None, database=None, derandomize=True,
                             phases=[hypothesis.Phase.generate], suppress_health_check=list(hypothesis.HealthCheck))
        @hypothesis.given(case=op.as_strategy(schemathesis.GenerationMode(mode)))
        def fuzz(case):
            if isinstance(case.body, dict) and mode == "positive":  # clamping could make a negative case valid
                tokens = {"/v1/completions": "max_tokens", "/v1/responses": "max_output_tokens"}.get(
                    op.path, "max_completion_tokens")
                value = case.body.get(tokens)  # null or missing: the rest of the context
                if value is None or type(value) is int and value > MAX_TOKENS:
                    case.body[tokens] = MAX_TOKENS
                if type(case.body.get("n")) is int and case.body["n"] > MAX_N:
                    case.body["n"] = MAX_N
                for field in LOGIT_TERMS:
                    if case.body.get(field) is not None:
                        case.body[field] = None
            response = case.call_and_validate(base_url=server.url, checks=CHECKS, timeout=300)
            statuses.append((op.path, response.status_code))

        fuzz()
    if mode == "negative":  # the checks ran on refusals
        assert {s // 100 for _, s in statuses} == {4}, statuses
    else:  # every schema-valid request was served (positive_data_acceptance), text generated on both routes
        assert {p for p, s in statuses if s == 200} >= {"/v1/completions", "/v1/chat/completions", "/v1/responses"}, \
            statuses


def test_healthy_and_idle_after_fuzzing(server):
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    wait_until_idle(server.url)
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "A year:", "max_tokens": 4,
                                                         "guided_regex": "(19|20)[0-9]{2}"}, timeout=60)
    assert r.status_code == 200 and len(r.json()["choices"][0]["text"]) == 4
