"""Data parallelism: ``data_parallel`` engine replicas behind the engine's own interface.

Each replica is a whole ``LLMEngine`` on its row of the ``data_parallel x tensor_parallel`` mesh
(its own weights, KV pool, scheduler and compiled step); a request lives on one replica from start
to end. This was chosen over one scheduler driving a step sharded over a data axis because the
packed, ragged step has no batch axis to split evenly: sequences of different lengths would have to
be balanced into equal per-replica token and page buckets every step, each replica's KV pool
addressed by its own page numbers, and every replica would wait for the slowest one's share. Here a
replica's step is sized by its own batch, and the replicas' steps overlap: ``step`` dispatches each
replica's next step before it reads that replica's previous one (each engine reads a step only
after dispatching the next, so while one replica's tokens are read the others' devices are busy).
Requests go to the replica with the fewest unfinished requests (ties: the lowest index).
"""

from __future__ import annotations

from jaxinfer.batching.engine import LLMEngine
from jaxinfer.batching.outputs import EngineOutput
from jaxinfer.sampling_params import SamplingParams

_SUMMED = ("running", "waiting", "preempted", "kv_pages_used", "kv_pages_total", "prefix_cache_pages",
           "prefix_cache_queries", "prefix_cache_hits", "preemptions", "compilations", "prompt_tokens",
           "generation_tokens", "computed_prompt_tokens", "steps", "spec_steps", "spec_proposed_tokens",
           "spec_accepted_tokens")


class ReplicatedEngine:
    """``LLMEngine``'s interface over ``data_parallel`` replicas (``factory.create_engine`` builds them)."""

    def __init__(self, replicas: list[LLMEngine]):
        self.replicas = replicas
        first = replicas[0]
        self.config, self.resolved = first.config, first.resolved
        self.model_config, self.tokenizer, self.max_model_len = first.model_config, first.tokenizer, first.max_model_len
        self._owner: dict[str, LLMEngine] = {}

    def encode(self, prompt):
        return self.replicas[0].encode(prompt)

    def embed(self, prompts, pooling: str = "last", normalize: bool = True):
        """``LLMEngine.embed`` on the least busy replica (all hold the same weights)."""
        return self._least_busy().embed(prompts, pooling, normalize)

    def prompt_logprobs(self, prompt, k: int):
        return self._least_busy().prompt_logprobs(prompt, k)

    def score_prompt(self, prompt, k: int):
        return self._least_busy().score_prompt(prompt, k)

    def _least_busy(self) -> LLMEngine:
        """The replica with the fewest unfinished requests (ties: the lowest index)."""
        return min(self.replicas, key=lambda e: e.num_unfinished)

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None, priority: int = 0) -> None:
        if request_id in self._owner:
            raise ValueError(f"request_id {request_id!r} is already in use")
        engine = self._least_busy()
        engine.add_request(request_id, prompt, params, priority)
        self._owner[request_id] = engine

    def abort(self, request_id: str) -> bool:
        engine = self._owner.pop(request_id, None)
        return engine is not None and engine.abort(request_id)

    def has_unfinished(self) -> bool:
        return any(e.has_unfinished() for e in self.replicas)

    def step(self) -> list[EngineOutput]:
        outputs = []
        for engine in self.replicas:
            for out in engine.step():
                if out.finished:
                    self._owner.pop(out.request_id, None)
                outputs.append(out)
        return outputs

    def warmup(self, shapes=None, greedy_only: bool = False, structured: bool = False,
               background: bool = False) -> float:
        return sum(e.warmup(shapes, greedy_only, structured, background) for e in self.replicas)

    def wait_warmup(self, stop: bool = False) -> None:
        for e in self.replicas:
            e.wait_warmup(stop)

    @property
    def num_compilations(self) -> int:
        return sum(e.num_compilations for e in self.replicas)

    def stats(self) -> dict:
        """``LLMEngine.stats``' keys: counts summed over the replicas, ratios averaged; each replica's
        own under ``replicas``."""
        per = [e.stats() for e in self.replicas]
        return {k: (sum(s[k] for s in per) if k in _SUMMED else sum(s[k] for s in per) / len(per))
                for k in per[0]} | {"replicas": per}
