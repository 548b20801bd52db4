"""The soak harness (``tests/soak.py``) for half a minute at 12 clients, on a tiny random model with
SmolLM2's tokenizer (steps of milliseconds, so many requests in little time): every valid response equal to the
same request's answer alone, no 5xx, every invalid request its own 4xx in OpenAI's error shape,
/health's p99 under 100 ms throughout, the server idle afterwards with no page held, and the engine
core's memory flat over the second half. ``python tests/soak.py --minutes 10 --clients 32`` is the
long run, on the embedded model. The checker itself is tested first, on responses made up here."""

import json

import pytest

import soak

MINUTES, CLIENTS = 0.5, 12


def completion(text=" Paris is", finish="length", logprobs=True):
    lp = {"tokens": [" Paris", " is"], "token_logprobs": [-0.5, -1.25], "text_offset": [0, 6],
          "top_logprobs": [{" Paris": -0.5, " Lyon": -2.0}, {" is": -1.25, " was": -1.5}]}
    return {"choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": lp if logprobs else None}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}}


def chat_call(arguments='{"tz": "UTC"}'):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": arguments}}
    return {"choices": [{"index": 0, "message": {"role": "assistant", "content": None, "tool_calls": [call]},
                         "logprobs": None, "finish_reason": "tool_calls"}],
            "usage": {"prompt_tokens": 50, "completion_tokens": 9, "total_tokens": 59}}


def sse(events) -> list[str]:
    return [f"data: {json.dumps(e)}" for e in events] + ["data: [DONE]"]


def test_the_checker_catches_a_changed_output():
    want = soak.canonical("/v1/completions", completion())
    assert soak.differences(soak.canonical("/v1/completions", completion()), want) == []
    for changed in (completion(text=" Paris was"), completion(finish="stop"), completion(logprobs=False)):
        assert soak.differences(soak.canonical("/v1/completions", changed), want)
    other = completion()
    other["choices"][0]["logprobs"]["token_logprobs"][1] = -1.0
    assert soak.differences(soak.canonical("/v1/completions", other), want)
    other = completion()
    other["usage"]["completion_tokens"] = 3
    assert soak.differences(soak.canonical("/v1/completions", other), want)
    want = soak.canonical("/v1/chat/completions", chat_call())
    assert soak.differences(soak.canonical("/v1/chat/completions", chat_call('{"tz": "CET"}')), want)


def test_a_stream_reassembles_to_the_response():
    """The pieces a stream sends (text and logprobs per event; a tool call's opening delta, then its
    arguments) reassemble to what the response says, and a changed piece is caught."""
    events = [{"choices": [{"index": 0, "text": " Paris", "finish_reason": None, "logprobs": {
                  "tokens": [" Paris"], "token_logprobs": [-0.5], "text_offset": [0],
                  "top_logprobs": [{" Lyon": -2.0, " Paris": -0.5}]}}], "usage": None},
              {"choices": [{"index": 0, "text": " is", "finish_reason": "length", "logprobs": {
                  "tokens": [" is"], "token_logprobs": [-1.25], "text_offset": [6],
                  "top_logprobs": [{" is": -1.25, " was": -1.5}]}}], "usage": None},
              {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}}]
    want = soak.canonical("/v1/completions", completion())
    stream = soak.Reassembly("/v1/completions")
    for line in sse(events):
        stream.line(line)
    assert stream.done and soak.differences(stream.result(), want) == []
    events[1]["choices"][0]["text"] = " was"
    stream = soak.Reassembly("/v1/completions")
    for line in sse(events):
        stream.line(line)
    assert soak.differences(stream.result(), want)

    chunks = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]},
              {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "call_9", "type": "function",
                                                                  "function": {"name": "get_time", "arguments": ""}}]},
                            "finish_reason": None}]},
              {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": '{"tz": '}}]},
                            "finish_reason": None}]},
              {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": '"UTC"}'}}]},
                            "finish_reason": "tool_calls"}]}]
    stream = soak.Reassembly("/v1/chat/completions")
    for line in sse(chunks):
        stream.line(line)
    got = stream.result()
    want = soak.canonical("/v1/chat/completions", chat_call())
    assert soak.differences(got, {**want, "usage": None}) == []  # usage only with include_usage


@pytest.fixture(scope="module")
def summary(tmp_path_factory, tiny_chat_model):
    return soak.run(MINUTES, CLIENTS, out=str(tmp_path_factory.mktemp("soak") / "soak.json"), model=tiny_chat_model)


def test_one_request_never_hurts_another_under_load(summary):
    by_kind = summary["by_kind"]
    assert summary["problems"] == [], "\n".join(summary["problems"])
    # Valid requests: every one answered and equal to its answer alone, streamed or not.
    assert by_kind["valid"]["checked"] == by_kind["valid"]["sent"] >= 20, by_kind["valid"]
    assert 0 < by_kind["valid"]["streamed"] < by_kind["valid"]["sent"]
    # Invalid requests: only 4xx, each the one its case expects (problems above); nothing was a 5xx.
    assert by_kind["invalid"]["sent"] and all(s.isdigit() and 400 <= int(s) < 500
                                              for s in by_kind["invalid"]["statuses"]), by_kind["invalid"]
    assert summary["count_5xx"] == 0
    assert by_kind["disconnect"]["sent"]
    assert summary["health"]["non_200"] == 0 and summary["health"]["p99_ms"] < soak.HEALTH_P99 * 1000
    assert summary["idle"] == {**summary["idle"], "pages_used": 0, "running": 0, "waiting": 0, "preempted": 0}
    core = summary["rss"]["engine_core"]
    assert core["second_half_growth_mib"] <= core["bound_mib"], core

