"""The FastAPI app: routing, auth, body limits, and one error shape for every failure.

Bodies are read and parsed here rather than by FastAPI's injection, so oversized, malformed and
wrong-typed bodies all get OpenAI-style errors (413/400) instead of framework defaults. The same
pydantic models describe the bodies in ``/openapi.json`` (browsable at ``/docs``), and every 4xx,
FastAPI's own included, answers ``{"error": {"message", "type", "param", "code"}}``.

In front of the routes, ``_Edge`` gives every request an id (``X-Request-Id`` on every response,
quoted by internal errors, whose details go only to the log), checks the ``Host`` header against the
allowed names, and bounds the requests handled at once; ``header_timeout_protocol`` closes
connections whose request headers do not arrive in time, which uvicorn does not.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import importlib.metadata
import json
import logging
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.utils import get_openapi
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse, Response
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from jaxinfer.server.async_engine import AsyncEngine
from jaxinfer.server.metrics import CONTENT_TYPE
from jaxinfer.server.protocol import (MAX_TOKEN_ID, APIError, ChatCompletionRequest, ChatCompletionResponse,
                                      CompletionRequest, CompletionResponse, DetokenizeRequest, DetokenizeResponse,
                                      EmbeddingRequest, EmbeddingResponse, ErrorResponse, HealthResponse, ModelList,
                                      ResponseObject, ResponsesRequest, TokenizeRequest, TokenizeResponse,
                                      VersionResponse, parse, shown)
from jaxinfer.server.serving import OpenAIServing

log = logging.getLogger(__name__)
MAX_IGNORED_SHOWN = 16  # unknown fields a log line and X-Ignored-Fields name


_BODIES = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
           "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest, "/v1/embeddings": EmbeddingRequest,
           "/v1/responses": ResponsesRequest}
_ANY_ERRORS = (421, 500)  # any route: a Host that is not allowed, an internal error
_METERED_ERRORS = (*_ANY_ERRORS, 503)  # and past the concurrency limit
_POST_ERRORS = (*_METERED_ERRORS, 400, 401, 404, 408, 413, 415, 504)
# With "stream": true, a 200 is server-sent events (the schema describes one): each "data:" is a chunk
# of the response model's shape (JSON), an {"error": ...} that ended the stream, or the closing [DONE].
_STREAMED = {"content": {"text/event-stream": {"schema": {
    "type": "object", "required": ["data"], "properties": {"data": {"type": "string"}}}}}}
# /v1/responses streams OpenAI's named events: an "event:" line with the type, "data:" its JSON.
_STREAMED_EVENTS = {"content": {"text/event-stream": {"schema": {
    "type": "object", "required": ["event", "data"],
    "properties": {"event": {"type": "string"}, "data": {"type": "string"}}}}}}
_STATUS_CODES = {401: "invalid_api_key", 404: "not_found", 405: "method_not_allowed"}
_UNMETERED = frozenset({"/health", "/metrics"})  # answered even at the concurrency limit: monitoring needs them then
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]")


def _errors(*codes: int) -> dict:
    return {code: {"model": ErrorResponse} for code in codes}


def create_app(engine: AsyncEngine, *, served_model_name: str, api_key: str | None = None,
               max_request_bytes: int = 1 << 20, shutdown_timeout: float = 30.0, chat_template: str | None = None,
               tool_call_parser: str | None = None, request_timeout: float | None = None,
               body_timeout: float = 30.0, max_concurrent_requests: int = 1024,
               allowed_hosts: tuple[str, ...] | None = None, metrics_public: bool = False,
               allowed_origins: tuple[str, ...] = (), pooling: str = "last",
               auto_tool_choice: bool = True) -> FastAPI:
    """An app that starts ``engine``'s core process on startup and stops it on shutdown.

    ``chat_template`` (jinja text) replaces the model's; ``tool_call_parser`` overrides the parser of
    ``tool_choice: "auto"`` replies (see tool_parsers.PARSERS); ``request_timeout``: seconds a request
    may take before it is aborted (504); ``body_timeout``: seconds to receive a request body (408);
    ``max_concurrent_requests``: requests handled at once (beyond: 503); ``allowed_hosts``: the names
    (any port) the ``Host`` header may carry, None for any; ``metrics_public``: /metrics without the key;
    ``allowed_origins``: the web origins (``https://app.example``, or ``*``) whose pages may call the
    server from a browser (CORS, Starlette's middleware: a preflight from another origin gets a 400 and
    no ``Access-Control-Allow-Origin``); none by default, as a browser then refuses them all. ``pooling``:
    how /v1/embeddings pools the final hidden states ("last" token's or "mean"; ``models.pooling``);
    ``auto_tool_choice``: whether tools with ``tool_choice`` "auto" (OpenAI's default) are served."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        if not await asyncio.to_thread(engine.shutdown, shutdown_timeout):
            log.warning("the engine core did not stop within %.0fs", shutdown_timeout)

    app = FastAPI(title="jaxinfer", summary="An OpenAI-compatible LLM server", lifespan=lifespan, redoc_url=None)
    if allowed_origins:  # added first, so it runs inside _Edge: its answers carry a request id too
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"],
                           expose_headers=["X-Request-Id", "X-Ignored-Fields"])
    app.add_middleware(_Edge, allowed_hosts=allowed_hosts, max_concurrent=max_concurrent_requests)
    serving = OpenAIServing(engine, served_model_name, chat_template=chat_template,
                            tool_call_parser=tool_call_parser, request_timeout=request_timeout, pooling=pooling,
                            auto_tool_choice=auto_tool_choice)
    created = int(time.time())

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        headers = {"Retry-After": "1"} if e.status == 503 else {}
        return JSONResponse(e.body(), status_code=e.status, headers={**headers, **(e.headers or {})})

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):
        return JSONResponse(APIError(e.status_code, str(e.detail), code=_STATUS_CODES.get(e.status_code)).body(),
                            status_code=e.status_code, headers=getattr(e, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError):
        err = (e.errors() or [{}])[0]
        param = ".".join(str(p) for p in err.get("loc", ())[1:]) or None
        return JSONResponse(APIError(400, f"{param or 'request'}: {err.get('msg', 'invalid')}", param=param).body(),
                            status_code=400)

    def authorize(request: Request) -> None:
        """Checked in each route that needs it (not a BaseHTTPMiddleware, which would wrap streams and
        disconnects)."""
        if not api_key:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    async def body(request: Request) -> bytes:
        """The JSON body, read within ``body_timeout``. Only ``application/json`` is taken: a browser
        sends a cross-site form or ``text/plain`` POST without asking first, but not JSON."""
        media_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
        if media_type != "application/json":
            raise APIError(415, "the request body must be JSON, sent with 'Content-Type: application/json'",
                           code="unsupported_media_type")
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > max_request_bytes:
            raise APIError(413, f"request body is {length} bytes; the limit is {max_request_bytes}",
                           code="request_too_large")
        chunks, size = [], 0
        try:
            async with asyncio.timeout(body_timeout):
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > max_request_bytes:
                        raise APIError(413, f"request body exceeds the limit of {max_request_bytes} bytes",
                                       code="request_too_large")
                    chunks.append(chunk)
        except TimeoutError:
            raise APIError(408, f"the request body was not received within {body_timeout:g}s",
                           code="read_timeout", headers={"Connection": "close"}) from None
        except ClientDisconnect:
            raise APIError(499, "the client went away while sending the body") from None  # nobody reads it
        return b"".join(chunks)

    async def read(model, request: Request):
        """The request's body parsed into ``model``; fields it does not know are logged and named in
        the response's ``X-Ignored-Fields`` (``protocol._Request``)."""
        req = parse(model, await body(request))
        if req.model_extra:
            ignored = sorted(req.model_extra)[:MAX_IGNORED_SHOWN]
            log.warning("%s: ignored unknown request fields %s", request.state.request_id, ignored)
            printable = lambda name: "".join(c if " " <= c <= "~" and c != "," else "?" for c in name[:64])  # noqa: E731
            request.state.ignored_fields = ",".join(map(printable, ignored))
        return req

    @app.post("/v1/completions", responses={200: {"model": CompletionResponse, **_STREAMED},
                                            **_errors(*_POST_ERRORS)})
    async def completions(request: Request):
        authorize(request)
        return await serving.completions(await read(CompletionRequest, request), request)

    @app.post("/v1/chat/completions", responses={200: {"model": ChatCompletionResponse, **_STREAMED},
                                                 **_errors(*_POST_ERRORS)})
    async def chat_completions(request: Request):
        authorize(request)
        return await serving.chat(await read(ChatCompletionRequest, request), request)

    @app.post("/v1/responses", responses={200: {"model": ResponseObject, **_STREAMED_EVENTS},
                                          **_errors(*_POST_ERRORS)})
    async def create_response(request: Request):
        authorize(request)
        return await serving.responses(await read(ResponsesRequest, request), request)

    @app.api_route("/v1/responses/{response_id}", methods=["GET", "DELETE"], include_in_schema=False)
    @app.api_route("/v1/responses/{response_id}/{action:path}", methods=["GET", "POST"], include_in_schema=False)
    async def stored_response(request: Request, response_id: str):
        authorize(request)
        raise APIError(404, f"response {shown(response_id)} is not stored: this server keeps no responses ('store' "
                            "is accepted and changes nothing), so none can be retrieved, cancelled or deleted",
                       param="response_id", code="not_found")

    @app.post("/tokenize", responses={200: {"model": TokenizeResponse}, **_errors(*_POST_ERRORS)})
    async def tokenize(request: Request):
        authorize(request)
        req = await read(TokenizeRequest, request)
        return await serving.tokenize(req)

    @app.post("/detokenize", responses={200: {"model": DetokenizeResponse}, **_errors(*_POST_ERRORS)})
    async def detokenize(request: Request):
        authorize(request)
        req = await read(DetokenizeRequest, request)
        return await serving.detokenize(req)

    @app.post("/v1/embeddings", responses={200: {"model": EmbeddingResponse}, **_errors(*_POST_ERRORS)})
    async def embeddings(request: Request):
        authorize(request)
        return await serving.embeddings(await read(EmbeddingRequest, request))

    @app.get("/v1/models", responses={200: {"model": ModelList}, **_errors(*_METERED_ERRORS, 401)})
    async def models(request: Request):
        authorize(request)
        card = {"id": served_model_name, "object": "model", "created": created, "owned_by": "jaxinfer"}
        if engine.max_model_len is not None:
            card["max_model_len"] = engine.max_model_len
        return {"object": "list", "data": [card]}

    @app.get("/version", responses={200: {"model": VersionResponse}, **_errors(*_METERED_ERRORS, 401)})
    async def version(request: Request):
        authorize(request)
        return {"version": importlib.metadata.version("jaxinfer"), "config": engine.resolved_config}

    @app.get("/health", responses={200: {"model": HealthResponse}, 503: {"model": HealthResponse},
                                   **_errors(*_ANY_ERRORS)})
    async def health():
        if engine.draining:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        if not engine.alive:
            return JSONResponse({"status": "engine process exited"}, status_code=503)
        if not engine.ready.is_set():
            return JSONResponse({"status": "warming up"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics", responses={200: {"content": {CONTENT_TYPE.split(";")[0]: {}}},
                                    **_errors(*_ANY_ERRORS, 401)})
    async def metrics(request: Request):
        if not metrics_public:
            authorize(request)
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE)

    def openapi() -> dict:
        """FastAPI's description plus the request bodies, which the routes parse themselves, with the
        limits of the model served: ``model`` is its name (any other is a 404), token ids are below its
        vocabulary size, ``max_tokens`` leaves a prompt token in its context, and ``priority`` is 0 unless
        the server schedules by priority. Until the engine is
        ready (the model's numbers unknown) the description is built anew per request."""
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version="1", summary=app.summary, routes=app.routes)
        _, defs = models_json_schema([(m, "validation") for m in _BODIES.values()],
                                     ref_template="#/components/schemas/{model}")
        for model in _BODIES.values():
            properties = defs["$defs"][model.__name__]["properties"]
            properties["model"] = {"anyOf": [{"enum": [served_model_name]}, {"type": "null"}], "default": None,
                                   "title": "Model"}
            if engine.scheduling_policy != "priority" and "priority" in properties:  # not 0: refused (check_supported)
                properties["priority"] = {**properties["priority"], "minimum": 0, "maximum": 0}
            if engine.ready.is_set():
                for name in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
                    if name in properties:
                        properties[name]["anyOf"][0]["maximum"] = engine.max_model_len - 1
                for name in ("prompt", "tokens", "input"):
                    if name in properties:
                        _set_maximum(properties[name], MAX_TOKEN_ID, engine.vocab_size - 1)
                if "dimensions" in properties:  # embeddings are not shortened: only the model's size
                    properties["dimensions"]["anyOf"][0].update(minimum=engine.hidden_size,
                                                                maximum=engine.hidden_size)
        schema.setdefault("components", {}).setdefault("schemas", {}).update(defs["$defs"])
        for path, model in _BODIES.items():
            schema["paths"][path]["post"]["requestBody"] = {"required": True, "content": {"application/json": {
                "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
        if engine.ready.is_set():
            app.openapi_schema = schema
        return schema

    app.openapi = openapi
    return app


class _Edge:
    """ASGI middleware (not a BaseHTTPMiddleware, which would wrap streams and disconnects) for every
    HTTP request: an ``X-Request-Id``; the ``Host`` check, which defeats DNS rebinding (a web page
    whose name an attacker points at 127.0.0.1 may send requests, but with its own name as Host);
    the concurrency limit; and unhandled errors, logged with the id and answered with only the id."""

    def __init__(self, app, *, allowed_hosts: tuple[str, ...] | None, max_concurrent: int):
        self.app = app
        self.allowed_hosts = None if allowed_hosts is None else frozenset(h.lower() for h in allowed_hosts)
        self.max_concurrent = max_concurrent
        self.handling = 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        request_id = f"req-{uuid.uuid4().hex[:24]}"
        scope.setdefault("state", {})["request_id"] = request_id
        started = False

        async def send_with_id(message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                headers = [*message.get("headers", ()), (b"x-request-id", request_id.encode())]
                ignored = scope["state"].get("ignored_fields")
                if ignored:
                    headers.append((b"x-ignored-fields", ignored.encode()))
                message = {**message, "headers": headers}
            await send(message)

        host = _host_name(dict(scope["headers"]).get(b"host", b"").decode("latin-1"))
        if self.allowed_hosts is not None and host not in self.allowed_hosts:
            return await _send_error(send_with_id, APIError(
                421, f"this server does not answer to the host name {host[:100]!r} (see --allowed_hosts)",
                code="invalid_host"))
        metered = scope["path"] not in _UNMETERED
        if metered and self.handling >= self.max_concurrent:
            return await _send_error(send_with_id, APIError(
                503, f"the server is handling its limit of {self.max_concurrent} requests; retry later",
                type="server_error", code="too_many_requests", headers={"Retry-After": "1"}))
        self.handling += metered
        try:
            await self.app(scope, receive, send_with_id)
        except Exception:  # noqa: BLE001 - the details are for the log, not the client
            log.exception("request %s: unhandled error on %s %s", request_id, scope["method"], scope["path"])
            if not started:
                await _send_error(send_with_id, APIError(500, f"internal error (request id {request_id})",
                                                         type="server_error"))
        finally:
            self.handling -= metered


def _set_maximum(schema, old: int, new: int) -> None:
    """Every ``maximum: old`` in ``schema`` becomes ``new``."""
    if isinstance(schema, list):
        for item in schema:
            _set_maximum(item, old, new)
    elif isinstance(schema, dict):
        if schema.get("maximum") == old:
            schema["maximum"] = new
        for value in schema.values():
            _set_maximum(value, old, new)


def _host_name(host: str) -> str:
    """The name in a Host header, without its port: ``[::1]:8000`` -> ``[::1]``, ``a.b:80`` -> ``a.b``."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[:host.find("]") + 1]
    return host.rpartition(":")[0] if ":" in host else host


async def _send_error(send, error: APIError) -> None:
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               *((k.lower().encode(), v.encode()) for k, v in (error.headers or {}).items())]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def header_timeout_protocol(timeout: float) -> type:
    """uvicorn's httptools protocol with two more timers: a connection that sends nothing is closed
    after ``timeout_keep_alive`` (as an idle kept-alive one is), and one whose request headers are not
    complete ``timeout`` seconds after their first byte gets a 408 and is closed. uvicorn waits for
    headers forever, so a client sending them slowly, or half of them, held a connection open for good."""

    class Protocol(HttpToolsProtocol):
        _headers_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive,
                                                                self.timeout_keep_alive_handler)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._headers_timer = self.loop.call_later(timeout, self._headers_timed_out)

        def on_headers_complete(self) -> None:
            self._cancel_headers_timer()
            super().on_headers_complete()

        def connection_lost(self, exc) -> None:
            self._cancel_headers_timer()
            super().connection_lost(exc)

        def _cancel_headers_timer(self) -> None:
            if self._headers_timer is not None:
                self._headers_timer.cancel()
                self._headers_timer = None

        def _headers_timed_out(self) -> None:
            self._headers_timer = None
            if self.transport.is_closing():
                return
            body = json.dumps(APIError(408, f"the request headers were not received within {timeout:g}s",
                                       code="read_timeout").body()).encode()
            self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                                 b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body))
            self.transport.close()

    return Protocol
