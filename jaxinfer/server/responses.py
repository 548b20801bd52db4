"""/v1/responses, OpenAI's Responses API, as a translation of the chat route: one way to generate.

A request becomes the chat completion of the same conversation (``chat_request``): ``instructions``
a system message first, ``input`` the messages (``function_call`` items an assistant turn's tool
calls, ``function_call_output`` items tool turns), ``text.format`` the ``response_format``, flat
function ``tools`` the chat's. The chat path prepares, constrains and runs it; its reply (a choice,
or its stream of deltas, tool calls parsed as the chat route parses them) is then written in the
Responses shape: a ``message`` item with ``output_text`` and ``function_call`` items, or the
event stream that builds them (``ResponseEvents``). Errors that the chat path raises name the
Responses fields (``responses_error``).
"""

from __future__ import annotations

import json
import time
import uuid

from jaxinfer.server.protocol import (LOGPROBS_INCLUDE, APIError, ChatCompletionRequest, FunctionCallItem,
                                      FunctionCallOutputItem, NamedFunctionChoice, ResponsesRequest)


def chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
    """The chat completion request that a Responses request is served as."""
    text = lambda content: content if isinstance(content, str) else "".join(p.text for p in content)  # noqa: E731
    conversation: list[dict] = []
    for item in [req.input] if isinstance(req.input, str) else req.input:
        if isinstance(item, str):
            conversation.append({"role": "user", "content": item})
        elif isinstance(item, FunctionCallItem):  # joins the assistant turn it follows, as chat messages hold them
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if conversation and conversation[-1]["role"] == "assistant":
                conversation[-1].setdefault("tool_calls", []).append(call)
            else:
                conversation.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            conversation.append({"role": "tool", "tool_call_id": item.call_id, "content": text(item.output)})
        else:
            conversation.append({"role": item.role, "content": text(item.content)})
    if not any(m["content"] or m.get("tool_calls") for m in conversation):
        raise APIError(400, "input must contain some text", param="input")
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    tools = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
             for t in req.tools or ()]
    choice = req.tool_choice
    if isinstance(choice, NamedFunctionChoice):
        choice = {"type": "function", "function": {"name": choice.name}}
    elif choice == "auto" and not tools:  # Responses' default, with or without tools
        choice = None
    fmt = req.text.format if req.text is not None else None
    response_format = None
    if fmt is not None and fmt.type == "json_object":
        response_format = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        response_format = {"type": "json_schema", "json_schema": {
            "name": fmt.name, "schema": fmt.schema_, "description": fmt.description, "strict": fmt.strict}}
    logprobs = LOGPROBS_INCLUDE in (req.include or ()) or req.top_logprobs is not None
    body = {"model": req.model, "messages": system + conversation, "max_completion_tokens": req.max_output_tokens,
            "temperature": req.temperature, "top_p": req.top_p, "seed": req.seed, "top_k": req.top_k,
            "min_p": req.min_p, "repetition_penalty": req.repetition_penalty, "priority": req.priority,
            "logprobs": logprobs, "top_logprobs": (req.top_logprobs or 0) if logprobs else None,
            "tools": tools or None, "tool_choice": choice, "response_format": response_format,
            "parallel_tool_calls": req.parallel_tool_calls is not False, "user": req.user, "metadata": req.metadata}
    return ChatCompletionRequest.model_validate(body)


# The chat request's field -> the Responses field it came from, for errors the chat path raises.
_PARAMS = {"messages": "input", "max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
           "response_format": "text"}
_WORDS = (("max_completion_tokens", "max_output_tokens"), ("max_tokens", "max_output_tokens"),
          ("response_format", "text.format"), ("messages", "input"))


def responses_error(e: APIError) -> APIError:
    """``e`` (from the chat path) naming the Responses request's fields."""
    message = e.message
    for old, new in _WORDS:
        message = message.replace(old, new)
    return APIError(e.status, message, type=e.type, param=_PARAMS.get(e.param, e.param), code=e.code,
                    headers=e.headers)


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def _message(text: str, status: str, logprobs: list[dict]) -> dict:
    return {"type": "message", "id": _item_id("msg"), "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}]}


def _function_call(call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"type": "function_call", "id": _item_id("fc"), "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def _status(finish_reason: str | None) -> tuple[str, dict | None]:
    """The response's status and incomplete_details for the way the chat choice finished."""
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    if finish_reason == "abort":
        return "incomplete", None
    return "completed", None


def usage(chat_usage: dict, cached_tokens: int) -> dict:
    return {"input_tokens": chat_usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0},
            "output_tokens": chat_usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": chat_usage["total_tokens"]}


class ResponseShape:
    """The Response object of one request: its id, and the settings it echoes."""

    def __init__(self, response_id: str, req: ResponsesRequest, model: str):
        self.id = response_id
        self.created_at = int(time.time())
        tool_choice = req.tool_choice if req.tool_choice is not None else "auto"
        fmt = req.text.format if req.text is not None and req.text.format is not None else None
        self.settings = {
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "metadata": req.metadata or {}, "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": None, "reasoning": None, "store": False,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
            "tool_choice": tool_choice if isinstance(tool_choice, str) else tool_choice.model_dump(),
            "tools": [t.model_dump() for t in req.tools or ()], "top_logprobs": req.top_logprobs,
            "top_p": 1.0 if req.top_p is None else req.top_p, "truncation": "disabled", "user": req.user}
        self.model = model

    def object(self, status: str, output: list[dict], usage: dict | None = None,
               incomplete_details: dict | None = None) -> dict:
        return {"id": self.id, "object": "response", "created_at": self.created_at,
                "completed_at": int(time.time()) if status != "in_progress" else None, "status": status,
                "error": None, "incomplete_details": incomplete_details, "model": self.model, "output": output,
                "usage": usage, **self.settings}

    def from_choice(self, choice: dict, usage: dict) -> dict:
        """The finished Response of a (non-streamed) chat choice."""
        message, finish = choice["message"], choice["finish_reason"]
        status, details = _status(finish)
        calls = message.get("tool_calls") or []
        logprobs = choice["logprobs"]["content"] if choice["logprobs"] else []
        output = []
        if message["content"] is not None or not calls:
            output.append(_message(message["content"] or "", "completed" if calls else status, logprobs))
        output += [_function_call(c["id"], c["function"]["name"], c["function"]["arguments"], "completed")
                   for c in calls]
        return self.object(status, output, usage, details)


class ResponseEvents:
    """The server-sent events of a streamed Response, from the chat route's deltas of its one choice:
    each output item opened when its first text or call arrives and closed (its ``.done`` events)
    before the next opens, as OpenAI orders them."""

    def __init__(self, shape: ResponseShape):
        self.shape = shape
        self.sequence = 0
        self.items: list[dict] = []
        self.open: int | None = None  # output index of the item being written
        self.calls: dict[int, int] = {}  # the chat's call index -> output index

    def _event(self, type: str, **fields) -> str:
        data = {"type": type, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {type}\ndata: {json.dumps(data)}\n\n"

    def start(self) -> list[str]:
        response = self.shape.object("in_progress", [])
        return [self._event("response.created", response=response),
                self._event("response.in_progress", response=response)]

    def _add(self, item: dict) -> list[str]:
        out = self._close("completed")
        self.open = len(self.items)
        self.items.append(item)
        if item["type"] == "message":
            part = item["content"].pop()
            out.append(self._event("response.output_item.added", output_index=self.open, item=item))
            item["content"].append(part)
            out.append(self._event("response.content_part.added", item_id=item["id"], output_index=self.open,
                                   content_index=0, part=part))
        else:
            out.append(self._event("response.output_item.added", output_index=self.open, item=item))
        return out

    def _close(self, status: str) -> list[str]:
        if self.open is None:
            return []
        index, item = self.open, self.items[self.open]
        self.open = None
        item["status"] = status
        if item["type"] == "message":
            part = item["content"][0]
            out = [self._event("response.output_text.done", item_id=item["id"], output_index=index,
                               content_index=0, text=part["text"], logprobs=part["logprobs"]),
                   self._event("response.content_part.done", item_id=item["id"], output_index=index,
                               content_index=0, part=part)]
        else:
            out = [self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                               arguments=item["arguments"])]
        return out + [self._event("response.output_item.done", output_index=index, item=item)]

    def delta(self, choice: dict) -> list[str]:
        """The events of one chat delta choice (content, or one tool-call entry)."""
        delta, out = choice["delta"], []
        logprobs = (choice["logprobs"] or {}).get("content") or []
        if delta.get("content"):
            if self.open is None or self.items[self.open]["type"] != "message":
                out += self._add(_message("", "in_progress", []))
            item = self.items[self.open]
            part = item["content"][0]
            part["text"] += delta["content"]
            part["logprobs"] += logprobs
            out.append(self._event("response.output_text.delta", item_id=item["id"], output_index=self.open,
                                   content_index=0, delta=delta["content"], logprobs=logprobs))
        for entry in delta.get("tool_calls") or ():
            if entry.get("id") is not None:  # a call opens: its name known, its arguments to come
                out += self._add(_function_call(entry["id"], entry["function"]["name"], "", "in_progress"))
                self.calls[entry["index"]] = self.open
            elif entry["function"].get("arguments"):
                index = self.calls[entry["index"]]
                item = self.items[index]
                item["arguments"] += entry["function"]["arguments"]
                out.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                       output_index=index, delta=entry["function"]["arguments"]))
        return out

    def finish(self, finish_reason: str | None, usage: dict) -> list[str]:
        """The last item's closing events and ``response.completed`` (or ``response.incomplete``)."""
        status, details = _status(finish_reason)
        out = [] if self.items else self._add(_message("", "in_progress", []))  # an empty reply is an empty message
        out += self._close(status)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return out + [self._event(kind, response=self.shape.object(status, self.items, usage, details))]

    def error(self, e: APIError) -> str:
        return self._event("error", code=e.code, message=e.message, param=e.param)
