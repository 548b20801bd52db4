"""Models named by Hugging Face Hub id (``org/name``, ``org/name:file.gguf``), read from a Hugging Face
cache built here in the layout huggingface_hub reads offline: ``models--org--name/refs/<ref>`` holding
a commit hash, ``snapshots/<commit>/<file>`` linking into ``blobs/``. No test reaches a network:
``HF_HUB_OFFLINE=1`` throughout, and the Hub's errors are raised by a stand-in for the download."""

import hashlib
import json
import os
import shutil

import jax
import numpy as np
import pytest

from jaxinfer.models.weights import ModelFileError, ModelSource, load_model, resolve_model
from jaxinfer.models.weights import hub

MAIN = "a" * 40  # commit hashes of the cached repos
V1 = "b" * 40
WEIGHTS_AND_CONFIG = ("config.json", "model.safetensors")
OPTS = dict(dtype="float32", max_model_len=64, max_num_seqs=1, max_num_batched_tokens=16, num_pages=8,
            token_buckets=(16,), seq_buckets=(1,), page_buckets=(4,), num_scheduler_steps=1)


def cache_repo(cache, repo_id: str, files: dict[str, str], commit: str = MAIN, refs=("main",)) -> str:
    """Put ``files`` (name in the repo -> a local file) in ``cache`` as snapshot ``commit`` of ``repo_id``,
    ``refs`` pointing at it, as huggingface_hub writes them; returns the snapshot directory."""
    repo = os.path.join(cache, "models--" + repo_id.replace("/", "--"))
    snapshot = os.path.join(repo, "snapshots", commit)
    os.makedirs(os.path.join(repo, "blobs"), exist_ok=True)
    os.makedirs(snapshot, exist_ok=True)
    for name, src in files.items():
        with open(src, "rb") as f:
            blob = os.path.join(repo, "blobs", hashlib.sha256(f.read()).hexdigest())
        if not os.path.exists(blob):
            shutil.copyfile(src, blob)
        link = os.path.join(snapshot, name)
        os.makedirs(os.path.dirname(link), exist_ok=True)
        os.symlink(os.path.relpath(blob, os.path.dirname(link)), link)
    os.makedirs(os.path.join(repo, "refs"), exist_ok=True)
    for ref in refs:
        with open(os.path.join(repo, "refs", ref), "w") as f:
            f.write(commit)  # no newline, as huggingface_hub writes it
    return snapshot


def write_random_llama_weights(path) -> None:
    """Random weights for the Llama ``config.json`` in ``path``, with Hugging Face's tensor names."""
    from safetensors.numpy import save_file

    c = json.loads((path / "config.json").read_text())
    h, inter, hd, vocab = c["hidden_size"], c["intermediate_size"], c["head_dim"], c["vocab_size"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    rng = np.random.default_rng(0)

    def w(rows, cols):
        return (rng.standard_normal((rows, cols)) * cols ** -0.5).astype(np.float32)

    tensors = {"model.embed_tokens.weight": w(vocab, h), "lm_head.weight": w(vocab, h),
               "model.norm.weight": rng.uniform(0.5, 1.5, h).astype(np.float32)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors.update({p + "self_attn.q_proj.weight": w(q, h), p + "self_attn.k_proj.weight": w(kv, h),
                        p + "self_attn.v_proj.weight": w(kv, h), p + "self_attn.o_proj.weight": w(h, q),
                        p + "mlp.gate_proj.weight": w(inter, h), p + "mlp.up_proj.weight": w(inter, h),
                        p + "mlp.down_proj.weight": w(h, inter),
                        p + "input_layernorm.weight": rng.uniform(0.5, 1.5, h).astype(np.float32),
                        p + "post_attention_layernorm.weight": rng.uniform(0.5, 1.5, h).astype(np.float32)})
    save_file(tensors, str(path / "model.safetensors"))


@pytest.fixture(scope="module")
def checkpoint(tiny_chat_model, tmp_path_factory):
    """The tiny chat model's config and tokenizer with real random weights, in a local directory."""
    path = tmp_path_factory.mktemp("tiny_checkpoint")
    for name in os.listdir(tiny_chat_model):
        shutil.copyfile(os.path.join(tiny_chat_model, name), path / name)
    write_random_llama_weights(path)
    return path


@pytest.fixture(scope="module")
def cache(checkpoint, tmp_path_factory):
    """A Hugging Face cache holding ``org/tiny`` (main: the checkpoint; tag v1: its config and weights,
    without a tokenizer), ``org/tiny-gguf`` (the embedded SmolLM2 GGUF, in a subfolder too) and
    ``org/tiny-tokenizer`` (the checkpoint's tokenizer files alone)."""
    root = tmp_path_factory.mktemp("hf_home")
    cache = str(root / "hub")
    files = {name: str(checkpoint / name) for name in os.listdir(checkpoint)}
    files["README.md"] = files["config.json"]  # a file the engine does not read
    cache_repo(cache, "org/tiny", files, MAIN)
    cache_repo(cache, "org/tiny", {n: files[n] for n in ("config.json", "model.safetensors")}, V1, refs=("v1",))
    gguf = resolve_model("smollm2-135m").path
    cache_repo(cache, "org/tiny-gguf", {"smollm2.Q8_0.gguf": gguf, "q4/smollm2.gguf": gguf})
    cache_repo(cache, "org/tiny-tokenizer", {n: f for n, f in files.items() if n not in WEIGHTS_AND_CONFIG})
    return cache


@pytest.fixture
def offline(cache, monkeypatch):
    """HF_HUB_OFFLINE=1 with ``cache`` as HF_HUB_CACHE."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", cache)
    monkeypatch.delenv("HF_HOME", raising=False)
    return cache


def snapshot(cache, repo_id, commit=MAIN):
    return os.path.join(cache, "models--" + repo_id.replace("/", "--"), "snapshots", commit)


def test_a_hub_id_generates_what_its_directory_does(offline, checkpoint):
    """``LLM("org/tiny")`` loads from the cache: the same greedy tokens as the checkpoint's directory."""
    from jaxinfer import LLM, SamplingParams

    assert resolve_model("org/tiny") == ModelSource("hf", snapshot(offline, "org/tiny"))
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    from_hub = LLM("org/tiny", **OPTS).generate("The capital of France is", greedy)[0]
    from_dir = LLM(str(checkpoint), **OPTS).generate("The capital of France is", greedy)[0]
    assert token_ids(from_hub) == token_ids(from_dir) and len(token_ids(from_hub)) == 6


def test_serve_a_hub_id_offline(offline, checkpoint):
    """``jaxinfer serve org/tiny`` with the network off: served from the cache, as its directory is."""
    import httpx

    from jaxinfer import LLM, SamplingParams
    from test_server import Server

    args = ["--max-num-seqs=1", "--max-num-batched-tokens=16", "--max-model-len=64", "--token-buckets=16",
            "--seq-buckets=1", "--page-buckets=4", "--num-scheduler-steps=1", "--dtype=float32"]
    server = Server(["org/tiny", *args], env={"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": offline})
    try:
        assert [m["id"] for m in httpx.get(f"{server.url}/v1/models").json()["data"]] == ["org/tiny"]
        body = {"model": "org/tiny", "prompt": "The capital of France is", "max_tokens": 6, "temperature": 0,
                "ignore_eos": True}
        served = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
    finally:
        server.stop()
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    assert served == LLM(str(checkpoint), **OPTS).generate("The capital of France is", greedy)[0].outputs[0].text


def test_a_checkpoint_without_tokenizer_files(checkpoint, tmp_path):
    """config.json and safetensors alone: refused in one line naming the way out, or with
    skip_tokenizer_init=True loaded without a tokenizer, generating from token ids as the whole
    checkpoint does (a text prompt: a ValueError saying to pass token ids)."""
    from jaxinfer import LLM, SamplingParams

    for name in ("config.json", "model.safetensors"):
        shutil.copyfile(checkpoint / name, tmp_path / name)
    with pytest.raises(ModelFileError) as e:
        LLM(str(tmp_path), **OPTS)
    assert str(e.value) == (f"{tmp_path}: no tokenizer files (tokenizer.json, tokenizer_config.json, tokenizer.model"
                            "...); give a checkpoint with its tokenizer, or skip_tokenizer_init=True for token-id "
                            "prompts")
    llm = LLM(str(tmp_path), skip_tokenizer_init=True, **OPTS)
    assert llm.tokenizer is None
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    got = token_ids(llm.generate([[1, 5, 9, 13]], greedy)[0])
    assert len(got) == 4 and got == token_ids(LLM(str(checkpoint), **OPTS).generate([[1, 5, 9, 13]], greedy)[0])
    with pytest.raises(ValueError, match=r"no tokenizer \(dummy weights, or skip_tokenizer_init=True\): pass "
                                         r"prompts as token ids"):
        llm.generate("The capital of France is", greedy)


def test_a_tokenizer_from_elsewhere(offline, checkpoint, tmp_path):
    """``tokenizer=`` (vLLM's ``--tokenizer``): a directory of weights alone loads with its tokenizer's
    files from another directory, encoding and generating as the whole checkpoint does; a Hub repo of
    tokenizer files alone (no weights: not a model) resolves to its snapshot."""
    from jaxinfer import LLM, SamplingParams
    from jaxinfer.models.weights.source import resolve_tokenizer
    from jaxinfer.tokenizer import load_tokenizer

    weights, tokenizer = tmp_path / "weights", tmp_path / "tokenizer"
    weights.mkdir()
    tokenizer.mkdir()
    for name in os.listdir(checkpoint):
        shutil.copyfile(checkpoint / name, (weights if name in WEIGHTS_AND_CONFIG else tokenizer) / name)
    text = "The capital of France is"
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    whole = LLM(str(checkpoint), **OPTS)
    split = LLM(str(weights), tokenizer=str(tokenizer), **OPTS)
    assert split.tokenizer.encode(text) == whole.tokenizer.encode(text)
    assert split.generate(text, greedy)[0].outputs[0].text == whole.generate(text, greedy)[0].outputs[0].text
    assert resolve_tokenizer("org/tiny-tokenizer") == ModelSource("hf", snapshot(offline, "org/tiny-tokenizer"))
    assert load_tokenizer(resolve_tokenizer("org/tiny-tokenizer")).encode(text) == whole.tokenizer.encode(text)
    with pytest.raises(ValueError, match=r"without its \*\.safetensors weights"):
        resolve_model("org/tiny-tokenizer")


def token_ids(out) -> list[int]:
    """A prompt's one completion's tokens, whether the output holds its completions (``outputs``, as
    vLLM's ``RequestOutput``) or is the completion."""
    return list(getattr(out, "outputs", [out])[0].token_ids)


def test_revision_and_cache_location(offline, monkeypatch, tmp_path):
    tiny = ModelSource("hf", snapshot(offline, "org/tiny"))
    v1 = ModelSource("hf", snapshot(offline, "org/tiny", V1))
    assert resolve_model("org/tiny", revision="v1") == v1  # a tag
    assert resolve_model("org/tiny", revision=V1) == v1  # a commit
    assert resolve_model("org/tiny", revision="main") == tiny
    # The v1 snapshot's weights equal main's: the same checkpoint, read through a revision.
    _, a = load_model(resolve_model("org/tiny", revision="v1"), layer_loop="unroll")
    _, b = load_model("org/tiny", layer_loop="unroll")
    assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    # HF_HOME/hub when HF_HUB_CACHE is unset; download_dir over both.
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", os.path.dirname(offline))
    assert resolve_model("org/tiny") == tiny
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    assert resolve_model("org/tiny", download_dir=offline) == tiny
    # A local directory of the same name as a Hub id wins.
    monkeypatch.chdir(tmp_path)
    shutil.copytree(tiny.path, "org/tiny")
    assert resolve_model("org/tiny") == ModelSource("hf", str(tmp_path / "org" / "tiny"))


def test_a_gguf_file_of_a_repo(offline):
    want = ModelSource("gguf", os.path.join(snapshot(offline, "org/tiny-gguf"), "smollm2.Q8_0.gguf"))
    assert resolve_model("org/tiny-gguf:smollm2.Q8_0.gguf") == want
    assert resolve_model("org/tiny-gguf", gguf_file="smollm2.Q8_0.gguf") == want
    assert resolve_model("org/tiny-gguf:q4/smollm2.gguf").path == os.path.join(
        snapshot(offline, "org/tiny-gguf"), "q4", "smollm2.gguf")
    local = snapshot(offline, "org/tiny-gguf")  # gguf_file of a local directory
    assert resolve_model(local, gguf_file="smollm2.Q8_0.gguf") == ModelSource("gguf", want.path)
    for model, kw, match in [
            ("org/tiny-gguf:Q4_K_M", {}, r"after the colon goes a \.gguf file of the repo"),
            ("org/tiny-gguf:a.gguf", dict(gguf_file="b.gguf"), r"names GGUF file 'a\.gguf' but gguf_file is"),
            ("org/tiny-gguf:missing.gguf", {}, r"missing\.gguf of org/tiny-gguf is not in the Hugging Face cache"),
            ("tiny-llama3", dict(gguf_file="x.gguf"), r"gguf_file names a file of .* not of preset"),
            ("org/tiny-gguf", {}, r"org/tiny-gguf holds GGUF files, not \*\.safetensors: name the one to load, e\.g\. "
                                  r"org/tiny-gguf:q4/smollm2\.gguf \(or gguf_file='q4/smollm2\.gguf'\)$")]:
        with pytest.raises(ValueError, match=match) as e:
            resolve_model(model, **kw)
        assert "\n" not in str(e.value)
    with pytest.raises(ModelFileError, match="no such .gguf file"):
        resolve_model(local, gguf_file="missing.gguf")


def test_what_cannot_be_loaded_says_why_in_one_line(offline, monkeypatch):
    for model, kw, match in [
            ("org/missing", {}, rf"org/missing is not in the Hugging Face cache \({offline}\) and HF_HUB_OFFLINE is "
                                r"set: fetch it once online"),
            ("org/tiny", dict(revision="v2"), r"org/tiny at revision 'v2' is not in the Hugging Face cache"),
            ("no/such/path", {}, r"unknown model 'no/such/path': .*Hugging Face Hub id \(org/name"),
            ("llama3-8b", {}, None)]:
        if match is None:  # a preset names shapes only
            with pytest.raises(ValueError, match=r"preset 'llama3-8b' has no weights: use load_format='dummy' "
                                                 r"\(--load_format dummy\) or give a checkpoint") as e:
                from jaxinfer import LLM
                LLM(model)
        else:
            with pytest.raises(ValueError, match=match) as e:
                resolve_model(model, **kw)
        assert "\n" not in str(e.value), str(e.value)
    # Online, the Hub's own errors (a stand-in raises them: no network here).
    import huggingface_hub
    from huggingface_hub import utils

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    for error, match in [(utils.RepositoryNotFoundError, r"no model 'org/x' on the Hugging Face Hub .* set HF_TOKEN"),
                         (utils.GatedRepoError, r"org/x is a gated repo: .* set HF_TOKEN"),
                         (utils.RevisionNotFoundError, r"org/x has no revision 'nope' \(revision: a branch, tag"),
                         (ConnectionError, r"could not fetch org/x at revision 'nope' into .*ConnectionError: down")]:
        def fail(*args, error=error, **kwargs):
            e = error.__new__(error)
            Exception.__init__(e, "down\nwith pages of detail")
            raise e
        monkeypatch.setattr(huggingface_hub, "snapshot_download", fail)
        with pytest.raises(ValueError, match=match) as e:
            resolve_model("org/x", revision="nope")
        assert "\n" not in str(e.value), str(e.value)


def test_hub_ids():
    for model in ("Qwen/Qwen2.5-0.5B-Instruct", "org/name:file.gguf", "org/name:sub/x.gguf", "a_b/c.d"):
        assert hub.is_hub_id(model), model
    for model in ("./x", "../x", "a/b/c", "/abs/path", "name", "org/", "-o/x", "o/x."):
        assert not hub.is_hub_id(model), model
