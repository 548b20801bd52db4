"""Tokenizer loading, chat templates and incremental (streaming) detokenization."""

from __future__ import annotations

import contextlib
import json
import logging
import numbers
import os
from typing import Sequence

from jaxinfer.models.weights import ModelFileError, ModelSource
from jaxinfer.models.weights.gguf_file import gguf_file
from jaxinfer.models.weights.source import blamed_on, resolve_model, resolve_tokenizer
from jaxinfer.user_cache import derived_from

log = logging.getLogger(__name__)

# Converted (orbax) directories keep the source's tokenizer here, written by ``jaxinfer convert``.
CONVERTED_TOKENIZER_DIR = "tokenizer"
# A Hugging Face checkpoint's tokenizer is in at least one of these (without any, transformers fails
# with a message about sentencepiece, whatever the checkpoint's tokenizer was).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model")
# A UTF-8 character is at most 4 bytes, so at most 4 tokens can be waiting for it to complete;
# text still ending in U+FFFD after that many is genuinely invalid and is emitted as is.
_MAX_PENDING_TOKENS = 4
# Tokens of prompt context decoded with the first outputs, so e.g. SentencePiece's leading-space
# handling matches what a whole-sequence decode would give.
_PROMPT_CONTEXT_TOKENS = 5


# The embedded model's chat template: SmolLM2's own (the same text for chats without tools) that also
# lists tools and shows Hermes-style <tool_call> replies, so the model serves ``tools`` as shipped.
EMBEDDED_CHAT_TEMPLATE = os.path.join(os.path.dirname(__file__), "server", "templates", "smollm2_tools.jinja")


def load_tokenizer(source: ModelSource):
    """A ``transformers`` tokenizer for ``source``, or None for a preset without files (a Hugging Face
    directory without tokenizer files is a ``ModelFileError``: the engine's ``skip_tokenizer_init``
    loads none instead). The embedded model (the packaged SmolLM2 GGUF) gets
    ``EMBEDDED_CHAT_TEMPLATE`` as its chat template."""
    if source.kind == "preset":
        return None
    if source.kind == "gguf":
        # Built from the GGUF's vocabulary once, then saved: transformers' conversion (still used for
        # tokenizers other than byte-level BPE) took ~11 s for the embedded model on a 2-core CPU.
        cached = derived_from(source.path, "tokenizers")
        # The server's two processes start together: one converts, the other waits and reads the result.
        with _locked(cached):
            if os.path.isfile(os.path.join(cached, "tokenizer.json")):
                tok = _saved_class(cached).from_pretrained(cached, local_files_only=True)
            else:
                tok = _convert_gguf_tokenizer(source, cached)
        if source.preset == "smollm2-135m":
            with open(EMBEDDED_CHAT_TEMPLATE, encoding="utf-8") as f:
                tok.chat_template = f.read()
        return tok
    from transformers import AutoTokenizer

    if source.kind == "hf":
        check_has_tokenizer(source)
        return AutoTokenizer.from_pretrained(source.path, local_files_only=True)
    path = os.path.join(source.path, CONVERTED_TOKENIZER_DIR)  # orbax
    return AutoTokenizer.from_pretrained(path, local_files_only=True) if os.path.isdir(path) else None


def tokenizer_source(model: ModelSource | str, config) -> ModelSource | None:
    """Where an engine with ``config`` (an ``EngineConfig``) for ``model`` (its source, or its name to
    resolve) reads its tokenizer: nowhere (None) with ``skip_tokenizer_init``; ``config.tokenizer``
    where given (``resolve_tokenizer``); else the model's own files."""
    if config.skip_tokenizer_init:
        return None
    if config.tokenizer is not None:
        return resolve_tokenizer(config.tokenizer, download_dir=config.download_dir)
    return model if isinstance(model, ModelSource) else resolve_model(model, **config.model_location())


def check_has_tokenizer(source: ModelSource) -> None:
    """Refuse, in one line, a Hugging Face directory without tokenizer files (before its weights load)."""
    if source.kind == "hf" and not any(os.path.isfile(os.path.join(source.path, n)) for n in TOKENIZER_FILES):
        raise ModelFileError(source.path, "no tokenizer files (tokenizer.json, tokenizer_config.json, "
                             "tokenizer.model...); give a checkpoint with its tokenizer, or "
                             "skip_tokenizer_init=True for token-id prompts")


@contextlib.contextmanager
def _locked(path: str):
    """An exclusive lock on ``path + ".lock"`` for the block (none where it cannot be made)."""
    try:
        import fcntl

        os.makedirs(os.path.dirname(path), exist_ok=True)
        f = open(path + ".lock", "w")
    except (ImportError, OSError):
        f = None
    try:
        if f is not None:
            fcntl.flock(f, fcntl.LOCK_EX)
        yield
    finally:
        if f is not None:
            f.close()  # releases the lock


def _convert_gguf_tokenizer(source: ModelSource, cached: str):
    """The tokenizer transformers converts from the GGUF's vocabulary, saved at ``cached``: byte-level
    BPE (SmolLM2, Llama 3, Qwen2) built from ``gguf_file``'s metadata by ``gguf_tokenizer``, the
    same tokenizer in a fraction of a second; any other kind (SentencePiece...) by transformers. The
    file is read by ``gguf_file`` first: transformers' reader fails on a file cut short with a bare
    ``struct.error`` or numpy's reshape error, naming neither the file nor the cause."""
    from jaxinfer.gguf_tokenizer import builds, byte_level_bpe

    gguf = gguf_file(source.path)  # a ModelFileError for a bad file, before transformers reads it
    if builds(gguf.metadata):
        with blamed_on(source.path):  # a special token id past the vocabulary
            tok = byte_level_bpe(gguf.metadata, os.path.dirname(source.path))
    else:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(os.path.dirname(source.path), gguf_file=os.path.basename(source.path),
                                            local_files_only=True)
    if not tok.chat_template:
        template = gguf.metadata.get("tokenizer.chat_template")
        if template:
            tok.chat_template = template
    try:
        tok.save_pretrained(cached)
    except OSError as e:  # a read-only home: convert again next time
        log.warning("could not cache the tokenizer in %s: %s", cached, e)
    return tok


def _saved_class(path: str):
    """The tokenizer class a tokenizer saved at ``path`` names, imported alone: ``AutoTokenizer``
    resolves the same class but imports PyTorch on the way (1.5 s of the server's start-up, in both
    of its processes, on the 2-core CPU); ``AutoTokenizer`` where the class is not found."""
    import transformers

    with open(os.path.join(path, "tokenizer_config.json")) as f:
        name = json.load(f).get("tokenizer_class")
    return (getattr(transformers, name, None) if name else None) or transformers.AutoTokenizer


def apply_chat_template(tokenizer, messages: Sequence[dict], *, tools: Sequence[dict] | None = None,
                        chat_template: str | None = None) -> list[int]:
    """Token ids of ``messages`` rendered with the model's chat template (or ``chat_template``), ending in
    the assistant header; ``tools`` (OpenAI tool objects) are passed to the template, which lists them."""
    if tokenizer is None:
        raise ValueError("chat needs a tokenizer; this model has none (a preset without files)")
    if not chat_template and not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"tokenizer {type(tokenizer).__name__} ({tokenizer.name_or_path!r}) has no chat "
                         "template; pass plain prompts instead of messages")
    text = tokenizer.apply_chat_template(list(messages), tools=list(tools) if tools else None,
                                         chat_template=chat_template, add_generation_prompt=True, tokenize=False)
    # The template already spells out BOS and role markers; adding special tokens would double BOS.
    return list(tokenizer.encode(text, add_special_tokens=False))


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas whose concatenation equals decoding all ids.

    Only a short window is decoded per token: ids ``[prefix_offset:read_offset]`` were already
    emitted and give the context; the delta is what decoding ``[prefix_offset:]`` adds to it. A
    delta is held back while the text ends in U+FFFD, i.e. a multi-byte character split across
    byte-fallback tokens is not complete yet.

    ``skip_special_tokens`` leaves special tokens out of the text. Where they are kept,
    ``spaces_between_special_tokens=False`` is vLLM's rule for fast tokenizers: an added token right
    after another is decoded with what follows it, apart from what precedes it, so a decoder that
    joins tokens with spaces (WordPiece) puts none between the two; byte-level BPE adds none anyway.
    """

    def __init__(self, tokenizer, prompt_ids: Sequence[int] = (), *, skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._added: frozenset[int] = frozenset() if skip_special_tokens or spaces_between_special_tokens else (
            frozenset(getattr(tokenizer, "added_tokens_decoder", None) or ()))
        # A fast tokenizer that needs no clean-up decodes in Rust directly: transformers' decode
        # wrapper costs ~10x the decode itself, paid twice per token per sequence on the host loop.
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._backend = backend if backend is not None and tokenizer.clean_up_tokenization_spaces is False else None
        self.ids: list[int] = list(prompt_ids)
        self.read_offset = len(self.ids)
        self.prefix_offset = max(0, self.read_offset - _PROMPT_CONTEXT_TOKENS)

    def _decode(self, ids: list[int]) -> str:
        if self._added:  # each run that starts with an added token right after another, decoded apart
            cuts = [i for i in range(1, len(ids)) if ids[i] in self._added and ids[i - 1] in self._added]
            if cuts:
                return "".join(self._decode_run(ids[a:b]) for a, b in zip([0, *cuts], [*cuts, len(ids)]))
        return self._decode_run(ids)

    def _decode_run(self, ids: list[int]) -> str:
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_ids: int | Sequence[int]) -> str:
        """Append one or more ids; return the newly completed text (possibly empty)."""
        self.ids.extend([int(token_ids)] if isinstance(token_ids, numbers.Integral) else map(int, token_ids))
        return self._emit(final=False)

    def flush(self) -> str:
        """The text still held back (an incomplete character at the end of the stream, as U+FFFD):
        called once a request finishes, so the deltas add up to decoding every id."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset:])
        pending = len(self.ids) - self.read_offset
        if not final and (len(new_text) <= len(prefix_text) or (
                new_text.endswith("\ufffd") and pending < _MAX_PENDING_TOKENS)):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return new_text[len(prefix_text):]
