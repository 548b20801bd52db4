"""An OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions, /v1/embeddings, /v1/models, /health,
/metrics, /openapi.json and /docs.

    jaxinfer serve                                        # smollm2-135m on 127.0.0.1:8000
    jaxinfer serve Qwen/Qwen2.5-0.5B-Instruct             # a Hugging Face Hub id, fetched into its cache
    jaxinfer serve --model /path/to/llama --max_num_seqs 64 --max_model_len 4096
    jaxinfer serve --model /path/to/llama-70b --tensor_parallel 8      # one host, 8 devices

The engine steps in its own process (jaxinfer/server/engine_core.py); this one serves HTTP. The
engine flags live in jaxinfer/cli/engine_flags.py (shared with benchmarks/bench_serving.py); their
defaults suit a small CPU. Every step shape is compiled (or loaded from the persistent compilation
cache) before /health answers 200; the engine's CPU buckets are few and coarse. The port is taken
first, so a busy one fails at once instead of after the model has loaded.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import signal
import socket
import sys

from absl import flags

from jaxinfer.cli import engine_flags, model_flags

flags.adopt_module_key_flags(model_flags)
flags.adopt_module_key_flags(engine_flags)
flags.DEFINE_string("served_model_name", None, "Model id clients send and /v1/models lists (default: the model "
                    "as given).")
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
flags.DEFINE_list("allowed_origins", [], "Web origins (e.g. https://app.example, or '*') whose pages may call the "
                  "server from a browser (CORS). Default: none, so browsers refuse every cross-origin call.")
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
flags.DEFINE_enum("pooling", "last", ["last", "mean"], "How /v1/embeddings pools a prompt's final hidden states "
                  "(after the final norm) into its vector, L2-normalized: the last token's (causal embedding models "
                  "such as e5-mistral) or the mean over its tokens.")
flags.DEFINE_float("timeout_keep_alive", 75.0, "Seconds an idle kept-alive HTTP connection stays open.")
F = flags.FLAGS


# Seconds past --shutdown_timeout that uvicorn waits for connections: the requests aborted at the
# timeout still write their error event and [DONE].
SHUTDOWN_GRACE = 5.0


def main(argv):
    """The flags, read once into ``serve``'s arguments; the port is bound before anything loads. The
    model is ``--model`` or the one positional argument (``jaxinfer serve org/name``, as ``vllm serve``)."""
    model = model_flags.model_argument("jaxinfer serve", argv[1:])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    serving = F.coordinator_address is None or F.process_id == 0
    sock = listening_socket(F.host, F.port) if serving else None
    key = api_key(F.api_key, F.api_key_file)
    chat_template = read_chat_template(F.chat_template)
    config = engine_flags.engine_config()
    if not serving:  # run process 0's steps, serve no HTTP
        from jaxinfer.batching.factory import run_follower
        model_flags.init_distributed()
        return run_follower(model, config)
    # Process 0 of several joins the run in its engine core, the process that touches devices.
    distributed = (F.coordinator_address, F.num_processes, F.process_id) if F.coordinator_address else None
    model_flags.fetch_model("jaxinfer serve", model)  # a Hub id fetched once, here; a bad model in one line
    serve(sock, model, config, distributed=distributed, max_waiting=F.max_waiting,
          warmup_structured=F.warmup_structured, shutdown_timeout=F.shutdown_timeout,
          timeout_keep_alive=F.timeout_keep_alive, timeout_headers=F.timeout_headers,
          log_address=f"http://{F.host}:{F.port}",
          app_options=dict(served_model_name=F.served_model_name or model, api_key=key,
                           max_request_bytes=F.max_request_bytes, shutdown_timeout=F.shutdown_timeout,
                           chat_template=chat_template, tool_call_parser=F.tool_call_parser,
                           request_timeout=F.request_timeout, body_timeout=F.timeout_body,
                           max_concurrent_requests=F.max_concurrent_requests,
                           allowed_hosts=allowed_hosts(F.host, F.allowed_hosts), metrics_public=F.metrics_public,
                           allowed_origins=tuple(F.allowed_origins), pooling=F.pooling))


def serve(sock: socket.socket, model: str, config, *, distributed, max_waiting: int, warmup_structured: bool,
          shutdown_timeout: float, timeout_keep_alive: float, timeout_headers: float, log_address: str,
          app_options: dict) -> None:
    """Serve ``model`` on the bound ``sock`` until SIGTERM / SIGINT or a fatal engine error; exits the
    process (0, or 1 after an engine failure). ``app_options``: ``create_app``'s."""
    import jax
    import uvicorn

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

    engine = AsyncEngine(model, config, max_waiting=max_waiting, on_fatal=on_fatal, distributed=distributed,
                         warmup_structured=warmup_structured)
    fastapi_app = create_app(engine, **app_options)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            engine.drain(shutdown_timeout)  # refuse new requests at once; running ones get shutdown_timeout
            super().handle_exit(sig, frame)

    # timeout_keep_alive: uvicorn's default of 5 s closes an idle kept-alive connection while a busy
    # client may just be sending its next request on it, which the client sees as a ReadError; 75 s
    # outlives the idle time of any pooling client under load (and matches vLLM's TIMEOUT_KEEP_ALIVE).
    server = Server(uvicorn.Config(fastapi_app, log_level="info",
                                   timeout_graceful_shutdown=shutdown_timeout + SHUTDOWN_GRACE,
                                   timeout_keep_alive=timeout_keep_alive,
                                   http=header_timeout_protocol(timeout_headers)))
    # uvicorn re-raises the signal that stopped it once it is done; with the default handlers that
    # would turn a clean SIGTERM shutdown into death by signal, so make the re-raise a no-op.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    logging.info("listening on %s", log_address)
    server.run(sockets=[sock])
    code = 1 if failed else 0
    if not engine.shutdown(timeout=5):
        # The engine core is inside an XLA compile or step that cannot be interrupted.
        logging.warning("exiting with the engine core still busy")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def listening_socket(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (uvicorn listens on it), or exit with one line saying why not."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as e:
        sys.exit(f"jaxinfer serve: cannot listen on {host}:{port}: {e.strerror or e}")
    return sock


def allowed_hosts(host: str, names: list[str] | None) -> tuple[str, ...] | None:
    """--allowed_hosts (``names``), or its default for the address served: loopback names on a loopback
    address."""
    if names is not None:
        return None if "*" in names else tuple(names)
    from jaxinfer.server.app import LOOPBACK_HOSTS

    try:
        loopback = host == "localhost" or ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        loopback = False
    return LOOPBACK_HOSTS if loopback else None


def api_key(key: str | None, key_file: str | None) -> str | None:
    """--api_key, --api_key_file's first line, or $JAXINFER_API_KEY, in that order."""
    if key and key_file:
        sys.exit("jaxinfer serve: give --api_key or --api_key_file, not both")
    if key_file:
        try:
            with open(key_file) as f:
                key = f.readline().strip()
        except OSError as e:
            sys.exit(f"jaxinfer serve: --api_key_file: {e}")
        if not key:
            sys.exit(f"jaxinfer serve: --api_key_file {key_file} is empty")
        return key
    return key or os.environ.get("JAXINFER_API_KEY") or None


def read_chat_template(path: str | None) -> str | None:
    """--chat_template's text (None: the model's own)."""
    if not path:
        return None
    try:
        with open(path) as f:
            return f.read()
    except OSError as e:
        sys.exit(f"jaxinfer serve: --chat_template: {e}")
