"""Per-request sampling parameters, validated at the boundary so bad values never reach JAX."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Sequence


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
                raise ValueError(f"structured choice must be a non-empty list of non-empty strings, got {self.choice!r}")
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
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured {name} must be a non-empty string, got {value!r}")
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

    ``temperature == 0`` is greedy. ``top_k <= 0`` and ``top_p == 1`` disable those filters.
    ``seed`` makes sampling reproducible regardless of what else is in the batch.
    ``logprobs`` asks for that many top alternatives per generated token (the sampled token's own
    logprob is always returned when it is set, including ``logprobs=0``).
    ``structured`` constrains the output (JSON schema, regex, choice, grammar): see StructuredOutputs.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    structured: StructuredOutputs | None = None

    def __post_init__(self):
        # Normalize list inputs so the dataclass stays hashable and immutable.
        stop = self.stop
        if isinstance(stop, str):
            stop = (stop,)
        object.__setattr__(self, "stop", tuple(stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        _check_int("max_tokens", self.max_tokens, low=1)
        _check_number("temperature", self.temperature, low=0.0, high=100.0)
        _check_number("top_p", self.top_p, low=0.0, high=1.0, low_open=True)
        _check_int("top_k", self.top_k, low=-1)
        _check_number("min_p", self.min_p, low=0.0, high=1.0)
        _check_number("presence_penalty", self.presence_penalty, low=-2.0, high=2.0)
        _check_number("frequency_penalty", self.frequency_penalty, low=-2.0, high=2.0)
        if self.seed is not None:
            _check_int("seed", self.seed, low=0, high=2**63 - 1)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, low=0, high=20)
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must be non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t, low=0)
        if self.structured is not None and not isinstance(self.structured, StructuredOutputs):
            raise TypeError(f"structured must be a StructuredOutputs, got {type(self.structured).__name__}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _check_int(name: str, value, *, low: int, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}")
    if value < low or (high is not None and value > high):
        rng = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be {rng}, got {value}")


def _check_number(name: str, value, *, low: float, high: float, low_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
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
