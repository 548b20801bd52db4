"""OpenAI request shapes, parsed strictly so a wrong type is a 400 that names the field, never a 500.

The fields carry the ranges the server accepts, so ``/openapi.json`` describes them and a client or
fuzzer that follows it is not refused for a range it could not know. The ranges are
``sampling_params``' bounds (the one copy of each limit, which ``SamplingParams`` still checks: its
ValueError/TypeError is mapped to a 400 whose ``param`` is the offending field).
"""

from __future__ import annotations

import re
from typing import Annotated, ClassVar, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from jaxinfer.sampling_params import (MAX_CHOICES, MAX_LOGIT_BIAS, MAX_LOGIT_BIAS_TOKENS, MAX_LOGPROBS, MAX_N,
                                      MAX_PENALTY, MAX_REPETITION_PENALTY, MAX_SEED, MAX_STOP_CHARS, MAX_STOP_STRINGS,
                                      MAX_STOP_TOKEN_IDS, MAX_TEMPERATURE, MAX_TOP_K, SamplingParams)

MIN_TOP_K = -1  # SamplingParams: top_k >= -1 (-1 and 0 turn it off)
MAX_TOKEN_ID = MAX_TOP_K  # ids travel to the device as int32
MAX_SHOWN = 100  # characters of a client's value that an error message repeats
# The scheduler only compares priorities, so any integer would do; int32's range is what a client of
# another server can send, and keeps the schema's range finite.
MAX_PRIORITY = 2**31 - 1



def _integral(value):
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _int(low: int, high: int | None = None):
    """An int in [low, high] that also takes an integral float (32.0), since JSON Schema's integers
    (what /openapi.json promises) include them; "5", true and 1.5 stay refused."""
    return Annotated[int, Field(ge=low, le=high), BeforeValidator(_integral)]


Text = Annotated[str, Field(min_length=1)]
# Constraint texts, each with its JSON Schema ``format`` so /openapi.json says what the string must
# hold ("regex" is JSON Schema's own; the other two are this server's names, described here).
Regex = Annotated[str, Field(min_length=1, json_schema_extra={"format": "regex"})]
Grammar = Annotated[str, Field(min_length=1, description="a Lark grammar, or llama.cpp's GBNF (rules written "
                               "'name ::= ...')", json_schema_extra={"format": "grammar"})]
SchemaText = Annotated[str, Field(min_length=1, description="a JSON schema as JSON text",
                                  json_schema_extra={"format": "json-schema"})]
StopText = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
Choices = Annotated[list[Text], Field(min_length=1, max_length=MAX_CHOICES)]
TokenId = _int(0, MAX_TOKEN_ID)
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
Logprobs = _int(0, MAX_LOGPROBS)
MaxTokens = _int(1)  # SamplingParams: max_tokens >= 1


def shown(value) -> str:
    """``repr(value)`` cut to ``MAX_SHOWN`` characters: an error echoes what it refused, but a
    megabyte field must not come back as a megabyte error."""
    text = repr(value)
    return text if len(text) <= MAX_SHOWN else f"{text[:MAX_SHOWN]}... ({len(text)} characters)"


class APIError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}``."""

    MAX_MESSAGE = 1000  # characters: however a message was built (a compiler's diagnostics), its body stays small

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        if len(message) > self.MAX_MESSAGE:
            message = message[:self.MAX_MESSAGE] + "..."
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    # strict: "5" is not an int and 1.0 is not an int, as in OpenAI's API; unknown fields are ignored.
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False


class StructuredOutputsParam(_Strict):
    """vLLM's ``structured_outputs`` object: exactly one field set (not null, and json_object not false)."""

    model_config = ConfigDict(json_schema_extra={"oneOf": [
        {"required": [name], "properties": {name: {"not": {"enum": [None, False]}}}}
        for name in ("json", "json_object", "regex", "choice", "grammar")]})

    json_: dict | SchemaText | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: Regex | None = None
    choice: Choices | None = None
    grammar: Grammar | None = None


class JSONSchemaFormat(_Strict):
    name: str = Field(max_length=64)
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class FunctionDefinition(_Strict):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class ChatTool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ToolCallFunction(_Strict):
    name: str
    arguments: str


class ToolCall(_Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


Penalty = Annotated[float, Field(ge=-MAX_PENALTY, le=MAX_PENALTY)]


class _Request(_Strict):
    """A request body: fields no model here declares are kept (``model_extra``) so the server can say
    it ignored them (a log line and ``X-Ignored-Fields``), as vLLM warns, rather than refuse clients
    that send another provider's extras. Fields that would change the output and are not served are
    declared, so they are refused by name (``_UNSUPPORTED``)."""

    model_config = ConfigDict(extra="allow")


class _Sampling(_Request):
    model: str | None = None
    n: _int(1, MAX_N) = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: Annotated[float, Field(ge=0, le=MAX_TEMPERATURE)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None  # SamplingParams: top_p in (0, 1]
    top_k: _int(MIN_TOP_K, MAX_TOP_K) | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None  # SamplingParams: min_p in [0, 1]
    seed: _int(0, MAX_SEED) | None = None
    stop: StopText | Annotated[list[StopText], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    ignore_eos: bool = False
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    # vLLM's: over the prompt's and the generated tokens (1: off)
    repetition_penalty: Annotated[float, Field(gt=0, le=MAX_REPETITION_PENALTY)] | None = None
    # OpenAI's: {token id as text: bias}; an id must be in the model's vocabulary (checked when served)
    logit_bias: Annotated[dict[Annotated[str, Field(pattern=r"^[0-9]{1,10}$")],
                               Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]],
                          Field(max_length=MAX_LOGIT_BIAS_TOKENS)] | None = None
    # vLLM's: no end of sequence, stop token or stop string before this many tokens (<= the max tokens)
    min_tokens: _int(0) | None = None
    user: str | None = None
    # OpenAI's bookkeeping fields: they change no output, so they are accepted (and not stored)
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    request_id: str | None = None  # vLLM's; responses carry the server's own id (X-Request-Id)
    best_of: _int(1, 1) | None = Field(None, description="only 1: each choice is generated once, none discarded")
    guided_decoding_backend: Literal["auto", "guidance"] | None = None  # vLLM's; llguidance is the one here
    # vLLM's: the prompt's tokens' logprobs, each with the top k; <= the server's max_logprobs
    prompt_logprobs: Logprobs | None = Field(None, description="not with stream (as vLLM)")
    # vLLM's text options (SamplingParams has their meaning)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Output options this server does not serve except at their defaults (refused by name otherwise)
    use_beam_search: Literal[False] = False
    length_penalty: Literal[1, 1.0] = 1.0
    allowed_token_ids: None = None
    bad_words: None = None
    truncate_prompt_tokens: None = None
    logits_processors: None = None
    return_tokens_as_token_ids: Literal[False] = False
    return_token_ids: Literal[False] = False
    add_special_tokens: None = None
    structural_tag: None = None
    guided_whitespace_pattern: None = None
    cache_salt: None = None
    kv_transfer_params: None = None
    vllm_xargs: None = None
    # vLLM's constraint fields, so its clients work unchanged (at most one constraint per request).
    guided_json: dict | SchemaText | None = None
    guided_regex: Regex | None = None
    guided_choice: Choices | None = None
    guided_grammar: Grammar | None = None
    structured_outputs: StructuredOutputsParam | None = None
    # vLLM's field: under --scheduling_policy=priority a lower value runs first (and may preempt a
    # running request of a higher value); ties are first come first served.
    priority: _int(-MAX_PRIORITY, MAX_PRIORITY) = 0


def _at_most_one(unset: dict[str, dict]) -> dict:
    """JSON Schema for "at most one of these fields is set": one branch per field, in which every other
    field is as ``unset`` describes it (absent, or a value that sets nothing)."""
    return {"anyOf": [{"properties": {other: schema for other, schema in unset.items() if other != name}}
                      for name in unset]}


# A request takes one output constraint (server.constraints): what "not set" means for each field.
_NULL = {"type": "null"}
_NO_CONSTRAINT = {name: _NULL for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar",
                                           "structured_outputs")}
_NO_CHAT_CONSTRAINT = {**_NO_CONSTRAINT,
                       "response_format": {"anyOf": [_NULL, {"properties": {"type": {"const": "text"}}}]},
                       "tool_choice": {"anyOf": [_NULL, {"enum": ["none", "auto"]}]}}


# prompt_logprobs are not streamed (as vLLM refuses them with stream). Said on completions only: with
# the chat route's other two rules Schemathesis could not draw requests from the description.
_PROMPT_LOGPROBS_NOT_STREAMED = {"anyOf": [{"properties": {"prompt_logprobs": _NULL}},
                                           {"properties": {"stream": {"const": False}}}]}


class CompletionRequest(_Sampling):
    model_config = ConfigDict(json_schema_extra={"allOf": [_at_most_one(_NO_CONSTRAINT),
                                                           _PROMPT_LOGPROBS_NOT_STREAMED]})
    # Refused here only: the chat route's response_format is served (a wrong one there is a type error).
    REFUSED: ClassVar[dict[str, str]] = {"response_format": "leave it out (/v1/chat/completions serves it)"}

    prompt: Text | TokenIds | Annotated[list[Text], Field(min_length=1)] | Annotated[list[TokenIds], Field(min_length=1)]
    max_tokens: MaxTokens | None = 16
    logprobs: Logprobs | None = None
    echo: bool = False  # each choice's text (and logprobs) starts with the prompt's
    suffix: None = None  # unsupported
    response_format: None = None  # unsupported on completions (vLLM's extra); the chat route serves it
    prompt_embeds: None = None  # unsupported


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool turn: which call it answers


# Some message must carry text or tool calls (the server checks it; the schema says it).
_SOME_TEXT = {"contains": {"anyOf": [
    {"required": ["content"], "properties": {"content": {"anyOf": [
        {"type": "string", "minLength": 1},
        {"type": "array", "contains": {"required": ["text"], "properties": {"text": {"minLength": 1}}}}]}}},
    {"required": ["tool_calls"], "properties": {"tool_calls": {"type": "array", "minItems": 1}}}]}}


# top_logprobs needs logprobs: true (as OpenAI's API says).
_TOP_LOGPROBS_NEED_LOGPROBS = {"anyOf": [{"properties": {"top_logprobs": _NULL}},
                                         {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}}]}


class ChatCompletionRequest(_Sampling):
    model_config = ConfigDict(json_schema_extra={"allOf": [_at_most_one(_NO_CHAT_CONSTRAINT),
                                                           _TOP_LOGPROBS_NEED_LOGPROBS]})

    messages: list[ChatMessage] = Field(min_length=1, json_schema_extra=_SOME_TEXT)
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool = False
    top_logprobs: Logprobs | None = None
    response_format: ResponseFormat | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # vLLM's: a reply begins with the last message's content where that message is the assistant's
    echo: bool = False
    modalities: list[Literal["text"]] | None = None
    # OpenAI's and vLLM's options this server does not serve (refused by name when set)
    audio: None = None
    prediction: None = None
    functions: None = None
    function_call: None = None
    web_search_options: None = None
    reasoning_effort: None = None
    verbosity: None = None
    add_generation_prompt: Literal[True] = True
    continue_final_message: Literal[False] = False
    moderation: None = None
    prompt_cache_options: dict | None = None  # OpenAI's prompt cache bookkeeping, as prompt_cache_key
    chat_template: None = None
    chat_template_kwargs: None = None
    documents: None = None
    mm_processor_kwargs: None = None


# ------------------------------------------------------------- /v1/responses (OpenAI's Responses API)


class InputTextPart(_Strict):
    """A text part of an input message: ``input_text``, or ``output_text`` as an earlier reply's
    message carries it when sent back (its ``annotations`` and ``logprobs`` are ignored)."""

    type: Literal["input_text", "output_text"]
    text: str


class InputMessage(_Strict):
    """A message of ``input``; an earlier reply's message item (``id``, ``status``) may be sent back as is."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputTextPart]


class FunctionCallItem(_Strict):
    """A call the model made (an earlier reply's ``function_call`` item, sent back)."""

    type: Literal["function_call"]
    call_id: str
    name: str = Field(min_length=1, max_length=64)
    arguments: str


class FunctionCallOutputItem(_Strict):
    """The result of a call, for the model to read."""

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputTextPart]


InputItem = InputMessage | FunctionCallItem | FunctionCallOutputItem


class FunctionTool(_Strict):
    """Responses' function tool: ``function``'s fields at the top level."""

    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class NamedFunctionChoice(_Strict):
    type: Literal["function"]
    name: str


class TextFormatText(_Strict):
    type: Literal["text"]


class TextFormatJSONObject(_Strict):
    type: Literal["json_object"]


class TextFormatJSONSchema(_Strict):
    type: Literal["json_schema"]
    name: str = Field(min_length=1, max_length=64)
    schema_: dict = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(_Strict):
    format: TextFormatText | TextFormatJSONObject | TextFormatJSONSchema | None = None
    verbosity: Literal["medium"] | None = None  # the model's own length; other values are not served


class NoReasoning(_Strict):
    """``reasoning`` is accepted only when it asks for nothing: these models do not reason apart."""

    model_config = ConfigDict(extra="forbid")

    effort: None = None
    summary: None = None
    generate_summary: None = None


class ResponsesStreamOptions(_Strict):
    include_obfuscation: bool = True  # the events carry no padding either way


LOGPROBS_INCLUDE = "message.output_text.logprobs"
# Some input item must carry text or be a call (the server checks it; the schema says it).
_TEXT = {"anyOf": [{"type": "string", "minLength": 1},
                   {"type": "array", "contains": {"required": ["text"], "properties": {"text": {"minLength": 1}}}}]}
_SOME_INPUT = {"contains": {"anyOf": [
    {"required": ["content"], "properties": {"type": {"const": "message"}, "content": _TEXT}},
    {"required": ["type"], "properties": {"type": {"const": "function_call"}}},
    {"required": ["type", "output"], "properties": {"type": {"const": "function_call_output"}, "output": _TEXT}}]}}
_WHY_NOT_STORED = "this server stores no responses, so there is none to continue; send the conversation so far " \
                  "as input items"


class ResponsesRequest(_Request):
    """OpenAI's ``/v1/responses``, served as a chat completion of the same messages: ``instructions``
    as a system message first, then ``input`` (a text, or message, ``function_call`` and
    ``function_call_output`` items); ``text.format`` as ``response_format``; flat function ``tools``.
    Nothing is stored: ``previous_response_id``, ``conversation`` and ``background`` are refused, and
    ``store`` changes nothing."""

    model_config = ConfigDict(json_schema_extra=_at_most_one({
        "text": {"anyOf": [_NULL, {"properties": {"format": {"anyOf": [
            _NULL, {"properties": {"type": {"const": "text"}}}]}}}]},
        "tool_choice": {"anyOf": [_NULL, {"enum": ["none", "auto"]}]}}))
    REFUSED: ClassVar[dict[str, str]] = {
        "previous_response_id": _WHY_NOT_STORED, "conversation": _WHY_NOT_STORED,
        "background": "responses are not stored, so none can run in the background",
        "background_options": "responses are not stored, so none can run in the background",
        "prompt": "stored prompt templates are not served; send the text as instructions and input",
        "reasoning": "these models do not reason apart from their reply; leave it out or null",
        "include": f"only {LOGPROBS_INCLUDE!r} (the output text's logprobs) can be included",
        "truncation": "only 'disabled': an input longer than the context is a 400, never cut",
        "context_management": "leave it out", "access_programs": "leave it out", "image": "leave it out"}
    HINTS: ClassVar[dict[str, str]] = {
        "input": "a non-empty string, or a non-empty list of input items: messages {role: user, system, developer "
                 "or assistant, content: a string or [{type: 'input_text', text}]}, {type: 'function_call', call_id, "
                 "name, arguments} and {type: 'function_call_output', call_id, output}",
        "tools": "a list of function tools {type: 'function', name, description, parameters, strict} (built-in "
                 "tools such as web_search or file_search are not served)",
        "tool_choice": "'none', 'auto', 'required' or {type: 'function', name}",
        "text": "{format: {type: 'text'}}, {format: {type: 'json_object'}} or {format: {type: 'json_schema', name, "
                "schema, strict}}",
    }

    model: str | None = None
    input: Text | Annotated[list[InputItem], Field(min_length=1, json_schema_extra=_SOME_INPUT)]
    instructions: str | None = None
    max_output_tokens: MaxTokens | None = None
    temperature: Annotated[float, Field(ge=0, le=MAX_TEMPERATURE)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_logprobs: Logprobs | None = None
    stream: bool = False
    stream_options: ResponsesStreamOptions | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    include: list[Literal["message.output_text.logprobs"]] | None = None
    truncation: Literal["disabled"] | None = None
    reasoning: NoReasoning | None = None
    # vLLM's sampling extras, as on the other routes
    seed: _int(0, MAX_SEED) | None = None
    top_k: _int(MIN_TOP_K, MAX_TOP_K) | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0, le=MAX_REPETITION_PENALTY)] | None = None
    priority: _int(-MAX_PRIORITY, MAX_PRIORITY) = 0
    # OpenAI's bookkeeping fields: they change no output, so they are accepted (and not stored)
    metadata: dict[str, str] | None = None
    user: str | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict | None = None
    safety_identifier: str | None = None
    max_tool_calls: _int(0) | None = None  # calls of built-in tools, of which none are served
    request_id: str | None = None  # vLLM's; responses carry the server's own id
    # Not served (refused by name when set; REFUSED says why)
    previous_response_id: None = None
    conversation: None = None
    background: Literal[False] | None = None
    background_options: None = None
    prompt: None = None
    context_management: None = None
    access_programs: None = None
    image: None = None
    moderation: None = None


# Plain-words types for fields whose pydantic union errors would list every alternative.
_FIELD_HINTS = {
    "prompt": "a non-empty string, a non-empty list of token ids (each >= 0), or a non-empty list of either",
    "input": "a non-empty string, a non-empty list of token ids (each >= 0), or a non-empty list of either",
    "stop": "a non-empty string or a list of non-empty strings",
    "messages": "a non-empty list of {role, content} objects, role one of system/developer/user/assistant/tool, "
                "content a string or a list of {type: 'text', text} parts",
    "tools": "a list of {type: 'function', function: {name, description, parameters}} objects",
    "tool_choice": "'none', 'auto', 'required' or {type: 'function', function: {name}}",
    "response_format": "{type: 'text'}, {type: 'json_object'} or {type: 'json_schema', json_schema: {name, schema, "
                       "strict}}",
    "guided_json": "a JSON schema (an object, or its non-empty JSON text)",
    "structured_outputs": "an object with one of json, json_object, regex, choice, grammar",
}


def parse(model: type[BaseModel], body: bytes):
    """Validate a JSON body into ``model``, turning the first problem into a 400 naming the field."""
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        if err["type"] == "json_invalid":
            raise APIError(400, f"request body is not valid JSON: {err['msg']}", code="invalid_json") from None
        if err["type"] == "model_type" or not err["loc"]:
            raise APIError(400, "request body must be a JSON object") from None
        param = str(err["loc"][0])
        refused = getattr(model, "REFUSED", {})
        if param in refused:
            raise APIError(400, f"'{param}' is not supported by this server: {refused[param]}", param=param,
                           code="unsupported") from None
        if param in _UNSUPPORTED:
            raise APIError(400, f"'{param}' is not supported by this server: leave it out", param=param,
                           code="unsupported") from None
        where = ".".join(str(p) for p in err["loc"] if not str(p).startswith(("function-after", "constrained-")))
        if err["type"] == "missing":
            raise APIError(400, f"'{where}' is a required field", param=param, code="missing_field") from None
        hints = {**_FIELD_HINTS, **getattr(model, "HINTS", {})}
        if param in hints:
            message = f"'{param}' must be {hints[param]}"
        elif err["type"] in _BOUNDS:
            message = f"{where} must be {_BOUNDS[err['type']].format(**err['ctx'])}, got {shown(err.get('input'))}"
            raise APIError(400, message, param=param, code="invalid_value") from None
        else:
            message = f"'{where}': {err['msg']}, got {shown(err.get('input'))}"
        raise APIError(400, message, param=param, code="invalid_type") from None


# Options this server does not support: refused by name rather than ignored (the schema admits only
# the values that mean "off").
_UNSUPPORTED = frozenset({
    "suffix", "prompt_embeds", "use_beam_search", "length_penalty",
    "allowed_token_ids", "bad_words", "truncate_prompt_tokens", "logits_processors", "return_tokens_as_token_ids",
    "return_token_ids", "add_special_tokens", "structural_tag", "guided_whitespace_pattern", "cache_salt",
    "kv_transfer_params", "vllm_xargs", "modalities", "audio", "prediction", "functions", "function_call",
    "web_search_options", "reasoning_effort", "verbosity", "add_generation_prompt", "continue_final_message",
    "moderation", "chat_template", "chat_template_kwargs", "documents", "mm_processor_kwargs",
    "guided_decoding_backend"})
# Range errors in the words SamplingParams uses (every length minimum above is 1: "non-empty").
_BOUNDS = {"greater_than_equal": ">= {ge}", "less_than_equal": "<= {le}", "greater_than": "> {gt}",
           "less_than": "< {lt}", "too_short": "non-empty", "string_too_short": "non-empty"}


def check_supported(req: _Sampling, scheduling_policy: str = "fcfs") -> None:
    """Reject what the types let through but this server would silently ignore: a ``priority`` other
    than 0 where the server does not schedule by priority (as vLLM refuses it)."""
    if req.priority != 0 and scheduling_policy != "priority":
        raise APIError(400, f"'priority' is {req.priority}, but this server schedules {scheduling_policy}, not by "
                            "priority (serve with --scheduling_policy=priority)", param="priority",
                       code="unsupported")


def sampling_params(req: _Sampling, max_tokens: int, logprobs: int | None, *,
                    renames: dict[str, str] | None = None, structured=None) -> SamplingParams:
    """``SamplingParams`` from a request; its own range checks become a 400 with ``param`` set."""
    opts = dict(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                min_p=req.min_p, seed=req.seed, stop=req.stop, stop_token_ids=tuple(req.stop_token_ids or ()),
                ignore_eos=req.ignore_eos, logprobs=logprobs, presence_penalty=req.presence_penalty,
                frequency_penalty=req.frequency_penalty, repetition_penalty=req.repetition_penalty,
                logit_bias=req.logit_bias, min_tokens=req.min_tokens, n=req.n, structured=structured,
                skip_special_tokens=req.skip_special_tokens,
                spaces_between_special_tokens=req.spaces_between_special_tokens,
                include_stop_str_in_output=req.include_stop_str_in_output)
    defaults = dict(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, presence_penalty=0.0, frequency_penalty=0.0,
                    repetition_penalty=1.0, min_tokens=0)
    opts.update({k: v for k, v in defaults.items() if opts[k] is None})
    try:
        return SamplingParams(**opts)
    except (ValueError, TypeError) as e:
        match = re.match(r"\w+", str(e))
        param = match.group(0) if match and match.group(0) in opts else None
        message = str(e)
        if param in (renames or {}):  # name the field the client sent, e.g. top_logprobs
            message = message.replace(param, renames[param], 1)
            param = renames[param]
        raise APIError(400, message, param=param) from None


def chat_text(message: ChatMessage) -> str:
    content = message.content
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(part.text for part in content)


# ------------------------------------------------------------------ response shapes (for /openapi.json)

class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


# vLLM's prompt_logprobs: null for the first prompt token, then per token {token id: {logprob, rank,
# decoded_token}} of the token itself and the top k.
PromptLogprobsField = list[dict[str, dict] | None] | None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: dict | None
    finish_reason: Literal["stop", "length", "abort"] | None
    prompt_logprobs: PromptLogprobsField = None


class CompletionResponse(BaseModel):
    """Without ``stream``; with it, ``text/event-stream`` chunks of the same shape, then ``data: [DONE]``."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: dict | None
    finish_reason: Literal["stop", "length", "tool_calls", "abort"] | None


class ChatCompletionResponse(BaseModel):
    """Without ``stream``; with it, ``chat.completion.chunk`` events with ``delta`` in place of ``message``."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobsField = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class VersionResponse(BaseModel):
    """The server's version and, once the engine is ready, every value it resolved and runs with."""

    version: str
    config: dict | None = None


class HealthResponse(BaseModel):
    status: str


class TokenizeRequest(_Request):
    """vLLM's ``/tokenize``: exactly one of ``prompt`` (text, encoded as a completion's is; with the
    tokenizer's special tokens unless ``add_special_tokens`` is false) and ``messages`` (rendered with
    the chat template and encoded as a chat request's prompt is, ending in the assistant's header)."""

    model_config = ConfigDict(json_schema_extra={"oneOf": [{"required": ["prompt"]}, {"required": ["messages"]}]})

    model: str | None = None
    prompt: str = Field(None, json_schema_extra={"type": "string"})
    messages: list[ChatMessage] = Field(None, min_length=1, json_schema_extra={"type": "array", **_SOME_TEXT})
    add_special_tokens: bool = True


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(_Request):
    """vLLM's ``/detokenize``: token ids (each below the vocabulary size) back to text."""

    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    prompt: str


MAX_EMBEDDING_INPUTS = 2048  # OpenAI's limit on the inputs of one request


class EmbeddingRequest(_Request):
    """OpenAI's ``/v1/embeddings``: ``input`` is one text, one list of token ids, or a list of either,
    each embedded on its own (the server's ``--pooling`` of the final hidden states, L2-normalized);
    ``encoding_format`` "float" (lists of numbers) or "base64" (each vector's little-endian float32
    bytes); ``dimensions`` only the model's hidden size (vectors are not shortened); ``user`` is
    ignored, as OpenAI does."""

    model: str | None = None
    input: Text | TokenIds | Annotated[list[Text], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)] | \
        Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: _int(1) | None = None
    user: str | None = None


class EmbeddingData(BaseModel):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str  # a string with encoding_format "base64"


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"]
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


class TokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class OutputTextLogprob(TokenLogprob):
    top_logprobs: list[TokenLogprob]


class OutputText(BaseModel):
    type: Literal["output_text"]
    text: str
    annotations: list[dict]
    logprobs: list[OutputTextLogprob] | None = None


class OutputMessage(BaseModel):
    type: Literal["message"]
    id: str
    role: Literal["assistant"]
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]


class OutputFunctionCall(BaseModel):
    type: Literal["function_call"]
    id: str
    call_id: str
    name: str
    arguments: str  # JSON text: the model's own, which a reply cut short leaves incomplete
    status: Literal["in_progress", "completed", "incomplete"]


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"] | None


class InputTokensDetails(BaseModel):
    cached_tokens: int
    cache_write_tokens: int


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int


class ResponsesUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class ResponseObject(BaseModel):
    """``/v1/responses`` without ``stream``. With it, server-sent events, each an ``event:`` line naming
    its ``type`` and a ``data:`` line of JSON with a ``sequence_number``: ``response.created`` and
    ``response.in_progress`` (this object, ``in_progress``, no output yet); per output item
    ``response.output_item.added``, then for a message ``response.content_part.added``,
    ``response.output_text.delta``..., ``response.output_text.done``, ``response.content_part.done``,
    or for a function call ``response.function_call_arguments.delta``...,
    ``response.function_call_arguments.done``; then ``response.output_item.done``; last
    ``response.completed`` or ``response.incomplete`` with the whole object, or an ``error`` event."""

    id: str
    object: Literal["response"]
    created_at: int
    completed_at: int | None
    status: Literal["completed", "incomplete", "in_progress"]
    error: None
    incomplete_details: IncompleteDetails | None
    model: str
    output: list[Annotated[OutputMessage | OutputFunctionCall, Field(discriminator="type")]]
    usage: ResponsesUsage | None
    instructions: str | None
    max_output_tokens: int | None
    metadata: dict[str, str]
    parallel_tool_calls: bool
    previous_response_id: None
    reasoning: None
    store: bool
    temperature: float
    text: dict
    tool_choice: str | dict
    tools: list[dict]
    top_logprobs: int | None
    top_p: float
    truncation: Literal["disabled"]
    user: str | None
