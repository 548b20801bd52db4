"""Models named by Hugging Face Hub id: ``org/name`` (a Hugging Face checkpoint) or
``org/name:file.gguf`` (one GGUF file of a repo), fetched into the Hugging Face cache and resolved to
the local snapshot directory or file, as ``vllm serve org/name`` and transformers do.

Why through ``huggingface_hub`` and not a download of our own: its cache (``models--org--name/`` with
``refs/<branch or tag>`` holding a commit hash, ``snapshots/<commit>/<files>`` linking into ``blobs/``)
is the one transformers, vLLM and the ``hf`` CLI share, so a model any of them fetched is not fetched
again; and it already does what a download needs: ``HF_TOKEN`` for gated and private repos,
``HF_ENDPOINT``, resumed and parallel transfers, file locks between processes (the server's two
processes resolve the same id at once), progress bars, and ``HF_HUB_OFFLINE=1`` (cache only).

Only what the engine reads is fetched: the top-level config, tokenizer and ``*.safetensors`` files
(``HF_FILES``), and of the safetensors only the shards the index names when there is one: repos often
also hold the same weights as ``*.bin``, ``original/*.pth``, ONNX or a ``consolidated.safetensors``,
each as large again. Of a GGUF repo, only the one named file.

``HF_HUB_OFFLINE``, ``HF_HUB_CACHE`` and ``HF_HOME`` are read at each call (``huggingface_hub`` reads
them once, when first imported), so a process that sets them later is still obeyed; ``download_dir``
replaces the cache directory, ``revision`` picks a branch, tag or commit (default ``main``). Every way
this can fail is one ``ValueError`` line saying why and what to do.
"""

from __future__ import annotations

import contextlib
import glob
import importlib
import os
import re

# A Hub repo id: "org/name", each part letters, digits, "_", "-", "." (not first or last).
_PART = r"[A-Za-z0-9](?:[\w.-]*[A-Za-z0-9_])?"
_HUB_ID = re.compile(rf"({_PART}/{_PART})(?::(.+))?")

# The top-level files of a Hugging Face tokenizer (transformers reads the tokenizer's class in
# config.json where tokenizer_config.json does not name it).
TOKENIZER_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "spiece.model",
                   "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt", "vocab.txt",
                   "chat_template.jinja", "chat_template.json")
# The top-level files of a Hugging Face checkpoint the engine reads (config, weights, tokenizer).
HF_FILES = (*TOKENIZER_FILES, "generation_config.json", "model.safetensors.index.json")
_INDEX = "model.safetensors.index.json"
_OFFLINE_VARS = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")


def is_hub_id(model: str) -> bool:
    """Whether ``model`` has the shape of a Hub id (``org/name`` or ``org/name:file``); the caller
    checks first that it is no local path."""
    return _HUB_ID.fullmatch(model) is not None


def cache_dir(download_dir: str | None = None) -> str:
    """Where models are cached: ``download_dir``, else ``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else
    huggingface_hub's default (``~/.cache/huggingface/hub``)."""
    if download_dir:
        return os.path.abspath(os.path.expanduser(download_dir))
    env = os.environ
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if env.get(name):
            return os.path.abspath(os.path.expanduser(os.path.expandvars(env[name])))
    if env.get("HF_HOME"):
        return os.path.join(os.path.abspath(os.path.expanduser(os.path.expandvars(env["HF_HOME"]))), "hub")
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def offline() -> bool:
    """Whether ``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) is set, now or when huggingface_hub was
    imported."""
    from huggingface_hub import constants

    now = any(os.environ.get(v, "").strip().upper() in ("1", "ON", "YES", "TRUE") for v in _OFFLINE_VARS)
    return now or bool(getattr(constants, "HF_HUB_OFFLINE", False))


def download(model: str, *, revision: str | None = None, download_dir: str | None = None,
             gguf_file: str | None = None, tokenizer_only: bool = False) -> str:
    """The local copy of Hub id ``model`` at ``revision``, fetched into the cache unless there already
    (or ``HF_HUB_OFFLINE`` is set): the snapshot directory of a Hugging Face checkpoint, or the path of
    its GGUF file for ``org/name:file.gguf`` or ``gguf_file``. ``tokenizer_only``: of a checkpoint only
    its tokenizer's files (``TOKENIZER_FILES``: a tokenizer given apart from the model)."""
    m = _HUB_ID.fullmatch(model)
    if m is None:
        raise ValueError(f"{model!r} is not a Hugging Face Hub id (org/name or org/name:file.gguf)")
    repo_id, named = m.group(1), m.group(2)
    if named is not None and gguf_file is not None and named != gguf_file:
        raise ValueError(f"model {model!r} names GGUF file {named!r} but gguf_file is {gguf_file!r}: give one")
    filename = named or gguf_file
    if filename is not None and not filename.endswith(".gguf"):
        raise ValueError(f"model {model!r}: after the colon goes a .gguf file of the repo (org/name:file.gguf), "
                         f"got {filename!r}")
    cache, local_only = cache_dir(download_dir), offline()
    with _one_line(repo_id, revision, filename, cache, local_only):
        if filename is not None:
            from huggingface_hub import hf_hub_download

            return hf_hub_download(repo_id, filename, revision=revision, cache_dir=cache, local_files_only=local_only)
        from huggingface_hub import snapshot_download

        def fetch(patterns, rev):
            return snapshot_download(repo_id, revision=rev, cache_dir=cache, local_files_only=local_only,
                                     allow_patterns=list(patterns), ignore_patterns=["*/*"])  # top level only
        snapshot = fetch(TOKENIZER_FILES if tokenizer_only else HF_FILES, revision)
        if tokenizer_only:
            return snapshot
        # The index names the shards that hold the weights; fetch just those, from the same commit.
        shards = _indexed_shards(os.path.join(snapshot, _INDEX)) or ["*.safetensors"]
        snapshot = fetch(shards, os.path.basename(os.path.normpath(snapshot)))
    if not glob.glob(os.path.join(snapshot, "*.safetensors")):
        where = f"{repo_id}{f' at revision {revision!r}' if revision else ''}"
        ggufs = sorted(os.path.relpath(p, snapshot) for p in glob.glob(os.path.join(snapshot, "**", "*.gguf"),
                                                                        recursive=True))
        if ggufs:
            raise ValueError(f"{where} holds GGUF files, not *.safetensors: name the one to load, e.g. "
                             f"{repo_id}:{ggufs[0]} (or gguf_file={ggufs[0]!r})")
        if local_only:
            raise ValueError(f"{where} is in the Hugging Face cache ({snapshot}) without its *.safetensors weights, "
                             "and HF_HUB_OFFLINE is set: fetch them once online (unset HF_HUB_OFFLINE)")
        raise ValueError(f"{where} has no *.safetensors weights at the top of the repo; if it holds GGUF files, "
                         "name one: org/name:file.gguf (or gguf_file=...)")
    return snapshot


def _indexed_shards(index: str) -> list[str]:
    """The shard files ``model.safetensors.index.json`` names (none if there is no usable index: the
    loader then reports what is wrong with it)."""
    import json

    try:
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map")
        return sorted({v for v in weight_map.values() if isinstance(v, str) and "/" not in v})
    except (OSError, ValueError, AttributeError):
        return []


@contextlib.contextmanager
def _one_line(repo_id: str, revision: str | None, filename: str | None, cache: str, local_only: bool):
    """huggingface_hub's errors (several lines, some with pages of HTTP detail) re-raised as one
    ``ValueError`` line that says why and what to do."""
    try:
        yield
    except Exception as e:
        message = _message(e, repo_id, revision, filename, cache, local_only)
        if message is None:
            raise
        raise ValueError(message) from None


def _message(e: Exception, repo_id: str, revision: str | None, filename: str | None, cache: str,
             local_only: bool) -> str | None:
    from huggingface_hub.utils import (EntryNotFoundError, GatedRepoError, HFValidationError, HfHubHTTPError,
                                       LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError)

    where = f"{repo_id}{f' at revision {revision!r}' if revision else ''}"
    what = where if filename is None else f"{filename} of {where}"
    if isinstance(e, LocalEntryNotFoundError):
        if local_only:
            return (f"{what} is not in the Hugging Face cache ({cache}) and HF_HUB_OFFLINE is set: fetch it once "
                    "online (unset HF_HUB_OFFLINE), or point HF_HUB_CACHE or download_dir (--download_dir) at a "
                    "cache that holds it")
        if type(e).__name__ == "IncompleteSnapshotError":
            return f"{what}: the cached snapshot is incomplete and the Hub cannot be reached: {_first_line(e)}"
        cause = e.__cause__ or e.__context__
        return (f"{what} is not in the Hugging Face cache ({cache}) and the Hub could not be reached"
                f"{f' ({_first_line(cause)})' if cause else ''}: check the network (or HF_ENDPOINT), or set "
                "HF_HUB_OFFLINE=1 with a cache that holds it")
    if isinstance(e, GatedRepoError):
        return (f"{repo_id} is a gated repo: accept its terms on its Hugging Face page, then set HF_TOKEN to a "
                "token of that account (or run `hf auth login`)")
    if isinstance(e, RevisionNotFoundError):
        return f"{repo_id} has no revision {revision!r} (revision: a branch, tag or commit hash of the repo)"
    if isinstance(e, RepositoryNotFoundError):
        return (f"no model {repo_id!r} on the Hugging Face Hub (nor a local path of that name): check the id, and "
                "for a private repo set HF_TOKEN")
    if isinstance(e, EntryNotFoundError):
        return f"{where} has no file {filename!r}: name a .gguf file the repo holds"
    if isinstance(e, HFValidationError):
        return f"{repo_id!r} is not a valid Hugging Face Hub id: {_first_line(e)}"
    if isinstance(e, HfHubHTTPError):
        return f"the Hugging Face Hub refused {what}: {_first_line(e)}"
    if isinstance(e, (OSError, *_transport_errors())):
        return (f"could not fetch {what} into {cache} ({type(e).__name__}: {_first_line(e)}): check the network "
                "(or HF_ENDPOINT) and the disk, or set HF_HUB_OFFLINE=1 with a cache that holds it")
    return None


def _transport_errors() -> tuple[type, ...]:
    """The HTTP client's network errors (huggingface_hub has used requests, httpx and httpx2; requests'
    are ``OSError``s already)."""
    out = []
    for name in ("httpx2", "httpx"):
        try:
            out.append(importlib.import_module(name).TransportError)
        except (ImportError, AttributeError):
            pass
    return tuple(out)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
