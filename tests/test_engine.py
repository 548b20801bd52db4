"""Engine and API behaviour on a tiny random Llama-3 (GQA, rope scaling): fast, no weights needed."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import all_position_logits
from jaxinfer import LLM, SamplingParams, StructuredOutputs
from jaxinfer.batching.config import EngineConfig

# float32 on every backend (bfloat16 is the accelerators' default): the exactness asserted below (1e-4 on
# logprobs, batched == alone token for token) is float32's.
OPTS = dict(load_format="dummy", dtype="float32", max_num_seqs=8, max_num_batched_tokens=64, num_pages=96,
            max_model_len=256, seq_buckets=(1, 2, 4, 8), page_buckets=(4, 16))


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-llama3", **OPTS)


def prompts(seed=0, lengths=(5, 17, 33, 64, 100, 3, 40, 9)):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 500, n).tolist() for n in lengths]


GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def full_logits(llm, ids):
    """Oracle: logits of every position of `ids` from one plain forward pass (no engine)."""
    return all_position_logits(llm.engine.model_config, llm.engine.runner.weights, ids)


def test_greedy_matches_plain_forward(llm):
    """Engine greedy decoding (paged, bucketed, incremental) equals argmax over a full recompute."""
    p = prompts(1, (11,))[0]
    out = llm.generate([p], GREEDY)[0].outputs[0]
    ids = list(p)
    for tok in out.token_ids[:8]:
        assert tok == int(np.argmax(full_logits(llm, ids)[-1]))
        ids.append(tok)


def test_batched_equals_alone(llm):
    ps = prompts()
    batched = [o.outputs[0] for o in llm.generate(ps, GREEDY)]
    for p, b in zip(ps, batched):
        assert llm.generate([p], GREEDY)[0].outputs[0].token_ids == b.token_ids
        assert len(b.token_ids) == 24 and b.finish_reason == "length"


def test_seeded_sampling_is_batch_invariant(llm):
    sp = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, top_k=40, min_p=0.01, seed=1234, ignore_eos=True)
    ps = prompts(2, (4, 30, 12))
    batched = [o.outputs[0] for o in llm.generate(ps, sp)]
    alone = [llm.generate([p], sp)[0].outputs[0] for p in ps]
    assert [b.token_ids for b in batched] == [a.token_ids for a in alone]
    other = llm.generate(ps[:1], SamplingParams(**{**sp.__dict__, "seed": 99}))[0].outputs[0]
    assert other.token_ids != alone[0].token_ids


def test_unseeded_requests_differ(llm):
    sp = SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True)
    a, b = (o.outputs[0] for o in llm.generate([prompts()[0]] * 2, sp))
    assert a.token_ids != b.token_ids


def test_logprobs_match_the_model(llm):
    p = prompts(3, (20,))[0]
    out = llm.generate([p], SamplingParams(max_tokens=3, temperature=0.0, logprobs=4, ignore_eos=True))[0].outputs[0]
    assert len(out.logprobs) == 3
    lp = jax.nn.log_softmax(full_logits(llm, p + out.token_ids[:1])[-2:], axis=-1)
    for step in range(2):
        d = out.logprobs[step]
        tok = out.token_ids[step]
        assert len(d) == 4 and tok in d  # greedy token is also the top-1
        for t, v in d.items():
            assert abs(v - float(lp[step, t])) < 1e-4


def test_stop_token_and_eos(llm):
    p = prompts(4, (10,))[0]
    free = llm.generate([p], GREEDY)[0].outputs[0].token_ids
    stop_at = free[5]
    first = free.index(stop_at)
    out = llm.generate([p], SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=(stop_at,)))[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids == free[:first]
    # The model's EOS (id 2 in this config) ends generation unless ignore_eos.
    eos_prompt = [5, 6, 7]
    cfg_eos = llm.engine.model_config.eos_token_ids
    assert cfg_eos == (2,)
    out = llm.generate([eos_prompt], SamplingParams(max_tokens=5, temperature=0.0, stop_token_ids=cfg_eos))[0].outputs[0]
    assert 2 not in out.token_ids


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_tokens=0), "max_tokens"), (dict(max_tokens=-3), "max_tokens"), (dict(temperature=-0.1), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(top_k=-2), "top_k"), (dict(min_p=2.0), "min_p"),
    (dict(logprobs=50), "logprobs"), (dict(seed=-1), "seed"), (dict(stop=[""]), "stop"),
    (dict(n=0), "n must"), (dict(n=65), "n must"), (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(min_tokens=17), "min_tokens"), (dict(logit_bias={5: 101.0}), "logit_bias value"),
    (dict(logit_bias={-1: 1.0}), "logit_bias token id"),
    (dict(min_tokens=1, structured=StructuredOutputs(choice=["a"])), "min_tokens cannot be combined"),
])
def test_sampling_params_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_type_errors_name_the_parameter():
    with pytest.raises(TypeError, match="max_tokens"):
        SamplingParams(max_tokens="8")
    with pytest.raises(TypeError, match="temperature"):
        SamplingParams(temperature="hot")
    for name in ("skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output"):
        with pytest.raises(TypeError, match=f"{name} must be a bool, got int 1"):
            SamplingParams(**{name: 1})


def test_prompt_validation(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], GREEDY)
    with pytest.raises(ValueError, match="max_model_len is 256"):
        llm.generate([[5] * 256], GREEDY)
    with pytest.raises(ValueError, match=r"\[0, 512\)"):
        llm.generate([[5, 9999]], GREEDY)
    with pytest.raises(ValueError, match="token ids"):
        llm.generate("text needs a tokenizer", GREEDY)
    assert not llm.engine.has_unfinished()  # nothing was queued by the failed calls


def test_engine_option_validation():
    with pytest.raises(TypeError, match="unknown engine option"):
        EngineConfig.from_options(page_sise=16)
    with pytest.raises(ValueError, match="dtype"):
        EngineConfig(dtype="float16")
    with pytest.raises(ValueError, match="page_size"):
        EngineConfig(page_size=0)
    with pytest.raises(ValueError, match="preemption_mode"):
        EngineConfig(preemption_mode="evict")
    for bad in (0, True, 2.0):
        with pytest.raises(ValueError, match="num_scheduler_steps must be a positive integer"):
            EngineConfig(num_scheduler_steps=bad)
    with pytest.raises(ValueError, match="cannot hold one sequence"):
        LLM("tiny-llama3", load_format="dummy", num_pages=4, max_model_len=256)


def test_unknown_model_name():
    with pytest.raises(ValueError, match="unknown model"):
        LLM("no-such-model", load_format="dummy")


def test_bfloat16_runs(llm):
    bf = LLM("tiny-llama3", **{**OPTS, "dtype": "bfloat16"})
    assert bf.engine.runner.cache.k.dtype == jnp.bfloat16
    out = bf.generate(prompts()[:2], GREEDY)
    assert all(len(o.outputs[0].token_ids) == 24 for o in out)


def test_repetition_penalty_matches_its_definition(llm):
    """Each greedy token with ``repetition_penalty`` is the argmax of the plain forward's logits with
    vLLM's penalty applied over the prompt and the tokens so far (a seen token's positive logit
    divided, a negative one multiplied), and the penalty changes the output."""
    p = prompts(5, (40,))[0]
    rp = 4.0
    out = llm.generate([p], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                           repetition_penalty=rp))[0].outputs[0]
    ids, changed = list(p), 0
    for tok in out.token_ids:
        x = full_logits(llm, ids)[-1]
        seen = np.zeros(x.shape, bool)
        seen[ids] = True
        assert tok == int(np.argmax(np.where(seen, np.where(x > 0, x / rp, x * rp), x)))
        changed += tok != int(np.argmax(x))
        ids.append(tok)
    assert changed  # the penalty decided some token


def test_logit_bias_and_min_tokens(llm):
    p = prompts(6, (9,))[0]
    free = llm.generate([p], GREEDY)[0].outputs[0].token_ids
    forced = llm.generate([p], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True,
                                              logit_bias={7: 100.0}))[0].outputs[0]
    assert forced.token_ids == [7] * 6
    banned = llm.generate([p], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                                              logit_bias={free[0]: -100.0}))[0].outputs[0]
    assert free[0] not in banned.token_ids
    # EOS (id 2) biased up ends at once; with min_tokens it is held back for that many tokens, which
    # are then the greedy tokens of a run that never ends (EOS biased down)
    eos_first = SamplingParams(max_tokens=24, temperature=0.0, logit_bias={2: 50.0})
    assert llm.generate([p], eos_first)[0].outputs[0].token_ids == []
    held = llm.generate([p], SamplingParams(**{**eos_first.__dict__, "min_tokens": 5}))[0].outputs[0]
    no_eos = llm.generate([p], SamplingParams(max_tokens=5, temperature=0.0, logit_bias={2: -100.0}))[0].outputs[0]
    assert held.token_ids == no_eos.token_ids and held.finish_reason == "stop"
    with pytest.raises(ValueError, match="logit_bias token id 99999 is not below the vocabulary size"):
        llm.generate([p], SamplingParams(logit_bias={99999: 1.0}))


def test_n_completions_and_vllm_prompt_shapes(llm):
    """``n`` completions of one prompt: seeded, choice j is the request alone with seed + j; the
    outputs keep the prompts' order and shape (vLLM's ``RequestOutput``)."""
    p = prompts(7, (10,))[0]
    sp = SamplingParams(max_tokens=8, temperature=1.0, seed=40, n=3, ignore_eos=True)
    out, other = llm.generate([{"prompt_token_ids": p}, p[:5]], [sp, GREEDY])
    assert [c.index for c in out.outputs] == [0, 1, 2] and out.finished and out.prompt is None
    assert out.prompt_token_ids == p and len(other.outputs) == 1 and other.prompt_token_ids == p[:5]
    for j, c in enumerate(out.outputs):
        alone = llm.generate([p], SamplingParams(**{**sp.__dict__, "n": 1, "seed": 40 + j}))[0].outputs[0]
        assert c.token_ids == alone.token_ids
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3
    logged = llm.generate([p], SamplingParams(max_tokens=3, temperature=0.0, logprobs=0, ignore_eos=True))[0]
    c = logged.outputs[0]
    assert c.cumulative_logprob == pytest.approx(sum(d[t] for d, t in zip(c.logprobs, c.token_ids)))
    assert llm.generate([p], GREEDY)[0].outputs[0].cumulative_logprob is None
    with pytest.raises(ValueError, match="exactly one of 'prompt'"):
        llm.generate([{"text": "x"}], GREEDY)


def test_prompt_logprobs_match_the_model(llm):
    """vLLM's prompt logprobs: None for the first token, then each token's own log-probability given
    those before it and the top k, equal to the plain forward's log-softmax; generation unchanged."""
    p = prompts(8, (21,))[0]
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=3)
    out = llm.generate([p], sp)[0]
    lp = np.asarray(jax.nn.log_softmax(full_logits(llm, p), axis=-1))
    assert len(out.prompt_logprobs) == len(p) and out.prompt_logprobs[0] is None
    for i, entry in enumerate(out.prompt_logprobs[1:]):
        top = set(np.argsort(-lp[i])[:3].tolist())
        assert set(entry) == top | {p[i + 1]}
        for t, v in entry.items():
            assert abs(v - float(lp[i, t])) < 1e-4
    assert out.outputs[0].token_ids == llm.generate([p], GREEDY)[0].outputs[0].token_ids[:4]
    assert llm.generate([p], GREEDY)[0].prompt_logprobs is None
    with pytest.raises(ValueError, match="prompt_logprobs"):
        llm.engine.add_request("x", p, sp)


def test_a_refused_request_leaves_nothing_queued(llm, monkeypatch):
    """A request the engine refuses while ``generate`` queues its list (here the second) takes the
    ones queued before it back out: nothing is left running, and the next call is served alone."""
    ps = prompts(9, (6, 7))
    want = llm.generate([ps[0]], GREEDY)[0].outputs[0].token_ids
    add, calls = llm.engine.add_request, []

    def refuse_second(*args):
        calls.append(args[0])
        if len(calls) == 2:
            raise ValueError("refused")
        return add(*args)

    monkeypatch.setattr(llm.engine, "add_request", refuse_second)
    with pytest.raises(ValueError, match="refused"):
        llm.generate(ps, GREEDY)
    monkeypatch.undo()
    assert not llm.engine.has_unfinished()
    assert llm.generate([ps[0]], GREEDY)[0].outputs[0].token_ids == want
