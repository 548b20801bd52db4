"""Streaming detokenization and chat templates with SmolLM2's real (byte-level BPE) tokenizer."""

import os

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


def test_special_tokens_kept_and_spaces_between_them_as_vllm():
    """``skip_special_tokens=False`` keeps them in the text; ``spaces_between_special_tokens=False`` drops
    the space a WordPiece decoder puts between two added tokens in a row, and no other (vLLM's rule)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    wordpiece = Tokenizer(models.WordPiece({"[UNK]": 0, "hello": 1, "world": 2, "##s": 3}, unk_token="[UNK]"))
    wordpiece.decoder = decoders.WordPiece()
    tok = PreTrainedTokenizerFast(tokenizer_object=wordpiece, unk_token="[UNK]",
                                  additional_special_tokens=["[A]", "[B]"], clean_up_tokenization_spaces=False)
    ids = [tok.convert_tokens_to_ids(t) for t in ("[A]", "[B]", "world", "##s", "[B]", "hello")]

    def streamed(**kw):
        detok = IncrementalDetokenizer(tok, [1], **kw)
        return "".join([detok.add(i) for i in ids] + [detok.flush()])

    assert streamed() == " worlds hello"
    assert streamed(skip_special_tokens=False) == " [A] [B] worlds [B] hello"
    assert streamed(skip_special_tokens=False, spaces_between_special_tokens=False) == " [A][B] worlds [B] hello"
    assert streamed(spaces_between_special_tokens=False) == " worlds hello"


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


# Text of every kind a byte-level BPE splits differently: scripts, emoji (with joiners), code,
# whitespace runs at either end, digit runs, contractions, control characters and special tokens
# written out in the text.
ORACLE_TEXTS = TEXTS + [
    "", " ", "  leading and trailing  ", "\n", "\n\n\n", "\t\t x \r\n y\u3000z\u2028", "a" * 40 + " " * 17 + "b",
    "def f(x: int) -> int:\n    return x ** 2  # square\n\n\tif x != 0: print(f'{x!r}')\n",
    "for (int i = 0; i < n; ++i) { a[i] = b[i] >> 3; }  /* C */ <div class=\"x\">&amp;</div>",
    "0 7 42 123 1234 12345678901234567890 3.14159 -2.5e-10 1,000,000 0xDEADBEEF 2026-12-07",
    "I'm you're he'll we've they'd it's DON'T Can't",
    "Ελληνικά Русский текст עברית العربية हिन्दी ไทย",
    "😀🎉👩‍👩‍👧 🇫🇷🇯🇵 👍🏽 🏳️‍🌈 \U0001f9ec",
    "<|im_start|>user\nhi<|im_end|><|endoftext|> <|im_start|>", "<|im_end|>\n<|im_start|>assistant\n",
    "\x00\x01\x7f control", "\ufeffBOM and \ufffd replacement",
]
ORACLE_CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi 😀, what's 2+2?"},
               {"role": "assistant", "content": "4."}, {"role": "user", "content": "  and\tin code?\n"}]


def _transformers_gguf_tokenizer(path):
    """transformers' own conversion of a GGUF's tokenizer: the oracle."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                         local_files_only=True)


@pytest.fixture(scope="module")
def transformers_smollm2_tokenizer():
    return _transformers_gguf_tokenizer(resolve_model("smollm2-135m").path)


def _assert_same_tokenizer(tok, want):
    """The same class, backend, special tokens, chat template and vocabulary, and the same ids and text
    for every one of ``ORACLE_TEXTS`` and a rendered chat."""
    assert type(tok) is type(want)
    assert tok.backend_tokenizer.to_str() == want.backend_tokenizer.to_str()
    assert len(tok) == len(want) and tok.get_vocab() == want.get_vocab()
    for name in ("bos_token", "eos_token", "pad_token", "unk_token", "bos_token_id", "eos_token_id", "pad_token_id",
                 "unk_token_id", "all_special_tokens", "all_special_ids", "add_bos_token", "add_eos_token",
                 "chat_template", "special_tokens_map", "clean_up_tokenization_spaces"):
        assert getattr(tok, name) == getattr(want, name), name
    chat = want.apply_chat_template(ORACLE_CHAT, tokenize=False, add_generation_prompt=True)
    assert tok.apply_chat_template(ORACLE_CHAT, tokenize=False, add_generation_prompt=True) == chat
    for text in ORACLE_TEXTS + [chat]:
        for special in (True, False):
            ids = tok.encode(text, add_special_tokens=special)
            assert ids == want.encode(text, add_special_tokens=special), (text, special)
            for skip in (True, False):
                assert tok.decode(ids, skip_special_tokens=skip) == want.decode(ids, skip_special_tokens=skip)
    pairs = (ORACLE_TEXTS[:3], ORACLE_TEXTS[3:6])
    assert tok(*pairs)["input_ids"] == want(*pairs)["input_ids"]


def _without_transformers_gguf_conversion(monkeypatch):
    """transformers' GGUF tokenizer conversion made to fail: what converts must not use it."""
    from transformers import AutoTokenizer, TokenizersBackend

    for cls in (AutoTokenizer, TokenizersBackend):
        original = cls.from_pretrained.__func__

        def refuse(klass, *args, _original=original, **kwargs):
            assert not kwargs.get("gguf_file"), "transformers' GGUF conversion was used"
            return _original(klass, *args, **kwargs)

        monkeypatch.setattr(cls, "from_pretrained", classmethod(refuse))


def test_gguf_tokenizer_is_transformers_conversion_without_transformers_gguf_path(
        tmp_path, monkeypatch, transformers_smollm2_tokenizer):
    """From a cold cache, the embedded GGUF's tokenizer is built from its metadata (in a fraction of a
    second, not transformers' ~11 s conversion) and is token for token transformers' conversion: as
    built, and as saved in the user cache and loaded back on the next start."""
    from jaxinfer.tokenizer import EMBEDDED_CHAT_TEMPLATE, _saved_class

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    _without_transformers_gguf_conversion(monkeypatch)
    source = resolve_model("smollm2-135m")
    want = transformers_smollm2_tokenizer
    with open(EMBEDDED_CHAT_TEMPLATE, encoding="utf-8") as f:
        embedded_template = f.read()
    first = load_tokenizer(source)  # converts and saves
    (saved,) = tmp_path.glob("jaxinfer/tokenizers/*/tokenizer.json")
    cached = load_tokenizer(source)
    assert cached.name_or_path == str(saved.parent)
    # load_tokenizer gives the embedded model its own chat template; the conversion keeps the GGUF's.
    assert first.chat_template == cached.chat_template == embedded_template != want.chat_template
    for tok in (first, cached):
        tok.chat_template = want.chat_template
        _assert_same_tokenizer(tok, want)
    _assert_same_tokenizer(_saved_class(str(saved.parent)).from_pretrained(str(saved.parent)), want)


def _gguf_with_tokenizer(path, metadata: dict) -> None:
    """A GGUF of ``metadata`` and no tensors: what transformers' tokenizer conversion reads."""
    import gguf

    writer = gguf.GGUFWriter(str(path), metadata["general.architecture"])
    for key, value in metadata.items():
        if key == "general.architecture":
            continue
        if isinstance(value, list):
            sub = gguf.GGUFValueType.get_type(value[0])
            if key.endswith("_id") or key == "tokenizer.ggml.token_type":
                sub = gguf.GGUFValueType.INT32
            writer.add_key_value(key, value, gguf.GGUFValueType.ARRAY, sub_type=sub)
        else:
            vtype = gguf.GGUFValueType.get_type(value)
            writer.add_key_value(key, value, gguf.GGUFValueType.UINT32 if vtype == gguf.GGUFValueType.INT32 else vtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("variant", ["llama3", "qwen2"])
def test_byte_level_bpe_variants_match_transformers_conversion(tmp_path, monkeypatch, variant):
    """SmolLM2's vocabulary changed the ways other byte-level BPE files differ (Llama 3, Qwen2): their
    pre-tokenizer splits, BOS added, no "<|endoftext|>", a user-defined token, a control token outside
    the byte alphabet (skipped as a mislabel), a token written in plain text, no unknown or padding
    token: built the same as transformers converts them."""
    from jaxinfer.gguf_tokenizer import builds, byte_level_bpe
    from jaxinfer.models.weights.gguf_file import gguf_file

    md = dict(gguf_file(resolve_model("smollm2-135m").path).metadata)
    tokens, types = list(md["tokenizer.ggml.tokens"]), list(md["tokenizer.ggml.token_type"])
    types[4] = 4  # "<reponame>": user-defined, not control
    tokens[9], types[9] = "<|中文|>", 3  # a control token llama.cpp wrote in plain text
    spaced = next(i for i, t in enumerate(tokens) if t.startswith("Ġ") and len(t) > 4)
    tokens[spaced] = tokens[spaced].replace("Ġ", " ")  # in plain text: respelled in the byte alphabet
    if variant == "llama3":
        tokens[0] = "<|end_of_text|>"
        md.update({"tokenizer.ggml.pre": "llama-bpe", "tokenizer.ggml.add_bos_token": True})
        del md["tokenizer.ggml.unknown_token_id"], md["tokenizer.ggml.padding_token_id"]
    else:
        md.update({"tokenizer.ggml.pre": "qwen2", "tokenizer.ggml.add_eos_token": True})
        del md["tokenizer.ggml.add_bos_token"]
    md.update({"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types})
    path = tmp_path / f"{variant}.gguf"
    _gguf_with_tokenizer(path, md)
    want = _transformers_gguf_tokenizer(str(path))
    assert builds(md)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    _without_transformers_gguf_conversion(monkeypatch)
    tok = load_tokenizer(resolve_model(str(path)))
    _assert_same_tokenizer(tok, want)
    _assert_same_tokenizer(byte_level_bpe(gguf_file(str(path)).metadata, str(tmp_path)), want)
    assert len(tok) == len(tokens) + (variant == "llama3")  # transformers' "<|endoftext|>" default, added
    ids = tok.encode(f"x<reponame>y{tokens[spaced]}", add_special_tokens=False)
    assert 4 in ids and spaced in ids and "<reponame>" in tok.decode(ids, skip_special_tokens=True)
    assert "<reponame>" in tok.get_added_vocab() and "<|中文|>" not in tok.get_added_vocab()


def test_gguf_tokenizer_errors(tmp_path, monkeypatch):
    """A special token id past the vocabulary names the file; a tokenizer other than byte-level BPE
    (SentencePiece, "llama") is left to transformers' conversion."""
    from jaxinfer.gguf_tokenizer import builds
    from jaxinfer.models.weights import ModelFileError
    from jaxinfer.models.weights.gguf_file import gguf_file

    md = dict(gguf_file(resolve_model("smollm2-135m").path).metadata)
    assert builds(md) and not builds({**md, "tokenizer.ggml.model": "llama"})
    assert not builds({k: v for k, v in md.items() if k != "tokenizer.ggml.merges"})
    md["tokenizer.ggml.eos_token_id"] = 49152
    path = tmp_path / "bad.gguf"
    _gguf_with_tokenizer(path, md)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    with pytest.raises(ModelFileError, match=r"bad\.gguf.*tokenizer\.ggml\.eos_token_id is 49152, past the end "
                                             r"of its 49152-token vocabulary"):
        load_tokenizer(resolve_model(str(path)))
