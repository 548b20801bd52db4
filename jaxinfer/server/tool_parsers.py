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
"""

from __future__ import annotations

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
        return content or None, calls

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


def _hermes(text: str) -> list:
    return [json.loads(m) for m in re.findall(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", text, re.DOTALL)]


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
