"""An OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics,
/openapi.json and /docs.

    python scripts/serve.py                               # smollm2-135m on 127.0.0.1:8000
    python scripts/serve.py --model /path/to/llama --max_num_seqs 64 --max_model_len 4096
    python scripts/serve.py --model /path/to/llama-70b --tensor_parallel 8      # one host, 8 devices

The engine steps in its own process (jaxinfer/server/engine_core.py); this one serves HTTP. The
engine flags live in engine_flags.py (shared with bench_serving.py); their defaults suit a small CPU.
Every step shape is compiled (or loaded from the persistent compilation cache) before /health
answers 200; the engine's CPU buckets are few and coarse. The port is taken first, so a busy one
fails at once instead of after the model has loaded.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import signal
import socket
import sys

from absl import app, flags

import engine_flags  # scripts/ is on sys.path when run as a script
import model_flags

flags.adopt_module_key_flags(model_flags)
flags.adopt_module_key_flags(engine_flags)
flags.DEFINE_string("served_model_name", None, "Model id clients send and /v1/models lists (default: --model).")
flags.DEFINE_string("host", "127.0.0.1", "Address to listen on.")
flags.DEFINE_integer("port", 8000, "Port to listen on.")
flags.DEFINE_integer("max_waiting", 128, "Sequences (prompts x n) admitted beyond the --max_num_seqs running ones; "
                     "a request that finds no room is answered 503 at once.")
flags.DEFINE_integer("max_concurrent_requests", 1024, "HTTP requests handled at once (streams count until they "
                     "end; /health and /metrics do not count); more are answered 503.")
flags.DEFINE_float("request_timeout", None, "Seconds a request may take, queueing included; an unfinished one is "
                   "aborted and answered 504 (streamed: an error event). Default: no limit.")
flags.DEFINE_string("api_key", None, "If set, /v1 requests and /metrics need 'Authorization: Bearer <key>' (else "
                    "401). Other processes can read it from the command line: prefer --api_key_file or "
                    "$JAXINFER_API_KEY.")
flags.DEFINE_string("api_key_file", None, "A file whose first line is the API key (see --api_key).")
flags.DEFINE_boolean("metrics_public", False, "Serve /metrics without the API key.")
flags.DEFINE_list("allowed_hosts", None, "Host names (any port) requests may carry in their Host header, '*' for "
                  "any; others are answered 421, which defeats DNS rebinding. Default: bound to a loopback address, "
                  "only localhost, 127.0.0.1 and [::1]; else any.")
flags.DEFINE_integer("max_request_bytes", 1 << 20, "Largest request body accepted (else 413).")
flags.DEFINE_float("timeout_headers", 10.0, "Seconds a client may take to send a request's headers, from their first "
                   "byte (else 408 and the connection is closed).")
flags.DEFINE_float("timeout_body", 30.0, "Seconds a client may take to send a request's body (else 408): a 1 MiB "
                   "body at 35 KB/s.")
flags.DEFINE_float("shutdown_timeout", 30.0, "On SIGTERM, seconds running requests may take to finish before "
                   "they are aborted (each answered 503 shutting_down).")
flags.DEFINE_string("chat_template", None, "A jinja chat template file replacing the model's, e.g. "
                    "jaxinfer/server/templates/smollm2_tools.jinja (SmolLM2 with tools).")
flags.DEFINE_enum("tool_call_parser", None, ["hermes", "llama3_json", "mistral"], "How tool_choice 'auto' replies "
                  "are parsed for tool calls (default: chosen from the chat template's markers).")
flags.DEFINE_boolean("warmup_structured", False, "Also compile the steps of constrained requests (response_format, "
                     "guided_*, tool_choice required/named) before /health answers 200; without it the first "
                     "such request stalls the engine on that compile.")
flags.DEFINE_float("timeout_keep_alive", 75.0, "Seconds an idle kept-alive HTTP connection stays open.")
F = flags.FLAGS


# Seconds past --shutdown_timeout that uvicorn waits for connections: the requests aborted at the
# timeout still write their error event and [DONE].
SHUTDOWN_GRACE = 5.0


def listening_socket(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (uvicorn listens on it), or exit with one line saying why not."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as e:
        sys.exit(f"serve.py: cannot listen on {host}:{port}: {e.strerror or e}")
    return sock


def allowed_hosts(host: str) -> tuple[str, ...] | None:
    """--allowed_hosts, or its default for the address served: loopback names on a loopback address."""
    if F.allowed_hosts is not None:
        return None if "*" in F.allowed_hosts else tuple(F.allowed_hosts)
    from jaxinfer.server.app import LOOPBACK_HOSTS

    try:
        loopback = host == "localhost" or ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        loopback = False
    return LOOPBACK_HOSTS if loopback else None


def api_key() -> str | None:
    """--api_key, --api_key_file's first line, or $JAXINFER_API_KEY, in that order."""
    if F.api_key and F.api_key_file:
        sys.exit("serve.py: give --api_key or --api_key_file, not both")
    if F.api_key_file:
        try:
            with open(F.api_key_file) as f:
                key = f.readline().strip()
        except OSError as e:
            sys.exit(f"serve.py: --api_key_file: {e}")
        if not key:
            sys.exit(f"serve.py: --api_key_file {F.api_key_file} is empty")
        return key
    return F.api_key or os.environ.get("JAXINFER_API_KEY") or None


def main(argv):
    del argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    serving = F.coordinator_address is None or F.process_id == 0
    sock = listening_socket(F.host, F.port) if serving else None
    key = api_key()
    chat_template = None
    if F.chat_template:
        try:
            with open(F.chat_template) as f:
                chat_template = f.read()
        except OSError as e:
            sys.exit(f"serve.py: --chat_template: {e}")
    import jax
    import uvicorn

    config = engine_flags.engine_config()
    if not serving:  # run process 0's steps, serve no HTTP
        from jaxinfer.batching.factory import run_follower
        model_flags.init_distributed()
        return run_follower(F.model, config)
    # Process 0 of several joins the run in its engine core, the process that touches devices.
    distributed = (F.coordinator_address, F.num_processes, F.process_id) if F.coordinator_address else None

    from jaxinfer.server import AsyncEngine, create_app
    from jaxinfer.server.app import header_timeout_protocol

    # This process only serves HTTP; should anything here touch JAX, it must not claim accelerator
    # memory that the engine core (a spawned process with its own JAX) needs. Config, not the
    # environment, so the engine core does not inherit it.
    jax.config.update("jax_platforms", "cpu")
    failed = []

    def on_fatal(error: BaseException) -> None:
        failed.append(error)
        server.should_exit = True

    engine = AsyncEngine(F.model, config, max_waiting=F.max_waiting, on_fatal=on_fatal, distributed=distributed,
                         warmup_structured=F.warmup_structured)
    fastapi_app = create_app(engine, served_model_name=F.served_model_name or F.model, api_key=key,
                             max_request_bytes=F.max_request_bytes, shutdown_timeout=F.shutdown_timeout,
                             chat_template=chat_template, tool_call_parser=F.tool_call_parser,
                             request_timeout=F.request_timeout, body_timeout=F.timeout_body,
                             max_concurrent_requests=F.max_concurrent_requests,
                             allowed_hosts=allowed_hosts(F.host), metrics_public=F.metrics_public)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            engine.drain(F.shutdown_timeout)  # refuse new requests at once; running ones get shutdown_timeout
            super().handle_exit(sig, frame)

    # timeout_keep_alive: uvicorn's default of 5 s closes an idle kept-alive connection while a busy
    # client may just be sending its next request on it, which the client sees as a ReadError; 75 s
    # outlives the idle time of any pooling client under load (and matches vLLM's TIMEOUT_KEEP_ALIVE).
    server = Server(uvicorn.Config(fastapi_app, log_level="info",
                                   timeout_graceful_shutdown=F.shutdown_timeout + SHUTDOWN_GRACE,
                                   timeout_keep_alive=F.timeout_keep_alive,
                                   http=header_timeout_protocol(F.timeout_headers)))
    # uvicorn re-raises the signal that stopped it once it is done; with the default handlers that
    # would turn a clean SIGTERM shutdown into death by signal, so make the re-raise a no-op.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    logging.info("listening on http://%s:%d", F.host, F.port)
    server.run(sockets=[sock])
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
