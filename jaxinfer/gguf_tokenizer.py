"""A byte-level BPE tokenizer (GGUF ``tokenizer.ggml.model`` "gpt2": SmolLM2, Llama 3, Qwen2) built
straight from a GGUF's metadata with the ``tokenizers`` library, as transformers' GGUF conversion
builds it (``transformers.integrations.gguf.gguf_tokenizer_mapping``: ``byte_level_tokenizer``,
``add_gguf_special_tokens``, ``set_split_regex``, then ``TokenizersBackend`` with the file's special
tokens and flags), and wrapped in the same ``TokenizersBackend`` class.

transformers' own conversion of the embedded model took ~11 s on a 2-core CPU: it imports PyTorch
for its GGUF reader, builds a model config, and makes the tokenizer through ``GPT2Tokenizer`` and
its Python-side bookkeeping. The same tokenizer from ``gguf_file``'s metadata takes a small
fraction of a second past importing transformers (which loading the saved tokenizer needs too).
``tests/test_tokenizer.py`` holds the two conversions to the same ids, text and special tokens.
"""

from __future__ import annotations

# A GGUF's ``tokenizer.ggml.token_type`` values (llama.cpp's ``llama_token_type``).
_CONTROL, _USER_DEFINED = 3, 4
# GPT2Tokenizer's own special-token defaults, which transformers' conversion goes through: a
# vocabulary without "<|endoftext|>" (Llama 3's) gets it as one more (special) token there, so here too.
_GPT2_DEFAULT_SPECIAL = "<|endoftext|>"
# The file's special token ids -> transformers' names for them.
_SPECIAL_TOKENS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
                   "pad_token": "padding_token_id"}

# How each ``tokenizer.ggml.pre`` splits text before the byte-level BPE: the regexes transformers
# uses (``GGUF_PRE_TOKENIZER_SPLITS``). Others keep ByteLevel's own (GPT-2's) split.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                 r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                 r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
                 r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                     "jina-v5-nano", "dbrx", "smaug-bpe"), _LLAMA3_SPLIT),
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2_SPLIT),
    "qwen35": _QWEN35_SPLIT,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O_SPLIT),
}


def builds(metadata: dict) -> bool:
    """Whether ``byte_level_bpe`` builds this file's tokenizer: byte-level BPE with its merges listed
    (transformers converts every other kind, and a BPE file whose merges it must derive)."""
    return (metadata.get("tokenizer.ggml.model") == "gpt2" and bool(metadata.get("tokenizer.ggml.tokens"))
            and bool(metadata.get("tokenizer.ggml.merges")))


def byte_level_bpe(metadata: dict, name_or_path: str = ""):
    """The ``transformers.TokenizersBackend`` transformers' GGUF conversion makes from this metadata
    (``builds(metadata)`` must hold); ``name_or_path`` is what it names as its source."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE
    from transformers import TokenizersBackend

    tokens = metadata["tokenizer.ggml.tokens"]
    token_types = metadata.get("tokenizer.ggml.token_type") or ()
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())  # the 256 characters byte-level BPE spells bytes with
    if alphabet.issuperset("".join(tokens)):  # the usual case, checked at once
        vocab = dict(zip(tokens, range(len(tokens))))
    else:
        # A token written in plain text rather than the byte alphabet (llama.cpp writes some that way)
        # is respelled byte by byte, so the merges, which are spelled in the alphabet, find it.
        vocab = {token if alphabet.issuperset(token) else "".join(spelling[b] for b in token.encode("utf-8")): index
                 for index, token in enumerate(tokens)}
    merges = [tuple(merge.split(" ")) for merge in metadata["tokenizer.ggml.merges"]]
    backend = Tokenizer(BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
                            end_of_word_suffix="", fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_tokens([AddedToken(_GPT2_DEFAULT_SPECIAL, special=True)])
    # Control tokens (like <|im_start|>) are special; one that is not spelled in the byte alphabet is a
    # llama.cpp mislabel and would grow the vocabulary past the model's, so it is left out.
    control = [AddedToken(token, normalized=False, special=True) for token, kind in zip(tokens, token_types)
               if kind == _CONTROL and alphabet.issuperset(token)]
    if control:
        backend.add_special_tokens(control)
    # User-defined tokens (like <think>) are matched whole, but are not special.
    user_defined = [token for token, kind in zip(tokens, token_types) if kind == _USER_DEFINED]
    if user_defined:
        known = backend.get_vocab()
        backend.add_tokens([AddedToken(token, normalized=False, special=False) for token in user_defined
                            if token in known])
    split = PRE_TOKENIZER_SPLITS.get(metadata.get("tokenizer.ggml.pre"))
    if split is not None:
        backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                         pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                  use_regex=False)])

    kwargs = {}
    for name, key in (("chat_template", "tokenizer.chat_template"), ("add_bos_token", "tokenizer.ggml.add_bos_token"),
                      ("add_eos_token", "tokenizer.ggml.add_eos_token")):
        if key in metadata:
            kwargs[name] = metadata[key]
    for name, key in _SPECIAL_TOKENS.items():
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        if token_id is not None and token_id >= len(tokens):
            raise ValueError(f"tokenizer.ggml.{key} is {token_id}, past the end of its {len(tokens)}-token vocabulary")
        kwargs[name] = tokens[token_id] if token_id is not None else None
    # As GPT2Tokenizer does: the backend set before ``__init__``, which takes it as it is (given as
    # ``tokenizer_object`` it would be deep-copied, a quarter of the build).
    tok = TokenizersBackend.__new__(TokenizersBackend)
    tok._tokenizer = backend
    tok.__init__(name_or_path=name_or_path, **kwargs)
    return tok


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> character table (``ByteLevel``'s alphabet): printable bytes stand for
    themselves, the rest for the characters from U+0100 up, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    rest = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(rest)}}
