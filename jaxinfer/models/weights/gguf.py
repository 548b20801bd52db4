"""GGUF checkpoints (llama.cpp's): a file's tensors (``gguf_file``) into the ``Assembler``, in their
own blocks (``quantization="gguf"``) or dequantized, and the config and float32 weights derived from
a file kept in the user cache.

The cache is why this module keeps anything at all: dequantizing SmolLM2 (~3 s) and parsing its
header were a third of the server's start-up on the 2-core CPU; the saved arrays are
memory-mapped instead.
"""

from __future__ import annotations

import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from tqdm.auto import tqdm

from jaxinfer.models.config import ModelConfig
from jaxinfer.models.families import GGUF_GLOBALS, family_for_gguf
from jaxinfer.models.spec import Weights, abstract_weights, check_shapes
from jaxinfer.models.weights.assemble import Assembler
from jaxinfer.models.weights.gguf_file import CONFIG_TENSORS, gguf_config, gguf_file
from jaxinfer.models.weights.source import ModelFileError
from jaxinfer.quant import gguf_blocks, map_rows
from jaxinfer.user_cache import derived_from, write_cache

# GGUF tensors that stay in their blocks with quantization="gguf": the matmul weights and the embedding.
NATIVE_PARTS = frozenset({"q", "k", "v", "qkv", "o", "gate", "up", "gate_up", "down", "experts_gate", "experts_up",
                          "experts_down", "shared_gate", "shared_up", "shared_down", "embed", "lm_head"})
_LAYER_RE = re.compile(r"blk\.(\d+)\.(.+)")


def cached_gguf_config(path: str) -> ModelConfig:
    """The file's ModelConfig, from the user cache once derived: a restart then skips parsing the header."""
    cached = os.path.join(derived_from(path, "gguf"), "config.json")
    if os.path.isfile(cached):
        with open(cached) as f:
            return ModelConfig.from_dict(json.load(f))
    config = gguf_config(gguf_file(path))

    def write(tmp):
        with open(tmp, "w") as f:
            json.dump(config.to_dict(), f)

    write_cache(cached, write)
    return config


def dequantized_gguf(path: str, config: ModelConfig) -> Weights:
    """The GGUF file's weights dequantized to float32, through the user cache. Per-layer arrays (the
    layout ``load_gguf`` gives), one ``.npy`` per leaf."""
    folder = os.path.join(derived_from(path, "gguf"), "float32")
    structure = jax.tree.structure(abstract_weights(config.replace(layer_loop="unroll")))
    if os.path.isdir(folder):
        leaves = [np.load(os.path.join(folder, f"{i}.npy"), mmap_mode="r") for i in range(structure.num_leaves)]
        weights = jax.tree.unflatten(structure, [jnp.asarray(x) for x in leaves])
        check_shapes(weights, config)
        return weights
    weights = load_gguf(path, config, np.float32, None)
    leaves = jax.tree.leaves(weights)
    if jax.tree.structure(weights) == structure:
        def write(tmp):
            os.makedirs(tmp)
            for i, x in enumerate(leaves):
                np.save(os.path.join(tmp, f"{i}.npy"), np.asarray(x))

        write_cache(folder, write)
    return weights


def _unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's conversion permutation of Q/K rows ``[heads * head_dim, ...]``.

    llama.cpp interleaves each head's two rotary halves (GPT-J pairs ``(i, i + d/2)`` become
    adjacent rows) for its llama architecture; rotate-half RoPE needs the halves back as contiguous blocks.
    """
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def load_gguf(path: str, config: ModelConfig, dtype: np.dtype, mesh: Mesh | None, native: bool = False,
              scheme: str | None = None) -> Weights:
    """``native``: quantized matmul weights and the embedding stay in their blocks (``QArray``s);
    other tensors (norms, and routers, which llama.cpp writes in float) are read as floats.
    ``scheme``: matmul weights quantized by it at load (``Assembler._mat``)."""
    from gguf.quants import dequantize

    gguf = gguf_file(path)
    family = family_for_gguf(gguf.metadata)
    out = Assembler(config, dtype, mesh=mesh, scheme=scheme, source=path)

    def read(t, part):
        # numpy shape is GGUF's reversed: [out, in] ([E, out, in])
        if native and part in NATIVE_PARTS and gguf_blocks.is_quantized(t.tensor_type.name):
            return gguf_blocks.from_gguf(t.data, t.tensor_type.name, t.name)
        return dequantize(t.data, t.tensor_type)

    for t in tqdm(gguf.tensors, desc=f"loading {os.path.basename(path)}", unit="tensor"):
        if t.name in CONFIG_TENSORS:
            continue
        if t.name in GGUF_GLOBALS:
            out.put_global(GGUF_GLOBALS[t.name], read(t, GGUF_GLOBALS[t.name]))
            continue
        m = _LAYER_RE.fullmatch(t.name)
        part = family.gguf_layer.get(m.group(2)) if m else None
        if part is None:
            raise ModelFileError(path, f"unexpected GGUF tensor {t.name!r} for architecture {family.name!r}")
        w = read(t, part)
        if part == "shared_expert_gate":
            w = w.reshape(1, -1)
        if family.gguf_permute_qk and part in ("q", "k"):
            n_heads = config.num_heads if part == "q" else config.num_kv_heads
            w = map_rows(w, lambda a, n=n_heads: _unpermute_qk(a, n))
        out.put_layer(int(m.group(1)), part, w)
    return out.finish()
