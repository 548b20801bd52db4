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
    single = tool_call_schema(ToolPlan("required", tools, parallel=False))
    jsonschema.validate({"name": "b", "arguments": {}}, single)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "b", "arguments": {}}], single)


def test_strict_schema_forbids_additional_properties_true():
    from jaxinfer.server.constraints import strict_schema
    from jaxinfer.server.protocol import APIError

    nested = {"type": "object", "properties": {"o": {"type": "object", "additionalProperties": {"type": "string"}}}}
    for schema, where in (({"type": "object", "additionalProperties": True}, "the schema"), (nested, ".properties.o")):
        with pytest.raises(APIError) as e:
            strict_schema(schema, "response_format")
        assert e.value.status == 400 and e.value.param == "response_format" and where in e.value.message
    assert strict_schema({"type": "string"}, "tools") == {"type": "string"}  # no object: unchanged
