"""Where jaxinfer keeps what it can rebuild but should not rebuild on every start (compiled steps,
tokenizers converted from GGUF, a GGUF's config and float32 weights): ``$XDG_CACHE_HOME/jaxinfer``,
or ``~/.cache/jaxinfer``."""

import hashlib
import json
import logging
import os
import shutil

_DIGESTS = "digests.json"


def user_cache_dir(*parts: str) -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jaxinfer", *parts)


def derived_from(path: str, kind: str) -> str:
    """Where what is derived from the file at ``path`` is kept (``kind``: what it is), keyed by the
    file's name and a digest of its content, so a changed file derives again while the same file
    elsewhere or with a new modification time finds what was derived before. Keyed by modification
    time instead, every fresh virtualenv (each CI run's clean clone) reinstalled the embedded model
    and left another 0.5 GB of float32 weights behind."""
    return user_cache_dir(kind, f"{os.path.basename(path)}-{_digest(path)}")


def _digest(path: str) -> str:
    """The file's SHA-1 (~0.07 s for the embedded model's 98 MB here), computed once per path, size
    and modification time and remembered in ``digests.json`` (a file gone or changed is dropped
    when the index is next written)."""
    path = os.path.abspath(path)
    stamp = _stamp(path)  # None: gone, and opening it below says so
    index_path = user_cache_dir(_DIGESTS)
    try:
        with open(index_path) as f:
            index = json.load(f)
    except (OSError, ValueError):
        index = {}
    entry = index.get(path)
    if entry and entry[:2] == stamp:
        return entry[2]
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha1").hexdigest()[:20]
    index = {p: e for p, e in index.items() if _stamp(p) == e[:2]}
    index[path] = stamp + [digest]

    def write(tmp):
        with open(tmp, "w") as f:
            json.dump(index, f)

    write_cache(index_path, write)
    return digest


def _stamp(path: str) -> list | None:
    """The file's size and modification time (None: gone)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return [st.st_size, st.st_mtime_ns]


def write_cache(path: str, write) -> None:
    """``write(tmp)`` then an atomic rename to ``path``; a cache that cannot be written is skipped."""
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        write(tmp)
        os.replace(tmp, path)
    except OSError as e:  # unwritable, or another process wrote it first
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
        logging.getLogger(__name__).warning("could not cache %s: %s", path, e)
