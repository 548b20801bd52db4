"""Structured outputs (constrained decoding) with the embedded model: every output satisfies its
constraint, free requests are untouched by constrained neighbours, preemption is exact, and bad
constraints are refused before anything is scheduled."""

import ast
import json
import os
import re

import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams, StructuredOutputs
from jaxinfer.batching.structured import ConstraintCompiler, compile_constraint
from jaxinfer.sampling import apply_bitmask

SCHEMAS = json.load(open(os.path.join(os.path.dirname(__file__), "data", "json_schemas.json")))
TOPICS = ["a customer", "a city", "a product", "a book", "the weather", "a game", "a recipe"]
OPTS = dict(max_num_seqs=32, max_model_len=512)


@pytest.fixture(scope="module")
def llm():
    return LLM("smollm2-135m", **OPTS)


def greedy(n=48, **kw):
    return SamplingParams(max_tokens=n, temperature=0.0, **kw)


def test_json_schemas_every_output_validates(llm):
    assert len(SCHEMAS) >= 15
    # two prompts per schema: 30 requests, one wave of the engine's 32 sequences
    cases = [(c, f"JSON describing {t}:") for c in SCHEMAS for t in ("a customer", "a recipe")]
    outs = [o.outputs[0] for o in llm.generate([p for _, p in cases],
                                               [greedy(192, structured=StructuredOutputs(json=c["schema"]))
                                                for c, _ in cases])]
    checker = jsonschema.FormatChecker()
    for (case, prompt), out in zip(cases, outs):
        assert out.finish_reason == "stop", (case["name"], prompt, out.text)
        jsonschema.validate(json.loads(out.text), case["schema"], format_checker=checker)
    # Different prompts take different paths through each schema, not one memorized answer.
    assert len({o.text for o in outs}) > len(SCHEMAS) * 1.5


def _arithmetic(text: str) -> bool:
    """Whether ``text`` is an arithmetic expression: numbers, + - * /, parentheses. Numbers may have
    leading zeros ("08": both grammars allow them, Python's parser does not, so they are dropped)."""
    try:
        tree = ast.parse(re.sub(r"\b0+(?=\d)", "", text), mode="eval")
    except SyntaxError:
        return False
    allowed = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Constant, ast.Add, ast.Sub, ast.Mult, ast.Div,
               ast.USub, ast.UAdd)
    return all(isinstance(n, allowed) for n in ast.walk(tree)) and all(
        isinstance(n.value, (int, float)) for n in ast.walk(tree) if isinstance(n, ast.Constant))


LARK_ARITH = r"""
start: expr
expr: term (("+" | "-") term)~0..3
term: factor (("*" | "/") factor)~0..2
factor: NUMBER | "(" expr ")"
NUMBER: /[0-9]{1,4}/
"""
GBNF_ARITH = r"""
root ::= expr
expr ::= term (("+" | "-" | "*") term){0,3}
term ::= num
num ::= [0-9] | [0-9] [0-9]
"""


def test_regex_choice_grammar_and_json_object_outputs_match(llm):
    regexes = [r"[0-9]{3}-[0-9]{4}", r"(red|green|blue) [a-z]{3,8}", r"[A-Z][a-z]+, [0-9]{4}-[0-9]{2}-[0-9]{2}"]
    choices = [("yes", "no", "maybe"), ("Paris", "London", "Berlin", "Rome"), ("positive", "negative")]
    prompts = ["Call me at", "My favourite colour is", "Signed and dated:", "Is the sky blue? Answer:",
               "The capital of France is", "The review was", "2 + 3 * (4 - 1) =", "Compute:", "A JSON object:"]
    kinds = ([StructuredOutputs(regex=r) for r in regexes] + [StructuredOutputs(choice=c) for c in choices]
             + [StructuredOutputs(grammar=LARK_ARITH), StructuredOutputs(grammar=GBNF_ARITH),
                StructuredOutputs(json_object=True)])
    # Greedy and sampled (every sampling filter, penalties), so the mask composes with each.
    sampled = dict(temperature=0.9, top_p=0.9, top_k=50, min_p=0.01, presence_penalty=0.5, frequency_penalty=0.5)
    params = [SamplingParams(max_tokens=64, structured=k, **({} if i % 2 else dict(temperature=0.0)),
                             **(dict(sampled, seed=i) if i % 2 else {})) for i, k in enumerate(kinds)]
    outs = [o.outputs[0] for o in llm.generate(prompts, params)]
    for r, out in zip(regexes, outs[:3]):
        assert re.fullmatch(r, out.text), (r, out.text)
    for c, out in zip(choices, outs[3:6]):
        assert out.text in c and out.finish_reason == "stop", (c, out.text)
    for out in outs[6:8]:
        assert out.finish_reason == "stop" and _arithmetic(out.text), out.text
    assert isinstance(json.loads(outs[8].text), dict)


def test_max_tokens_and_stop_strings_cut_constrained_output(llm):
    schema = SCHEMAS[0]["schema"]
    full, cut, stopped = (o.outputs[0] for o in llm.generate(["JSON describing a customer:"] * 3, [
        greedy(64, structured=StructuredOutputs(json=schema)),
        greedy(5, structured=StructuredOutputs(json=schema), logprobs=2),
        greedy(64, structured=StructuredOutputs(json=schema), stop=['"age"'])]))
    assert full.finish_reason == "stop" and '"age"' in full.text
    assert cut.finish_reason == "length" and cut.token_ids == full.token_ids[:5]
    assert [len(lp) >= 1 and t in lp for t, lp in zip(cut.token_ids, cut.logprobs)] == [True] * 5
    assert stopped.finish_reason == "stop" and stopped.text == full.text[:full.text.index('"age"')]


def test_free_requests_unchanged_by_constrained_neighbours(llm):
    free = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "The three primary colours are"]
    alone = llm.generate(free, greedy(24, ignore_eos=True))
    constrained = [greedy(48, structured=StructuredOutputs(json=c["schema"])) for c in SCHEMAS[:4]]
    mixed = llm.generate([p for pair in zip(free, TOPICS) for p in pair],
                         [p for pair in zip([greedy(24, ignore_eos=True)] * 4, constrained) for p in pair])
    assert [o.outputs[0].token_ids for o in mixed[0::2]] == [o.outputs[0].token_ids for o in alone]


@pytest.fixture(scope="module")
def preemption_case(llm):
    """Long prompts with constrained outputs (greedy and seeded sampling), and each one's output alone."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, 40000, 60).tolist() + llm.tokenizer.encode(f" JSON describing {t}:")
               for t in TOPICS[:4]]
    schemas = [SCHEMAS[i]["schema"] for i in (0, 3, 8, 14)]
    params = [SamplingParams(max_tokens=48, structured=StructuredOutputs(json=s),
                             **(dict(temperature=0.8, seed=i) if i % 2 else dict(temperature=0.0)))
              for i, s in enumerate(schemas)]
    alone = [llm.generate([p], sp)[0].outputs[0].token_ids for p, sp in zip(prompts, params)]
    return prompts, params, schemas, alone


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_matcher_state_exact(preemption_case, mode):
    """A pool too small for all the requests: constrained requests are preempted mid-output and
    must produce what each produces alone."""
    prompts, params, schemas, alone = preemption_case
    # 65-token prompts take 5 pages each: two fill the 10 and either one's next page preempts the other
    small = LLM("smollm2-135m", **{**OPTS, "max_num_seqs": 4, "max_model_len": 128, "num_pages": 10,
                                   "preemption_mode": mode})
    together = small.generate(prompts, params)
    assert small.engine.stats()["preemptions"] > 0, "the pool was meant to force preemption"
    assert [o.outputs[0].token_ids for o in together] == alone
    for o, s in zip(together, schemas):
        jsonschema.validate(json.loads(o.outputs[0].text), s)


@pytest.mark.parametrize("kwargs, match", [
    (dict(), "exactly one"),
    (dict(regex="a+", choice=["a"]), "exactly one"),
    (dict(json="{not json"), "not valid JSON"),
    (dict(choice=[]), "non-empty"),
])
def test_malformed_structured_outputs_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        StructuredOutputs(**kwargs)


@pytest.mark.parametrize("structured, match", [
    (StructuredOutputs(json={"type": "frobnicate"}), "frobnicate"),
    (StructuredOutputs(regex="a(b"), "unclosed group"),
    (StructuredOutputs(grammar="start: undefined_rule"), "undefined_rule"),
])
def test_bad_constraint_raises_at_add_request(llm, structured, match):
    with pytest.raises(ValueError, match=match):
        compile_constraint(llm.tokenizer, structured)
    eng = llm.engine
    with pytest.raises(ValueError, match=match):
        eng.add_request("bad", "Hello", greedy(structured=structured))
    assert "bad" not in eng.scheduler.requests and not eng.has_unfinished()
    with pytest.raises(TypeError, match="StructuredOutputs"):
        SamplingParams(structured={"json": {}})


def test_structured_warmup_compiles_every_constrained_step():
    llm = LLM("smollm2-135m", max_num_seqs=4, max_num_batched_tokens=16, max_model_len=128, token_buckets=(16,),
              seq_buckets=(4,), page_buckets=(8,))
    llm.warmup(greedy_only=True, structured=True)
    compiled = llm.engine.num_compilations
    outs = llm.generate(["A JSON object:", "Yes or no?", "Hello"], [
        greedy(16, structured=StructuredOutputs(json_object=True)),
        greedy(4, structured=StructuredOutputs(choice=["yes", "no"])), greedy(4)])
    assert outs[1].outputs[0].text in ("yes", "no")
    assert llm.engine.num_compilations == compiled


def test_constraint_needs_a_tokenizer():
    with pytest.raises(ValueError, match="tokenizer"):
        LLM("tiny-llama3", load_format="dummy", max_model_len=64).generate(
            [[1, 2, 3]], greedy(structured=StructuredOutputs(choice=["a"])))


def test_eos_allowed_exactly_when_complete_and_compiles_cached(smollm2_tokenizer):
    comp = ConstraintCompiler(smollm2_tokenizer, eos_token_ids=[2])
    yes_no = StructuredOutputs(choice=("yes", "no"))

    def allowed(m, vocab=len(smollm2_tokenizer)):
        mask = np.full((1, (vocab + 31) // 32), -1, np.int32)
        import llguidance.numpy
        llguidance.numpy.fill_next_token_bitmask(m, mask, 0)
        return set(np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")).tolist())

    m = comp.matcher(yes_no)
    assert 2 not in allowed(m)
    assert m.consume_tokens(smollm2_tokenizer.encode("yes", add_special_tokens=False))
    assert allowed(m) == {2}
    digits = comp.matcher(StructuredOutputs(regex="[0-9]+"))
    assert 2 not in allowed(digits)
    assert digits.consume_tokens(smollm2_tokenizer.encode("12", add_special_tokens=False))
    assert 2 in allowed(digits) and len(allowed(digits)) > 1  # may end, or go on
    comp.matcher(StructuredOutputs(choice=["yes", "no"]))  # a list and a tuple: one constraint
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    comp.compile(StructuredOutputs(json=schema))
    comp.compile(StructuredOutputs(json=json.dumps(schema)))  # as text: the same constraint
    assert (comp.misses, comp.hits) == (3, 2)
    # A model whose EOS ids the tokenizer lacks (llama3-8b shapes with SmolLM2's tokenizer, as the
    # dummy-weight benchmarks pair them): the tokenizer's own EOS ends a constraint.
    wide = ConstraintCompiler(smollm2_tokenizer, 128256, (128001, 128009)).matcher(yes_no)
    assert wide.consume_tokens(smollm2_tokenizer.encode("yes", add_special_tokens=False))
    assert allowed(wide, 128256) == {smollm2_tokenizer.eos_token_id}


def test_apply_bitmask_masks_exactly_the_cleared_bits():
    rng = np.random.default_rng(0)
    vocab = 70
    allowed = rng.random((3, vocab)) < 0.3
    words = np.zeros((3, 3), np.uint32)
    for r, t in zip(*np.nonzero(allowed)):
        words[r, t // 32] |= np.uint32(1 << (t % 32))
    logits = rng.standard_normal((3, vocab)).astype(np.float32)
    out = np.asarray(apply_bitmask(jnp.asarray(logits), jnp.asarray(words.view(np.int32))))
    np.testing.assert_array_equal(out, np.where(allowed, logits, -np.inf))


def test_strict_schema_refuses_unlisted_keys(smollm2_tokenizer):
    """OpenAI's ``strict``: JSON Schema lets an object without ``additionalProperties`` take unlisted
    keys; under strict every object, nested and in ``$defs`` too, refuses them."""
    from jaxinfer.server.constraints import strict_schema

    item = {"type": "object", "properties": {"id": {"type": "integer"}}}
    schema = {"type": "object", "properties": {"a": {"$ref": "#/$defs/item"}, "b": {"type": "array", "items": item}},
              "$defs": {"item": item}}
    comp = ConstraintCompiler(smollm2_tokenizer)

    def takes(s, text):
        m = comp.matcher(StructuredOutputs(json=s))
        ids = smollm2_tokenizer.encode(text, add_special_tokens=False)
        return m.try_consume_tokens(ids) == len(ids)

    strict = strict_schema(schema, "response_format")
    # Not strict, objects that list their properties are closed too (structured.close_objects), unless
    # the schema opens them itself.
    opened = {**schema, "additionalProperties": True}
    for text in ('{"a":{"id":1},"x":1}', '{"a":{"id":1,"x":1}}', '{"b":[{"id":1,"x":1}]}'):
        assert not takes(schema, text) and not takes(strict, text), text
    assert takes(opened, '{"a":{"id":1},"x":1}')
    assert takes(strict, '{"a":{"id":1},"b":[{"id":2}]}')
    assert strict_schema(json.dumps(schema), "tools") == strict  # a schema given as JSON text


# ----------------------------------------------------------------------------- schema policy

UNION = {"type": "object", "properties": {"pet": {"oneOf": [
    {"type": "object", "properties": {"kind": {"const": "cat"}, "lives": {"type": "integer"}},
     "required": ["kind", "lives"]},
    {"type": "object", "properties": {"kind": {"const": "dog"}, "name": {"type": "string", "maxLength": 12}},
     "required": ["kind", "name"]}]}}, "required": ["pet"]}
OVERLAP = {"type": "object", "properties": {"v": {"oneOf": [{"type": "string", "maxLength": 8},
                                                              {"type": "string", "maxLength": 3}]}},
           "required": ["v"]}


def test_discriminated_oneof_is_enforced_and_validates(llm):
    from jaxinfer.batching.structured import compiler_for

    structured = StructuredOutputs(json=UNION)
    assert compiler_for(llm.tokenizer).relaxations(structured) == []
    outs = llm.generate(["A pet as JSON:", "A dog as JSON:"], greedy(64, structured=structured))
    for out in outs:
        o = out.outputs[0]
        assert o.finish_reason == "stop" and o.warnings == [], o
        jsonschema.validate(json.loads(o.text), UNION)


def test_overlapping_oneof_is_relaxed_with_a_warning(llm):
    from jaxinfer.batching.structured import compiler_for

    relaxed = compiler_for(llm.tokenizer).relaxations(StructuredOutputs(json=OVERLAP))
    assert len(relaxed) == 1 and "'oneOf'" in relaxed[0] and "anyOf" in relaxed[0]
    o = llm.generate("A value as JSON:", greedy(32, structured=StructuredOutputs(json=OVERLAP)))[0].outputs[0]
    assert o.warnings[0] == relaxed[0]
    # a short string matches both branches: the check after generation says so
    doc = json.loads(o.text)
    assert (len(doc["v"]) <= 3) == any("violates" in w and "oneOf" in w for w in o.warnings), o


def test_unique_items_violation_is_reported():
    from jaxinfer.batching.structured import output_warnings

    schema = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    relaxed = ["schema keyword 'uniqueItems' is not enforced while generating"]
    warnings = output_warnings(StructuredOutputs(json=schema), "[1,2,1]", "stop", relaxed)
    assert warnings[0] == relaxed[0] and "uniqueItems" in warnings[1] and "violates" in warnings[1]
    assert output_warnings(StructuredOutputs(json=schema), "[1,2]", "stop", relaxed) == relaxed
    # a repeated key, and a document max_tokens cut off
    assert "repeats keys" in output_warnings(StructuredOutputs(json={"type": "object"}), '{"a":1,"a":2}', "stop")[0]
    cut = output_warnings(StructuredOutputs(json={"type": "object"}), '{"a":[1,', "length")
    assert "incomplete" in cut[0] and "max_tokens" in cut[0] and "character 8" in cut[0]


def test_looping_schema_closes_or_says_length(llm):
    """A JSONSchemaBench schema on which greedy SmolLM2 repeated keys in an open object until
    max_tokens: its objects that list properties are closed now, so the document closes, or the
    output is flagged incomplete."""
    schema = json.load(open(os.path.join(os.path.dirname(__file__), "data", "jsb_looping.json")))
    o = llm.generate("JSON:", greedy(256, structured=StructuredOutputs(json=schema)))[0].outputs[0]
    if o.finish_reason == "stop":
        json.loads(o.text)
        assert not any("incomplete" in w for w in o.warnings)
    else:
        assert o.finish_reason == "length" and any("incomplete" in w for w in o.warnings), o


def test_whitespace_compact_by_default(llm):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "array", "items":
                                                                           {"type": "integer"}, "maxItems": 3}},
              "required": ["a", "b"]}
    o = llm.generate("Numbers as JSON:", greedy(48, structured=StructuredOutputs(json=schema)))[0].outputs[0]
    assert o.finish_reason == "stop" and not re.search(r"\s", o.text), o.text


def test_whitespace_belongs_to_the_compiler(smollm2_tokenizer):
    """Each compiler holds its JSON whitespace, so engines of one process may differ: ``default``
    accepts ``json.dumps``'s separators, ``compact`` only none."""
    from jaxinfer.batching.structured import compiler_for

    structured = StructuredOutputs(json={"type": "object", "properties": {"a": {"type": "integer"}},
                                         "required": ["a"]})

    def accepts(whitespace, text):
        m = compiler_for(smollm2_tokenizer, whitespace=whitespace).matcher(structured)
        return m.consume_tokens(smollm2_tokenizer.encode(text, add_special_tokens=False)) and not m.is_error()

    assert accepts("default", '{"a": 1}') and not accepts("compact", '{"a": 1}')
    assert accepts("compact", '{"a":1}') and not accepts("default", '{"a":1}')
    with pytest.raises(ValueError, match="structured_outputs_whitespace must be one of"):
        compiler_for(smollm2_tokenizer, whitespace="tabs")
