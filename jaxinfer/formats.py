"""The names the options accept for how weights and the KV cache are stored. This module imports
nothing, JAX least of all, so the command line lists them in ``--help`` without starting JAX; what
each name means is with its code: ``quant.schemes`` (the schemes quantized at load),
``models.weights`` (loading), ``paged.kv_cache`` (the cache's storage)."""

INT4_GROUPS = (32, 64, 128)
# Weights quantized at load from float weights (``quant.schemes``); "int4": the largest group that fits the model.
SCHEMES = ("int8", "int4", *(f"int4-g{g}" for g in INT4_GROUPS), "fp8")
# The ``quantization`` option: "none": full precision; "gguf": a GGUF file's blocks as they are; the rest:
# quantized at load (the engine adds "auto").
QUANTIZATIONS = ("none", "gguf", *SCHEMES)
LOAD_FORMATS = ("auto", "dummy")  # read the weights, or random ones of the same shapes
KV_CACHE_DTYPES = ("auto", "int8", "fp8")  # the model's dtype, or codes with a float32 scale per token and kv head
