"""Where jaxinfer keeps what it can rebuild but should not rebuild on every start (compiled steps,
tokenizers converted from GGUF, a GGUF's config and float32 weights): ``$XDG_CACHE_HOME/jaxinfer``,
or ``~/.cache/jaxinfer``."""

import os


def user_cache_dir(*parts: str) -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jaxinfer", *parts)


def derived_from(path: str, kind: str) -> str:
    """Where what is derived from the file at ``path`` is kept (``kind``: what it is), keyed by the
    file's name, size and modification time, so a changed file derives again."""
    st = os.stat(path)
    return user_cache_dir(kind, f"{os.path.basename(path)}-{st.st_size}-{st.st_mtime_ns}")
