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
}


def usage() -> str:
    width = max(map(len, SUBCOMMANDS))
    lines = [f"  {name:<{width}}  {what}" for name, (_, what) in SUBCOMMANDS.items()]
    return ("usage: jaxinfer <subcommand> [flags]   (jaxinfer <subcommand> --help for its flags)\n\n"
            "subcommands:\n" + "\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> None:
    """Run ``argv[1]``'s subcommand with the rest of ``argv`` as its flags."""
    argv = sys.argv if argv is None else argv
    if len(argv) < 2 or argv[1] in ("-h", "--help", "help"):
        (sys.stdout if len(argv) >= 2 else sys.stderr).write(usage())
        sys.exit(0 if len(argv) >= 2 else 2)
    name = argv[1]
    if name not in SUBCOMMANDS:
        sys.stderr.write(f"jaxinfer: no subcommand {name!r}\n{usage()}")
        sys.exit(2)
    importlib.import_module(SUBCOMMANDS[name][0]).main(argv[2:])
