"""The ``jaxinfer`` command (``python -m jaxinfer`` alike): ``jaxinfer <subcommand> [options]``.

Each subcommand is a module here with a ``main(argv)`` that parses its own options (argparse; the
engine's options come from ``options``, made from ``EngineConfig``). Only the chosen subcommand's
module is imported, and nothing here imports JAX until its ``main`` runs, so ``--help`` is fast.
"""

from __future__ import annotations

import importlib
import sys

# name: (module, what it does)
SUBCOMMANDS = {
    "serve": ("jaxinfer.cli.serve", "an OpenAI-compatible HTTP server"),
    "chat": ("jaxinfer.cli.chat", "chat with a model in the terminal, replies streamed"),
    "generate": ("jaxinfer.cli.generate", "generate text from the command line, streamed"),
    "convert": ("jaxinfer.cli.convert", "convert a model (GGUF, Hugging Face, preset) to an orbax directory"),
    "plan-sharding": ("jaxinfer.cli.plan_sharding", "a sharded model's bytes per device, without its memory"),
    "build-kernels": ("jaxinfer.cli.build_kernels", "build the native CPU kernels now rather than on first use"),
    "bench": ("jaxinfer.cli.bench", "benchmark the engine (latency, throughput) or a server (serve), as vllm bench"),
}


def usage(prog: str = "jaxinfer", commands: dict = SUBCOMMANDS, word: str = "subcommand") -> str:
    width = max(map(len, commands))
    lines = [f"  {name:<{width}}  {what}" for name, (_, what) in commands.items()]
    return (f"usage: {prog} <{word}> [flags]   ({prog} <{word}> --help for its flags)\n\n"
            f"{word}s:\n" + "\n".join(lines) + "\n")


def dispatch(prog: str, commands: dict, argv: list[str], word: str = "subcommand") -> None:
    """Run ``argv[0]``'s command with the rest of ``argv`` as its flags: ``commands`` maps a name to
    (``module`` or ``module:function``, what it does), the function ``main`` unless named."""
    if not argv or argv[0] in ("-h", "--help", "help"):
        (sys.stdout if argv else sys.stderr).write(usage(prog, commands, word))
        sys.exit(0 if argv else 2)
    name = argv[0]
    if name not in commands:
        sys.stderr.write(f"{prog}: no {word} {name!r}\n{usage(prog, commands, word)}")
        sys.exit(2)
    module, _, function = commands[name][0].partition(":")
    getattr(importlib.import_module(module), function or "main")(argv[1:])


def main(argv: list[str] | None = None) -> None:
    """Run ``argv[1]``'s subcommand with the rest of ``argv`` as its flags."""
    argv = sys.argv if argv is None else argv
    dispatch("jaxinfer", SUBCOMMANDS, argv[1:])
