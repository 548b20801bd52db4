"""One request never hurts another, in the engine: a request whose constraint fails inside a step
finishes alone (``finish_reason="error"``) while the requests beside it run on token-identical to
their runs alone; constraints and sampling values a step could not run are refused at the boundary.

The embedded SmolLM2 on CPU, where one dispatch runs 4 decode steps (``num_scheduler_steps``), so
requests join batches whose multi-step decode is in flight."""

import re

import pytest

from jaxinfer import LLM, SamplingParams, StructuredOutputs
from jaxinfer.batching.structured import compile_constraint
from jaxinfer.sampling_params import MAX_CHOICES, MAX_REGEX_SIZE, MAX_TOP_K

OPTS = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256)
PLAIN = ["The capital of France is", "Once upon a time, in a small village,"]


@pytest.fixture(scope="module")
def llm():
    llm = LLM("smollm2-135m", **OPTS)
    assert llm.engine.runner.num_scheduler_steps == 4  # what these tests exercise
    return llm


def greedy(n=16, **kw):
    return SamplingParams(max_tokens=n, temperature=0.0, **kw)


@pytest.fixture(scope="module")
def alone(llm):
    return {p: llm.generate(p, greedy())[0] for p in PLAIN}


def run_joining(llm, first: list[tuple[str, SamplingParams]], later: list[tuple[str, SamplingParams]],
                after_steps: int) -> dict:
    """Add ``first``, step ``after_steps`` times, add ``later``, run to the end: every output by id."""
    eng, done = llm.engine, {}

    def step():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out

    for i, (prompt, params) in enumerate(first):
        eng.add_request(f"first-{i}", prompt, params)
    for _ in range(after_steps):
        step()
    for i, (prompt, params) in enumerate(later):
        eng.add_request(f"later-{i}", prompt, params)
    while eng.has_unfinished():
        step()
    return done


@pytest.mark.parametrize("after_steps", [1, 2, 3, 5])
def test_constrained_request_joins_a_multi_step_batch(llm, alone, after_steps):
    choices = ("yes", "no")
    done = run_joining(llm, [(p, greedy()) for p in PLAIN],
                       [("Is the sky blue?", greedy(4, structured=StructuredOutputs(choice=choices)))], after_steps)
    for i, p in enumerate(PLAIN):
        assert done[f"first-{i}"].token_ids == alone[p].token_ids
    assert done["later-0"].finish_reason == "stop" and done["later-0"].text in choices


def test_a_constraint_failing_inside_the_step_fails_its_request_alone(llm, alone):
    # 2,500 alternatives compile and give a first token mask, but llguidance refuses the grammar row
    # when a token arrives (more than 2,000 items): only then, inside the step.
    grammar = "start: " + " | ".join(f'"w{i}"' for i in range(2500))
    bad = greedy(4, structured=StructuredOutputs(grammar=grammar))
    compile_constraint(llm.tokenizer, bad.structured)  # the boundary cannot see it
    for after_steps in (0, 2):
        done = run_joining(llm, [(p, greedy()) for p in PLAIN], [("Pick a word:", bad)], after_steps)
        for i, p in enumerate(PLAIN):
            assert done[f"first-{i}"].token_ids == alone[p].token_ids
        failed = done["later-0"]
        assert failed.finished and failed.finish_reason == "error"
        assert "2000" in failed.error and "constraint" in failed.error
    assert llm.engine.stats()["running"] == 0 and not llm.engine.requests


def test_top_k_bound_is_the_steps(llm):
    with pytest.raises(ValueError, match=r"top_k must be in \[-1, 2147483647\]"):
        SamplingParams(top_k=2**31)
    # The largest top_k the boundary accepts runs, and keeps every token: the same sample as no top-k.
    kw = dict(max_tokens=12, temperature=1.0, seed=7)
    top, none = llm.generate(PLAIN[0], [SamplingParams(top_k=MAX_TOP_K, **kw)])[0], \
        llm.generate(PLAIN[0], [SamplingParams(top_k=0, **kw)])[0]
    assert top.token_ids == none.token_ids


def test_the_largest_choice_list_runs(llm):
    choices = tuple(f"option {i}" for i in range(MAX_CHOICES))
    out = llm.generate("Pick an option:", greedy(8, structured=StructuredOutputs(choice=choices)))[0]
    assert out.finish_reason == "stop" and out.text in choices
    with pytest.raises(ValueError, match=f"at most {MAX_CHOICES}"):
        StructuredOutputs(choice=choices + ("one more",))


@pytest.mark.parametrize("kind, value, match", [
    ("regex", "(a{1000}){1000}", "too complex: its counted repetitions expand to 1,000,000"),
    ("json", {"type": "string", "pattern": "^(b{500}){500}$"}, "json pattern is too complex"),
    ("grammar", 'start: /(c{400}){400}/', "grammar is too complex"),
])
def test_constraints_too_large_for_a_step_are_refused(kind, value, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        StructuredOutputs(**{kind: value})
    StructuredOutputs(regex="a" * 10 + "{%d}" % (MAX_REGEX_SIZE - 9))  # at the bound: accepted


@pytest.mark.parametrize("schema", [
    {"$ref": "#"},
    {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
])
def test_unsatisfiable_schemas_are_refused(llm, schema):
    with pytest.raises(ValueError, match="admits no output"):
        compile_constraint(llm.tokenizer, StructuredOutputs(json=schema))


def test_logprobs_above_the_engines_bound_are_refused():
    with pytest.raises(ValueError, match=r"logprobs must be in \[0, 20\]"):
        SamplingParams(logprobs=21)
