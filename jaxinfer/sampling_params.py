"""Per-request sampling parameters, validated at the boundary so bad values never reach JAX.

The bounds below are the only copy of each limit: ``SamplingParams`` and ``StructuredOutputs`` check
them, the server's request models state them in ``/openapi.json``, and the engine's step and the
constraint compiler are built to run anything within them, so a request the boundary accepts never
fails inside a step for its values.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Sequence

MAX_TOP_K = 2**31 - 1  # top_k travels to the step as int32; any value >= the vocabulary keeps every token
MAX_SEED = 2**63 - 1
MAX_LOGPROBS = 20  # top alternatives per token (OpenAI's limit); the step computes this many
MAX_N = 64  # choices per request
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256  # a stop string's length is held back from a stream until it cannot start one
MAX_STOP_TOKEN_IDS = 256
# llguidance refuses a grammar row of more than 2000 items when the step consumes a token, not when it
# compiles, so a longer choice list would fail inside a step; a choice adds one item to its row.
MAX_CHOICES = 1024
# Counted repetitions multiply inside llguidance's lexer: ``(a{1000}){1000}`` (10^6) took 12 s for its
# first token mask and then failed the step ("too many expressions constructed"), while ``a{50000}``
# took 0.1 s. A regex (or a schema's ``pattern``) is refused above this expanded size (``regex_size``).
MAX_REGEX_SIZE = 100_000
MAX_TEMPERATURE = 100.0
MAX_PENALTY = 2.0  # presence and frequency penalties lie in [-MAX_PENALTY, MAX_PENALTY]
MAX_REPETITION_PENALTY = 10.0  # repetition_penalty lies in (0, MAX_REPETITION_PENALTY]; 1 is off
MAX_LOGIT_BIAS = 100.0  # each logit_bias value lies in [-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS] (OpenAI's range)
MAX_LOGIT_BIAS_TOKENS = 1024  # entries of one logit_bias: each is a term of every step the request is in


@dataclasses.dataclass(frozen=True)
class StructuredOutputs:
    """A constraint on a request's output; exactly one field is set.

    ``json``: a JSON schema (dict or JSON text); ``json_object``: any JSON object; ``regex``: the
    whole output matches it (Rust ``regex`` syntax); ``choice``: the output is one of these strings;
    ``grammar``: a context-free grammar, Lark (llguidance's dialect) or GBNF (llama.cpp's). Only the
    shape is checked here; ``jaxinfer.batching.structured.compile_constraint`` checks the content
    (schema keywords, regex and grammar syntax) against the tokenizer, raising ``ValueError``.
    """

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self):
        if self.choice is not None:
            if isinstance(self.choice, str) or not isinstance(self.choice, (list, tuple)):
                raise TypeError(f"structured choice must be a list of strings, got {self.choice!r}")
            object.__setattr__(self, "choice", tuple(self.choice))
            if not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError(f"structured choice must be a non-empty list of non-empty strings, got "
                                 f"{_short(self.choice)}")
            if len(self.choice) > MAX_CHOICES:
                raise ValueError(f"structured choice has {len(self.choice)} items; at most {MAX_CHOICES} are allowed")
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    schema = json.loads(self.json)
                except json.JSONDecodeError as e:
                    raise ValueError(f"structured json is not valid JSON text: {e}") from None
            else:
                schema = self.json
            if not isinstance(schema, (dict, bool)):
                raise TypeError(f"structured json must be a JSON schema (an object), got {type(schema).__name__}")
            for pattern in _schema_patterns(schema):
                _check_regex_size("json pattern", pattern)
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured {name} must be a non-empty string, got {_short(value)}")
            if value is not None:
                _check_regex_size(name, value)
        if not isinstance(self.json_object, bool):
            raise TypeError(f"structured json_object must be a bool, got {self.json_object!r}")
        kinds = self.kinds
        if len(kinds) != 1:
            raise ValueError("structured outputs must set exactly one of json, json_object, regex, choice, grammar; "
                             f"got {', '.join(kinds) if kinds else 'none'}")

    @property
    def kinds(self) -> list[str]:
        return [f.name for f in dataclasses.fields(self) if getattr(self, f.name) not in (None, False)]

    @property
    def key(self) -> str:
        """Canonical text of the constraint: equal constraints (a schema as dict or as text) share it."""
        kind = self.kinds[0]
        value = getattr(self, kind)
        if kind == "json" and isinstance(value, str):
            value = json.loads(value)
        return json.dumps([kind, value], sort_keys=True, separators=(",", ":"))

    def __hash__(self):  # a schema dict is unhashable; the canonical text is not
        return hash(self.key)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """OpenAI/vLLM-style sampling settings for one request.

    ``n`` completions are generated for the prompt (choice ``j`` seeded ``seed + j`` when ``seed`` is
    given, so each is reproducible; ``choices``). ``temperature == 0`` is greedy. ``top_k <= 0`` and
    ``top_p == 1`` disable those filters. ``seed`` makes sampling reproducible regardless of what else
    is in the batch. ``logprobs`` asks for that many top alternatives per generated token (the
    sampled token's own logprob is always returned when it is set, including ``logprobs=0``);
    ``prompt_logprobs`` as many for each prompt token (``LLM.generate`` computes them in a pass of
    their own: ``RequestOutput.prompt_logprobs``).
    Penalties and bias are vLLM's: ``presence_penalty`` and ``frequency_penalty`` over the generated
    tokens, ``repetition_penalty`` over the prompt's and the generated tokens (a seen token's positive
    logit divided by it, a negative one multiplied), ``logit_bias`` ``{token id: bias}`` added to the
    logits; ``min_tokens`` holds back the end-of-sequence tokens, ``stop_token_ids`` and ``stop``
    strings until that many tokens are generated. ``structured`` constrains the output (JSON schema,
    regex, choice, grammar): see StructuredOutputs.
    The text is vLLM's: ``skip_special_tokens`` leaves special tokens (``<|im_end|>``...) out of it;
    ``spaces_between_special_tokens=False``, where they are kept, puts no space the tokenizer's decoder
    would add between two added tokens in a row. The stop that ended a request is left out of its
    text unless ``include_stop_str_in_output``: then the text ends with the matched stop string, or
    with the stop token's text (EOS or one of ``stop_token_ids``, which a special token has only
    without ``skip_special_tokens``). A stop token is never one of the output's ``token_ids``.
    """

    max_tokens: int = 16
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = dataclasses.field(default=None, hash=False)
    structured: StructuredOutputs | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def __post_init__(self):
        # Normalize list inputs so the dataclass stays hashable and immutable.
        stop = self.stop
        if isinstance(stop, str):
            stop = (stop,)
        object.__setattr__(self, "stop", tuple(stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        _check_int("max_tokens", self.max_tokens, low=1)
        _check_int("n", self.n, low=1, high=MAX_N)
        _check_number("temperature", self.temperature, low=0.0, high=MAX_TEMPERATURE)
        _check_number("top_p", self.top_p, low=0.0, high=1.0, low_open=True)
        _check_int("top_k", self.top_k, low=-1, high=MAX_TOP_K)
        _check_number("min_p", self.min_p, low=0.0, high=1.0)
        _check_number("presence_penalty", self.presence_penalty, low=-MAX_PENALTY, high=MAX_PENALTY)
        _check_number("frequency_penalty", self.frequency_penalty, low=-MAX_PENALTY, high=MAX_PENALTY)
        _check_number("repetition_penalty", self.repetition_penalty, low=0.0, high=MAX_REPETITION_PENALTY,
                      low_open=True)
        _check_int("min_tokens", self.min_tokens, low=0, high=self.max_tokens)
        if self.seed is not None:
            _check_int("seed", self.seed, low=0, high=MAX_SEED)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, low=0, high=MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, low=0, high=MAX_LOGPROBS)
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop has {len(self.stop)} strings; at most {MAX_STOP_STRINGS} are allowed")
        for s in self.stop:
            if not isinstance(s, str) or not s or len(s) > MAX_STOP_CHARS:
                raise ValueError(f"stop must be non-empty strings of at most {MAX_STOP_CHARS} characters, "
                                 f"got {_short(s)}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids has {len(self.stop_token_ids)} ids; at most {MAX_STOP_TOKEN_IDS} "
                             "are allowed")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t, low=0, high=MAX_TOP_K)
        if self.logit_bias is not None:
            object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        for name in ("skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {type(getattr(self, name)).__name__} "
                                f"{_short(getattr(self, name))}")
        if self.structured is not None and not isinstance(self.structured, StructuredOutputs):
            raise TypeError(f"structured must be a StructuredOutputs, got {type(self.structured).__name__}")
        if self.structured is not None and self.min_tokens:
            raise ValueError("min_tokens cannot be combined with structured outputs: the grammar decides where "
                             "the output may end")

    @property
    def penalized(self) -> bool:
        """Presence, frequency or repetition penalties: a step needs the generated tokens on the host."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def adjusts_logits(self) -> bool:
        """Whether steps apply terms of this request to its logits (``sampling.LogitTerms``)."""
        return self.penalized or bool(self.logit_bias) or self.min_tokens > 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def choices(params: SamplingParams) -> list[SamplingParams]:
    """The ``n`` single completions ``params`` asks for: choice ``j`` seeded ``seed + j`` (wrapped below
    ``MAX_SEED``) when a seed is given, so every choice is reproducible and none repeats another."""
    one = dataclasses.replace(params, n=1)
    if params.seed is None:
        return [one] * params.n
    return [one] + [dataclasses.replace(one, seed=(params.seed + j) % (MAX_SEED + 1)) for j in range(1, params.n)]


def check_logit_bias(params: SamplingParams, vocab_size: int) -> None:
    """A ``logit_bias`` token outside the model's vocabulary would bias nothing: refused, not dropped
    (checked where the vocabulary is known: the engine, the server)."""
    bad = [t for t in params.logit_bias or () if t >= vocab_size]
    if bad:
        raise ValueError(f"logit_bias token id {bad[0]} is not below the vocabulary size {vocab_size}")


def _logit_bias(bias) -> dict[int, float]:
    """``logit_bias`` checked: a dict of token ids (ints, or their decimal text as JSON carries them) to
    finite biases in OpenAI's range."""
    if not isinstance(bias, dict):
        raise TypeError(f"logit_bias must be a dict of token id to bias, got {type(bias).__name__}")
    if len(bias) > MAX_LOGIT_BIAS_TOKENS:
        raise ValueError(f"logit_bias has {len(bias)} entries; at most {MAX_LOGIT_BIAS_TOKENS} are allowed")
    out = {}
    for token, value in bias.items():
        if isinstance(token, str) and token.isascii() and token.isdigit():
            token = int(token)
        _check_int("logit_bias token id", token, low=0, high=MAX_TOP_K)
        _check_number("logit_bias value", value, low=-MAX_LOGIT_BIAS, high=MAX_LOGIT_BIAS)
        out[token] = float(value)
    return out


def _short(value, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters: an error message never echoes a huge input."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def regex_size(pattern: str) -> int:
    """The length ``pattern`` expands to with each counted repetition ``{m}``/``{m,n}``/``{m,}`` written
    out (``a{3}`` -> 3, ``(ab){2}c`` -> 5, ``(a{10}){10}`` -> 100; ``*``, ``+`` and ``?`` count once): what
    grows a grammar engine's lexer. Escapes and character classes are one atom; text that is not a
    regex (a grammar's rules) is scanned the same way, which only finds its counted repetitions.
    Alternatives add up, as their lexer states do."""
    stack = [[0, 0]]  # per open group: [size so far, size of the last atom]
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\":
            atom, i = 1, i + 2
        elif c == "[":
            j = i + 1 + (pattern[i + 1:i + 2] == "^")
            j += pattern[j:j + 1] == "]"
            while j < n and pattern[j] != "]":
                j += 2 if pattern[j] == "\\" else 1
            atom, i = 1, j + 1
        elif c == "(":
            stack.append([0, 0])
            i += 1
            continue
        elif c == ")" and len(stack) > 1:
            atom, i = stack.pop()[0], i + 1
        elif c == "|":  # alternatives add up, as their states do
            stack[-1][1] = 0
            i += 1
            continue
        elif c == "{" and (end := pattern.find("}", i)) > i:
            bounds = pattern[i + 1:end].split(",")
            if all(b.strip().isdigit() or (k == 1 and not b.strip()) for k, b in enumerate(bounds)) and len(bounds) <= 2:
                count = max(int(b) for b in bounds if b.strip())
                frame = stack[-1]
                frame[0] += frame[1] * (count - 1)
                frame[1] *= count
                i = end + 1
                continue
            atom, i = 1, i + 1
        else:
            atom, i = 1, i + 1
        stack[-1][0] += atom
        stack[-1][1] = atom
    while len(stack) > 1:  # unbalanced: count what was opened
        size = stack.pop()[0]
        stack[-1][0] += size
    return stack[0][0]


def _check_regex_size(name: str, pattern: str) -> None:
    size = regex_size(pattern)
    if size > MAX_REGEX_SIZE:
        raise ValueError(f"structured {name} is too complex: its counted repetitions expand to {size:,} characters; "
                         f"at most {MAX_REGEX_SIZE:,} are allowed")


def _schema_patterns(node):
    """Every regex a JSON schema carries: ``pattern`` values and ``patternProperties`` keys."""
    if isinstance(node, list):
        for item in node:
            yield from _schema_patterns(item)
    elif isinstance(node, dict):
        for key, value in node.items():
            if key == "pattern" and isinstance(value, str):
                yield value
            elif key == "patternProperties" and isinstance(value, dict):
                yield from (k for k in value if isinstance(k, str))
            yield from _schema_patterns(value)


def _check_int(name: str, value, *, low: int, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} {_short(value)}")
    if value < low or (high is not None and value > high):
        rng = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be {rng}, got {value}")


def _check_number(name: str, value, *, low: float, high: float, low_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {_short(value)}")
    bad_low = value <= low if low_open else value < low
    if not math.isfinite(value) or bad_low or value > high:
        rng = f"({low}, {high}]" if low_open else f"[{low}, {high}]"
        raise ValueError(f"{name} must be in {rng}, got {value}")


def as_list(params: "SamplingParams | Sequence[SamplingParams] | None", n: int) -> list[SamplingParams]:
    """One SamplingParams per prompt: broadcast a single one, or check a list's length."""
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n or not all(isinstance(p, SamplingParams) for p in params):
        raise ValueError(f"sampling_params must be one SamplingParams or a list of {n} (one per prompt)")
    return params
