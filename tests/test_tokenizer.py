"""Streaming detokenization and chat templates with SmolLM2's real (byte-level BPE) tokenizer."""

import pytest

from jaxinfer.models.weights import resolve_model
from jaxinfer.tokenizer import IncrementalDetokenizer, apply_chat_template, load_tokenizer

TEXTS = [
    "Hello, world! Plain ASCII with  double spaces.\n",
    "Emoji: 😀🎉👩‍👩‍👧 and flags 🇫🇷🇯🇵.",
    "中文和日本語のテキスト、한국어도。",
    "Accents: café, naïve, Ångström, Đorđe, ñandú — “quotes” ½ €.",
    "mixed😀中é\t\u00a0𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
]


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_detokenizer_round_trips(smollm2_tokenizer, text):
    tok = smollm2_tokenizer
    ids = tok.encode(text, add_special_tokens=False)
    assert "\ufffd" in "".join(tok.decode([i]) for i in ids) or text.isascii()  # tokens really split chars
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.add(i) for i in ids]
    assert not any("\ufffd" in d for d in deltas), deltas
    assert "".join(deltas) == text == tok.decode(ids, skip_special_tokens=True)


def test_incremental_detokenizer_with_prompt_and_specials(smollm2_tokenizer):
    tok = smollm2_tokenizer
    prompt = tok.encode("Say hi:", add_special_tokens=False)
    out = tok.encode(" Hi 😀 there", add_special_tokens=False) + [tok.eos_token_id]
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = [detok.add(i) for i in out[:3]] + [detok.add(out[3:])]  # one at a time, then several
    assert "".join(deltas) == tok.decode(out, skip_special_tokens=True) == " Hi 😀 there"


def test_invalid_utf8_is_emitted_not_held_forever(smollm2_tokenizer):
    tok = smollm2_tokenizer
    lone = tok.convert_tokens_to_ids("ð")  # byte 0xF0: starts a 4-byte sequence that never completes
    a = tok.encode("a", add_special_tokens=False)[0]
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.add(lone) for _ in range(4)] + [detok.add(a)]
    assert deltas[:3] == ["", "", ""] and deltas[3]  # held while it could still complete, then emitted
    assert "".join(deltas) == tok.decode([lone] * 4 + [a], skip_special_tokens=True)


def test_flush_emits_a_character_cut_off_at_the_end(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = tok.encode("ok 😀", add_special_tokens=False)
    cut = ids[:-1]  # the emoji's last byte token never comes (generation stopped on a length limit)
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.add(i) for i in cut]
    assert "\ufffd" not in "".join(deltas)  # the partial character is held back while streaming ...
    tail = detok.flush()
    assert tail.endswith("\ufffd") and "".join(deltas) + tail == tok.decode(cut)  # ... and flushed at the end
    assert detok.flush() == ""


def test_chat_template(smollm2_tokenizer):
    ids = apply_chat_template(smollm2_tokenizer, [{"role": "user", "content": "What is 2+2?"}])
    text = smollm2_tokenizer.decode(ids)
    assert "<|im_start|>user\nWhat is 2+2?<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert ids.count(smollm2_tokenizer.convert_tokens_to_ids("<|im_start|>")) == 3  # system, user, assistant


def test_embedded_model_renders_tools_and_plain_chats_as_its_own_template(smollm2_tokenizer):
    """The embedded model's chat template lists ``tools`` (Hermes-style calls, so the hermes parser
    reads its replies) and renders chats without tools exactly as the GGUF's own template does."""
    from jaxinfer.models.weights.gguf_file import gguf_file
    from jaxinfer.server.tool_parsers import parser_for_template

    own = gguf_file(resolve_model("smollm2-135m").path).metadata["tokenizer.chat_template"]

    def turns(*pairs):
        return [{"role": role, "content": content} for role, content in pairs]

    chats = [turns(("user", "Hi")), turns(("system", "Be brief."), ("user", "Hi 😀")),
             turns(("user", "a"), ("assistant", "b"), ("user", "c")),
             turns(("system", "S"), ("user", "a"), ("assistant", ""), ("user", "late"), ("system", "late system"))]
    for chat in chats:
        for prompt in (True, False):
            assert smollm2_tokenizer.apply_chat_template(chat, add_generation_prompt=prompt, tokenize=False) == \
                smollm2_tokenizer.apply_chat_template(chat, chat_template=own, add_generation_prompt=prompt,
                                                      tokenize=False)
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    text = smollm2_tokenizer.decode(apply_chat_template(smollm2_tokenizer, chats[0], tools=[tool]))
    assert "<tools>" in text and '"get_weather"' in text and "<tool_call>" in text
    assert parser_for_template(smollm2_tokenizer.chat_template).name == "hermes"


def test_chat_template_errors(smollm2_tokenizer, monkeypatch):
    monkeypatch.setattr(smollm2_tokenizer, "chat_template", None)
    with pytest.raises(ValueError, match="has no chat template"):
        apply_chat_template(smollm2_tokenizer, [{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match="needs a tokenizer"):
        apply_chat_template(None, [{"role": "user", "content": "hi"}])


def test_preset_without_files_has_no_tokenizer():
    assert load_tokenizer(resolve_model("tiny-llama3")) is None


def test_gguf_tokenizer_is_cached_and_behaves_the_same(tmp_path, monkeypatch, smollm2_tokenizer):
    """The second load reads the converted tokenizer back from the user cache: the same ids, text,
    special tokens and chat rendering as transformers' conversion from the GGUF."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    source = resolve_model("smollm2-135m")
    first = load_tokenizer(source)  # converts, then saves
    saved = list(tmp_path.glob("jaxinfer/tokenizers/*/tokenizer.json"))
    assert len(saved) == 1
    cached = load_tokenizer(source)
    assert cached.name_or_path == str(saved[0].parent)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 😀"}]
    for tok in (first, cached):
        assert len(tok) == len(smollm2_tokenizer)
        assert (tok.bos_token_id, tok.eos_token_id) == (smollm2_tokenizer.bos_token_id, smollm2_tokenizer.eos_token_id)
        assert apply_chat_template(tok, messages) == apply_chat_template(smollm2_tokenizer, messages)
        for text in TEXTS:
            ids = tok.encode(text)
            assert ids == smollm2_tokenizer.encode(text)
            assert tok.decode(ids, skip_special_tokens=True) == smollm2_tokenizer.decode(ids, skip_special_tokens=True)
