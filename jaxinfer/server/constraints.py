"""A request's output constraint: OpenAI's ``response_format``, vLLM's ``guided_*`` and
``structured_outputs`` fields, and forced tool calls (``tool_choice`` required or named), all mapped
onto one ``StructuredOutputs`` and compiled before anything is queued, so a bad one is a 400 naming
the field and costs the engine nothing."""

from __future__ import annotations

import dataclasses

from jaxinfer.batching.structured import compile_constraint
from jaxinfer.sampling_params import StructuredOutputs
from jaxinfer.server.protocol import APIError


@dataclasses.dataclass(frozen=True)
class ToolPlan:
    """How a chat request uses its tools: ``mode`` is none, auto, required or named."""

    mode: str
    tools: list[dict]  # OpenAI tool objects, as the chat template takes them
    named: str | None = None  # the forced function (mode "named")
    parallel: bool = True


def _requested(req) -> list[tuple[str, StructuredOutputs]]:
    """(param, constraint) for each constraint field the request set."""
    found = []

    def add(param: str, **kind) -> None:
        try:
            found.append((param, StructuredOutputs(**kind)))
        except (ValueError, TypeError) as e:
            raise APIError(400, f"{param}: {e}", param=param) from None

    fmt = getattr(req, "response_format", None)
    if fmt is not None and fmt.type == "json_object":
        add("response_format", json_object=True)
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise APIError(400, "response_format of type 'json_schema' needs json_schema.schema",
                           param="response_format")
        add("response_format", json=fmt.json_schema.schema_)
    for param, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_grammar", "grammar")):
        if getattr(req, param) is not None:
            add(param, **{kind: getattr(req, param)})
    if req.guided_choice is not None:
        add("guided_choice", choice=tuple(req.guided_choice))
    if req.structured_outputs is not None:
        so = req.structured_outputs
        kinds = {k: v for k, v in (("json", so.json_), ("json_object", so.json_object), ("regex", so.regex),
                                   ("choice", None if so.choice is None else tuple(so.choice)),
                                   ("grammar", so.grammar)) if v not in (None, False)}
        add("structured_outputs", **kinds)
    return found


def tool_plan(req) -> ToolPlan:
    """The request's tool use, checked against its tools (a 400 naming the field if inconsistent)."""
    tools = [t.model_dump(exclude_none=True) for t in req.tools or ()]
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
    if isinstance(choice, str):
        if choice in ("auto", "required") and not tools:
            raise APIError(400, f"tool_choice {choice!r} needs tools", param="tool_choice")
        return ToolPlan(choice, tools if choice != "none" else [], parallel=req.parallel_tool_calls)
    names = [t["function"]["name"] for t in tools]
    if choice.function.name not in names:
        raise APIError(400, f"tool_choice names function {choice.function.name!r}, which is not among the tools "
                            f"({', '.join(map(repr, names)) or 'none given'})", param="tool_choice")
    return ToolPlan("named", tools, named=choice.function.name, parallel=req.parallel_tool_calls)


def tool_call_schema(plan: ToolPlan) -> dict:
    """The JSON schema a forced tool call is generated under. Named: the function's arguments object.
    Required: {"name", "arguments"} for one of the tools (anyOf), a non-empty array of them when
    parallel calls are allowed."""
    params = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in plan.tools}
    if plan.mode == "named":
        return params[plan.named]
    one = {"anyOf": [{"type": "object", "properties": {"name": {"const": name}, "arguments": schema},
                      "required": ["name", "arguments"], "additionalProperties": False}
                     for name, schema in params.items()]}
    return {"type": "array", "items": one, "minItems": 1} if plan.parallel else one


def request_constraint(req, tokenizer, plan: ToolPlan | None = None) -> StructuredOutputs | None:
    """The one constraint of a request, validated and compiled (cached), or None."""
    found = _requested(req)
    if plan is not None and plan.mode in ("required", "named"):
        found.append(("tools" if plan.mode == "required" else "tool_choice",
                      StructuredOutputs(json=tool_call_schema(plan))))
    if not found:
        return None
    if len(found) > 1:
        raise APIError(400, "a request takes one output constraint; got " + ", ".join(p for p, _ in found) +
                       (" (tool_choice required or a named function is one)" if plan and plan.mode in
                        ("required", "named") else ""), param=found[1][0])
    param, structured = found[0]
    if tokenizer is None:
        raise APIError(400, f"{param}: constrained output needs a tokenizer; this model has none", param=param)
    try:
        compile_constraint(tokenizer, structured)
    except ValueError as e:
        raise APIError(400, f"{param}: {e}", param=param, code="invalid_constraint") from None
    return structured
