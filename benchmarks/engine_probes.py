"""What the benchmarks read from an engine, in a module of its own that defines no flags (a benchmark
importing another benchmark would define that one's flags a second time): one step set up to run
alone on an idle engine (``probe_step``), and the engine's counters from its public ``stats()``."""

from __future__ import annotations


def probe_step(llm, prompts, proposals=None):
    """The scheduler's output for one step of ``prompts`` alone on an idle engine: each prompt's context
    already in the cache (in pages of its own), its last token fed, then its ``proposals`` (a verifying
    step) if given. The engine serves nothing meanwhile, so the pages it names hold whatever they hold."""
    from jaxinfer import SamplingParams
    from jaxinfer.batching.step_io import SchedulerOutput

    ps, first, tables = llm.engine.resolved.page_size, 0, []
    for p in prompts:
        n = -(-(len(p) + len(proposals[0] if proposals else ())) // ps)
        tables.append(list(range(first, first + n)))
        first += n
    assert first <= llm.engine.resolved.num_pages, "the probe's contexts do not fit the KV pool"
    props = proposals or [[] for _ in prompts]
    return SchedulerOutput(
        request_ids=[f"probe{i}" for i in range(len(prompts))], num_tokens=[1 + len(q) for q in props],
        starts=[len(p) - 1 for p in prompts], token_ids=[t for p, q in zip(prompts, props) for t in [p[-1], *q]],
        page_tables=tables, params=[SamplingParams(max_tokens=1, temperature=0.0)] * len(prompts),
        seeds=[0] * len(prompts), output_index=[0] * len(prompts), logit_terms={}, proposals=props,
        num_speculative=len(props[0]))


def steps_done(engine) -> int:
    """Steps the engine has run so far."""
    return engine.stats()["steps"]


def host_time(stats: dict) -> float:
    """The engine's host seconds (its own work, not waiting for the device) over all its steps so far,
    from an ``LLMEngine.stats()``."""
    return stats["host_time_per_step"] * max(1, stats["steps"])
