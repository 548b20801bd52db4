"""Model loading: a model id resolved to its source, its config, and its weights, from whichever
format the source is, one module each:

- ``source``: a preset name, path or Hugging Face Hub id -> ``ModelSource``; ``ModelFileError``,
  the one error of a model file that cannot be read (``"<path>: <cause>"``);
- ``hub``: a Hub id fetched into (or found in) the Hugging Face cache;
- ``gguf_file``: the GGUF file format (header, metadata, tensors; config from metadata), which the
  tokenizer reads too; ``gguf``: its tensors into weights, and what the user cache keeps of them;
- ``hf``: Hugging Face ``config.json`` and ``*.safetensors``;
- ``converted``: orbax directories written by ``save_converted``;
- ``assemble``: the ``Assembler`` that the ``gguf`` and ``hf`` loaders feed.

Every source is read tensor by tensor, its names mapped by the checkpoint's family
(``families.py``) to canonical parts, and turned into the layout of the family's parameter spec
(``spec.py``: linear weights ``[out, in]`` as in the checkpoints, fused ``wqkv`` / ``w_gate_up``,
stacked experts, Q/K in HF rotate-half head order), cast to the target dtype one layer at a time so
a load never holds more than one extra copy.

Quantization (``quantization``): ``"gguf"`` keeps a GGUF file's quantized matmul weights and
embedding in their own blocks (``jaxinfer.quant.gguf_blocks``; norm gains stay explicit as the
blocks' ``col_scale``); a scheme of ``jaxinfer.quant.SCHEMES`` quantizes the spec's ``quantizable``
leaves of float weights from any source (after the norms are folded into them), one leaf at a time on
the device. int4 loads from GGUF and safetensors also follow the first token through the float
layers and weigh each matrix's grid search by that token's activations
(``assemble.Assembler._sink_importance``); float orbax checkpoints and dummy weights
(``converted.quantize_weights``, ``init_dummy_weights``) are quantized unweighted. An orbax
directory saved quantized (``save_converted``, ``jaxinfer convert --quantization``)
restores its ``QArray``s as they were saved, and is loaded only with that quantization
(``saved_quantization``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxinfer.formats import LOAD_FORMATS, QUANTIZATIONS, SCHEMES
from jaxinfer.models import sharding
from jaxinfer.models.config import PRESETS, ModelConfig
from jaxinfer.models.spec import Weights, arrange_layers, init_dummy_weights, param_spec
from jaxinfer.models.weights.converted import (converted_config, quantize_weights, restore_converted,
                                               save_converted, saved_quantization)
from jaxinfer.models.weights.gguf import cached_gguf_config, dequantized_gguf, load_gguf
from jaxinfer.models.weights.hf import hf_config, load_hf
from jaxinfer.models.weights.source import ModelFileError, ModelSource, resolve_model
from jaxinfer.quant import check_device_supports, parse_scheme, quantize, scheme_for_inputs

__all__ = ["LOAD_FORMATS", "QUANTIZATIONS", "ModelFileError", "ModelSource", "check_has_weights", "load_config",
           "load_model", "model_quantization", "resolve_model", "save_converted", "saved_quantization"]


def load_config(source: ModelSource) -> ModelConfig:
    """The ModelConfig of a source, without reading its weights."""
    if source.kind == "preset":
        return PRESETS[source.preset]
    if source.kind == "hf":
        return hf_config(source.path)
    if source.kind == "gguf":
        return cached_gguf_config(source.path)
    return converted_config(source.path)


def model_quantization(quantization: str, config: ModelConfig) -> str:
    """``quantization`` as ``config``'s weights take it: plain ``"int4"`` becomes the ``int4-gN`` whose
    group divides every quantized matrix's input dimension (``quant.scheme_for_inputs``), an explicit
    group that does not is refused; the rest as given."""
    if quantization not in SCHEMES:
        return quantization
    spec = param_spec(config)
    return scheme_for_inputs(quantization, {name: s.shape[-1] for name, s in {**spec.globals, **spec.layer}.items()
                                            if s.quantizable})


def check_has_weights(source: ModelSource, load_format: str) -> None:
    """Refuse, in one line, to read the weights of a preset (only its shapes are here), before any work."""
    if source.kind == "preset" and load_format != "dummy":
        raise ValueError(f"preset {source.preset!r} has no weights: use load_format='dummy' (--load_format dummy) "
                         "or give a checkpoint (a Hugging Face Hub id org/name, a local Hugging Face directory or "
                         "a .gguf file)")


def load_model(model: str | ModelSource, *, dtype="float32", load_format: str = "auto", seed: int = 0,
               layer_loop: str | None = None, mesh: Mesh | None = None,
               quantization: str = "none") -> tuple[ModelConfig, Weights]:
    """Resolve ``model`` (or take the ``ModelSource`` ``resolve_model`` made of it, e.g. of a Hub id
    at a ``revision``) and return its config and weights, cast to ``dtype`` (float leaves) and
    arranged for ``layer_loop`` (default: the config's), split over ``mesh`` if given
    (``models.sharding``), quantized by ``quantization`` (one of ``QUANTIZATIONS``; see the module
    docstring). ``load_format="dummy"`` gives random weights of the right
    shapes (benchmarks without a checkpoint)."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
    check_device_supports(quantization)
    dtype = _float_dtype(dtype)
    source = model if isinstance(model, ModelSource) else resolve_model(model)
    model = model if isinstance(model, str) else source.preset or source.path
    check_has_weights(source, load_format)
    quantization = model_quantization(quantization, load_config(source))
    scheme = quantization if quantization in SCHEMES else None
    saved = saved_quantization(source)
    if saved != "none" and load_format != "dummy" and not _same_quantization(saved, quantization):
        raise ValueError(f"{model!r} holds weights quantized as {saved!r} (jaxinfer convert); load it "
                         f"with quantization={saved!r} (the engine's 'auto' does), or convert the source again")
    if quantization == "gguf" and saved != "gguf" and (source.kind != "gguf" or load_format == "dummy"):
        raise ValueError(f"quantization='gguf' keeps a .gguf file's own blocks; {model!r} "
                         f"({'dummy weights' if load_format == 'dummy' else source.kind}) has none: use one of "
                         f"{SCHEMES} or 'none'")
    config = load_config(source)
    if layer_loop is not None:
        config = config.replace(layer_loop=layer_loop)
    if load_format == "dummy":
        if mesh is not None and scheme is None:
            return config, sharding.dummy_weights(config, jax.random.key(seed), dtype, mesh)
        finish = None if scheme is None else (lambda s, x: quantize(x, scheme) if s.quantizable else x)
        weights = init_dummy_weights(config, jax.random.key(seed), dtype, finish)
        return config, weights if mesh is None else sharding.place_weights(weights, config, mesh)
    if source.kind == "orbax":  # restored in the checkpoint's layout, then laid out per device on device
        # quantized weights (saved so, or made now) are restored whole on one device, then split: the
        # checkpoint's shardings are per plain array
        weights = restore_converted(source.path, dtype, None if saved != "none" or scheme is not None else mesh)
        if scheme is not None and saved == "none":
            weights = quantize_weights(weights, config, scheme)  # nothing unfolded to start from
        if mesh is not None:
            return config, sharding.place_weights(arrange_layers(weights, config), config, mesh)
        return config, arrange_layers(weights, config)
    if source.kind == "gguf" and quantization == "none" and mesh is None and dtype == np.float32:
        weights = dequantized_gguf(source.path, config)
    elif source.kind == "gguf":
        weights = load_gguf(source.path, config, dtype, mesh, native=quantization == "gguf", scheme=scheme)
    else:
        weights = load_hf(source.path, config, dtype, mesh, scheme)
    if mesh is not None and config.layer_loop == "scan":
        return config, sharding.stack_layers(weights, config, mesh)
    return config, arrange_layers(weights, config)


def _same_quantization(a: str, b: str) -> bool:
    """Whether two ``quantization`` names make the same weights (``int4`` is ``int4-g128``)."""
    return a == b or (a in SCHEMES and b in SCHEMES and parse_scheme(a) == parse_scheme(b))


def _float_dtype(dtype) -> np.dtype:
    try:
        dt = jnp.dtype(dtype)
    except TypeError:
        raise TypeError(f"dtype must be a floating dtype such as 'float32' or 'bfloat16', got {dtype!r}") from None
    if not jnp.issubdtype(dt, jnp.floating):
        raise TypeError(f"dtype must be a floating dtype such as 'float32' or 'bfloat16', got {dtype!r}")
    return dt
