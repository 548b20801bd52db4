"""Hugging Face checkpoints: ``config.json`` and ``*.safetensors`` (sharded with
``model.safetensors.index.json`` or not), read tensor by tensor into the ``Assembler``.

Each shard's header is read and checked here before the ``safetensors`` library opens it: its own
error for a file of garbage is ``Error while deserializing header: header too large``, naming
neither the file nor what is wrong with it, under a 20-line traceback; a header of 1,000 tensors
reads in ~6 ms.
"""

from __future__ import annotations

import glob
import json
import os
import re
import struct

import numpy as np
from jax.sharding import Mesh
from safetensors import SafetensorError, safe_open
from tqdm.auto import tqdm

from jaxinfer.models.config import ModelConfig
from jaxinfer.models.families import FAMILIES, HF_GLOBALS, config_from_hf
from jaxinfer.models.spec import Weights
from jaxinfer.models.weights.assemble import Assembler
from jaxinfer.models.weights.source import ModelFileError, blamed_on, read_json

INDEX = "model.safetensors.index.json"
_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")


def hf_config(path: str) -> ModelConfig:
    """The ModelConfig of the directory's ``config.json``."""
    file = os.path.join(path, "config.json")
    cfg = read_json(file)
    with blamed_on(file):  # a key missing, an unknown architecture, a field the family refuses
        return config_from_hf(cfg)


def safetensors_names(path: str) -> list[str]:
    """The tensor names a ``.safetensors`` file holds, from its header, checked against the file's
    size (``ModelFileError``: not a safetensors file, or cut short)."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            (n,) = struct.unpack("<Q", head) if len(head) == 8 else (None,)
            raw = f.read(n) if n is not None and n <= size - 8 else b""
    except OSError as e:
        raise ModelFileError(path, f"unreadable ({e.strerror or e})") from None
    if n is None:
        raise ModelFileError(path, f"not a safetensors file ({size} bytes, too short for its 8-byte header length)")
    if n > size - 8:
        raise ModelFileError(path, f"not a safetensors file (header length {n:#x} exceeds the file size, {size} bytes)")
    try:
        header = json.loads(raw)
        tensors = {k: v for k, v in header.items() if k != "__metadata__"}
        end, last = max(((int(v["data_offsets"][1]), k) for k, v in tensors.items()), default=(0, None))
    except (AttributeError, KeyError, TypeError, ValueError) as e:  # JSON errors are ValueErrors
        raise ModelFileError(path, f"not a safetensors file (its {n}-byte header is not a tensor index: {e})") from None
    if 8 + n + end > size:
        raise ModelFileError(path, f"truncated: the tensor data ends at byte {size} of {8 + n + end} expected "
                             f"(tensor {last!r} runs past the end of the file)")
    return list(tensors)


def _safetensors_files(path: str) -> dict[str, str]:
    """Tensor name -> shard file, from ``model.safetensors.index.json`` when sharded; every shard's
    header checked (``safetensors_names``) before the first tensor is read."""
    index = os.path.join(path, INDEX)
    if not os.path.isfile(index):
        return {name: shard for shard in sorted(glob.glob(os.path.join(path, "*.safetensors")))
                for name in safetensors_names(shard)}
    weight_map = read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(s, str) for s in weight_map.values()):
        raise ModelFileError(index, "has no weight_map of tensor names to shard files")
    missing = sorted({s for s in weight_map.values() if not os.path.isfile(os.path.join(path, s))})
    if missing:
        raise ModelFileError(index, f"its weight_map names {len(missing)} shard(s) that are missing: "
                             f"{', '.join(missing[:3])}")
    held = {shard: set(safetensors_names(os.path.join(path, shard))) for shard in set(weight_map.values())}
    absent = [(name, shard) for name, shard in weight_map.items() if name not in held[shard]]
    if absent:
        raise ModelFileError(index, f"its weight_map puts {len(absent)} tensor(s) in shards that do not hold them: "
                             f"{absent[0][0]!r} in {absent[0][1]}")
    return {name: os.path.join(path, shard) for name, shard in weight_map.items()}


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
    out = Assembler(config, dtype, family.hf_norm_offset, mesh, scheme, source=path)
    by_shard: dict[str, list[str]] = {}
    for name, shard in _safetensors_files(path).items():
        by_shard.setdefault(shard, []).append(name)
    with tqdm(total=sum(map(len, by_shard.values())), desc=f"loading {os.path.basename(path)}",
              unit="tensor") as bar:
        for shard, names in by_shard.items():
            try:
                with safe_open(shard, framework="np") as f:
                    for name in sorted(names, key=_layer_index):
                        bar.update()
                        _put(out, matchers, config, shard, name, f)
            except SafetensorError as e:  # what the header check above does not see
                raise ModelFileError(shard, f"unreadable safetensors file ({e})") from None
    return out.finish()


def _put(out: Assembler, matchers, config: ModelConfig, shard: str, name: str, f) -> None:
    """One tensor of the open shard ``f`` handed to ``out`` as its canonical part."""
    if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and config.tie_word_embeddings):
        return  # recomputed from the config / tied to the embedding
    if name in HF_GLOBALS:
        out.put_global(HF_GLOBALS[name], f.get_tensor(name))
        return
    m = _LAYER_RE.fullmatch(name)
    part = _match_part(matchers, m.group(2)) if m else None
    if part is None:
        raise ModelFileError(shard, f"unexpected tensor {name!r} for architecture {config.architecture!r}")
    out.put_layer(int(m.group(1)), part, f.get_tensor(name))
