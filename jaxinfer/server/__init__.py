"""An OpenAI-compatible HTTP server around ``LLMEngine`` (``jaxinfer serve``: ``jaxinfer.cli.serve``):
``app.create_app`` over an ``async_engine.AsyncEngine``, whose engine steps in ``engine_core``'s process.

The package imports nothing itself: the engine core process imports ``server.engine_core`` and must
not pay for the HTTP stack (FastAPI, uvicorn) it never runs."""
