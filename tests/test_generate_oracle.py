"""End to end on the real embedded model: greedy text equals transformers' greedy generate."""

import pytest
import torch

from jaxinfer import LLM, SamplingParams
from jaxinfer.tokenizer import apply_chat_template

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "def fibonacci(n):",
    "Water boils at",
    "List three primary colors:",
    "The theory of relativity, proposed by Albert Einstein in the early twentieth century, changed how "
    "physicists think about space, time and gravity. In simple terms, it says that",
    "Q: What is 12 times 12?\nA:",
    "Hello",
]


@pytest.fixture(scope="module")
def llm():
    return LLM("smollm2-135m", max_num_seqs=8, max_num_batched_tokens=256, max_model_len=512,
               seq_buckets=(1, 8), page_buckets=(8, 32))


def hf_greedy(model, ids, n):
    """Greedy decoding with transformers' forward and its own KV cache, EOS ignored (as ours)."""
    out, past, x = [], None, torch.tensor([ids])
    with torch.inference_mode():
        for _ in range(n):
            res = model(input_ids=x, past_key_values=past, use_cache=True)
            past = res.past_key_values
            tok = int(res.logits[0, -1].argmax())
            out.append(tok)
            x = torch.tensor([[tok]])
    return out


def test_greedy_64_tokens_match_transformers_batched(llm, smollm2_hf):
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    outs = llm.generate(PROMPTS, params)  # all eight in one continuous batch
    assert len({len(o.prompt_token_ids) for o in outs}) >= 6  # genuinely different lengths
    for prompt, out in zip(PROMPTS, outs):
        ref = hf_greedy(smollm2_hf, out.prompt_token_ids, 64)
        assert len(ref) == 64
        assert out.prompt == prompt and out.finished
        assert out.outputs[0].token_ids == ref, f"diverged on {prompt!r}"
        assert out.outputs[0].text == llm.tokenizer.decode(ref, skip_special_tokens=True)


def test_streamed_deltas_concatenate_to_the_text(llm):
    eng = llm.engine
    eng.add_request("s", "Write the word café and a smiley emoji: ", SamplingParams(max_tokens=40, temperature=0.0))
    deltas, final = [], None
    while eng.has_unfinished():
        for out in eng.step():
            deltas.append(out.delta_text)
            final = out
    assert "".join(deltas) == final.text and "\ufffd" not in final.text


def test_chat_template_and_stop_string(llm):
    msgs = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    out = llm.chat(msgs, SamplingParams(max_tokens=32, temperature=0.0))[0].outputs[0]
    assert "Paris" in out.text and out.finish_reason == "stop"
    cut = llm.chat(msgs, SamplingParams(max_tokens=32, temperature=0.0, stop=["aris"]))[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.text == out.text[:out.text.index("aris")]


def test_min_tokens_holds_back_stop_strings_and_eos(llm):
    """``min_tokens``: neither a stop string nor the end of sequence ends the output before that many
    tokens; until then the tokens are the free run's (greedy), EOS excepted."""
    msgs = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    free = llm.chat(msgs, SamplingParams(max_tokens=32, temperature=0.0))[0].outputs[0]
    assert "aris" in free.text and free.finish_reason == "stop" and len(free.token_ids) < 12
    held = llm.chat(msgs, SamplingParams(max_tokens=32, temperature=0.0, stop=["aris"], min_tokens=12))[0].outputs[0]
    assert len(held.token_ids) >= 12 and held.token_ids[:len(free.token_ids)] == free.token_ids
    assert held.text.startswith(free.text)


def test_special_tokens_and_the_stop_in_the_text_as_vllm_streams_them(llm):
    """vLLM's ``skip_special_tokens`` and ``include_stop_str_in_output``: special tokens are in the text
    only without the first; the stop that ended the request (EOS, a stop token id, a stop string) is in
    it only with the second. Every request of one batch, streamed: the deltas add up to the text."""
    tok, eng = llm.tokenizer, llm.engine
    chat = apply_chat_template(tok, [{"role": "user", "content": "What is the capital of France? Answer in one word."}])
    greedy = dict(max_tokens=32, temperature=0.0)
    kept = dict(skip_special_tokens=False, include_stop_str_in_output=True)
    # past EOS to <|im_start|> (id 1, a stop token id): "...Paris.<|im_end|>\n<|im_end|><|im_start|>" on greedy
    past_eos = dict(greedy, ignore_eos=True, stop_token_ids=[1])
    runs = {"default": greedy, "specials": dict(greedy, skip_special_tokens=False), "eos kept": dict(greedy, **kept),
            "eos skipped": dict(greedy, include_stop_str_in_output=True), "past eos": dict(past_eos, **kept),
            "past eos, stop left out": dict(past_eos, skip_special_tokens=False),
            "stop string": dict(greedy, stop=["aris"]), "stop string kept": dict(greedy, stop=["aris"], **kept)}
    for rid, params in runs.items():
        eng.add_request(rid, chat, SamplingParams(**params))
    deltas, final = {rid: [] for rid in runs}, {}
    while eng.has_unfinished():
        for out in eng.step():
            deltas[out.request_id].append(out.delta_text)
            final[out.request_id] = out
    for rid, out in final.items():
        assert "".join(deltas[rid]) == out.text and out.finished and out.finish_reason == "stop", rid
    text = {rid: out.text for rid, out in final.items()}
    assert text["default"] == "The capital of France is Paris." == tok.decode(final["default"].token_ids)
    assert final["default"].token_ids[-1] != tok.eos_token_id  # EOS ended it and is no output token
    assert text["specials"] == text["eos skipped"] == text["default"]
    assert text["eos kept"] == text["default"] + "<|im_end|>"
    past = final["past eos"].token_ids
    assert tok.eos_token_id in past and 1 not in past
    assert text["past eos"] == tok.decode(past + [1], skip_special_tokens=False) and text["past eos"].endswith(
        "<|im_end|><|im_start|>")
    assert text["past eos, stop left out"] == tok.decode(past, skip_special_tokens=False)
    assert text["stop string"] == "The capital of France is P"
    assert text["stop string kept"] == "The capital of France is Paris"
