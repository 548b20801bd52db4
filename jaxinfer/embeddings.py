"""What ``LLM.embed`` returns, in vLLM's shape: one ``EmbeddingRequestOutput`` per prompt, its vector
at ``out.outputs.embedding`` (a list of floats), so code written against vLLM's offline embedding API
reads our results unchanged. The vectors come from ``LLMEngine.embed`` (``models.pooling``)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class EmbeddingOutput:
    """One prompt's embedding: its pooled final hidden states (L2-normalized unless asked not to)."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclasses.dataclass
class EmbeddingRequestOutput:
    """A prompt's embedding (``outputs.embedding``) and the token ids it was computed from."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True
