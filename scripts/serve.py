"""An OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics,
/openapi.json and /docs.

    python scripts/serve.py                               # smollm2-135m on 127.0.0.1:8000
    python scripts/serve.py --model /path/to/llama --max_num_seqs 64 --max_model_len 4096
    python scripts/serve.py --model /path/to/llama-70b --tensor_parallel 8      # one host, 8 devices

The engine steps in its own process (jaxinfer/server/engine_core.py); this one serves HTTP. The
engine flags live in engine_flags.py (shared with bench_serving.py); their defaults suit a small CPU.
Every step shape is compiled (or loaded from the persistent compilation cache) before /health
answers 200; the engine's CPU buckets are few and coarse.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

from absl import app, flags

import engine_flags  # scripts/ is on sys.path when run as a script
import model_flags

flags.adopt_module_key_flags(model_flags)
flags.adopt_module_key_flags(engine_flags)
flags.DEFINE_string("served_model_name", None, "Model id clients send and /v1/models lists (default: --model).")
flags.DEFINE_string("host", "127.0.0.1", "Address to listen on.")
flags.DEFINE_integer("port", 8000, "Port to listen on.")
flags.DEFINE_integer("max_waiting", 128, "Most requests queued behind the running ones; more are answered 503.")
flags.DEFINE_string("api_key", None, "If set, /v1 requests need 'Authorization: Bearer <key>' (else 401).")
flags.DEFINE_integer("max_request_bytes", 1 << 20, "Largest request body accepted (else 413).")
flags.DEFINE_float("shutdown_timeout", 30.0, "On SIGTERM, seconds running requests may take to finish before "
                   "they are aborted.")
flags.DEFINE_string("chat_template", None, "A jinja chat template file replacing the model's, e.g. "
                    "jaxinfer/server/templates/smollm2_tools.jinja (SmolLM2 with tools).")
flags.DEFINE_enum("tool_call_parser", None, ["hermes", "llama3_json", "mistral"], "How tool_choice 'auto' replies "
                  "are parsed for tool calls (default: chosen from the chat template's markers).")
flags.DEFINE_boolean("warmup_structured", False, "Also compile the steps of constrained requests (response_format, "
                     "guided_*, tool_choice required/named) before /health answers 200; without it the first "
                     "such request stalls the engine on that compile.")
flags.DEFINE_float("timeout_keep_alive", 75.0, "Seconds an idle kept-alive HTTP connection stays open.")
F = flags.FLAGS


def main(argv):
    del argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import jax
    import uvicorn

    config = engine_flags.engine_config()
    if F.coordinator_address is not None and F.process_id != 0:  # run process 0's steps, serve no HTTP
        from jaxinfer.batching.factory import run_follower
        model_flags.init_distributed()
        return run_follower(F.model, config)
    # Process 0 of several joins the run in its engine core, the process that touches devices.
    distributed = (F.coordinator_address, F.num_processes, F.process_id) if F.coordinator_address else None

    from jaxinfer.server import AsyncEngine, create_app

    # This process only serves HTTP; should anything here touch JAX, it must not claim accelerator
    # memory that the engine core (a spawned process with its own JAX) needs. Config, not the
    # environment, so the engine core does not inherit it.
    jax.config.update("jax_platforms", "cpu")
    failed = []

    def on_fatal(error: BaseException) -> None:
        failed.append(error)
        server.should_exit = True

    chat_template = None
    if F.chat_template:
        with open(F.chat_template) as f:
            chat_template = f.read()
    engine = AsyncEngine(F.model, config, max_waiting=F.max_waiting, on_fatal=on_fatal, distributed=distributed,
                         warmup_structured=F.warmup_structured)
    fastapi_app = create_app(engine, served_model_name=F.served_model_name or F.model, api_key=F.api_key,
                             max_request_bytes=F.max_request_bytes, shutdown_timeout=F.shutdown_timeout,
                             chat_template=chat_template, tool_call_parser=F.tool_call_parser)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            engine.draining = True  # refuse new requests at once; running ones get shutdown_timeout
            super().handle_exit(sig, frame)

    # timeout_keep_alive: uvicorn's default of 5 s closes an idle kept-alive connection while a busy
    # client may just be sending its next request on it, which the client sees as a ReadError; 75 s
    # outlives the idle time of any pooling client under load (and matches vLLM's TIMEOUT_KEEP_ALIVE).
    server = Server(uvicorn.Config(fastapi_app, host=F.host, port=F.port, log_level="info",
                                   timeout_graceful_shutdown=F.shutdown_timeout,
                                   timeout_keep_alive=F.timeout_keep_alive))
    # uvicorn re-raises the signal that stopped it once it is done; with the default handlers that
    # would turn a clean SIGTERM shutdown into death by signal, so make the re-raise a no-op.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    server.run()
    code = 1 if failed else 0
    if not engine.shutdown(timeout=5):
        # The engine core is inside an XLA compile or step that cannot be interrupted.
        logging.warning("exiting with the engine core still busy")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    app.run(main)
