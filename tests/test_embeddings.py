"""``LLM.embed`` against transformers: a tiny random Llama's final hidden states (after the final norm:
``hidden_states[-1]`` of transformers' output), pooled and normalized as vLLM's embed task does.

Tolerance: both sides compute in float32; they differ only in summation order (matmuls, attention,
the mean), which over this model's two layers moved the unit vectors by ~1e-6 (measured), so 1e-5 of
the largest component is ten times that and still far below what a wrong token, position or norm
would give (~1e-1).
"""

import numpy as np
import pytest
import torch

from test_families import VOCAB, save_random_hf, save_word_tokenizer
from jaxinfer import LLM, EmbeddingRequestOutput

TOL = 1e-5
LENGTHS = (5, 17, 40)  # with max_num_batched_tokens=32: the first two share a pass, the third runs alone
MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    model = save_random_hf("llama", path, ("LlamaConfig", dict(hidden_size=64)))
    save_word_tokenizer(path)
    llm = LLM(str(path), dtype="float32", max_num_seqs=4, max_num_batched_tokens=32, max_model_len=MAX_MODEL_LEN,
              token_buckets=(4, 32), seq_buckets=(4,), page_buckets=(4,), num_pages=32)
    return model, llm


def hf_embedding(model, ids, pooling, normalize=True) -> np.ndarray:
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
        states = out.hidden_states[-1][0].numpy()
        # transformers 5 records the final norm's output as the last hidden state (post-norm)
        np.testing.assert_array_equal(states, model.model(torch.tensor([ids])).last_hidden_state[0].numpy())
    v = states[-1] if pooling == "last" else states.mean(0)
    return v / np.linalg.norm(v) if normalize else v


def prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(3, VOCAB, n).tolist() for n in LENGTHS]


def rel_err(got, ref) -> float:
    return float(np.max(np.abs(np.asarray(got) - ref)) / np.max(np.abs(ref)))


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_matches_transformers_and_batching_changes_nothing(llama, pooling):
    model, llm = llama
    ps = prompts()
    outs = llm.embed(ps, pooling=pooling)
    assert all(isinstance(o, EmbeddingRequestOutput) and o.prompt_token_ids == p for o, p in zip(outs, ps))
    for p, out in zip(ps, outs):
        vec = out.outputs.embedding
        assert isinstance(vec, list) and len(vec) == out.outputs.hidden_size == 64
        assert rel_err(vec, hf_embedding(model, p, pooling)) < TOL, (pooling, len(p))
        assert abs(np.linalg.norm(vec) - 1) < 1e-5
        alone = llm.embed([p], pooling=pooling)[0].outputs.embedding  # a pass of its own, other shapes
        np.testing.assert_allclose(alone, vec, rtol=0, atol=TOL)


def test_unnormalized_text_and_limits(llama):
    model, llm = llama
    p = prompts()[1]
    raw = llm.embed(p, normalize=False)[0].outputs.embedding  # one token-id prompt
    assert rel_err(raw, hf_embedding(model, p, "last", normalize=False)) < TOL
    text = "w5 w9 w200 w17"
    out = llm.embed(text)[0]  # a text prompt: the tokenizer's ids
    assert out.prompt_token_ids == llm.tokenizer.encode(text)
    np.testing.assert_allclose(out.outputs.embedding, llm.embed([out.prompt_token_ids])[0].outputs.embedding,
                               rtol=0, atol=TOL)
    full = [3 + i % 50 for i in range(MAX_MODEL_LEN)]  # an embedding's prompt may fill the context
    assert rel_err(llm.embed([full])[0].outputs.embedding, hf_embedding(model, full, "last")) < TOL
    with pytest.raises(ValueError, match=f"max_model_len is {MAX_MODEL_LEN}"):
        llm.embed([p, full + [3]])
    with pytest.raises(ValueError, match="pooling"):
        llm.embed([p], pooling="cls")
    with pytest.raises(ValueError, match="empty"):
        llm.embed([[]])
    with pytest.raises(ValueError, match=str(VOCAB)):
        llm.embed([[VOCAB]])
