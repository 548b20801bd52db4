"""A request's output constraint: OpenAI's ``response_format``, vLLM's ``guided_*`` and
``structured_outputs`` fields, and forced tool calls (``tool_choice`` required or named), all mapped
onto one ``StructuredOutputs`` and compiled before anything is queued, so a bad one is a 400 naming
the field and costs the engine nothing."""

from __future__ import annotations

import dataclasses
import json

from jaxinfer.batching.structured import ConstraintCompiler
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
        schema = fmt.json_schema.schema_
        add("response_format", json=strict_schema(schema, "response_format") if fmt.json_schema.strict else schema)
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


def strict_schema(schema, param: str):
    """``schema`` under OpenAI's ``strict: true``: properties not listed are forbidden, so every object
    schema in it gets ``additionalProperties: false``; one that allows more (``true`` or a schema) is a
    400, as OpenAI answers it. (JSON Schema's and llguidance's default is to allow them.) A schema
    given as JSON text is parsed first; a non-object is left for the compiler to refuse."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError:
            return schema

    def walk(node, where: str):
        if isinstance(node, list):
            return [walk(n, f"{where}[{i}]") for i, n in enumerate(node)]
        if not isinstance(node, dict):
            return node
        if "allOf" in node:  # its parts, each closed to the others' properties, would admit no object at all
            raise APIError(400, f"{param}: allOf is not supported with strict ({where or 'the schema'}); merge "
                                "its parts into one object schema", param=param, code="invalid_schema")
        out = {k: walk(v, f"{where}.{k}") if k in _SUBSCHEMAS else
               {name: walk(sub, f"{where}.{k}.{name}") for name, sub in v.items()} if k in _SCHEMA_MAPS and
               isinstance(v, dict) else v for k, v in node.items()}
        types = node.get("type")
        if types == "object" or (isinstance(types, list) and "object" in types) or "properties" in node:
            extra = node.get("additionalProperties", False)
            if extra is not False:
                raise APIError(400, f"{param}: with strict, additionalProperties must be false (properties not "
                                    f"listed are not allowed); {where or 'the schema'} sets it to "
                                    f"{json.dumps(extra)}", param=param, code="invalid_schema")
            out["additionalProperties"] = False
        return out

    return walk(schema, "")


# Keywords whose value is a schema or a list of schemas, and those whose value maps names to schemas.
_SUBSCHEMAS = frozenset({"items", "prefixItems", "additionalItems", "contains", "anyOf", "oneOf", "not",
                         "if", "then", "else", "additionalProperties", "unevaluatedProperties", "propertyNames"})
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


def tool_plan(req) -> ToolPlan:
    """The request's tool use, checked against its tools (a 400 naming the field if inconsistent,
    including a ``strict`` function whose parameters allow unlisted properties)."""
    tools = [t.model_dump(exclude_none=True) for t in req.tools or ()]
    for tool in tools:
        _parameters(tool)
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
    parallel calls are allowed. A ``strict`` function's arguments allow no unlisted properties.

    Nested under ``arguments``, a tool's parameters would lose their local references (pydantic's
    ``#/$defs/Model``), so each tool's ``$defs``/``definitions`` move to the built schema's root
    ``$defs`` (a name that another tool already took gets this tool's name in front) and every
    local ``$ref`` is rewritten to where its target now is."""
    params = {t["function"]["name"]: _parameters(t) for t in plan.tools}
    if plan.mode == "named":
        return params[plan.named]
    defs: dict = {}
    at = ["items"] if plan.parallel else []
    one = {"anyOf": [{"type": "object", "properties": {
        "name": {"const": name},
        "arguments": _hoist_defs(schema, name, [*at, "anyOf", str(i), "properties", "arguments"], defs)},
        "required": ["name", "arguments"], "additionalProperties": False}
        for i, (name, schema) in enumerate(params.items())]}
    built = {"type": "array", "items": one, "minItems": 1} if plan.parallel else one
    return {**built, "$defs": defs} if defs else built


def _hoist_defs(schema, tool: str, at: list[str], defs: dict):
    """``schema`` (a tool's parameters, to be placed at path ``at``) without its root definitions,
    which are added to ``defs`` (renamed where taken), its local references rewritten to match."""
    if not isinstance(schema, dict):
        return schema
    renames = {}
    for key in ("$defs", "definitions"):
        for name in schema.get(key) or {}:
            new, n = name, 1
            while new in defs or new in renames.values():
                new, n = f"{tool}.{name}" + (f".{n}" if n > 1 else ""), n + 1
            renames[(key, name)] = new

    def moved(ref: str) -> str:
        parts = [p.replace("~1", "/").replace("~0", "~") for p in ref[2:].split("/")] if ref != "#" else []
        if len(parts) >= 2 and (parts[0], parts[1]) in renames:
            parts = ["$defs", renames[(parts[0], parts[1])], *parts[2:]]
        else:
            parts = [*at, *parts]
        return "#/" + "/".join(p.replace("~", "~0").replace("/", "~1") for p in parts)

    def walk(node):
        if isinstance(node, list):
            return [walk(n) for n in node]
        if not isinstance(node, dict):
            return node
        out = {k: v if k in _DATA else walk(v) for k, v in node.items()}
        ref = node.get("$ref")
        if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
            out["$ref"] = moved(ref)
        return out

    for (key, name), new in renames.items():
        defs[new] = walk(schema[key][name])
    return walk({k: v for k, v in schema.items() if k not in ("$defs", "definitions")})


_DATA = frozenset({"const", "enum", "default", "examples"})  # keywords whose values are data, not schemas


def _parameters(tool: dict) -> dict:
    """The schema a call of ``tool`` is generated under: its parameters, made strict if it says so
    (the chat template still renders the parameters as given)."""
    fn = tool["function"]
    params = fn.get("parameters") or {"type": "object"}
    return strict_schema(params, "tools") if fn.get("strict") else params


def request_constraint(req, compiler: ConstraintCompiler | None, plan: ToolPlan | None = None
                       ) -> StructuredOutputs | None:
    """The one constraint of a request, validated and compiled (cached) by the server's ``compiler``
    (None: the model has no tokenizer), or None."""
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
    if compiler is None:
        raise APIError(400, f"{param}: constrained output needs a tokenizer; this model has none", param=param)
    try:
        compiler.compile(structured)
    except ValueError as e:
        raise APIError(400, f"{param}: {e}", param=param, code="invalid_constraint") from None
    relaxed = compiler.relaxations(structured) if _strict(req, param, plan) else []
    if relaxed:  # strict: true asks that the output obey the schema, so nothing may be relaxed
        raise APIError(400, f"{param}: strict: true, but the grammar cannot enforce the whole schema: "
                            + "; ".join(relaxed) + " (without strict the schema is relaxed and the output "
                            "checked afterwards)", param=param, code="invalid_constraint")
    return structured


def _strict(req, param: str, plan: ToolPlan | None) -> bool:
    """Whether the request's constraint came with OpenAI's ``strict: true``."""
    if param == "response_format":
        fmt = req.response_format
        return fmt.type == "json_schema" and bool(fmt.json_schema.strict)
    if param in ("tools", "tool_choice") and plan is not None:
        fns = [t["function"] for t in plan.tools if t.get("type") == "function"]
        return bool(fns) and all(fn.get("strict") for fn in fns)
    return False
