"""What /openapi.json cannot say, told to Schemathesis, so the requests it draws as valid are requests
the server can serve and "schema-valid data is accepted" can be checked.

- Values for the string formats the description names: ``grammar`` (Lark or GBNF) and ``json-schema``
  (JSON text). ``regex`` is JSON Schema's own and Schemathesis draws it. Its coverage phase draws plain
  strings for formats it does not know: such valid drawn requests are left out (llguidance's grammar
  parser and ``json.loads`` say what is a grammar and a schema's text).
- A named ``tool_choice`` must name one of ``tools``, and ``auto`` / ``required`` need some (on
  /v1/responses only ``required``: ``auto`` without tools is its default): references between fields,
  which JSON Schema has no word for. Valid drawn requests are made to agree.
- A request must fit the server (tests/fuzz_openapi.py's flags): its prompt plus ``max_tokens`` within
  the context (an embedding's every input within it), its prompts x ``n`` within the sequences it holds. Tokens cannot be counted from the
  schema, so valid drawn requests are kept only where a bound says they fit: a prompt's UTF-8 bytes
  (byte-level BPE: at most one token a byte), a chat's messages (a Responses request's ``input`` and
  ``instructions``) and tools as JSON plus the chat template's own tokens (SmolLM2's with tools: 154 for
  one short message and one tool).
- ``logit_bias`` keys must be token ids of the served model's vocabulary and ``min_tokens`` at most
  the tokens asked for (or the room the prompt leaves): the vocabulary and the prompt's tokens are not
  in the schema, so valid drawn requests send neither (null).
- A constraint must admit text the model can write: SmolLM2's tokenizer (the served model's) has no
  token for 21 bytes (``missing_bytes``), so a regex or choice whose every output needs one (``"\\x04"``)
  is refused as admitting no output, and a prompt of only such bytes as encoding to no tokens. That is
  a fact of the model, not of the request's shape, so such valid drawn requests are left out.

``schemathesis run`` loads it with ``SCHEMATHESIS_HOOKS=openapi_hooks`` and tests/ on ``PYTHONPATH``
(tests/fuzz_openapi.py does both); tests/test_server_fuzz.py imports it.
"""

import functools
import json

import schemathesis
from hypothesis import strategies as st

from fuzz_openapi import MAX_MODEL_LEN, MAX_NUM_SEQS, MAX_WAITING

TEMPLATE_TOKENS = {False: 40, True: 160}  # at most, by whether tools are given (measured: 31 and 154)

_WORD = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789 ", min_size=1, max_size=6)


def _grammar(literals: list[str], gbnf: bool) -> str:
    alternatives = " | ".join(json.dumps(text) for text in literals)
    return f"root ::= {alternatives}" if gbnf else f"start: {alternatives}"


schemathesis.openapi.format("grammar", st.builds(_grammar, st.lists(_WORD, min_size=1, max_size=3), st.booleans()))
_SCHEMAS = st.sampled_from([{"type": t} for t in ("string", "integer", "number", "boolean", "null", "object")]) | \
    st.builds(lambda words: {"enum": words}, st.lists(_WORD, min_size=1, max_size=3, unique=True)) | \
    st.builds(lambda names: {"type": "object", "properties": {n: {"type": "integer"} for n in names},
                             "required": names}, st.lists(_WORD, max_size=2, unique=True))
schemathesis.openapi.format("json-schema", _SCHEMAS.map(json.dumps))


@functools.cache
def missing_bytes() -> frozenset[int]:
    """The bytes no token of SmolLM2's byte-level vocabulary spells (0x04, 0xc0, 0xf1, ...)."""
    from jaxinfer.models.weights import resolve_model
    from jaxinfer.tokenizer import load_tokenizer

    # GPT-2's byte-level alphabet: printable bytes stand for themselves, the rest for chr(256 + i).
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    char_of = {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}
    vocab = load_tokenizer(resolve_model("smollm2-135m")).get_vocab()
    return frozenset(b for b, char in char_of.items() if char not in vocab)


def _unwritable(text) -> bool:
    return isinstance(text, str) and not missing_bytes().isdisjoint(text.encode("utf-8", "surrogatepass"))


def _unreadable(text: str) -> bool:
    """Text that encodes to no tokens: every byte one the vocabulary lacks."""
    return set(text.encode("utf-8", "surrogatepass")) <= missing_bytes()


def _constraint_texts(body: dict):
    for key in ("guided_regex", "guided_choice"):
        yield body.get(key)
    so = body.get("structured_outputs")
    if isinstance(so, dict):
        yield so.get("regex")
        yield so.get("choice")


def _is_grammar(text: str) -> bool:
    import llguidance

    try:
        return not llguidance.LLMatcher.validate_grammar(llguidance.grammar_from("gbnf" if "::=" in text else "lark",
                                                                                 text), None)
    except ValueError:
        return False


def _is_schema_text(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict | bool)
    except ValueError:
        return False


def _formatted(body: dict):
    """(value, checker) for each string of a ``grammar`` or ``json-schema`` format in ``body``."""
    so = body.get("structured_outputs") if isinstance(body.get("structured_outputs"), dict) else {}
    for value, check in ((body.get("guided_grammar"), _is_grammar), (so.get("grammar"), _is_grammar),
                         (body.get("guided_json"), _is_schema_text), (so.get("json"), _is_schema_text)):
        if isinstance(value, str):
            yield value, check


def _positive(case) -> bool:
    meta = case.meta
    return meta is None or meta.generation.mode == schemathesis.GenerationMode.POSITIVE


# Case hooks rather than body hooks: Schemathesis applies these in every phase (coverage included).
@schemathesis.hook
def filter_case(ctx, case):
    body = case.body
    if not _positive(case) or not isinstance(body, dict):
        return True
    for value in _constraint_texts(body):
        if any(_unwritable(text) for text in (value if isinstance(value, list) else [value])):
            return False
    for key in ("prompt", "input"):
        prompts = body.get(key) if isinstance(body.get(key), list) else [body.get(key)]
        if any(isinstance(p, str) and _unreadable(p) for p in prompts):
            return False
    if body.get("prompt_logprobs") is not None and body.get("stream") is True:
        return False  # refused (the chat route's description says so in words only)
    # The coverage phase draws plain strings (boundary lengths) for formats it does not know.
    # /tokenize has no room to fit
    generates = case.operation.path in ("/v1/completions", "/v1/chat/completions", "/v1/responses")
    embeds = case.operation.path == "/v1/embeddings"
    flat = case.operation.path == "/v1/responses"
    return all(check(value) for value, check in _formatted(body)) and (not generates or _fits(body, flat)) and \
        (not embeds or max(_sizes(body.get("input"))) <= MAX_MODEL_LEN)


def _fits(body: dict, flat: bool) -> bool:
    """Whether the request surely fits the server: prompt tokens (bounded from above) plus the
    tokens asked for within the context, prompts x n within running + waiting."""
    count = lambda v: int(v) if type(v) in (int, float) else None  # noqa: E731  (JSON's integers: 3 or 3.0)
    n = count(body.get("n")) or 1
    asked = next((count(v) for v in (body.get("max_completion_tokens"), body.get("max_tokens"),
                                     body.get("max_output_tokens")) if count(v)), 1)
    if "messages" in body or flat:
        tools = _mended_tools(body, flat) or None  # filter_case runs before map_case adds them
        conversation = [body.get("instructions"), body.get("input")] if flat else body["messages"]
        size = len(json.dumps(conversation, ensure_ascii=False).encode()) + TEMPLATE_TOKENS[tools is not None]
        if tools is not None:
            size += len(json.dumps(tools, ensure_ascii=False).encode())
        prompts = [size]
    else:
        prompts = _sizes(body.get("prompt"))
    return max(prompts) + asked <= MAX_MODEL_LEN and len(prompts) * n <= MAX_NUM_SEQS + MAX_WAITING


def _sizes(prompt) -> list[int]:
    """Each prompt's tokens at most (a text's UTF-8 bytes), of a ``prompt`` or ``input`` field."""
    many = isinstance(prompt, list) and prompt and isinstance(prompt[0], list | str)
    return [len(p) if isinstance(p, list) else len(p.encode("utf-8", "surrogatepass"))
            for p in (prompt if many else [prompt])]


def _mended_tools(body: dict, flat: bool):
    """``tools`` as ``map_case`` leaves them: one tool named as a named ``tool_choice`` (or ``f``) added
    where ``tool_choice`` needs tools and none are given; else as drawn. ``flat``: a /v1/responses body,
    whose tools and named tool_choice are ``{type, name}``."""
    choice, tools = body.get("tool_choice"), body.get("tools")
    needs = ("required",) if flat else ("auto", "required")
    if tools or not (_named(choice) or choice in needs):
        return tools
    name = _choice_name(choice) if _named(choice) and 1 <= len(_choice_name(choice)) <= 64 else "f"
    return [{"type": "function", "name": name} if flat else {"type": "function", "function": {"name": name}}]


def _named(choice) -> bool:
    return isinstance(choice, dict) and isinstance(_choice_name(choice), str)


def _choice_name(choice: dict):
    """The function a named tool_choice names: ``function.name`` (chat) or ``name`` (Responses)."""
    return choice["function"].get("name") if isinstance(choice.get("function"), dict) else choice.get("name")


@schemathesis.hook
def map_case(ctx, case):
    body = case.body
    if not _positive(case) or not isinstance(body, dict):
        return case
    for field in ("logit_bias", "min_tokens"):
        if body.get(field) is not None:
            body[field] = None
    flat = case.operation.path == "/v1/responses"
    if "messages" not in body and not flat:
        return case
    tools = _mended_tools(body, flat)
    if tools is not body.get("tools"):
        body["tools"] = tools
    if _named(body.get("tool_choice")):  # positive: tools are well formed, and some are given or added
        if flat:
            body["tool_choice"]["name"] = tools[0]["name"]
        else:
            body["tool_choice"]["function"]["name"] = tools[0]["function"]["name"]
    return case
