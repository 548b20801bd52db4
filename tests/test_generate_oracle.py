"""End to end on the real embedded model: greedy text equals transformers' greedy generate."""

import pytest
import torch

from jaxinfer import LLM, SamplingParams

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
