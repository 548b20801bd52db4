"""Hugging Face checkpoints: ``config.json`` and ``*.safetensors`` (sharded with
``model.safetensors.index.json`` or not), read tensor by tensor into the ``Assembler``.
"""

from __future__ import annotations

import glob
import json
import os
import re

import numpy as np
from jax.sharding import Mesh
from safetensors import safe_open
from tqdm.auto import tqdm

from jaxinfer.models.config import ModelConfig
from jaxinfer.models.families import FAMILIES, HF_GLOBALS, config_from_hf
from jaxinfer.models.spec import Weights
from jaxinfer.models.weights.assemble import Assembler

INDEX = "model.safetensors.index.json"
_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")


def hf_config(path: str) -> ModelConfig:
    """The ModelConfig of the directory's ``config.json``."""
    with open(os.path.join(path, "config.json")) as f:
        return config_from_hf(json.load(f))


def _safetensors_files(path: str) -> dict[str, str]:
    """Tensor name -> shard file, from ``model.safetensors.index.json`` when sharded."""
    index = os.path.join(path, INDEX)
    if os.path.isfile(index):
        with open(index) as f:
            return {name: os.path.join(path, shard) for name, shard in json.load(f)["weight_map"].items()}
    files = {}
    for shard in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        with safe_open(shard, framework="np") as f:
            files.update(dict.fromkeys(f.keys(), shard))
    return files


def _layer_index(name: str) -> int:
    """A safetensors name's layer (-1: a global), to read a shard's layers in order: index files list
    ``layers.10`` before ``layers.2``, and int4 loads build layers in order (``Assembler``), holding
    complete later layers on the host until the earlier ones arrive."""
    m = _LAYER_RE.fullmatch(name)
    return int(m.group(1)) if m else -1


def _layer_matcher(names: dict[str, str]):
    """``(regex, part template)`` pairs for a family's per-layer names (``{e}``: an expert index)."""
    return [(re.compile(re.escape(k).replace(r"\{e\}", r"(?P<e>\d+)") + "$"), v) for k, v in names.items()]


def _match_part(matchers, suffix: str) -> str | None:
    for rx, part in matchers:
        m = rx.match(suffix)
        if m:
            return part.format(e=m.group("e")) if "e" in rx.groupindex else part
    return None


def load_hf(path: str, config: ModelConfig, dtype: np.dtype, mesh: Mesh | None, scheme: str | None = None) -> Weights:
    family = FAMILIES[config.architecture]
    matchers = _layer_matcher(family.hf_layer)
    out = Assembler(config, dtype, family.hf_norm_offset, mesh, scheme)
    by_shard: dict[str, list[str]] = {}
    for name, shard in _safetensors_files(path).items():
        by_shard.setdefault(shard, []).append(name)
    with tqdm(total=sum(map(len, by_shard.values())), desc=f"loading {os.path.basename(path)}",
              unit="tensor") as bar:
        for shard, names in by_shard.items():
            with safe_open(shard, framework="np") as f:
                for name in sorted(names, key=_layer_index):
                    bar.update()
                    if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight"
                                                                 and config.tie_word_embeddings):
                        continue  # recomputed from the config / tied to the embedding
                    if name in HF_GLOBALS:
                        out.put_global(HF_GLOBALS[name], f.get_tensor(name))
                        continue
                    m = _LAYER_RE.fullmatch(name)
                    part = _match_part(matchers, m.group(2)) if m else None
                    if part is None:
                        raise ValueError(f"unexpected tensor {name!r} in {shard} for architecture "
                                         f"{config.architecture!r}")
                    out.put_layer(int(m.group(1)), part, f.get_tensor(name))
    return out.finish()
