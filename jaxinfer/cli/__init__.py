"""The ``jaxinfer`` command (``python -m jaxinfer`` alike): ``jaxinfer <subcommand> [flags]``.

Each subcommand is a module here with its flags and a ``main``; the flags every command that loads a
model shares are in ``model_flags`` (and the engine's, shared by the server and the benchmarks that
run it, in ``engine_flags``). Only the chosen subcommand's module is imported: modules define their
flags when imported, and two may define one name differently (``generate``'s ``--max_model_len``
defaults to 2048, the server's to 1024). Nothing here imports JAX until the subcommand's ``main``
runs, so ``--help`` is fast.
"""

from __future__ import annotations

import importlib
import sys

# name: (module, what it does)
SUBCOMMANDS = {
    "serve": ("jaxinfer.cli.serve", "an OpenAI-compatible HTTP server"),
    "generate": ("jaxinfer.cli.generate", "generate text from the command line, streamed"),
    "convert": ("jaxinfer.cli.convert", "convert a model (GGUF, Hugging Face, preset) to an orbax directory"),
    "plan-sharding": ("jaxinfer.cli.plan_sharding", "a sharded model's bytes per device, without its memory"),
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
    from absl import app, flags

    module = importlib.import_module(SUBCOMMANDS[name][0])
    prog = f"jaxinfer {name}"
    # absl's --help prints __main__'s docstring and the flags of the module named sys.argv[0]: make those
    # the subcommand's.
    for flag in flags.FLAGS.get_key_flags_for_module(module):
        flags.FLAGS.register_key_flag_for_module(prog, flag)
    sys.modules["__main__"].__doc__ = module.__doc__
    sys.argv = [prog, *argv[2:]]
    app.run(module.main)
