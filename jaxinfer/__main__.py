"""``python -m jaxinfer <subcommand> [flags]``: the ``jaxinfer`` command (``jaxinfer.cli``)."""

from jaxinfer.cli import main

if __name__ == "__main__":  # not when a spawned process (the server's engine core) imports this module
    main()
