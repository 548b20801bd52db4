"""An OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions, /v1/embeddings, /v1/models,
/tokenize, /detokenize, /health, /metrics, /openapi.json and /docs.

    jaxinfer serve                                        # smollm2-135m on 127.0.0.1:8000
    jaxinfer serve Qwen/Qwen2.5-0.5B-Instruct             # a Hugging Face Hub id, fetched into its cache
    jaxinfer serve /path/to/llama --max-num-seqs 64 --max-model-len 4096
    jaxinfer serve /path/to/llama-70b --tensor-parallel-size 8      # one host, 8 devices
    jaxinfer serve --config serve.yaml                    # options from a file (keys: flag names)

Every engine option (``LLM(...)``'s) is a flag, spelled as vLLM spells it where vLLM has it, with
dashes or underscores; JAXINFER_<NAME> environment variables set defaults (jaxinfer/cli/options.py).
The engine steps in its own process (jaxinfer/server/engine_core.py); this one serves HTTP. The
defaults below suit a small CPU. Every step shape is compiled (or loaded from the persistent
compilation cache) before /health answers 200. The port is taken first, so a busy one fails at once
instead of after the model has loaded.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import signal
import socket
import sys

from jaxinfer.cli import options
from jaxinfer.cli.options import Parser

# Seconds past --shutdown-timeout that uvicorn waits for connections: the requests aborted at the
# timeout still write their error event and [DONE].
SHUTDOWN_GRACE = 5.0
# The engine options' defaults for a server on a small CPU (EngineConfig's suit an offline batch).
ENGINE_DEFAULTS = dict(max_num_seqs=16, max_num_batched_tokens=128, max_model_len=1024)
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral")


def parser() -> Parser:
    p = Parser("jaxinfer serve", __doc__)
    options.add_model_argument(p)
    g = p.add_argument_group("server")
    p.option(g, "served-model-name", default=None, help="Model id clients send and /v1/models lists (default: the "
             "model as given).")
    p.option(g, "host", default="127.0.0.1", help="Address to listen on [default: 127.0.0.1].")
    p.option(g, "port", type=int, default=8000, help="Port to listen on [default: 8000].")
    p.option(g, "api-key", default=None, help="If set, /v1 requests and /metrics need 'Authorization: Bearer "
             "<key>' (else 401). Other processes can read it from the command line: prefer --api-key-file or "
             "$JAXINFER_API_KEY.")
    p.option(g, "api-key-file", default=None, help="A file whose first line is the API key.")
    p.flag(g, "metrics-public", default=False, help="Serve /metrics without the API key.")
    p.option(g, "allowed-hosts", type=_names, default=None, metavar="NAME,NAME", help="Host names (any port) "
             "requests may carry in their Host header, '*' for any; others are answered 421, which defeats DNS "
             "rebinding. Default: bound to a loopback address, only localhost, 127.0.0.1 and [::1]; else any.")
    p.option(g, "allowed-origins", type=_names, default=(), metavar="ORIGIN,ORIGIN", help="Web origins (e.g. "
             "https://app.example, or '*') whose pages may call the server from a browser (CORS); comma-separated "
             "or vLLM's JSON list. Default: none.")
    p.option(g, "max-waiting", type=int, default=128, help="Sequences (prompts x n) admitted beyond the running "
             "ones; a request that finds no room is answered 503 at once [default: 128].")
    p.option(g, "max-concurrent-requests", type=int, default=1024, help="HTTP requests handled at once (streams "
             "count until they end; /health and /metrics do not); more are answered 503 [default: 1024].")
    p.option(g, "request-timeout", type=float, default=None, help="Seconds a request may take, queueing "
             "included; an unfinished one is aborted and answered 504. Default: no limit.")
    p.option(g, "max-request-bytes", type=int, default=1 << 20, help="Largest request body accepted (else 413) "
             "[default: 1 MiB].")
    p.option(g, "timeout-headers", type=float, default=10.0, help="Seconds a client may take to send a request's "
             "headers (else 408) [default: 10].")
    p.option(g, "timeout-body", type=float, default=30.0, help="Seconds a client may take to send a request's "
             "body (else 408) [default: 30].")
    p.option(g, "timeout-keep-alive", type=float, default=75.0, help="Seconds an idle kept-alive connection "
             "stays open [default: 75].")
    p.option(g, "shutdown-timeout", type=float, default=30.0, help="On SIGTERM, seconds running requests may "
             "take to finish before they are aborted [default: 30].")
    p.option(g, "chat-template", default=None, help="A jinja chat template file replacing the model's, e.g. "
             "jaxinfer/server/templates/smollm2_tools.jinja.")
    p.option(g, "tool-call-parser", choices=TOOL_CALL_PARSERS, default=None, help="How tool_choice 'auto' "
             "replies are parsed for tool calls (default: chosen from the chat template's markers).")
    p.flag(g, "enable-auto-tool-choice", default=True, help="Serve tools with tool_choice 'auto' (OpenAI's default "
           "when tools are given; on unless --no-enable-auto-tool-choice, which answers such requests 400).")
    p.flag(g, "warmup-structured", default=False, help="Also compile the steps of constrained requests before "
           "/health answers 200; without it the first such request compiles them.")
    p.option(g, "pooling", choices=("last", "mean"), default="last", help="How /v1/embeddings pools a prompt's "
             "final hidden states into its vector (L2-normalized): the last token's or the mean [default: last].")
    options.add_engine_options(p, defaults=ENGINE_DEFAULTS)
    options.add_distributed_options(p)
    return p


def main(argv: list[str]) -> None:
    """The flags, read once into ``serve``'s arguments; the port is bound before anything loads."""
    p = parser()
    args, model = options.parse_command(p, argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("jax").setLevel(logging.WARNING)  # its INFO lines (no libtpu, cache resets) are noise here
    logging.info("jaxinfer serve %s: starting", model)
    serving = args.coordinator_address is None or args.process_id == 0
    sock = listening_socket(args.host, args.port) if serving else None
    key = api_key(args.api_key, args.api_key_file)
    chat_template = read_chat_template(args.chat_template)
    config = options.engine_config(p, args)
    if not serving:  # run process 0's steps, serve no HTTP
        from jaxinfer.batching.factory import run_follower
        options.init_distributed(args)
        return run_follower(model, config)
    # Process 0 of several joins the run in its engine core, the process that touches devices.
    distributed = (args.coordinator_address, args.num_processes, args.process_id) if args.coordinator_address else None
    options.fetch_model("jaxinfer serve", model, config)  # a Hub id fetched once, here; a bad model in one line
    serve(sock, model, config, distributed=distributed, max_waiting=args.max_waiting,
          warmup_structured=args.warmup_structured, shutdown_timeout=args.shutdown_timeout,
          timeout_keep_alive=args.timeout_keep_alive, timeout_headers=args.timeout_headers,
          log_address=f"http://{args.host}:{args.port}",
          app_options=dict(served_model_name=args.served_model_name or model, api_key=key,
                           max_request_bytes=args.max_request_bytes, shutdown_timeout=args.shutdown_timeout,
                           chat_template=chat_template, tool_call_parser=args.tool_call_parser,
                           request_timeout=args.request_timeout, body_timeout=args.timeout_body,
                           max_concurrent_requests=args.max_concurrent_requests,
                           allowed_hosts=allowed_hosts(args.host, args.allowed_hosts),
                           metrics_public=args.metrics_public, allowed_origins=tuple(args.allowed_origins),
                           pooling=args.pooling, auto_tool_choice=args.enable_auto_tool_choice))


def _names(text: str) -> tuple[str, ...]:
    """A comma-separated list, or vLLM's JSON list (``'["*"]'``)."""
    text = text.strip()
    if text.startswith("["):
        import json

        try:
            names = json.loads(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a JSON list: {text!r}") from None
        return tuple(str(n) for n in names)
    return tuple(n.strip() for n in text.split(",") if n.strip())


def serve(sock: socket.socket, model: str, config, *, distributed, max_waiting: int, warmup_structured: bool,
          shutdown_timeout: float, timeout_keep_alive: float, timeout_headers: float, log_address: str,
          app_options: dict) -> None:
    """Serve ``model`` on the bound ``sock`` until SIGTERM / SIGINT or a fatal engine error; exits the
    process (0, or 1 after an engine failure). ``app_options``: ``create_app``'s."""
    import jax
    import uvicorn

    from jaxinfer.server.app import create_app, header_timeout_protocol
    from jaxinfer.server.async_engine import AsyncEngine

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


def allowed_hosts(host: str, names: tuple[str, ...] | None) -> tuple[str, ...] | None:
    """--allowed-hosts (``names``), or its default for the address served: loopback names on a loopback
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
    """--api-key, --api-key-file's first line, or $JAXINFER_API_KEY, in that order."""
    if key and key_file:
        sys.exit("jaxinfer serve: give --api-key or --api-key-file, not both")
    if key_file:
        try:
            with open(key_file) as f:
                key = f.readline().strip()
        except OSError as e:
            sys.exit(f"jaxinfer serve: --api-key-file: {e}")
        if not key:
            sys.exit(f"jaxinfer serve: --api-key-file {key_file} is empty")
        return key
    return key or os.environ.get("JAXINFER_API_KEY") or None


def read_chat_template(path: str | None) -> str | None:
    """--chat-template's text (None: the model's own)."""
    if not path:
        return None
    try:
        with open(path) as f:
            return f.read()
    except OSError as e:
        sys.exit(f"jaxinfer serve: --chat-template: {e}")
