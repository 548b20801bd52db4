"""Constrained decoding, host side: constraints compiled (and cached) with llguidance, one matcher
per constrained sequence, and the token bitmask each step's sampler applies on device.

Why llguidance, not xgrammar (both on PyPI; measured on SmolLM2's 49,152-token tokenizer over the
15 schemas of tests/data/json_schemas.json, 2-core CPU, llguidance 1.9.1 / xgrammar 0.2.9):

=====================================  ==================  ==================
                                       llguidance          xgrammar
=====================================  ==================  ==================
tokenizer set-up (once per process)    0.26 s              0.11 s
schema compile p50 / p99 / max         0.5 / 1.9 / 2.0 ms  5.4 / 13.9 / 15 ms
mask per token p50 / p99 (random      3 / 181 us          1 / 16 us
walks through every schema)
``not``, ``if``/``then``,              refused by name     ``not`` silently
``uniqueItems``, ``dependentRequired``                     ignored (an output
                                                           that violates the
                                                           schema passes)
runtime dependencies                   none (abi3 wheels)  torch, triton,
                                                           apache-tvm-ffi
=====================================  ==================  ==================

The mask is not the cost that matters: either is microseconds next to a decode step (tens of ms
on this CPU, ~13 ms for 256 sequences of an 8B model on an H200), and llguidance's is computed
while the device runs the step's forward pass. What decides it: llguidance refuses what it cannot
enforce (the engine must never return output that violates the schema it accepted, and the server
owes a 400 naming the keyword), compiles 10x faster (a new schema per request is the common case
for tool calling), accepts Lark and GBNF grammars, and brings in nothing else, whereas xgrammar
needs PyTorch in a JAX engine.

Overlap: the bitmask of a constrained sequence at step N+1 depends on the token it sampled at step
N. The engine dispatches step N+1's forward pass first (its input token is read on device), then
reads step N's tokens and advances the matchers (``consume_token_par``); llguidance then fills the
bitmask from a background thread, without the GIL, while the main thread turns step N's tokens into
outputs (detokenizing, stop strings); the sampling goes last, its bitmask written in place into the
step's reused host transfer buffer (``ModelRunner.run_forward``). A step without constrained
sequences runs the fused step it always did and sends no bitmask.

JSON schemas: what is enforced, relaxed or refused. A schema is compiled as given first; what
llguidance enforces that way the output obeys. A schema that needs a keyword llguidance cannot
enforce is compiled again in its lenient mode, which relaxes that keyword; the relaxation is sound
(every valid document is still allowed) and the client is told (``relaxations``): a log line, the
server's ``X-Structured-Output-Warnings`` header and ``warnings`` list, ``CompletionOutput.warnings``
in the Python API. A relaxed output is then validated against the full schema (``output_warnings``,
with ``jsonschema``), so a violation is reported, never passed off as valid. Under OpenAI's
``strict: true`` a relaxation is refused instead: a 400 naming the keyword.

=========================================  =================================================
keyword                                    policy
=========================================  =================================================
``oneOf`` with disjoint branches (a         enforced: llguidance proves the branches exclusive
``const``/``enum`` tag property, distinct   and compiles it as ``anyOf``
types)
``oneOf`` with overlapping branches         relaxed to ``anyOf``; checked after generation
``uniqueItems``                             relaxed (repeats allowed while generating); checked
                                            after generation
``if``/``then``/``else``,                   relaxed (ignored while generating); checked after
``dependentRequired``/``dependentSchemas``, generation
``not``, ``contains``, other keywords
llguidance does not implement
``format`` llguidance does not know         relaxed to a plain string; not checked after
                                            generation (``jsonschema`` checks no formats)
``properties`` without                      closed: only the listed properties are generated
``additionalProperties``                    (a sound narrowing; keys listed in ``properties``
                                            come once each, in order, so no key repeats)
``additionalProperties``/``patternProperties`` enforced; llguidance cannot forbid a repeated
keys                                        key among them: a repeat is reported after
                                            generation
a document cut off by ``max_tokens``        ``finish_reason`` ``length`` and a warning saying
                                            the JSON is incomplete and where it breaks off
=========================================  =================================================

Whitespace (``EngineConfig.structured_outputs_whitespace``): ``compact`` (the default) allows none,
``default`` writes ``", "`` and ``": "`` as ``json.dumps`` does, ``flexible`` allows any (the model's
own style; greedy SmolLM2 emitted newlines until ``max_tokens`` in 8 of 105 requests). A schema's
own ``"x-guidance"`` options override these.
"""

from __future__ import annotations

import collections
import concurrent.futures
import itertools
import json
import logging
import threading
import time

import numpy as np

from jaxinfer.sampling_params import StructuredOutputs

_CACHE_SIZE = 512  # distinct constraints kept compiled per tokenizer
logger = logging.getLogger(__name__)


def bitmask_width(vocab_size: int) -> int:
    """int32 words of one row of the token bitmask (bit ``t % 32`` of word ``t // 32`` allows token t)."""
    return (vocab_size + 31) // 32


class ConstraintCompiler:
    """Compiles constraints for one tokenizer and vocabulary, caching each distinct one (by
    ``StructuredOutputs.key``): compiling builds and checks the grammar once; every request then
    gets a copy of the compiled matcher, which is cheap."""

    def __init__(self, tokenizer, vocab_size: int | None = None, eos_token_ids=None, whitespace: str = "compact"):
        import llguidance.hf

        if whitespace not in WHITESPACE_OPTIONS:
            raise ValueError(f"structured_outputs_whitespace must be one of {tuple(WHITESPACE_OPTIONS)}, got "
                             f"{whitespace!r}")
        self._json_options = WHITESPACE_OPTIONS[whitespace]  # the JSON's separators, llguidance's options

        if tokenizer is None:
            raise ValueError("structured outputs need a tokenizer; this model has none (dummy weights without "
                             "a tokenizer directory)")
        self.vocab_size = vocab_size or len(tokenizer)
        # The model's EOS ids that the tokenizer knows (a checkpoint paired with another model's
        # tokenizer, as the dummy-weight benchmarks are, may have none: then the tokenizer's own).
        eos = [t for t in eos_token_ids or () if t < len(tokenizer)] or tokenizer.eos_token_id
        self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=self.vocab_size, eos_token=eos)
        self._cache: collections.OrderedDict[str, object] = collections.OrderedDict()
        self._relaxed: dict[str, list[str]] = {}  # key -> the relaxations its schema was compiled with
        self._lock = threading.Lock()  # the server may compile from its request threads
        self.hits = self.misses = 0
        self.compile_seconds: list[float] = []

    def compile(self, structured: StructuredOutputs):
        """The compiled matcher for ``structured`` (a template: call ``.deep_copy()`` per sequence);
        ``ValueError`` naming the problem if the constraint is invalid or unsupported."""
        import llguidance

        if not isinstance(structured, StructuredOutputs):
            raise TypeError(f"structured must be a StructuredOutputs, got {type(structured).__name__}")
        key = structured.key
        with self._lock:
            template = self._cache.get(key)
            if template is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return template
        t0 = time.perf_counter()
        kind = structured.kinds[0]
        what = {"json": "JSON schema (invalid or unsupported)", "json_object": "JSON object constraint"}.get(
            kind, kind)
        relaxed = []
        try:
            if kind == "json":
                grammar, relaxed = _json_grammar(llguidance, getattr(structured, kind), self._json_options)
            else:
                grammar = _grammar(llguidance, kind, getattr(structured, kind), self._json_options)
        except ValueError as e:
            raise ValueError(f"invalid structured {what}: {e}") from None
        template = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
        if template.is_error():
            raise ValueError(f"invalid structured {what}: {_message(template.get_error())}")
        # Some constraints compile but fail at their first token mask: a schema that admits no document
        # ({"$ref": "#"}, mutually recursive $defs) would otherwise be answered "" with reason "stop".
        # The template keeps the mask it computed here, so copies of it start from it.
        template.compute_bitmask()
        if template.is_error():
            raise ValueError(f"invalid structured {what}: it admits no output ({_message(template.get_error())})")
        with self._lock:
            self.misses += 1
            self.compile_seconds.append(time.perf_counter() - t0)
            self._cache[key] = template
            self._relaxed[key] = relaxed
            if len(self._cache) > _CACHE_SIZE:
                self._relaxed.pop(self._cache.popitem(last=False)[0], None)
        if relaxed:
            logger.info("structured json schema relaxed: %s", "; ".join(relaxed))
        return template

    def relaxations(self, structured: StructuredOutputs) -> list[str]:
        """What of ``structured``'s schema the grammar does not enforce (compiling it if need be): one
        sentence each, naming the keyword; empty where it is enforced whole."""
        self.compile(structured)
        with self._lock:
            return list(self._relaxed.get(structured.key, ()))

    def matcher(self, structured: StructuredOutputs):
        """A fresh matcher for one sequence."""
        return self.compile(structured).deep_copy()


def _message(error: str) -> str:
    """llguidance's error without the parser state it dumps after it, on one line."""
    return " ".join(error.split("<state>", 1)[0].split())[:500]


# The whitespace of generated JSON (``EngineConfig.structured_outputs_whitespace``, one per compiler),
# llguidance's options for it.
WHITESPACE_OPTIONS = {
    "compact": {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"},
    "default": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "},
    "flexible": {"whitespace_flexible": True, "item_separator": ",", "key_separator": ":"},
}


def _json_grammar(llguidance, schema, options: dict) -> tuple[str, list[str]]:
    """The grammar of a JSON schema and the relaxations it needed (the module's policy): as given,
    with objects that list their properties closed; else with those left open; else lenient."""
    schema = json.loads(schema) if isinstance(schema, str) else schema
    closed = close_objects(schema)
    error = None
    for overrides in (None, {"lenient": True}):
        for candidate in ([closed, schema] if closed is not schema else [schema]):
            grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(candidate), defaults=options,
                                                                    overrides=overrides)
            failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
            if not failed:
                return grammar, [r for m in messages for r in _relaxation(m)]
            error = error or "; ".join(messages)
    raise ValueError(_message(error))


def _relaxation(message: str) -> list[str]:
    """llguidance's warning of a lenient compile as the client reads it, one sentence a keyword."""
    if message.startswith("Unimplemented keys:"):
        try:
            keys = json.loads(message.split(":", 1)[1])
        except ValueError:
            keys = [message.split(":", 1)[1].strip()]
        return [f"schema keyword '{k}' is not enforced while generating: the output is validated against it "
                "afterwards" for k in keys]
    if message.startswith("oneOf not fully supported"):
        return ["schema keyword 'oneOf' (branches not provably exclusive) is enforced as anyOf: the output is "
                "validated against oneOf afterwards"]
    if message.startswith("Unknown format:"):
        return [f"schema keyword 'format' ({message.split(':', 1)[1].strip()}) is not enforced: any string is "
                "allowed"]
    return ["schema relaxed: " + _message(message)]


# Keywords whose values are data, not schemas; keywords whose values map names to schemas.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples", "required", "x-guidance"})
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


def close_objects(schema):
    """``schema`` with ``additionalProperties: false`` on every object schema that lists ``properties``,
    says nothing of other properties and requires only listed ones: llguidance generates listed
    properties once each, in order, whereas extra keys may repeat, which let greedy SmolLM2 write
    ``{"type": "object", "type": "object", ...}`` until ``max_tokens``. Sound: every document generated
    is valid. Schemas using ``allOf`` (their merges read each part's additional properties) are left
    as they are; so is the whole schema where nothing changes (the same object is returned)."""
    if not isinstance(schema, dict) or "allOf" in json.dumps(schema):
        return schema
    changed = False

    def walk(node):
        nonlocal changed
        if isinstance(node, list):
            return [walk(n) for n in node]
        if not isinstance(node, dict):
            return node
        out = {}
        for k, v in node.items():
            if k in _DATA_KEYWORDS:
                out[k] = v
            elif k in _SCHEMA_MAPS and isinstance(v, dict):
                out[k] = {name: walk(sub) for name, sub in v.items()}
            else:
                out[k] = walk(v)
        props = node.get("properties")
        if (isinstance(props, dict) and props and not {"additionalProperties", "patternProperties",
                                                       "unevaluatedProperties", "$ref", "anyOf", "oneOf"} & node.keys()
                and all(r in props for r in node.get("required", ()) if isinstance(r, str))):
            out["additionalProperties"] = False
            changed = True
        return out

    closed = walk(schema)
    return closed if changed else schema


def output_warnings(structured: StructuredOutputs | None, text: str, finish_reason: str | None,
                    relaxed: list[str] = ()) -> list[str]:
    """What the client should know of a finished JSON output beyond its text: that it is incomplete
    (cut off by ``max_tokens``: where it breaks off), keys repeated in one of its objects, and where
    the schema was ``relaxed`` (``ConstraintCompiler.relaxations``), the relaxations themselves and
    the output's violations of the full schema. Empty for other constraints and clean outputs."""
    if structured is None or not (structured.json is not None or structured.json_object):
        return []
    warnings = list(relaxed)
    repeated = []

    def pairs(items):
        keys = [k for k, _ in items]
        repeated.extend(sorted({k for k in keys if keys.count(k) > 1}))
        return dict(items)

    try:
        doc = json.loads(text, object_pairs_hook=pairs)
    except ValueError as e:
        why = "max_tokens ran out" if finish_reason == "length" else f"generation ended ({finish_reason})"
        warnings.append(f"the output is incomplete: {why} before the JSON document closed; it breaks off at "
                        f"character {len(text)} ({getattr(e, 'msg', e)} at character {getattr(e, 'pos', '?')})")
        return warnings
    if repeated:
        warnings.append("the output repeats keys in one object (the schema's additional properties cannot "
                        "forbid it while generating): " + ", ".join(repr(k) for k in repeated[:5]))
    if relaxed and structured.json is not None:
        warnings += _violations(structured.json, doc)
    return warnings


def _violations(schema, doc, limit: int = 5) -> list[str]:
    """The output's violations of its full schema, ``limit`` at most (``jsonschema``)."""
    import jsonschema  # only here: ~0.1 s to import, and only relaxed schemas need it

    schema = json.loads(schema) if isinstance(schema, str) else schema
    try:
        validator = jsonschema.validators.validator_for(schema)(schema)
        errors = list(itertools.islice(validator.iter_errors(doc), limit))
    except Exception as e:  # a schema jsonschema cannot read (an unresolvable $ref, ...)
        return [f"the output could not be validated against the full schema: {_message(str(e))}"]
    return [f"the output violates the schema at /{'/'.join(map(str, err.absolute_path))}: {err.validator} "
            f"({_message(err.message)[:200]})" for err in errors]


def _grammar(llguidance, kind: str, value, options: dict) -> str:
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}',
                                                             defaults=options)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(value)
    if kind == "choice":
        return llguidance.grammar_from("choice", list(value))
    # A grammar in llama.cpp's GBNF (rules written ``name ::= ...``) is converted to Lark first.
    return llguidance.grammar_from("gbnf" if "::=" in value else "lark", value)


_compilers: dict[tuple, tuple[object, ConstraintCompiler]] = {}  # key -> (tokenizer, its compiler)
_compilers_lock = threading.Lock()


def compiler_for(tokenizer, vocab_size: int | None = None, eos_token_ids=None,
                 whitespace: str = "compact") -> ConstraintCompiler:
    """The process's compiler for this tokenizer, vocabulary and JSON whitespace (built once: ~0.3 s
    for SmolLM2)."""
    key = (id(tokenizer), vocab_size, tuple(eos_token_ids or ()), whitespace)
    with _compilers_lock:
        held = _compilers.get(key)
        if held is None:  # holding the tokenizer keeps its id from being reused by another
            held = _compilers[key] = (tokenizer, ConstraintCompiler(tokenizer, vocab_size, eos_token_ids, whitespace))
        return held[1]


def compile_constraint(tokenizer, structured: StructuredOutputs, vocab_size: int | None = None,
                       eos_token_ids=None, whitespace: str = "compact"):
    """Validate and compile ``structured`` for ``tokenizer`` (cached per process): raises ``ValueError``
    naming the problem. The server calls it to answer 400 before queueing; the engine calls it in
    ``add_request``, and gets the compiled constraint from the cache."""
    return compiler_for(tokenizer, vocab_size, eos_token_ids, whitespace).compile(structured)


class Matchers:
    """The matchers of one engine's constrained requests, keyed by request id. The tokenizer's
    compiler (~0.3 s to build for SmolLM2) and llguidance's threads are made on the first one."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids=(), whitespace: str = "compact"):
        self._compiler_args = (tokenizer, vocab_size, eos_token_ids, whitespace)
        self._by_request: dict[str, object] = {}
        self._constraints: dict[str, StructuredOutputs] = {}
        self._executor = self._filler = None

    def add(self, request_id: str, structured: StructuredOutputs) -> None:
        """A matcher for the request (``ValueError`` for a constraint that does not compile)."""
        import llguidance

        if self._executor is None:
            self._executor = llguidance.LLExecutor()
            self._filler = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="bitmask")
        self._by_request[request_id] = compiler_for(*self._compiler_args).matcher(structured)
        self._constraints[request_id] = structured

    def replay(self, request_id: str, tokens: list[int]) -> None:
        """The request's matcher made anew and advanced over ``tokens`` (its output so far): after a
        failed step it may have taken tokens the request never got."""
        m = self._by_request[request_id] = compiler_for(*self._compiler_args).matcher(self._constraints[request_id])
        for t in tokens:
            m.consume_token(t)

    def remove(self, request_id: str) -> None:
        self._by_request.pop(request_id, None)
        self._constraints.pop(request_id, None)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._by_request

    def __len__(self) -> int:
        return len(self._by_request)

    def advance(self, tokens: list[tuple[str, list[int]]]) -> tuple[set[str], dict[str, str]]:
        """Consume each ``(request id, sampled tokens)`` of a constrained request (others are skipped),
        in parallel. Returns the requests whose constraint is now complete (nothing but EOS may follow)
        and, by request, the error of each whose matcher failed (a grammar that exceeds llguidance's
        limits only when a token arrives, e.g. a row of more than 2000 items): those requests fail
        alone, the step goes on for the rest."""
        import llguidance.numpy

        pairs = [(self._by_request[rid], ids, rid) for rid, ids in tokens if rid in self._by_request]
        if not pairs:
            return set(), {}
        ok = llguidance.numpy.consume_token_par(self._executor, [(m, ids[0]) for m, ids, _ in pairs])
        failed = {}
        for (m, ids, rid), good in zip(pairs, ok):
            if good:
                good = all(m.consume_token(t) for t in ids[1:])  # several decode steps: never constrained
            if not good:
                failed[rid] = (f"the sampled token {ids[0]} broke the request's constraint: "
                               f"{_message(m.get_error())}")
        return {rid for m, _, rid in pairs if rid not in failed and m.is_stopped()}, failed

    def errors(self, request_ids) -> dict[str, str]:
        """The error of each of these requests whose matcher failed (a mask it could not compute)."""
        return {rid: f"the request's constraint failed: {_message(m.get_error())}" for rid in request_ids
                if (m := self._by_request.get(rid)) is not None and m.is_error()}

    def fill(self, bitmask: np.ndarray, rows: list[tuple[int, str]]) -> concurrent.futures.Future:
        """Start writing the allowed tokens of each ``(row, request id)`` into ``bitmask [S, W]`` (int32,
        C order; other rows are left as they are) over llguidance's threads, and return the future to
        wait on before the bitmask is sent; the matchers must not advance until then. A background
        thread makes the call, which holds no GIL while it runs, so the caller's Python work (turning
        the last step's tokens into outputs) runs meanwhile."""
        import llguidance.numpy

        pairs = [(self._by_request[rid], row) for row, rid in rows if rid in self._by_request]
        if not pairs:  # llguidance refuses an empty batch
            done = concurrent.futures.Future()
            done.set_result(None)
            return done
        started = threading.Event()

        def fill():
            started.set()
            llguidance.numpy.fill_next_token_bitmask_par(self._executor, pairs, bitmask)

        future = self._filler.submit(fill)
        # Wait (without the GIL) until the thread runs: were the caller to go on with Python at once,
        # the thread would wait for the GIL up to the interpreter's switch interval (5 ms), longer
        # than the work it is meant to overlap. Once inside llguidance it holds no GIL.
        started.wait()
        return future
