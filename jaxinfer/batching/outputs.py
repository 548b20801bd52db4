"""The output side of the engine: each request's text (incremental detokenization, stop strings
held back and cut) and the ``EngineOutput`` a step reports for it.

The scheduler appends tokens to requests; as it does, it asks this processor whether the text now
holds a stop string (``add_token``). The processor owns only text state; a request's tokens, status
and finish reason are the scheduler's and are only read here. Text is made in the engine (the
server's engine core too), overlapped with the device step, so streamed text equals ``LLM.generate``'s.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import NamedTuple

import numpy as np

from jaxinfer.batching.request import Request, RequestError, Status
from jaxinfer.tokenizer import IncrementalDetokenizer

log = logging.getLogger(__name__)


@dataclasses.dataclass
class EngineOutput:
    """A request's state after a step: the whole text so far plus what is new since the last one."""

    request_id: str
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    delta_text: str = ""
    delta_token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    num_cached_tokens: int = 0
    error: RequestError | None = None  # why the request failed (``finish_reason == "error"``); it failed alone


class PromptLogprobs(NamedTuple):
    """A prompt's logprobs as arrays (``LLMEngine.score_prompt``), row i scoring ``token_ids[i + 1]``
    given the tokens before it: its log-probability and rank (1: the most likely), and the ``k`` most
    likely tokens' log-probabilities and ids, most likely first (``[n - 1, k]``, k may be 0). Arrays,
    so a server's engine process sends a long prompt's in a few buffers."""

    token_ids: list[int]
    logprobs: np.ndarray
    ranks: np.ndarray
    top_logprobs: np.ndarray
    top_ids: np.ndarray

    def rows(self):
        """Per token after the first, ``(token id, logprob, rank)`` of the token itself, then of the top k."""
        ranks = range(1, self.top_ids.shape[1] + 1)
        for i, token in enumerate(self.token_ids[1:]):
            yield [(token, float(self.logprobs[i]), int(self.ranks[i])),
                   *zip(self.top_ids[i].tolist(), self.top_logprobs[i].tolist(), ranks)]

    def as_dicts(self) -> list[dict[int, float] | None]:
        """vLLM's ``prompt_logprobs``: None for the first token, then per token ``{token id: logprob}`` of
        the token itself (first) and the top k."""
        return [None, *({token: logprob for token, logprob, _ in row} for row in self.rows())]


@dataclasses.dataclass
class _Text:
    """One request's text: its detokenizer, the text so far, and how much of it was reported."""

    detok: IncrementalDetokenizer | None
    text: str = ""
    emitted: int = 0  # characters of ``text`` already reported
    emitted_tokens: int = 0
    stopped: bool = False  # the text was cut at a stop string: nothing is left to flush
    num_tokens: int = 0  # output tokens the text was made from


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._texts: dict[str, _Text] = {}

    def add(self, req: Request) -> None:
        self._texts[req.request_id] = _Text(self._detokenizer(req))

    def _detokenizer(self, req: Request) -> IncrementalDetokenizer | None:
        if self.tokenizer is None:
            return None
        p = req.params
        return IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, skip_special_tokens=p.skip_special_tokens,
                                      spaces_between_special_tokens=p.spaces_between_special_tokens)

    def drop(self, request_id: str) -> None:
        self._texts.pop(request_id, None)

    def add_token(self, req: Request, token: int) -> bool:
        """``token`` was appended to ``req``: extend its text; True if the text now holds one of its
        stop strings (the text is cut before it)."""
        t = self._texts[req.request_id]
        t.num_tokens += 1
        searched = len(t.text)  # a stop string found now ends in the text this token adds
        if t.detok is not None:
            t.text += t.detok.add(token)
        stops = req.params.stop
        # A stop string counts only where it ends past the first min_tokens.
        if stops and t.num_tokens >= req.params.min_tokens and self._find_stop(
                t, stops, searched, req.params.include_stop_str_in_output):
            t.stopped = True
        return t.stopped

    def add_stop_token(self, req: Request, token: int) -> None:
        """``token`` (EOS, or one of ``stop_token_ids``) ended ``req`` and is none of its output tokens:
        its text ends the request's text only with ``include_stop_str_in_output`` (vLLM's rule; with
        ``skip_special_tokens`` a special token has none), and no stop string is looked for in it."""
        t = self._texts[req.request_id]
        if req.params.include_stop_str_in_output and t.detok is not None:
            t.text += t.detok.add(token)

    def resync(self, req: Request) -> None:
        """Make ``req``'s text again from its output tokens where a failed step left the two apart (the
        text had taken a token the request never got); what was reported stays reported."""
        t = self._texts.get(req.request_id)
        if t is None or t.num_tokens == len(req.output_token_ids):
            return
        fresh = _Text(self._detokenizer(req))
        for token in req.output_token_ids:
            fresh.num_tokens += 1
            if fresh.detok is not None:
                fresh.text += fresh.detok.add(token)
        fresh.emitted, fresh.emitted_tokens = min(t.emitted, len(fresh.text)), min(t.emitted_tokens, fresh.num_tokens)
        self._texts[req.request_id] = fresh

    def output(self, req: Request) -> EngineOutput:
        """What ``req`` has new since its last output (its last, if it finished: the text flushed and
        the processor's state for it dropped)."""
        t = self._texts[req.request_id]
        finished = req.status is Status.FINISHED
        if finished:
            del self._texts[req.request_id]
            if t.detok is not None and not t.stopped and req.finish_reason != "error":
                t.text += t.detok.flush()  # a character cut off by the end of generation
        # Hold back a tail that may still turn out to start a stop string (one kept in the text is cut
        # after its end, which comes with the token that completes it: nothing before it is held).
        stops = req.params.stop
        hold = 0 if finished or not stops or req.params.include_stop_str_in_output else max(map(len, stops)) - 1
        visible = max(t.emitted, len(t.text) - hold)
        delta, t.emitted = t.text[t.emitted:visible], visible
        new_ids = req.output_token_ids[t.emitted_tokens:]
        t.emitted_tokens = len(req.output_token_ids)
        return EngineOutput(req.request_id, req.prompt_token_ids, t.text, list(req.output_token_ids), finished,
                            req.finish_reason, delta, new_ids,
                            list(req.output_top_logprobs) if req.params.logprobs is not None else None,
                            req.num_cached_tokens, req.error)

    @staticmethod
    def _find_stop(t: _Text, stops: tuple[str, ...], searched: int, keep: bool) -> bool:
        """Cut ``t``'s text at the first stop string ending past its first ``searched`` characters:
        before it, or with ``keep`` after it (the one that ends first, as a stream of single characters
        would meet it)."""
        hits = [(i + len(s) if keep else i) for s in stops if (i := t.text.find(s, max(0, searched - len(s) + 1))) >= 0]
        if hits:
            t.text = t.text[:min(hits)]
        return bool(hits)
