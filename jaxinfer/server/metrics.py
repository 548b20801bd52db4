"""Prometheus metrics: latency histograms observed per finished request, engine state read at scrape time.

Engine state comes from the last ``stats()`` snapshot the engine thread published, so a scrape never
touches the engine while it steps. Each app has its own registry (several servers can share a process).
"""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
_TOKEN_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)


class Metrics:
    def __init__(self, snapshot: Callable[[], dict | None]):
        self.registry = CollectorRegistry()
        self.ttft = Histogram("jaxinfer_time_to_first_token_seconds", "Time from arrival to the first generated token.",
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.tpot = Histogram("jaxinfer_time_per_output_token_seconds",
                              "Mean time per output token after the first, per request.",
                              buckets=_TOKEN_BUCKETS, registry=self.registry)
        self.e2e = Histogram("jaxinfer_e2e_request_latency_seconds", "Time from arrival to the last token.",
                             buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.registry.register(_EngineCollector(snapshot))

    def observe(self, arrival: float, first_token: float | None, finished: float, num_tokens: int) -> None:
        """Record one finished request (monotonic timestamps)."""
        self.e2e.observe(finished - arrival)
        if first_token is not None:
            self.ttft.observe(first_token - arrival)
            if num_tokens > 1:
                self.tpot.observe((finished - first_token) / (num_tokens - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    def __init__(self, snapshot: Callable[[], dict | None]):
        self._snapshot = snapshot

    def collect(self):
        s = self._snapshot()
        if s is None:  # still loading
            return
        for key, help_ in (("running", "Requests being computed."), ("waiting", "Requests queued for admission."),
                           ("preempted", "Requests preempted, waiting to resume.")):
            yield GaugeMetricFamily(f"jaxinfer_num_requests_{key}", help_, value=s[key])
        yield GaugeMetricFamily("jaxinfer_kv_cache_pages_used", "KV pages held by requests.", value=s["kv_pages_used"])
        yield GaugeMetricFamily("jaxinfer_kv_cache_pages_total", "KV pages in the pool.", value=s["kv_pages_total"])
        yield GaugeMetricFamily("jaxinfer_kv_cache_usage_ratio", "Fraction of KV pages held by requests.",
                                value=s["kv_pages_used"] / max(1, s["kv_pages_total"]))
        yield GaugeMetricFamily("jaxinfer_kv_cache_page_utilization_ratio",
                                "Fraction of token slots in held pages that hold a token.", value=s["kv_utilization"])
        yield GaugeMetricFamily("jaxinfer_prefix_cache_hit_rate", "Prefix-cache page hits / lookups since start.",
                                value=s["prefix_cache_hits"] / max(1, s["prefix_cache_queries"]))
        yield GaugeMetricFamily("jaxinfer_spec_acceptance_rate", "Accepted / proposed speculative tokens since start.",
                                value=s["spec_acceptance_rate"])
        yield GaugeMetricFamily("jaxinfer_spec_mean_accepted_length",
                                "Tokens a sequence gained per verification of its proposals, since start.",
                                value=s["spec_mean_accepted_length"])
        for name, key, help_ in (
                ("prefix_cache_queries", "prefix_cache_queries", "Pages looked up in the prefix cache."),
                ("prefix_cache_hits", "prefix_cache_hits", "Pages found in the prefix cache."),
                ("preemptions", "preemptions", "Sequences preempted for lack of KV pages."),
                ("prompt_tokens", "prompt_tokens", "Prompt tokens admitted."),
                ("generation_tokens", "generation_tokens", "Tokens generated."),
                ("compilations", "compilations", "Step shapes compiled."),
                ("spec_proposed_tokens", "spec_proposed_tokens", "Tokens proposed by speculative decoding."),
                ("spec_accepted_tokens", "spec_accepted_tokens", "Proposed tokens the target accepted.")):
            yield CounterMetricFamily(f"jaxinfer_{name}", help_, value=s[key])
