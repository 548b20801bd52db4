"""What ``LLM.generate`` and ``LLM.chat`` return, in vLLM's shape: one ``RequestOutput`` per prompt
holding its ``n`` completions (``out.outputs[0].text``), so code written against vLLM's offline API
reads our results unchanged.

The engine reports each completion on its own, step by step (``batching.outputs.EngineOutput``, with
the deltas a stream needs); this module only gathers a prompt's finished completions.
"""

from __future__ import annotations

import dataclasses

from jaxinfer.batching.outputs import EngineOutput
from jaxinfer.batching.request import RequestError


@dataclasses.dataclass
class CompletionOutput:
    """One completion of a prompt. ``logprobs`` (one ``{token id: logprob}`` per generated token, the
    sampled token's included) and ``cumulative_logprob`` (the sampled tokens' sum) are set only where
    ``SamplingParams.logprobs`` asked for them. ``finish_reason``: ``"stop"`` (end of sequence, a stop
    token or string), ``"length"`` (``max_tokens`` or the model's length), ``"abort"`` or ``"error"``
    (``error`` says why; only this completion failed). ``warnings``: under a JSON schema, what the
    caller should know of the output (the schema's relaxed keywords and any violation of them, an
    output cut off by ``max_tokens``, a repeated key; ``batching.structured``'s policy)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None
    error: RequestError | None = None
    warnings: list[str] = dataclasses.field(default_factory=list)

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
    """A prompt and its completions. ``prompt`` is the text given (``None`` for token ids);
    ``num_cached_tokens``: prompt tokens whose KV the prefix cache supplied (the first completion's);
    ``prompt_logprobs`` (where ``SamplingParams.prompt_logprobs`` asked): None for the first prompt
    token, then per token ``{token id: logprob}`` of the token itself and the most likely ones."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, float] | None] | None = None

    @staticmethod
    def gather(request_id: str, prompt: str | None, completions: list[EngineOutput],
               prompt_logprobs: list[dict[int, float] | None] | None = None) -> RequestOutput:
        """The output of a prompt whose completions ran as the engine requests ``completions``."""
        outputs = [CompletionOutput(i, c.text, c.token_ids, _cumulative(c), c.logprobs, c.finish_reason, c.error)
                   for i, c in enumerate(completions)]
        first = completions[0]
        return RequestOutput(request_id, prompt, first.prompt_token_ids, outputs,
                             all(c.finished for c in completions), first.num_cached_tokens, prompt_logprobs)


def _cumulative(c: EngineOutput) -> float | None:
    if c.logprobs is None:
        return None
    return float(sum(step[token] for step, token in zip(c.logprobs, c.token_ids)))
