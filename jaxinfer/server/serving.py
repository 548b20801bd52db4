"""/v1/completions, /v1/chat/completions and /v1/responses: requests -> engine sub-requests -> OpenAI
response shapes (a Responses request is served as a chat completion: ``server.responses``).

Everything that can be wrong with a request is checked before anything is queued, so a bad
request costs no engine work and a streamed response never starts only to fail on its input.

A request is admitted (``AsyncEngine.admit``: its prompts x n counted against the free slots)
before any of its work is done, and that work (tokenizing, chat templating, compiling an output
constraint: seconds for a big prompt list or schema) runs in a small thread pool, never on the
event loop that every other client, ``/health`` included, is answered from.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import contextlib
import dataclasses
import functools
import itertools
import json
import logging
import time
import uuid
from typing import AsyncIterator, Callable

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from jaxinfer.batching.outputs import EngineOutput, PromptLogprobs
from jaxinfer.batching.structured import output_warnings
from jaxinfer.sampling_params import SamplingParams, check_logit_bias, choices
from jaxinfer.server import responses, tool_parsers
from jaxinfer.server.async_engine import AsyncEngine, Submission
from jaxinfer.server.constraints import ToolPlan, request_constraint, tool_plan
from jaxinfer.server.protocol import (APIError, ChatCompletionRequest, ChatMessage, CompletionRequest,
                                      DetokenizeRequest, EmbeddingRequest, ResponsesRequest, TokenizeRequest,
                                      chat_text, check_supported, sampling_params, shown)
from jaxinfer.tokenizer import apply_chat_template


logger = logging.getLogger(__name__)
# The response header listing (as a JSON array of strings) what a JSON-constrained response's client
# should know: relaxed schema keywords, an output cut off by max_tokens (batching/structured.py).
WARNINGS_HEADER = "X-Structured-Output-Warnings"

@dataclasses.dataclass
class _Job:
    """A validated request: one (prompt ids, params) pair per choice, in choice-index order."""

    prompts: list[list[int]]  # distinct prompts
    choice_prompts: list[list[int]]
    params: list[SamplingParams]
    prompt_logprobs: int | None = None  # top logprobs per token of each prompt's pass; None: no pass


class OpenAIServing:
    # Preparing a request is CPU work that mostly runs without the GIL (tokenizers, llguidance): a few
    # threads let a quick request's preparation pass a slow one's (a big schema compiles for seconds);
    # more would only contend for the same cores.
    PREPARE_THREADS = 4

    def __init__(self, engine: AsyncEngine, model_name: str, *, chat_template: str | None = None,
                 tool_call_parser: str | None = None, request_timeout: float | None = None, pooling: str = "last",
                 auto_tool_choice: bool = True):
        """``chat_template`` replaces the tokenizer's (e.g. one that renders tools); ``tool_call_parser``
        names the parser of ``tool_choice: "auto"`` replies (default: chosen from the template);
        ``request_timeout``: seconds after which an unfinished request is aborted (504)."""
        self.engine = engine
        self.model_name = model_name
        self.chat_template = chat_template
        self.tool_parser = tool_parsers.get_parser(tool_call_parser) if tool_call_parser else None
        self.request_timeout = request_timeout
        self.pooling = pooling  # how /v1/embeddings pools the final hidden states: "last" or "mean"
        self.auto_tool_choice = auto_tool_choice  # serve tools with tool_choice "auto" (vLLM's flag)
        self._prepare = concurrent.futures.ThreadPoolExecutor(self.PREPARE_THREADS, thread_name_prefix="prepare")

    # ------------------------------------------------------------------------------- endpoints

    async def completions(self, req: CompletionRequest, request: Request) -> Response:
        self._check_common(req)
        raw = [req.prompt] if isinstance(req.prompt, str) or _is_ids(req.prompt) else list(req.prompt)
        return await self._serve(req, request, "cmpl", len(raw) * req.n, "prompt" if len(raw) > 1 else "n",
                                 lambda: self.prepare_completion(req, raw))

    async def chat(self, req: ChatCompletionRequest, request: Request) -> Response:
        self._check_common(req)
        return await self._serve(req, request, "chatcmpl", req.n, "n", lambda: self.prepare_chat(req))

    async def responses(self, req: ResponsesRequest, request: Request) -> Response:
        """``/v1/responses``: the chat completion of the same conversation (``responses.chat_request``),
        answered in the Responses shape; the chat path's errors name the Responses fields."""
        try:
            chat = responses.chat_request(req)
            self._check_common(chat)
        except APIError as e:
            raise responses.responses_error(e) from None

        def prepare():
            try:
                return self.prepare_chat(chat)
            except APIError as e:
                raise responses.responses_error(e) from None

        async def respond(_, job, sub, render, request):
            shape = responses.ResponseShape(f"resp_{sub.request_ids[0].rsplit('-', 2)[-2]}", req, self.model_name)
            return await self._respond_responses(req.stream, job, sub, render, shape, request)

        return await self._serve(chat, request, "resp", 1, "n", prepare, respond)

    # ------------------------------------------------------------------------------ validation

    def prepare_completion(self, req: CompletionRequest, raw: list) -> tuple[_Job, _Renderer]:
        """The engine's sub-requests and the response renderer of a completion (run off the event loop)."""
        prompts = [self._encode(p, "prompt") for p in raw]
        structured = request_constraint(req, self.engine.constraints)
        # vLLM's: echoed logprobs begin with the prompt's, as many top ones as logprobs asks for
        prompt_logprobs = self._prompt_pass(req, req.logprobs if req.echo else None)
        job = self._job(req, prompts, req.max_tokens, "max_tokens", explicit="max_tokens" in req.model_fields_set,
                        logprobs=req.logprobs, structured=structured, prompt_logprobs=prompt_logprobs)
        echoed = None
        if req.echo:  # a prompt of token ids is echoed as its text
            echoed = [p if isinstance(p, str) else self._tokenizer("echo").decode(ids) for p, ids in zip(raw, prompts)]
        return job, _CompletionRenderer(self, req, prompts, echoed)

    def prepare_chat(self, req: ChatCompletionRequest) -> tuple[_Job, _Renderer]:
        """The engine's sub-request and the response renderer of a chat completion (run off the event loop)."""
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise APIError(400, "this model has no tokenizer, so chat is unavailable; use /v1/completions with "
                                "token ids", param="messages")
        messages = _messages(req.messages)
        plan = tool_plan(req)
        if plan.tools and req.tool_choice in (None, "auto") and not self.auto_tool_choice:
            raise APIError(400, "tool_choice 'auto' is off on this server (serve with --enable-auto-tool-choice); "
                                "name a tool or use 'required'", param="tool_choice", code="unsupported")
        ids = self._render(messages, plan.tools)
        if plan.tools and ids == self._render(messages, None):
            raise APIError(400, "this model's chat template does not render tools, so the model would never see "
                                "them; serve it with --chat_template naming a template that does", param="tools",
                           code="tools_unsupported")
        structured = request_constraint(req, self.engine.constraints, plan)
        prompt = self._encode(ids, "messages")
        name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        job = self._job(req, [prompt], max_tokens, name, explicit=True, logprobs=logprobs,
                        logprobs_param="top_logprobs", structured=structured,
                        prompt_logprobs=self._prompt_pass(req, None))
        parser = self.tool_parser or tool_parsers.parser_for_template(self.chat_template or
                                                                      str(tokenizer.chat_template or ""))
        # vLLM's echo: the reply continues the last message where that is the assistant's
        echo = messages[-1]["content"] if req.echo and messages[-1]["role"] == "assistant" else ""
        return job, _ChatRenderer(self, req, plan, parser, echo)

    def _prompt_pass(self, req, implied: int | None) -> int | None:
        """The top logprobs per token of the prompt's pass: ``prompt_logprobs``, else ``implied``; None for none."""
        if req.prompt_logprobs is None:
            return implied
        if req.stream:
            raise APIError(400, "prompt_logprobs are not available with stream=true", param="prompt_logprobs",
                           code="unsupported")
        self._check_logprobs(req.prompt_logprobs, "prompt_logprobs")
        return req.prompt_logprobs

    def _check_logprobs(self, k: int | None, param: str) -> None:
        if k is not None and k > self.engine.max_logprobs:
            raise APIError(400, f"{param} must be in [0, {self.engine.max_logprobs}] (the server's max_logprobs), "
                                f"got {k}", param=param, code="invalid_value")

    async def tokenize(self, req: TokenizeRequest) -> dict:
        return await asyncio.get_running_loop().run_in_executor(self._prepare, self._tokenize, req)

    async def embeddings(self, req: EmbeddingRequest) -> dict:
        """``/v1/embeddings``: the inputs encoded on the preparation threads, then embedded by the engine
        core between two steps (``AsyncEngine.embed``), in OpenAI's shape. One admission slot per
        request: a pass holds no sequence of the engine's, but a flood of them still queues."""
        self._check_model(req)
        self.engine.admit(1, "input")
        try:
            async with asyncio.timeout(self.request_timeout):
                prompts = await asyncio.get_running_loop().run_in_executor(self._prepare, self._embedding_inputs, req)
                vectors = await self.engine.embed(prompts, self.pooling, True)
        except TimeoutError:
            raise self._timeout_error() from None
        finally:
            self.engine.cancel(1)
        as_base64 = req.encoding_format == "base64"
        data = [{"object": "embedding", "index": i,
                 "embedding": base64.b64encode(np.asarray(v, "<f4").tobytes()).decode() if as_base64 else v.tolist()}
                for i, v in enumerate(vectors)]
        tokens = sum(len(p) for p in prompts)
        return {"object": "list", "data": data, "model": self.model_name,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    def _embedding_inputs(self, req: EmbeddingRequest) -> list[list[int]]:
        """The token ids of each of an embedding request's inputs (an input may fill the context)."""
        if req.dimensions is not None and req.dimensions != self.engine.hidden_size:
            raise APIError(400, f"dimensions: this model's embeddings have {self.engine.hidden_size} dimensions and "
                                f"are not shortened, got {req.dimensions}", param="dimensions", code="invalid_value")
        raw = [req.input] if isinstance(req.input, str) or _is_ids(req.input) else list(req.input)
        return [self._encode(p, "input", generate=False) for p in raw]

    async def detokenize(self, req: DetokenizeRequest) -> dict:
        return await asyncio.get_running_loop().run_in_executor(self._prepare, self._detokenize, req)

    def _tokenize(self, req: TokenizeRequest) -> dict:
        """``/tokenize``, on the preparation threads as generation's encoding is: the ids a completion's
        ``prompt`` or a chat's ``messages`` become, as ``prepare_completion`` / ``prepare_chat`` encode them."""
        self._check_ready(req)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of 'prompt' and 'messages'", param="prompt")
        tokenizer = self._tokenizer("messages" if req.prompt is None else "prompt")
        if req.messages is not None:
            ids = self._render(_messages(req.messages), None)
        else:
            ids = list(tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens))
        return {"count": len(ids), "max_model_len": self.engine.max_model_len, "tokens": ids}

    def _detokenize(self, req: DetokenizeRequest) -> dict:
        """``/detokenize``, on the preparation threads: the text of ``tokens``, special tokens included."""
        self._check_ready(req)
        tokenizer = self._tokenizer("tokens")
        bad = [t for t in req.tokens if t >= self.engine.vocab_size]
        if bad:
            raise APIError(400, f"tokens: id {bad[0]} is not below the vocabulary size {self.engine.vocab_size}",
                           param="tokens", code="invalid_value")
        return {"prompt": tokenizer.decode(req.tokens)}

    def _check_ready(self, req) -> None:
        """A request naming another model is a 404; before the engine is ready (its tokenizer and
        limits unknown) a 503, as for generation."""
        self._check_model(req)
        self.engine.check_serving()

    def _timeout_error(self) -> APIError:
        return APIError(504, f"the request did not finish within the server's request timeout of "
                             f"{self.request_timeout:g}s", type="server_error", code="request_timeout")

    def _check_model(self, req) -> None:
        if req.model is not None and req.model != self.model_name:
            raise APIError(404, f"model {shown(req.model)} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    def _tokenizer(self, param: str):
        if self.engine.tokenizer is None:
            raise APIError(400, "this model has no tokenizer, so text cannot be encoded or decoded here", param=param)
        return self.engine.tokenizer

    def _render(self, messages: list[dict], tools: list[dict] | None) -> list[int]:
        try:
            return apply_chat_template(self.engine.tokenizer, messages, tools=tools, chat_template=self.chat_template)
        except Exception as e:  # noqa: BLE001 - template errors (jinja raise_exception) are the caller's
            raise APIError(400, f"messages could not be rendered with the chat template: {e}",
                           param="messages") from None

    def _check_common(self, req) -> None:
        self._check_model(req)
        check_supported(req, self.engine.scheduling_policy if req.priority else "fcfs")

    def _encode(self, prompt, param: str, generate: bool = True) -> list[int]:
        try:
            return self.engine.encode(prompt, generate)
        except (ValueError, TypeError) as e:
            raise APIError(400, f"{param}: {e}", param=param,
                           code="context_length_exceeded" if "max_model_len" in str(e) else None) from None

    def _job(self, req, prompts: list[list[int]], max_tokens: int | None, max_tokens_param: str, *,
             explicit: bool, logprobs: int | None, logprobs_param: str = "logprobs", structured=None,
             prompt_logprobs: int | None = None) -> _Job:
        """Without max_tokens a request may use the rest of the context; a default (not an explicit
        value) is clipped to it, while an explicit value that does not fit is an error."""
        self._check_logprobs(logprobs, logprobs_param)
        limit = self.engine.max_model_len
        choice_prompts, params = [], []
        for ids in prompts:
            room = limit - len(ids)
            want = room if max_tokens is None else max_tokens if explicit else min(max_tokens, room)
            base = sampling_params(req, want, logprobs, structured=structured,
                                   renames={"logprobs": logprobs_param, "max_tokens": max_tokens_param})
            if len(ids) + want > limit:
                raise APIError(400, f"this model's maximum context length is {limit} tokens, but the prompt has "
                                    f"{len(ids)} tokens and {max_tokens_param} is {want} ({len(ids) + want} in "
                                    "total); shorten the prompt or lower " + max_tokens_param,
                               param=max_tokens_param, code="context_length_exceeded")
            try:
                check_logit_bias(base, self.engine.vocab_size)
            except ValueError as e:
                raise APIError(400, str(e), param="logit_bias") from None
            for one in choices(base):
                params.append(one)
                choice_prompts.append(ids)
        return _Job(prompts, choice_prompts, params, prompt_logprobs)

    # -------------------------------------------------------------------------------- responses

    async def _serve(self, req, request: Request, kind: str, count: int, param: str,
                     prepare: Callable[[], tuple[_Job, _Renderer]], respond=None) -> Response:
        """Admit ``count`` sub-requests, prepare them off the event loop, queue them and respond
        (``_respond``, or ``respond`` with the same arguments)."""
        deadline = timeout = None
        if self.request_timeout is not None:
            deadline = time.monotonic() + self.request_timeout
            timeout = self._timeout_error()

        async def in_time(work):
            try:
                return await asyncio.wait_for(work, None if deadline is None else deadline - time.monotonic())
            except TimeoutError:
                raise timeout from None

        self.engine.admit(count, param)
        try:
            job, render = await in_time(asyncio.get_running_loop().run_in_executor(self._prepare, prepare))
            if job.prompt_logprobs is not None:  # each prompt scored once, whatever its n, before any is queued
                render.scores = await in_time(asyncio.gather(
                    *(self.engine.prompt_logprobs(p, job.prompt_logprobs) for p in job.prompts)))
            request_id = request.state.request_id
            sub = self.engine.submit(request_id, f"{kind}-{uuid.uuid4().hex[:16]}", job.choice_prompts, job.params,
                                     priority=req.priority, deadline=deadline, timeout_error=timeout)
        except BaseException:
            self.engine.cancel(count)
            raise
        return await (respond or self._respond)(req, job, sub, render, request)

    async def _respond(self, req, job: _Job, sub: Submission, render, request: Request) -> Response:
        index = {rid: i for i, rid in enumerate(sub.request_ids)}
        release = lambda: self.engine.release(sub)  # noqa: E731
        if req.stream:
            body = self._stream(sub, index, job, render, request,
                                include_usage=bool(req.stream_options and req.stream_options.include_usage))
            return _EventStream(body, release)
        try:
            finals = await _finals(sub, index, request)
            if finals is None:
                return Response(status_code=499)  # the client is gone; nobody reads this
        finally:
            release()
        choices = [render.choice(i, finals[i]) for i in range(len(finals))]
        warnings = self._structured_warnings(job, finals)
        return JSONResponse({"id": sub.request_ids[0].rsplit("-", 1)[0], "object": render.object,
                             "created": int(time.time()), "model": self.model_name, "choices": choices,
                             "usage": _usage(job, finals.values()), **render.response_fields(),
                             **({"warnings": warnings} if warnings else {})},
                            headers={WARNINGS_HEADER: json.dumps(warnings)} if warnings else None)

    def _structured_warnings(self, job: _Job, finals: dict[int, EngineOutput]) -> list[str]:
        """What the client should know of its JSON-constrained choices (``structured.output_warnings``:
        relaxed schema keywords and violations of them, an output cut off by max_tokens, a repeated
        key), distinct, each naming its choice where there are several; logged too."""
        structured = job.params[0].structured if job.params else None
        if structured is None or not (structured.json is not None or structured.json_object):
            return []
        relaxed = self.engine.constraints.relaxations(structured)
        warnings = []
        for i in range(len(finals)):
            for w in output_warnings(structured, finals[i].text, finals[i].finish_reason, relaxed):
                w = f"choice {i}: {w}" if len(finals) > 1 and w not in relaxed else w
                if w not in warnings:
                    warnings.append(w)
        if warnings:
            logger.warning("structured output: %s", "; ".join(warnings))
        return warnings

    async def _stream(self, sub: Submission, index: dict[str, int], job: _Job, render, request: Request, *,
                      include_usage: bool) -> AsyncIterator[str]:
        rid = sub.request_ids[0].rsplit("-", 1)[0]
        created = int(time.time())

        def event(choices: list[dict], usage=None, warnings=None) -> str:
            chunk = {"id": rid, "object": render.chunk_object, "created": created, "model": self.model_name,
                     "choices": choices}
            if include_usage:
                chunk["usage"] = usage
            if warnings:  # the structured-output warnings of the non-streamed body, on the last chunk
                chunk["warnings"] = warnings
            return f"data: {json.dumps(chunk)}\n\n"

        finals: dict[int, EngineOutput] = {}
        warnings: list[str] = []
        try:
            for i in range(len(sub.request_ids)):
                first = render.first_chunk(i)
                if first is not None:
                    yield event([first])
            async with contextlib.aclosing(_outputs(sub, request)) as outputs:
                async for out in outputs:
                    last = False
                    if out.finished:
                        finals[index[out.request_id]] = out
                        if len(finals) == len(sub.request_ids):
                            warnings, last = self._structured_warnings(job, finals), not include_usage
                    if out.delta_text or out.finished or (out.logprobs is not None and out.delta_token_ids):
                        chunks = render.delta(index[out.request_id], out)
                        for j, choice in enumerate(chunks):
                            yield event([choice], warnings=warnings if last and j == len(chunks) - 1 else None)
                        if last and not chunks and warnings:
                            yield event([], warnings=warnings)
            if include_usage and sub.done:
                yield event([], _usage(job, finals.values()), warnings)
        except APIError as e:
            yield f"data: {json.dumps(e.body())}\n\n"
        yield "data: [DONE]\n\n"

    async def _respond_responses(self, stream: bool, job: _Job, sub: Submission, render: _ChatRenderer,
                                 shape: responses.ResponseShape, request: Request) -> Response:
        """A Response from the chat renderer's choice, or (``stream``) events from its deltas."""
        index = {sub.request_ids[0]: 0}
        release = lambda: self.engine.release(sub)  # noqa: E731
        if stream:
            return _EventStream(self._stream_responses(sub, index, job, render, shape, request), release)
        try:
            finals = await _finals(sub, index, request)
            if finals is None:
                return Response(status_code=499)
        finally:
            release()
        usage = responses.usage(_usage(job, finals.values()), finals[0].num_cached_tokens)
        return JSONResponse(shape.from_choice(render.choice(0, finals[0]), usage))

    async def _stream_responses(self, sub: Submission, index: dict[str, int], job: _Job, render: _ChatRenderer,
                                shape: responses.ResponseShape, request: Request) -> AsyncIterator[str]:
        events = responses.ResponseEvents(shape)
        for event in events.start():
            yield event
        try:
            async with contextlib.aclosing(_outputs(sub, request)) as outputs:
                async for out in outputs:
                    if not (out.delta_text or out.finished or (out.logprobs is not None and out.delta_token_ids)):
                        continue
                    choices = render.delta(0, out)
                    for choice in choices:
                        for event in events.delta(choice):
                            yield event
                    if out.finished:  # the chat's finish_reason: "tool_calls" where calls parsed
                        usage = responses.usage(_usage(job, [out]), out.num_cached_tokens)
                        for event in events.finish(choices[-1]["finish_reason"], usage):
                            yield event
        except APIError as e:
            yield events.error(e)


class _EventStream(StreamingResponse):
    """An SSE response that releases its submission however it ends: finished, client gone, or cancelled
    (an abandoned body generator would otherwise keep its requests running until garbage collection)."""

    def __init__(self, body: AsyncIterator[str], on_close: Callable[[], None]):
        super().__init__(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
            await self.body_iterator.aclose()


async def _outputs(sub: Submission, request: Request) -> AsyncIterator[EngineOutput]:
    """The submission's outputs until all sub-requests finish, or until the client disconnects.

    Each wake-up yields what accumulated since the last one, so a stream that is read slowly gets
    fewer, larger events rather than a backlog. The disconnect watcher wakes the submission itself,
    so waiting costs one await per wake-up, not a future and an ``asyncio.wait`` per output."""
    gone = asyncio.ensure_future(_disconnect(request))
    gone.add_done_callback(lambda _: sub.hang_up())
    try:
        while not sub.done:
            outs = await sub.next()
            if sub.hung_up:
                return
            for out in outs:
                yield out
    finally:
        gone.cancel()


async def _finals(sub: Submission, index: dict[str, int], request: Request) -> dict[int, EngineOutput] | None:
    """Each choice's final output, by choice index; None if the client went away first."""
    finals: dict[int, EngineOutput] = {}
    async with contextlib.aclosing(_outputs(sub, request)) as outputs:
        async for out in outputs:
            if out.finished:
                finals[index[out.request_id]] = out
    return finals if sub.done else None


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _usage(job: _Job, finals) -> dict:
    prompt = sum(len(p) for p in job.prompts)
    completion = sum(len(o.token_ids) for o in finals)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _messages(messages: list[ChatMessage]) -> list[dict]:
    """A request's messages as the chat template takes them; a 400 if none carries any text."""
    out = [_message(m) for m in messages]
    if not any(m["content"] or m.get("tool_calls") for m in out):
        raise APIError(400, "messages must contain some text", param="messages")
    return out


def _message(m: ChatMessage) -> dict:
    """A message as chat templates take it; tool-call arguments as objects, which templates expect."""
    d = {"role": "system" if m.role == "developer" else m.role, "content": chat_text(m)}
    if m.name is not None:
        d["name"] = m.name
    if m.tool_call_id is not None:
        d["tool_call_id"] = m.tool_call_id
    if m.tool_calls:
        d["tool_calls"] = [{"id": c.id, "type": "function",
                            "function": {"name": c.function.name, "arguments": _json_or_text(c.function.arguments)}}
                           for c in m.tool_calls]
    return d


def _json_or_text(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _is_ids(prompt) -> bool:
    return all(isinstance(t, int) for t in prompt)


class _Renderer:
    def __init__(self, serving: OpenAIServing, req):
        tok = serving.engine.tokenizer
        # cached: a prompt's logprobs decode each of its tokens' top k, the same few tokens again and again
        self._decode = functools.lru_cache(maxsize=None)((lambda t: tok.decode([t])) if tok is not None
                                                         else (lambda t: f"<{t}>"))
        self._has_tokenizer = tok is not None
        self.req = req
        self.scores: list[PromptLogprobs] | None = None  # each prompt's logprobs, where the request asked

    def first_chunk(self, i: int) -> dict | None:
        return None

    def response_fields(self) -> dict:
        """Fields of a (not streamed) response beside its choices."""
        return {}

    def _prompt_logprobs(self, prompt: int) -> list[dict | None]:
        """vLLM's ``prompt_logprobs`` of the request's ``prompt``-th prompt: null for its first token, then
        per token ``{token id: {logprob, rank, decoded_token}}`` of the token itself and the top k."""
        return [None, *({str(t): {"logprob": max(lp, -9999.0), "rank": rank,
                                  "decoded_token": self._decode(t) if self._has_tokenizer else None}
                         for t, lp, rank in row} for row in self.scores[prompt].rows())]


class _CompletionRenderer(_Renderer):
    object, chunk_object = "text_completion", "text_completion"

    def __init__(self, serving, req, prompts: list[list[int]], echoed: list[str] | None):
        super().__init__(serving, req)
        self._prompts = prompts  # each prompt's ids; choice i is of prompt i // n
        self._echoed = echoed  # each prompt's text, with echo
        self._offsets: dict[int, int] = {}  # streamed characters so far, for text_offset

    def choice(self, i: int, out: EngineOutput) -> dict:
        p = i // self.req.n
        text, ids, lps = out.text, out.token_ids, out.logprobs
        if self._echoed is not None:
            text = self._echoed[p] + text
            if lps is not None:
                ids, lps = self._prompts[p] + ids, self._echoed_logprobs(p) + lps
        choice = {"index": i, "text": text, "logprobs": self._logprobs(i, ids, lps), "finish_reason": out.finish_reason}
        if self.scores is not None:
            choice["prompt_logprobs"] = self._prompt_logprobs(p)
        return choice

    def first_chunk(self, i: int) -> dict | None:
        """With echo, the prompt (and its logprobs) before the choice's first tokens."""
        if self._echoed is None:
            return None
        p = i // self.req.n
        lps = self._echoed_logprobs(p) if self.req.logprobs is not None else None
        return {"index": i, "text": self._echoed[p], "logprobs": self._logprobs(i, self._prompts[p], lps),
                "finish_reason": None}

    def _echoed_logprobs(self, p: int) -> list[dict[int, float] | None]:
        """Prompt ``p``'s logprobs as an echoing choice's begin: each token's and the top ``logprobs`` (as
        a generated token's; prompt_logprobs may have asked for more)."""
        keep = self.req.logprobs + 1
        return [None if d is None else dict(itertools.islice(d.items(), keep)) for d in self.scores[p].as_dicts()]

    def delta(self, i: int, out: EngineOutput) -> list[dict]:
        lps = out.logprobs[len(out.logprobs) - len(out.delta_token_ids):] if out.logprobs is not None else None
        return [{"index": i, "text": out.delta_text, "logprobs": self._logprobs(i, out.delta_token_ids, lps),
                 "finish_reason": out.finish_reason}]

    def _logprobs(self, i: int, ids: list[int], lps) -> dict | None:
        if lps is None:
            return None
        tokens = [self._decode(t) for t in ids]
        offsets, pos = [], self._offsets.get(i, 0)
        for s in tokens:
            offsets.append(pos)
            pos += len(s)
        self._offsets[i] = pos
        # an echoed prompt's first token has no logprobs (null)
        return {"tokens": tokens, "token_logprobs": [None if lp is None else lp[t] for t, lp in zip(ids, lps)],
                "top_logprobs": [None if lp is None else {self._decode(k): v for k, v in lp.items()} for lp in lps],
                "text_offset": offsets}


class _ChatRenderer(_Renderer):
    """Chat choices and deltas. With tools in play the reply may be tool calls. A forced call
    (tool_choice required or named) is JSON throughout; under ``auto`` text before the parser's marker
    streams as content. Streamed, a call is sent as OpenAI does: once its name is known a delta with
    ``index``, ``id``, ``type``, ``function.name`` and ``function.arguments: ""``, then deltas with
    pieces of ``function.arguments`` as they are generated (``tool_parsers.forced_calls`` and
    ``ToolParser.partial_calls`` find them). Calls in a form those do not follow as they grow (a
    Hermes call written arguments first, the Llama 3 and Mistral formats) are sent whole when the
    choice finishes. A choice cut short (``max_tokens``, a stop string) inside a call leaves that
    call's arguments incomplete, with ``finish_reason`` saying why it stopped; not streamed, such
    a reply is plain content."""

    object, chunk_object = "chat.completion", "chat.completion.chunk"

    def __init__(self, serving, req, plan: ToolPlan, parser: tool_parsers.ToolParser, echo: str = ""):
        super().__init__(serving, req)
        self.plan, self.parser = plan, parser
        self._echo = echo  # what the reply's content begins with (echo)
        self._text: dict[int, str] = {}
        self._sent: dict[int, int] = {}  # characters of _text sent as content
        self._streamed: dict[int, dict[int, list[str]]] = {}  # choice -> call index -> [id, arguments sent]

    def _partial(self, text: str) -> list[tuple[int, str, int, int | None]]:
        if self.plan.mode == "auto":
            return self.parser.partial_calls(text)
        return tool_parsers.forced_calls(text, self.plan.named if self.plan.mode == "named" else None)

    def _calls(self, text: str) -> tuple[str | None, list[dict], int]:
        """(content, calls, where the calls begin in text); no calls -> (text, [], len(text))."""
        mode = self.plan.mode
        if mode == "auto":
            content, calls = self.parser.extract(text)
            return content, calls, (self.parser.tool_start(text) if calls else len(text))
        if mode in ("named", "required"):
            try:
                obj = json.loads(text)
                objs = ([{"name": self.plan.named, "arguments": obj}] if mode == "named"
                        else obj if isinstance(obj, list) else [obj])
                calls = [tool_parsers.to_call(o) for o in objs]
                return None, tool_parsers.with_raw_arguments(text, calls, self._partial(text)), 0
            except (ValueError, TypeError):  # cut short by max_tokens or a stop string
                pass
        return text, [], len(text)

    def choice(self, i: int, out: EngineOutput) -> dict:
        content, calls, _ = self._calls(out.text)
        message = {"role": "assistant", "content": self._echo + (content or "") if self._echo else content}
        if calls:
            message["tool_calls"] = [{"id": _call_id(), "type": "function", "function": call} for call in calls]
        return {"index": i, "message": message, "logprobs": self._logprobs(out.token_ids, out.logprobs),
                "finish_reason": "tool_calls" if calls else out.finish_reason}

    def first_chunk(self, i: int) -> dict:
        return {"index": i, "delta": {"role": "assistant", "content": self._echo}, "logprobs": None,
                "finish_reason": None}

    def response_fields(self) -> dict:
        return {} if self.scores is None else {"prompt_logprobs": self._prompt_logprobs(0)}

    def delta(self, i: int, out: EngineOutput) -> list[dict]:
        """One chunk's choice for the content, then one per tool-call delta (the last carries
        ``finish_reason``)."""
        lps = out.logprobs[len(out.logprobs) - len(out.delta_token_ids):] if out.logprobs is not None else None
        logprobs = self._logprobs(out.delta_token_ids, lps)
        if self.plan.mode == "none":
            return [{"index": i, "delta": {"content": out.delta_text} if out.delta_text else {},
                     "logprobs": logprobs, "finish_reason": out.finish_reason}]
        text = self._text[i] = self._text.get(i, "") + out.delta_text
        sent = self._sent.get(i, 0)
        streamed = self._streamed.setdefault(i, {})
        entries = [e for k, name, a, b in self._partial(text)
                   for e in self._call_deltas(streamed, k, name, text[a:b] if b is not None else text[a:])]
        finish = None
        if not out.finished:
            upto = self.parser.streamable(text) if self.plan.mode == "auto" else 0
            content = text[sent:upto] if upto > sent else ""
            self._sent[i] = max(sent, upto)
        else:
            _, calls, start = self._calls(text)
            entries += [e for k, call in enumerate(calls)
                        for e in self._call_deltas(streamed, k, call["name"], call["arguments"])]
            # Cut short inside a call that was being streamed: its pieces stand; the text is not content.
            content = text[sent:start].rstrip() if calls else "" if streamed else text[sent:]
            finish = "tool_calls" if calls else out.finish_reason
        deltas = ([{"content": content}] if content else []) + [{"tool_calls": [e]} for e in entries] or [{}]
        return [{"index": i, "delta": d, "logprobs": logprobs if j == 0 else None,
                 "finish_reason": finish if j == len(deltas) - 1 else None} for j, d in enumerate(deltas)]

    @staticmethod
    def _call_deltas(streamed: dict[int, list[str]], k: int, name: str, arguments: str) -> list[dict]:
        """The deltas that bring call ``k`` up to ``arguments`` (its text so far): its opening delta if
        not yet sent, then the piece of arguments not yet sent."""
        out = []
        if k not in streamed:
            streamed[k] = [_call_id(), ""]
            out.append({"index": k, "id": streamed[k][0], "type": "function",
                        "function": {"name": name, "arguments": ""}})
        done = streamed[k][1]
        if len(arguments) > len(done) and arguments.startswith(done):
            streamed[k][1] = arguments
            out.append({"index": k, "function": {"arguments": arguments[len(done):]}})
        return out

    def _entry(self, token: int, logprob: float) -> dict:
        s = self._decode(token)
        return {"token": s, "logprob": logprob, "bytes": list(s.encode())}

    def _logprobs(self, ids: list[int], lps) -> dict | None:
        if lps is None:
            return None
        k = self.req.top_logprobs or 0
        content = []
        for t, lp in zip(ids, lps):
            items = list(lp.items())
            top = items[1:] if len(items) > k else items  # the sampled token leads unless it is in the top k
            top.sort(key=lambda kv: -kv[1])
            content.append({**self._entry(t, lp[t]), "top_logprobs": [self._entry(a, b) for a, b in top]})
        return {"content": content}
