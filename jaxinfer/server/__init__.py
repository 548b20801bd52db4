"""An OpenAI-compatible HTTP server around ``LLMEngine`` (``jaxinfer serve``: ``jaxinfer.cli.serve``)."""

from jaxinfer.server.app import create_app
from jaxinfer.server.async_engine import AsyncEngine

__all__ = ["AsyncEngine", "create_app"]
