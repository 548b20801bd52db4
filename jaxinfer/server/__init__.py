"""An OpenAI-compatible HTTP server around ``LLMEngine`` (``jaxinfer serve``: ``jaxinfer.cli.serve``).

The names load on first use (PEP 562): the engine core process imports ``server.engine_core`` and
must not pay for the HTTP stack (FastAPI, uvicorn) it never runs."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {"AsyncEngine": "jaxinfer.server.async_engine", "create_app": "jaxinfer.server.app"}
__all__ = ["AsyncEngine", "create_app"]

if TYPE_CHECKING:
    from jaxinfer.server.app import create_app
    from jaxinfer.server.async_engine import AsyncEngine


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'jaxinfer.server' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
