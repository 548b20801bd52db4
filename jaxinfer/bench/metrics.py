"""The figures of a benchmark run, named as vLLM's ``vllm bench`` names them in its JSON: a
distribution is ``mean_/median_/std_/p<q>_<name>_ms``; a serving run adds completed and failed
requests, token totals and throughputs. ``table`` prints them as vLLM's result table."""

from __future__ import annotations

from typing import Sequence

import numpy as np

# Per-request metrics of a serving run: (short name, section title).
SERVING_METRICS = {"ttft": ("TTFT", "Time to First Token"),
                   "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
                   "itl": ("ITL", "Inter-token Latency"),
                   "e2el": ("E2EL", "End-to-end Latency")}
WIDTH = 50


def percentile_name(q: float) -> str:
    """``99`` for 99.0, ``99.9`` for 99.9 (vLLM's key spelling)."""
    return str(int(q)) if int(q) == q else str(q)


def distributions(samples: dict[str, Sequence[float]], percentiles: Sequence[float]) -> dict:
    """Each metric's samples (seconds) as milliseconds: mean, median, std and ``percentiles``; a
    metric without samples is left out."""
    out = {}
    for name, xs in samples.items():
        if len(xs):
            ms = np.asarray(xs, dtype=float) * 1e3
            out.update({f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": float(np.median(ms)),
                        f"std_{name}_ms": float(ms.std())})
            out.update({f"p{percentile_name(q)}_{name}_ms": float(np.percentile(ms, q)) for q in percentiles})
    return out


def serving_summary(results: Sequence, duration: float, metrics: Sequence[str] = tuple(SERVING_METRICS),
                    percentiles: Sequence[float] = (99,)) -> dict:
    """The figures of streamed requests (``client.Result``) that took ``duration`` seconds in all.
    TPOT is per request, (latency - TTFT) / (output tokens - 1); ITL the gaps between streamed chunks;
    E2EL a request's latency. ``errors``: up to five distinct reasons requests failed."""
    ok = [r for r in results if r.ok]
    prompt_tokens, output_tokens = sum(r.prompt_tokens for r in ok), sum(r.output_tokens for r in ok)
    summary = dict(duration=duration, completed=len(ok), failed=len(results) - len(ok),
                   total_input_tokens=prompt_tokens, total_output_tokens=output_tokens,
                   request_throughput=len(ok) / duration, output_throughput=output_tokens / duration,
                   total_token_throughput=(prompt_tokens + output_tokens) / duration,
                   errors=sorted({r.error for r in results if not r.ok})[:5])
    samples = {"ttft": [r.ttft for r in ok if r.ttft is not None],
               "tpot": [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok
                        if r.ttft is not None and r.output_tokens > 1],
               "itl": [x for r in ok for x in r.itl],
               "e2el": [r.latency for r in ok]}
    summary.update(distributions({k: v for k, v in samples.items() if k in metrics}, percentiles))
    return summary


def serving_rows(summary: dict, metrics: Sequence[str], percentiles: Sequence[float],
                 max_concurrency: int | None = None, request_rate: float = float("inf")) -> list[tuple]:
    """``summary``'s rows for ``table``, in vLLM's order."""
    rows = [("Successful requests:", summary["completed"]), ("Failed requests:", summary["failed"])]
    if max_concurrency is not None:
        rows.append(("Maximum request concurrency:", max_concurrency))
    if request_rate != float("inf"):
        rows.append(("Request rate configured (RPS):", float(request_rate)))
    rows += [("Benchmark duration (s):", summary["duration"]),
             ("Total input tokens:", summary["total_input_tokens"]),
             ("Total generated tokens:", summary["total_output_tokens"]),
             ("Request throughput (req/s):", summary["request_throughput"]),
             ("Output token throughput (tok/s):", summary["output_throughput"]),
             ("Total token throughput (tok/s):", summary["total_token_throughput"])]
    for name in metrics:
        if f"mean_{name}_ms" not in summary:
            continue
        short, title = SERVING_METRICS[name]
        rows += [(title, None), (f"Mean {short} (ms):", summary[f"mean_{name}_ms"]),
                 (f"Median {short} (ms):", summary[f"median_{name}_ms"])]
        rows += [(f"P{percentile_name(q)} {short} (ms):", summary[f"p{percentile_name(q)}_{name}_ms"])
                 for q in percentiles]
    return rows


def table(title: str, rows: Sequence[tuple]) -> str:
    """vLLM's result table: ``title`` in a rule of '=', a ``label value`` line per row (floats to two
    places), a row whose value is None a section title in a rule of '-'."""
    lines = [f" {title} ".center(WIDTH, "=")]
    for label, value in rows:
        if value is None:
            lines.append(label.center(WIDTH, "-"))
        else:
            lines.append(f"{label:<40} {value:<10.2f}" if isinstance(value, float) else f"{label:<40} {value:<10}")
    lines.append("=" * WIDTH)
    return "\n".join(lines)
