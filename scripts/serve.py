"""An OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics.

    python scripts/serve.py                               # smollm2-135m on 127.0.0.1:8000
    python scripts/serve.py --model /path/to/llama --max_num_seqs 64 --max_model_len 4096

The defaults are sized for a small CPU: every step shape is compiled (or loaded from the persistent
compilation cache) before /health answers 200; the engine's CPU buckets are few and coarse.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

from absl import app, flags

import model_flags  # scripts/ is on sys.path when run as a script

flags.adopt_module_key_flags(model_flags)
flags.DEFINE_string("served_model_name", None, "Model id clients send and /v1/models lists (default: --model).")
flags.DEFINE_string("host", "127.0.0.1", "Address to listen on.")
flags.DEFINE_integer("port", 8000, "Port to listen on.")
flags.DEFINE_integer("max_num_seqs", 16, "Most sequences computed together in one step.")
flags.DEFINE_integer("max_num_batched_tokens", 128, "Token budget of one step (prefill chunks plus decodes).")
flags.DEFINE_integer("max_model_len", 1024, "Longest prompt plus completion, in tokens.")
flags.DEFINE_integer("page_size", 16, "Tokens per KV cache page.")
flags.DEFINE_integer("num_pages", None, "KV pool size in pages (default: derived from memory).")
flags.DEFINE_float("kv_cache_memory_fraction", 0.9, "Fraction of accelerator memory for weights plus KV cache.")
flags.DEFINE_boolean("enable_prefix_caching", True, "Reuse KV pages of shared prompt prefixes.")
flags.DEFINE_integer("max_waiting", 128, "Most requests queued behind the running ones; more are answered 503.")
flags.DEFINE_string("api_key", None, "If set, /v1 requests need 'Authorization: Bearer <key>' (else 401).")
flags.DEFINE_list("token_buckets", None, "Padded token counts steps compile for (default: the engine's; on CPU "
                  "1, 16, x4, ... up to --max_num_batched_tokens).")
flags.DEFINE_list("seq_buckets", None, "Padded sequence counts (default: the engine's; on CPU 1, 4, x4, ... up "
                  "to --max_num_seqs).")
flags.DEFINE_list("page_buckets", None, "Padded pages per sequence (default: the engine's; on CPU 16, x4, ... "
                  "up to max_model_len / page_size).")
flags.DEFINE_integer("max_request_bytes", 1 << 20, "Largest request body accepted (else 413).")
flags.DEFINE_float("shutdown_timeout", 30.0, "On SIGTERM, seconds running requests may take to finish before "
                   "they are aborted.")
F = flags.FLAGS


def buckets(values: list[str] | None) -> tuple[int, ...] | None:
    return tuple(int(v) for v in values) if values else None


def main(argv):
    del argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import uvicorn

    from jaxinfer.batching.config import EngineConfig
    from jaxinfer.batching.engine import LLMEngine
    from jaxinfer.server import AsyncEngine, create_app

    config = EngineConfig(
        page_size=F.page_size, num_pages=F.num_pages, kv_cache_memory_fraction=F.kv_cache_memory_fraction,
        max_num_seqs=F.max_num_seqs, max_num_batched_tokens=F.max_num_batched_tokens,
        max_model_len=F.max_model_len, dtype=F.dtype, load_format=F.load_format,
        enable_prefix_caching=F.enable_prefix_caching, compilation_cache_dir=F.compilation_cache_dir,
        token_buckets=buckets(F.token_buckets), seq_buckets=buckets(F.seq_buckets),
        page_buckets=buckets(F.page_buckets))
    failed = []

    def on_fatal(error: BaseException) -> None:
        failed.append(error)
        server.should_exit = True

    engine = AsyncEngine(lambda: LLMEngine(F.model, config), max_waiting=F.max_waiting, on_fatal=on_fatal)
    fastapi_app = create_app(engine, served_model_name=F.served_model_name or F.model, api_key=F.api_key,
                             max_request_bytes=F.max_request_bytes, shutdown_timeout=F.shutdown_timeout)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            engine.draining = True  # refuse new requests at once; running ones get shutdown_timeout
            super().handle_exit(sig, frame)

    server = Server(uvicorn.Config(fastapi_app, host=F.host, port=F.port, log_level="info",
                                   timeout_graceful_shutdown=F.shutdown_timeout))
    # uvicorn re-raises the signal that stopped it once it is done; with the default handlers that
    # would turn a clean SIGTERM shutdown into death by signal, so make the re-raise a no-op.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    server.run()
    code = 1 if failed else 0
    if not engine.shutdown(timeout=5):
        # The engine thread is inside an XLA compile or step that cannot be interrupted.
        logging.warning("exiting with the engine thread still busy")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    app.run(main)
