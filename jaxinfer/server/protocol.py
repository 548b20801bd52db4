"""OpenAI request shapes, parsed strictly so a wrong type is a 400 that names the field, never a 500.

Sampling values are not range-checked here: ``SamplingParams`` owns those rules, and its
ValueError/TypeError is mapped to a 400 whose ``param`` is the offending field.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from jaxinfer.sampling_params import SamplingParams

MAX_N = 64


class APIError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    # strict: "5" is not an int and 1.0 is not an int, as in OpenAI's API; unknown fields are ignored.
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class StructuredOutputsParam(_Strict):
    """vLLM's ``structured_outputs`` object: exactly one field set."""

    json_: dict | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


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


class _Sampling(_Strict):
    model: str | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's constraint fields, so its clients work unchanged (at most one constraint per request).
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputsParam | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool turn: which call it answers


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True


# Plain-words types for fields whose pydantic union errors would list every alternative.
_FIELD_HINTS = {
    "prompt": "a non-empty string, a list of token ids, or a list of either",
    "stop": "a string or a list of strings",
    "messages": "a non-empty list of {role, content} objects, role one of system/developer/user/assistant/tool, "
                "content a string or a list of {type: 'text', text} parts",
    "tools": "a list of {type: 'function', function: {name, description, parameters}} objects",
    "tool_choice": "'none', 'auto', 'required' or {type: 'function', function: {name}}",
    "response_format": "{type: 'text'}, {type: 'json_object'} or {type: 'json_schema', json_schema: {name, schema, "
                       "strict}}",
    "guided_json": "a JSON schema (an object, or its JSON text)",
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
        if err["type"] == "missing":
            where = ".".join(str(p) for p in err["loc"] if not str(p).startswith("function-after"))
            raise APIError(400, f"'{where}' is a required field", param=param, code="missing_field") from None
        if param in _FIELD_HINTS:
            message = f"'{param}' must be {_FIELD_HINTS[param]}"
        else:
            message = f"'{param}': {err['msg']}, got {err.get('input')!r}"
        raise APIError(400, message, param=param, code="invalid_type") from None


def check_supported(req: _Sampling) -> None:
    """Reject options this server would otherwise silently ignore."""
    unsupported = {
        "logit_bias": bool(req.logit_bias),
        "echo": getattr(req, "echo", False),
        "suffix": getattr(req, "suffix", None) is not None,
        "best_of": getattr(req, "best_of", None) not in (None, req.n),
    }
    for name, used in unsupported.items():
        if used:
            raise APIError(400, f"'{name}' is not supported by this server", param=name, code="unsupported")
    if not 1 <= req.n <= MAX_N:
        raise APIError(400, f"n must be in [1, {MAX_N}], got {req.n}", param="n")


def sampling_params(req: _Sampling, max_tokens: int, logprobs: int | None, *,
                    renames: dict[str, str] | None = None, structured=None) -> SamplingParams:
    """``SamplingParams`` from a request; its own range checks become a 400 with ``param`` set."""
    opts = dict(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                min_p=req.min_p, seed=req.seed, stop=req.stop, stop_token_ids=tuple(req.stop_token_ids or ()),
                ignore_eos=req.ignore_eos, logprobs=logprobs, presence_penalty=req.presence_penalty,
                frequency_penalty=req.frequency_penalty, structured=structured)
    defaults = dict(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, presence_penalty=0.0, frequency_penalty=0.0)
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


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: dict | None
    finish_reason: Literal["stop", "length", "abort"] | None


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


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class HealthResponse(BaseModel):
    status: str
