"""Where jaxinfer keeps what it can rebuild but should not rebuild on every start (compiled steps,
tokenizers converted from GGUF): ``$XDG_CACHE_HOME/jaxinfer``, or ``~/.cache/jaxinfer``."""

import os


def user_cache_dir(*parts: str) -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jaxinfer", *parts)
