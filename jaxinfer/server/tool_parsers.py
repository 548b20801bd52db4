"""Tool calls in a model's own output format (``tool_choice: "auto"``), one table row per family.

A model that decides to call a tool writes the call in the format its chat template taught it:

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number, after optional
  text (Qwen2/2.5/3, Hermes, and ChatML templates such as SmolLM2's with tools);
- ``llama3_json``: the whole reply is ``{"name": ..., "parameters": {...}}`` (optionally after
  ``<|python_tag|>``, several separated by ``;``), as Llama 3.1+ templates ask for;
- ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``.

The parser is picked from the chat template's own markers (``parser_for_template``) unless the server
is told one (``--tool_call_parser``). Output that does not parse is returned as plain content, as
vLLM does: a malformed call is the model's text, not a server error.

Streamed, a call's arguments are sent as they are written (OpenAI's deltas): ``partial_calls`` (Hermes)
and ``forced_calls`` (``tool_choice`` required or named) find each call's name and the span of its
arguments in a reply still growing, and a finished call's arguments are that span of the model's own
text (``with_raw_arguments``), so the streamed pieces add up to exactly the non-streamed arguments.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re


@dataclasses.dataclass(frozen=True)
class ToolParser:
    name: str
    markers: tuple[str, ...]  # text that begins the tool-call part of a reply
    at_start_only: bool  # the markers count only at the start of the reply (after whitespace)
    template_hints: tuple[str, ...]  # chat-template text that identifies the family

    def extract(self, text: str) -> tuple[str | None, list[dict]]:
        """(content, calls): calls as {"name", "arguments": JSON text}; no calls -> (text, [])."""
        start = self.tool_start(text)
        if start is None:
            return text, []
        try:
            calls = [to_call(obj) for obj in _EXTRACT[self.name](text[start:])]
        except (ValueError, TypeError, KeyError):
            return text, []
        if not calls:
            return text, []
        content = text[:start].strip()
        return content or None, with_raw_arguments(text, calls, self.partial_calls(text))

    def partial_calls(self, text: str) -> list[tuple[int, str, int, int | None]]:
        """The calls of a partial reply whose name is known and whose arguments object has begun, as
        ``(index, name, arguments start, arguments end or None while open)``, so the arguments can be
        streamed as they are written. Hermes calls written name first (as its template shows them);
        other formats and orders get no entry and are sent whole once the reply is complete."""
        start = self.tool_start(text) if self.name == "hermes" else None
        if start is None:
            return []
        found = []
        for k, block in enumerate(_HERMES_BLOCK.finditer(text, start)):
            call = _partial_call(text, block.start(1))
            if call is not None and (call[2] is None or call[2] <= block.end(1)):
                found.append((k, *call))
        return found

    def tool_start(self, text: str) -> int | None:
        """Where the tool-call part of ``text`` begins, or None if it has none (yet)."""
        if self.at_start_only:
            stripped = text.lstrip()
            return len(text) - len(stripped) if stripped.startswith(self.markers) else None
        found = [i for i in (text.find(m) for m in self.markers) if i >= 0]
        return min(found) if found else None

    def streamable(self, text: str) -> int:
        """How many leading characters of a partial reply are content for sure: text before a marker,
        less any tail that could still grow into one."""
        start = self.tool_start(text)
        if start is not None:
            return start
        if self.at_start_only:
            stripped = text.lstrip()
            undecided = not stripped or any(m.startswith(stripped) for m in self.markers)
            return 0 if undecided else len(text)
        hold = max((k for m in self.markers for k in range(1, len(m)) if text.endswith(m[:k])), default=0)
        return len(text) - hold


def to_call(obj) -> dict:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise ValueError("a tool call is an object with a string 'name'")
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as JSON text already
        args = json.loads(args)
    if not isinstance(args, dict):
        raise ValueError("tool-call arguments must be an object")
    return {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}


_HERMES_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def _hermes(text: str) -> list:
    return [json.loads(m) for m in _HERMES_BLOCK.findall(text)]


def _llama3_json(text: str) -> list:
    text = text.strip().removeprefix("<|python_tag|>").strip()
    decoder, objs, pos = json.JSONDecoder(), [], 0
    while pos < len(text):
        obj, pos = decoder.raw_decode(text, pos)
        objs.append(obj)
        pos = len(text) - len(text[pos:].lstrip().removeprefix(";").lstrip())
    return objs


def _mistral(text: str) -> list:
    text = text.strip().removeprefix("[TOOL_CALLS]").strip()
    obj, end = json.JSONDecoder().raw_decode(text)
    if text[end:].strip():
        raise ValueError("text after Mistral tool calls")
    return obj if isinstance(obj, list) else [obj]


# ------------------------------------------------------------------ arguments as they are written

_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')
_JSON_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*("|\\?\Z)|[{}\[\]]')  # a string (closed or not), or a bracket
_NEXT_CALL = re.compile(r"\s*\}\s*,\s*")


def json_end(text: str, start: int) -> int | None:
    """Where the JSON object or array opening at ``text[start]`` ends (one past its closing bracket),
    or None while it is still open."""
    depth = 0
    for m in _JSON_TOKEN.finditer(text, start):
        c = m.group()
        if c[0] == '"':
            if m.group(1) != '"':  # a string still open at the end of the text
                return None
        elif c in "{[":
            depth += 1
        else:
            depth -= 1
            if depth == 0:
                return m.end()
    return None


def _partial_call(text: str, pos: int) -> tuple[str, int, int | None] | None:
    """``{"name": "...", "arguments": {`` at ``pos``: (name, arguments start, end or None); else None."""
    m = _CALL_HEAD.match(text, pos)
    if m is None or not text.startswith("{", m.end()):
        return None
    return json.loads(m.group(1)), m.end(), json_end(text, m.end())


def forced_calls(text: str, named: str | None) -> list[tuple[int, str, int, int | None]]:
    """``partial_calls`` for a reply generated under ``tool_choice`` (constraints.tool_call_schema): a
    named function's arguments object, or ``[{"name", "arguments"}, ...]`` (one object without
    parallel calls), whose properties the grammar writes in the schema's order."""
    if named is not None:
        start = len(text) - len(text.lstrip())
        return [(0, named, start, json_end(text, start))] if text.startswith("{", start) else []
    found, pos = [], len(text) - len(text.lstrip().removeprefix("["))
    while (call := _partial_call(text, pos)) is not None:
        found.append((len(found), *call))
        nxt = _NEXT_CALL.match(text, call[2]) if call[2] is not None else None
        if nxt is None:
            break
        pos = nxt.end()
    return found


def with_raw_arguments(text: str, calls: list[dict], spans) -> list[dict]:
    """``calls`` with each one's arguments as the model wrote them (``spans`` from ``partial_calls``
    or ``forced_calls``) where that text is the same JSON, so a streamed call's pieces add up to
    exactly the arguments of the same reply not streamed."""
    out = [dict(c) for c in calls]
    for k, name, a, b in spans:
        if b is not None and k < len(out) and out[k]["name"] == name:
            with contextlib.suppress(ValueError):
                if json.loads(text[a:b]) == json.loads(out[k]["arguments"]):
                    out[k]["arguments"] = text[a:b]
    return out


_EXTRACT = {"hermes": _hermes, "llama3_json": _llama3_json, "mistral": _mistral}

PARSERS = {p.name: p for p in (
    ToolParser("hermes", ("<tool_call>",), False, ("<tool_call>",)),
    # Mistral's [TOOL_CALLS] is a special token that detokenization may drop, leaving the JSON list.
    ToolParser("mistral", ("[TOOL_CALLS]", "[{"), True, ("[TOOL_CALLS]", "[AVAILABLE_TOOLS]")),
    ToolParser("llama3_json", ("<|python_tag|>", "{"), True, ("<|python_tag|>", "Environment: ipython")),
)}
DEFAULT = "hermes"


def parser_for_template(template: str | None) -> ToolParser:
    """The parser whose family's markers the chat template uses (Hermes when none match)."""
    for parser in PARSERS.values():
        if template and any(h in template for h in parser.template_hints):
            return parser
    return PARSERS[DEFAULT]


def get_parser(name: str) -> ToolParser:
    if name not in PARSERS:
        raise ValueError(f"unknown tool_call_parser {name!r}; expected one of {', '.join(PARSERS)}")
    return PARSERS[name]
