"""The public facade: ``LLM`` for repeated use (compiled steps are reused), ``generate`` for one-offs."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
from typing import Sequence

from tqdm.auto import tqdm

from jaxinfer.batching.config import EngineConfig
from jaxinfer.batching.engine import encode_prompt
from jaxinfer.batching.factory import create_engine
from jaxinfer.batching.outputs import EngineOutput
from jaxinfer.batching.structured import compiler_for, output_warnings
from jaxinfer.embeddings import EmbeddingOutput, EmbeddingRequestOutput
from jaxinfer.outputs import RequestOutput
from jaxinfer.sampling_params import SamplingParams, StructuredOutputs, as_list, check_logit_bias, choices
from jaxinfer.tokenizer import apply_chat_template

logger = logging.getLogger(__name__)

Prompt = str | Sequence[int]
PromptInput = Prompt | dict  # and vLLM's {"prompt": text} / {"prompt_token_ids": ids}


class LLM:
    """An engine bound to one model. ``engine_options`` are the fields of :class:`EngineConfig`."""

    def __init__(self, model: str = "smollm2-135m", **engine_options):
        self.engine = create_engine(model, EngineConfig.from_options(**engine_options))
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.get_tokenizer()

    def warmup(self, shapes=None, greedy_only: bool = False, structured: bool = False,
               background: bool = False) -> float:
        """Compile every step shape ahead of time (``structured``: also those of steps with
        constrained requests); returns the seconds it took. ``background``: only the steps a single
        request meets first before returning, the rest in a background thread (what the server does)."""
        return self.engine.warmup(shapes, greedy_only, structured, background)

    def get_tokenizer(self):
        """The model's tokenizer (transformers'); ``None`` for a model without one (dummy weights)."""
        return self.engine.tokenizer

    def generate(self, prompts: PromptInput | Sequence[PromptInput],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 priority: int | Sequence[int] = 0, use_tqdm: bool = True) -> list[RequestOutput]:
        """Run prompts to completion; one ``RequestOutput`` per prompt, in order, each with its
        ``sampling_params.n`` completions (``out.outputs[i]``). A prompt is text, a list of token ids,
        or vLLM's ``{"prompt": text}`` / ``{"prompt_token_ids": ids}``; ``sampling_params`` is one for
        all prompts or a list with one per prompt. Every prompt and option is checked before any runs."""
        prompts = _as_prompt_list(prompts)
        params = as_list(sampling_params, len(prompts))
        priorities = [priority] * len(prompts) if isinstance(priority, int) else list(priority)
        if len(priorities) != len(prompts):
            raise ValueError(f"priority must be one int or a list of {len(prompts)}")
        encoded = [self.engine.encode(p) for p in prompts]  # validate all before queueing any
        mc = self.engine.model_config
        constraints = None  # the engine's constraint compiler, made only if a request is constrained
        for sp in params:
            check_logit_bias(sp, mc.vocab_size)
            if sp.structured is not None:  # compiled once here, then found in the cache by add_request
                constraints = constraints or compiler_for(self.tokenizer, mc.vocab_size, mc.eos_token_ids,
                                                          self.engine.config.structured_outputs_whitespace)
                constraints.compile(sp.structured)
        scored = [None if sp.prompt_logprobs is None else self.engine.prompt_logprobs(p, sp.prompt_logprobs)
                  for p, sp in zip(encoded, params)]
        groups = []  # per prompt: its request id and its engine requests, one per completion
        for p, sp, prio in zip(encoded, params, priorities):
            rid = f"gen-{next(self._ids)}"
            completions = choices(dataclasses.replace(sp, prompt_logprobs=None))
            groups.append((rid, [(f"{rid}-{j}" if sp.n > 1 else rid, p, one, prio)
                                 for j, one in enumerate(completions)]))
        owner = {}  # engine request id -> its prompt's index, as queued
        left = [len(group) for _, group in groups]  # completions still running, per prompt
        done: dict[str, EngineOutput] = {}
        bar = tqdm(total=len(groups), desc="generating", disable=not use_tqdm or len(groups) == 1)
        try:  # whatever ends this early (a refused request, an interrupt) aborts what was queued
            for i, (_, group) in enumerate(groups):
                for rid, p, sp, prio in group:
                    self.engine.add_request(rid, p, sp, prio)
                    owner[rid] = i
            while len(done) < len(owner):
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        left[owner[out.request_id]] -= 1
                        bar.update(left[owner[out.request_id]] == 0)
        finally:
            bar.close()
            for rid in owner:
                if rid not in done:
                    self.engine.abort(rid)
        results = [RequestOutput.gather(rid, _text(prompt), [done[r] for r, *_ in group], lps)
                   for prompt, (rid, group), lps in zip(prompts, groups, scored)]
        for result, sp in zip(results, params):
            if sp.structured is not None and (sp.structured.json is not None or sp.structured.json_object):
                relaxed = constraints.relaxations(sp.structured)
                for c in result.outputs:
                    c.warnings = output_warnings(sp.structured, c.text, c.finish_reason, relaxed)
                    if c.warnings:
                        logger.warning("structured output %s: %s", result.request_id, "; ".join(c.warnings))
        return results

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
             tools: Sequence[dict] | None = None, chat_template: str | None = None,
             **kwargs) -> list[RequestOutput]:
        """Apply the model's chat template (or ``chat_template``) to one conversation or a list of them,
        then generate; ``tools`` (OpenAI tool objects) are given to the template, which lists them for
        the model (the reply is text: parse tool calls from it as the model formats them)."""
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts (or a list of such lists)")
        convs = messages if isinstance(messages[0], list) else [messages]
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer (dummy weights, or skip_tokenizer_init=True), so chat is "
                             "unavailable")
        prompts = [apply_chat_template(self.tokenizer, conv, tools=tools, chat_template=chat_template)
                   for conv in convs]
        return self.generate(prompts, sampling_params, **kwargs)

    def embed(self, prompts: Prompt | Sequence[Prompt], pooling: str = "last",
              normalize: bool = True) -> list[EmbeddingRequestOutput]:
        """Each prompt's embedding, in vLLM's shape (``out.outputs.embedding``, a list of floats): the
        model's final hidden states (after the final norm, before the LM head) pooled over the prompt,
        "last" (its last token's) or "mean" (over its tokens), then L2-normalized unless ``normalize``
        is false. A prompt is text or token ids and may fill ``max_model_len`` (a longer one is a
        ValueError). Runs at once, between the engine's steps (``LLMEngine.embed``); nothing is queued."""
        prompts = _as_prompt_list(prompts)
        mc = self.engine.model_config
        ids = [encode_prompt(p, self.tokenizer, mc.vocab_size, self.engine.max_model_len, generate=False)
               for p in prompts]  # validate all before computing any
        vectors = self.engine.embed(ids, pooling, normalize)
        return [EmbeddingRequestOutput(f"embd-{next(self._ids)}", EmbeddingOutput(v.tolist()), p)
                for p, v in zip(ids, vectors)]


def _as_prompt_list(prompts) -> list[Prompt]:
    """Each prompt as text or a token-id list (vLLM's prompt dicts unwrapped)."""
    if isinstance(prompts, (str, dict)):
        prompts = [prompts]
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts must be a string, a token-id list, or a non-empty list of them")
    if all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
        return [list(prompts)]
    out = []
    for p in prompts:
        if isinstance(p, dict):
            keys = set(p) & {"prompt", "prompt_token_ids"}
            if len(keys) != 1 or set(p) - keys:
                raise ValueError("a prompt dict must hold exactly one of 'prompt' (text) or 'prompt_token_ids', "
                                 f"got keys {sorted(p)}")
            p = p[keys.pop()]
        if not isinstance(p, (str, list, tuple)):
            raise TypeError(f"each prompt must be a string or a list of token ids, got {type(p).__name__}")
        out.append(p)
    return out


def _text(prompt: Prompt) -> str | None:
    return prompt if isinstance(prompt, str) else None


@functools.lru_cache(maxsize=2)
def _cached_llm(model: str, options: tuple) -> LLM:
    return LLM(model, **dict(options))


def generate(prompts: Prompt | Sequence[Prompt], model: str = "smollm2-135m", *, max_tokens: int = 64,
             temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0,
             seed: int | None = None, stop: str | Sequence[str] = (), stop_token_ids: Sequence[int] = (),
             ignore_eos: bool = False, logprobs: int | None = None, structured: StructuredOutputs | None = None,
             **engine_options) -> list[RequestOutput]:
    """One call from a notebook: the engine for ``(model, engine_options)`` is built once and reused."""
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                            seed=seed, stop=stop, stop_token_ids=tuple(stop_token_ids), ignore_eos=ignore_eos,
                            logprobs=logprobs, structured=structured)
    EngineConfig.from_options(**engine_options)  # reject bad options before building anything
    key = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in engine_options.items()))
    return _cached_llm(model, key).generate(prompts, params)
