"""Tool-call parsers (tool_choice "auto"): each family's format, text around calls, streaming hold-back,
and malformed calls left as content; the forced-call schema and the ChatML tools template."""

import json

import pytest

from jaxinfer.server import tool_parsers
from jaxinfer.server.constraints import ToolPlan, tool_call_schema

GET = {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}
TIME = {"name": "get_time", "arguments": {}}


def _args(calls):
    return [(c["name"], json.loads(c["arguments"])) for c in calls]


@pytest.mark.parametrize("name, text, content, calls", [
    ("hermes", f"<tool_call>\n{json.dumps(GET)}\n</tool_call>", None, [GET]),
    ("hermes", f"Let me check.\n<tool_call>{json.dumps(GET)}</tool_call>\n<tool_call>{json.dumps(TIME)}</tool_call>",
     "Let me check.", [GET, TIME]),
    ("hermes", f"<tool_call>{json.dumps(GET)}", None, [GET]),  # cut before the closing tag
    ("hermes", "no tools here", "no tools here", []),
    ("hermes", "<tool_call>{\"name\": \"get_weather\", \"argu", "<tool_call>{\"name\": \"get_weather\", \"argu", []),
    ("llama3_json", json.dumps({"name": "get_weather", "parameters": GET["arguments"]}), None, [GET]),
    ("llama3_json", "<|python_tag|>" + json.dumps(GET) + "; " + json.dumps(TIME), None, [GET, TIME]),
    ("llama3_json", "The answer is {x}", "The answer is {x}", []),
    ("llama3_json", '{"not": "a call"}', '{"not": "a call"}', []),
    ("mistral", "[TOOL_CALLS]" + json.dumps([GET, TIME]), None, [GET, TIME]),
    ("mistral", json.dumps([GET]), None, [GET]),  # the special token dropped by detokenization
    ("mistral", "[1, 2]", "[1, 2]", []),
])
def test_extract(name, text, content, calls):
    got_content, got_calls = tool_parsers.PARSERS[name].extract(text)
    assert got_content == content
    assert _args(got_calls) == [(c["name"], c["arguments"]) for c in calls]
    assert all(isinstance(c["arguments"], str) for c in got_calls)  # OpenAI's JSON text


def test_arguments_given_as_json_text():
    text = '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>'
    assert _args(tool_parsers.PARSERS["hermes"].extract(text)[1]) == [("f", {"a": 1})]


@pytest.mark.parametrize("name, text, streamable", [
    ("hermes", "Hello <tool", len("Hello ")),  # may become <tool_call>: held back
    ("hermes", "Hello <b>", len("Hello <b>")),
    ("hermes", "Hi <tool_call>{", len("Hi ")),
    ("llama3_json", "  ", 0),  # undecided until the first visible character
    ("llama3_json", "{\"na", 0),
    ("llama3_json", "Sure", 4),
    ("mistral", "[TOOL", 0),
    ("mistral", "Plain", 5),
])
def test_streamable(name, text, streamable):
    assert tool_parsers.PARSERS[name].streamable(text) == streamable


def test_parser_for_template():
    assert tool_parsers.parser_for_template("...<tool_call>...").name == "hermes"
    assert tool_parsers.parser_for_template("{{ '<|python_tag|>' }}").name == "llama3_json"
    assert tool_parsers.parser_for_template("[AVAILABLE_TOOLS]").name == "mistral"
    assert tool_parsers.parser_for_template(None).name == tool_parsers.DEFAULT
    with pytest.raises(ValueError, match="tool_call_parser"):
        tool_parsers.get_parser("nope")


def test_tool_call_schema():
    jsonschema = pytest.importorskip("jsonschema")
    tools = [{"type": "function", "function": {"name": "a", "parameters": {
        "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}},
             {"type": "function", "function": {"name": "b"}}]
    named = tool_call_schema(ToolPlan("named", tools, named="a"))
    jsonschema.validate({"x": 1}, named)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"x": "1"}, named)
    parallel = tool_call_schema(ToolPlan("required", tools, parallel=True))
    jsonschema.validate([{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}], parallel)
    for bad in ([], [{"name": "c", "arguments": {}}], [{"name": "a", "arguments": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, parallel)
    strict = [{"type": "function", "function": {**tools[0]["function"], "strict": True}}]
    jsonschema.validate({"x": 1, "y": 2}, named)  # JSON Schema's default: unlisted properties allowed
    with pytest.raises(jsonschema.ValidationError, match="Additional properties"):
        jsonschema.validate({"x": 1, "y": 2}, tool_call_schema(ToolPlan("named", strict, named="a")))
    single = tool_call_schema(ToolPlan("required", tools, parallel=False))
    jsonschema.validate({"name": "b", "arguments": {}}, single)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "b", "arguments": {}}], single)


def test_strict_schema_forbids_additional_properties_true():
    from jaxinfer.server.constraints import strict_schema
    from jaxinfer.server.protocol import APIError

    nested = {"type": "object", "properties": {"o": {"type": "object", "additionalProperties": {"type": "string"}}}}
    parts = {"type": "object", "properties": {"p": {"allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]}}}
    for schema, where in (({"type": "object", "additionalProperties": True}, "the schema"), (nested, ".properties.o"),
                          (parts, "allOf is not supported with strict (.properties.p)")):
        with pytest.raises(APIError) as e:
            strict_schema(schema, "response_format")
        assert e.value.status == 400 and e.value.param == "response_format" and where in e.value.message
    assert strict_schema({"type": "string"}, "tools") == {"type": "string"}  # no object: unchanged


def _stream(plan, text, pieces, parser="hermes", finish="stop"):
    """Feed ``text`` to a chat renderer in ``pieces``-character deltas: (the streamed choices, the same
    reply not streamed)."""
    import types

    from jaxinfer.batching.outputs import EngineOutput
    from jaxinfer.server.serving import _ChatRenderer

    serving = types.SimpleNamespace(engine=types.SimpleNamespace(tokenizer=None))
    req = types.SimpleNamespace(top_logprobs=None)
    render = _ChatRenderer(serving, req, plan, tool_parsers.PARSERS[parser])
    chunks = []
    for pos in range(0, len(text), pieces):
        last = pos + pieces >= len(text)
        chunks += render.delta(0, EngineOutput("r", [], text[:pos + pieces], [], last, finish if last else None,
                                               delta_text=text[pos:pos + pieces]))
    whole = _ChatRenderer(serving, req, plan, tool_parsers.PARSERS[parser]).choice(
        0, EngineOutput("r", [], text, [], True, finish))
    return chunks, whole


def _assemble(chunks):
    """(content, {index: [name, arguments, number of argument pieces]}, finish_reason) as a client adds them up."""
    content, calls = "", {}
    for c in chunks:
        content += c["delta"].get("content", "")
        for tc in c["delta"].get("tool_calls", ()):
            if "id" in tc:  # a call's first delta: all of it but the arguments, which begin empty
                assert tc["index"] not in calls and tc["type"] == "function" and tc["function"]["arguments"] == ""
                calls[tc["index"]] = [tc["function"]["name"], "", 0]
            else:
                assert set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}
                calls[tc["index"]][1] += tc["function"]["arguments"]
                calls[tc["index"]][2] += 1
    assert all(c["finish_reason"] is None for c in chunks[:-1])
    return content, calls, chunks[-1]["finish_reason"]


TOOLS = [{"type": "function", "function": {"name": n}} for n in ("get_weather", "get_time")]
WEATHER_ARGS = '{"city": "Paris \\"centre\\" {x}", "days": [2, {"a": []}]}'


@pytest.mark.parametrize("plan, parser, text", [
    (ToolPlan("named", TOOLS, named="get_weather"), "hermes", WEATHER_ARGS),
    (ToolPlan("required", TOOLS), "hermes",
     f'[{{"name": "get_weather", "arguments": {WEATHER_ARGS}}}, {{"name": "get_time", "arguments": {{}}}}]'),
    (ToolPlan("required", TOOLS, parallel=False), "hermes", f'{{"name": "get_weather", "arguments": {WEATHER_ARGS}}}'),
    (ToolPlan("auto", TOOLS), "hermes", f'One moment.\n<tool_call>\n{{"name": "get_weather", "arguments": '
                                        f'{WEATHER_ARGS}}}\n</tool_call>\n<tool_call>\n{{"arguments": {{"tz": "UTC"}}, '
                                        f'"name": "get_time"}}\n</tool_call>'),
    (ToolPlan("auto", TOOLS), "llama3_json", '{"name": "get_time", "parameters": {"tz":"UTC"}}'),
], ids=["named", "required", "required-single", "auto-hermes", "auto-llama3"])
@pytest.mark.parametrize("pieces", [1, 3, 1000])
def test_streamed_tool_calls_add_up_to_the_whole_reply(plan, parser, text, pieces):
    """OpenAI's streamed tool calls: an opening delta per call, then argument pieces as they are
    written, adding up to exactly the arguments of the same reply not streamed."""
    chunks, whole = _stream(plan, text, pieces, parser)
    content, calls, finish = _assemble(chunks)
    assert finish == whole["finish_reason"] == "tool_calls"
    assert (content.strip() or None) == whole["message"]["content"]  # (whitespace before a call may stream)
    assert [c[:2] for _, c in sorted(calls.items())] == [
        [c["function"]["name"], c["function"]["arguments"]] for c in whole["message"]["tool_calls"]]
    if "get_weather" in text:
        assert calls[0][1] == WEATHER_ARGS  # as the model wrote it
        if pieces == 1:
            assert calls[0][2] > 10  # streamed as it was written, not whole at the end


def test_streamed_tool_call_cut_short():
    """A forced call cut by max_tokens: the pieces sent stand and finish_reason says "length"; the
    text is not sent again as content (not streamed, the reply is that text as content)."""
    text = '[{"name": "get_weather", "arguments": {"city": "Par'
    chunks, whole = _stream(ToolPlan("required", TOOLS), text, 2, finish="length")
    content, calls, finish = _assemble(chunks)
    assert (content, finish) == ("", "length") and calls == {0: ["get_weather", '{"city": "Par', calls[0][2]]}
    assert whole["message"]["content"] == text and whole["finish_reason"] == "length"
