"""jaxinfer: a JAX/XLA-compiled, functional LLM inference engine."""

from jaxinfer.batching.engine import LLMEngine
from jaxinfer.batching.outputs import RequestOutput
from jaxinfer.llm import LLM, generate
from jaxinfer.sampling_params import SamplingParams, StructuredOutputs

__all__ = ["LLM", "LLMEngine", "RequestOutput", "SamplingParams", "StructuredOutputs", "generate"]
