"""The FastAPI app: routing, auth, body limits, and one error shape for every failure.

Bodies are read and parsed here rather than by FastAPI's injection, so oversized, malformed and
wrong-typed bodies all get OpenAI-style errors (413/400) instead of framework defaults. The same
pydantic models describe the bodies in ``/openapi.json`` (browsable at ``/docs``), and every 4xx,
FastAPI's own included, answers ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, Response

from jaxinfer.server.async_engine import AsyncEngine
from jaxinfer.server.metrics import CONTENT_TYPE
from jaxinfer.server.protocol import (APIError, ChatCompletionRequest, ChatCompletionResponse, CompletionRequest,
                                      CompletionResponse, ErrorResponse, HealthResponse, ModelList, parse)
from jaxinfer.server.serving import OpenAIServing

log = logging.getLogger(__name__)


_BODIES = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest}
_ERRORS = {code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 503)}
_STATUS_CODES = {401: "invalid_api_key", 404: "not_found", 405: "method_not_allowed"}


def create_app(engine: AsyncEngine, *, served_model_name: str, api_key: str | None = None,
               max_request_bytes: int = 1 << 20, shutdown_timeout: float = 30.0, chat_template: str | None = None,
               tool_call_parser: str | None = None) -> FastAPI:
    """An app that starts ``engine``'s core process on startup and stops it on shutdown.

    ``chat_template`` (jinja text) replaces the model's; ``tool_call_parser`` overrides the parser of
    ``tool_choice: "auto"`` replies (see tool_parsers.PARSERS)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        if not await asyncio.to_thread(engine.shutdown, shutdown_timeout):
            log.warning("the engine core did not stop within %.0fs", shutdown_timeout)

    app = FastAPI(title="jaxinfer", summary="An OpenAI-compatible LLM server", lifespan=lifespan, redoc_url=None)
    serving = OpenAIServing(engine, served_model_name, chat_template=chat_template,
                            tool_call_parser=tool_call_parser)
    created = int(time.time())

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        headers = {"Retry-After": "1"} if e.status == 503 else None
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

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

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception):
        log.exception("unhandled error on %s", request.url.path)
        return JSONResponse(APIError(500, f"internal error: {type(e).__name__}", type="server_error").body(),
                            status_code=500)

    def authorize(request: Request) -> None:
        """Checked in each /v1 route (not a BaseHTTPMiddleware, which would wrap streams and disconnects)."""
        if not api_key:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")

    async def body(request: Request) -> bytes:
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > max_request_bytes:
            raise APIError(413, f"request body is {length} bytes; the limit is {max_request_bytes}",
                           code="request_too_large")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_request_bytes:
                raise APIError(413, f"request body exceeds the limit of {max_request_bytes} bytes",
                               code="request_too_large")
            chunks.append(chunk)
        return b"".join(chunks)

    @app.post("/v1/completions", responses={200: {"model": CompletionResponse}, **_ERRORS})
    async def completions(request: Request):
        authorize(request)
        return await serving.completions(parse(CompletionRequest, await body(request)), request)

    @app.post("/v1/chat/completions", responses={200: {"model": ChatCompletionResponse}, **_ERRORS})
    async def chat_completions(request: Request):
        authorize(request)
        return await serving.chat(parse(ChatCompletionRequest, await body(request)), request)

    @app.get("/v1/models", responses={200: {"model": ModelList}, 401: _ERRORS[401]})
    async def models(request: Request):
        authorize(request)
        card = {"id": served_model_name, "object": "model", "created": created, "owned_by": "jaxinfer"}
        if engine.max_model_len is not None:
            card["max_model_len"] = engine.max_model_len
        return {"object": "list", "data": [card]}

    @app.get("/health", responses={200: {"model": HealthResponse}, 503: {"model": HealthResponse}})
    async def health():
        if engine.draining:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        if not engine.ready.is_set():
            return JSONResponse({"status": "warming up"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics", responses={200: {"content": {CONTENT_TYPE.split(";")[0]: {}}}})
    async def metrics():
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE)

    def openapi() -> dict:
        """FastAPI's description plus the request bodies, which the routes parse themselves."""
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version="1", summary=app.summary, routes=app.routes)
            _, defs = models_json_schema([(m, "validation") for m in _BODIES.values()],
                                         ref_template="#/components/schemas/{model}")
            schema.setdefault("components", {}).setdefault("schemas", {}).update(defs["$defs"])
            for path, model in _BODIES.items():
                schema["paths"][path]["post"]["requestBody"] = {"required": True, "content": {"application/json": {
                    "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
    return app
