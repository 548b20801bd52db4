"""One request never hurts another, in the engine: a request whose constraint fails inside a step
finishes alone (``finish_reason="error"``) while the requests beside it run on token-identical to
their runs alone; constraints and sampling values a step could not run are refused at the boundary.

The embedded SmolLM2 on CPU, where one dispatch runs 4 decode steps (``num_scheduler_steps``), so
requests join batches whose multi-step decode is in flight."""

import re

import jax
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
    return {p: llm.generate(p, greedy())[0].outputs[0] for p in PLAIN}


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
        assert "2000" in failed.error.message and "constraint" in failed.error.message and failed.error.invalid
    assert llm.engine.stats()["running"] == 0 and not llm.engine.scheduler.requests


def test_top_k_bound_is_the_steps(llm):
    with pytest.raises(ValueError, match=r"top_k must be in \[-1, 2147483647\]"):
        SamplingParams(top_k=2**31)
    # The largest top_k the boundary accepts runs, and keeps every token: the same sample as no top-k.
    kw = dict(max_tokens=12, temperature=1.0, seed=7)
    top, none = llm.generate(PLAIN[0], [SamplingParams(top_k=MAX_TOP_K, **kw)])[0].outputs[0], \
        llm.generate(PLAIN[0], [SamplingParams(top_k=0, **kw)])[0].outputs[0]
    assert top.token_ids == none.token_ids


def test_the_largest_choice_list_runs(llm):
    choices = tuple(f"option {i}" for i in range(MAX_CHOICES))
    out = llm.generate("Pick an option:", greedy(8, structured=StructuredOutputs(choice=choices)))[0].outputs[0]
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


# ------------------------------------------------------------------ a step that fails as a whole


def inject(monkeypatch, runner, method: str, fails, delete_cache: bool = False):
    """``runner.method`` raises where ``fails(call index, args)`` says, as a device or runtime error
    would; ``delete_cache``: the failed step took the donated KV pool with it."""
    real, calls = getattr(runner, method), [0]

    def wrapped(*args, **kwargs):
        calls[0] += 1
        if fails(calls[0] - 1, args):
            if delete_cache:
                for x in jax.tree.leaves(runner.cache):
                    x.delete()
            raise RuntimeError("injected device failure")
        return real(*args, **kwargs)
    monkeypatch.setattr(runner, method, wrapped)


MIXED = [(p, greedy(12)) for p in PLAIN] + [
    ("Write a list of fruits:", SamplingParams(max_tokens=12, temperature=0.8, seed=5)),
    ("Is the sky blue?", greedy(4, structured=StructuredOutputs(choice=("yes", "no"))))]


@pytest.fixture(scope="module")
def mixed_alone(llm):
    return [llm.generate(p, params)[0].outputs[0] for p, params in MIXED]


@pytest.mark.parametrize("method, at, delete_cache", [("execute", 1, False), ("execute", 3, True),
                                                      ("fetch", 2, False), ("fetch", 4, True),
                                                      ("run_forward", 1, True)])
def test_a_failed_step_recomputes_its_requests(llm, mixed_alone, monkeypatch, caplog, method, at, delete_cache):
    """Whatever part of a step fails (dispatch, reading its tokens, the constrained forward), the
    requests in flight are recomputed from their known tokens: each output, greedy, seeded and
    constrained, is the one it has alone, and nothing leaks."""
    inject(monkeypatch, llm.engine.runner, method, lambda n, _: n == at, delete_cache)
    with caplog.at_level("ERROR", logger="jaxinfer.batching.engine"):
        done = run_joining(llm, MIXED[:2], MIXED[2:], after_steps=1)
    assert any("a step failed (RuntimeError: injected device failure)" in r.getMessage() for r in caplog.records)
    for i, want in enumerate(mixed_alone):
        got = done[f"first-{i}" if i < 2 else f"later-{i - 2}"]
        assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason)
    stats = llm.engine.stats()
    assert stats["running"] == stats["preempted"] == 0 and not llm.engine.scheduler.requests
    assert stats["kv_pages_used"] == 0


def test_a_request_that_fails_every_step_fails_alone(llm, mixed_alone, monkeypatch):
    """A request whose every step fails (whatever it is about it) is failed with an error after
    ``MAX_STEP_FAILURES`` steps of its own; the requests that shared its failed steps go on to the
    outputs they have alone."""
    inject(monkeypatch, llm.engine.runner, "execute", lambda n, args: "later-0" in args[0].request_ids)
    poison = ("Tell me a story.", greedy(8))
    done = run_joining(llm, MIXED[:2], [poison] + MIXED[2:3], after_steps=2)
    assert done["later-0"].finish_reason == "error"
    assert "failed to run a step with this request 3 times" in done["later-0"].error.message
    assert not done["later-0"].error.invalid
    for key, want in (("first-0", mixed_alone[0]), ("first-1", mixed_alone[1]), ("later-1", mixed_alone[2])):
        assert done[key].token_ids == want.token_ids
    assert llm.engine.stats()["kv_pages_used"] == 0 and not llm.engine.scheduler.requests
