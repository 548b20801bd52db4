"""jaxinfer: a JAX/XLA-compiled, functional LLM inference engine.

The public names load on first use (PEP 562), so importing a module under ``jaxinfer`` (the command
line's flags, ``jaxinfer serve --help``) does not import JAX; ``from jaxinfer import LLM`` does."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# Each public name and the module that defines it.
_EXPORTS = {
    "LLM": "jaxinfer.llm",
    "generate": "jaxinfer.llm",
    "EmbeddingOutput": "jaxinfer.embeddings",
    "EmbeddingRequestOutput": "jaxinfer.embeddings",
    "LLMEngine": "jaxinfer.batching.engine",
    "RequestOutput": "jaxinfer.outputs",
    "CompletionOutput": "jaxinfer.outputs",
    "SamplingParams": "jaxinfer.sampling_params",
    "StructuredOutputs": "jaxinfer.sampling_params",
}

__all__ = ["CompletionOutput", "EmbeddingOutput", "EmbeddingRequestOutput", "LLM", "LLMEngine", "RequestOutput",
           "SamplingParams", "StructuredOutputs", "generate"]

if TYPE_CHECKING:
    from jaxinfer.batching.engine import LLMEngine
    from jaxinfer.embeddings import EmbeddingOutput, EmbeddingRequestOutput
    from jaxinfer.llm import LLM, generate
    from jaxinfer.outputs import CompletionOutput, RequestOutput
    from jaxinfer.sampling_params import SamplingParams, StructuredOutputs


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'jaxinfer' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
