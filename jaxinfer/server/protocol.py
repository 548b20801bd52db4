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


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list | None = None
    response_format: dict | None = None


# Plain-words types for fields whose pydantic union errors would list every alternative.
_FIELD_HINTS = {
    "prompt": "a non-empty string, a list of token ids, or a list of either",
    "stop": "a string or a list of strings",
    "messages": "a non-empty list of {role, content} objects, role one of system/developer/user/assistant/tool, "
                "content a string or a list of {type: 'text', text} parts",
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
            raise APIError(400, f"'{param}' is a required field", param=param, code="missing_field") from None
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
        "tools": bool(getattr(req, "tools", None)),
        "response_format": (getattr(req, "response_format", None) or {}).get("type", "text") != "text",
    }
    for name, used in unsupported.items():
        if used:
            raise APIError(400, f"'{name}' is not supported by this server", param=name, code="unsupported")
    if not 1 <= req.n <= MAX_N:
        raise APIError(400, f"n must be in [1, {MAX_N}], got {req.n}", param="n")


def sampling_params(req: _Sampling, max_tokens: int, logprobs: int | None, *,
                    renames: dict[str, str] | None = None) -> SamplingParams:
    """``SamplingParams`` from a request; its own range checks become a 400 with ``param`` set."""
    opts = dict(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                min_p=req.min_p, seed=req.seed, stop=req.stop, stop_token_ids=tuple(req.stop_token_ids or ()),
                ignore_eos=req.ignore_eos, logprobs=logprobs, presence_penalty=req.presence_penalty,
                frequency_penalty=req.frequency_penalty)
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
