"""benchmarks/benchmark.py --compare: each format runs in its own process with the flags it names, and
the ratios printed are of those runs' own figures; the benchmarks' engine options are the server's flags
(``jaxinfer.cli.options``), so bench_serving.py's server runs the engine its offline peer builds."""

import json
import os
import subprocess
import sys

from helpers import benchmark_module

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def bench(*args, timeout=300):
    return subprocess.run([sys.executable, "benchmarks/benchmark.py", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def test_compare_runs_each_format_and_sets_its_figure_against_the_first(tmp_path):
    out = tmp_path / "cmp.json"
    proc = bench("--model=tiny-gqa8", "--load-format=dummy", "--workload=decode", "--compare=none,int8:int8",
                 f"--out={out}", "--compilation-cache-dir=")
    assert proc.returncode == 0, proc.stderr[-2000:]
    runs = json.loads(out.read_text())["compare"]
    assert [(r["format"], r["quantization"], r["kv_cache_dtype"]) for r in runs] == \
        [("none:auto", "none", "auto"), ("int8:int8", "int8", "int8")]
    base, q = (r["decode"]["output_tok_s"] for r in runs)
    assert base > 0 and q > 0
    assert runs[0]["vs_first"] == {"decode": 1.0}
    assert runs[1]["vs_first"]["decode"] == q / base
    assert runs[0]["decode"]["weight_bytes"] > runs[1]["decode"]["weight_bytes"]  # int8 really loaded
    assert "int8:int8" in proc.stdout and f"{q / base:.3f}x" in proc.stdout


def test_compare_rejects_bad_formats_and_workloads_before_running():
    proc = bench("--compare=none,int3", timeout=60)
    assert proc.returncode != 0
    assert "'int3' is not QUANT or QUANT:KV" in proc.stderr and "int4-g64" in proc.stderr and "fp8" in proc.stderr
    proc = bench("--compare=none,int8:bf16", timeout=60)
    assert proc.returncode != 0 and "KV one of auto, int8, fp8" in proc.stderr
    proc = bench("--compare=int8", timeout=60)
    assert proc.returncode != 0 and "two formats or more" in proc.stderr
    proc = bench("--compare=none,int8", "--workload=prefix", timeout=60)
    assert proc.returncode != 0 and "not prefix" in proc.stderr
    proc = bench("--workload=latency,fast", timeout=60)
    assert proc.returncode != 0 and "unknown workload(s) fast" in proc.stderr


def test_host_share_is_the_hosts_time_over_the_wall():
    """The compare table's host share, from a run's own figures: 0.75 of the wall for a run whose host
    set the pace, 0.27 for one whose host did not; blank where a workload has no host time."""
    benchmark = benchmark_module("benchmark")

    slow = dict(host_ms_per_step=17.86, steps=1093, wall_s=25.93)
    fast = dict(host_ms_per_step=4.741, steps=1093, wall_s=19.31)
    assert abs(benchmark.host_share(slow) - 0.753) < 1e-3 and abs(benchmark.host_share(fast) - 0.268) < 1e-3
    assert benchmark.host_share(dict(output_tok_s=1.0)) is None


def test_bench_serving_launches_the_server_with_the_engine_its_offline_peer_builds():
    """Every engine option, in either spelling, reaches ``jaxinfer serve`` as the same EngineConfig that
    ``--offline`` builds; ``--seed`` stays the load's own (prompts and arrival times)."""
    from jaxinfer.batching.config import EngineConfig
    from jaxinfer.cli import options, serve

    bench_serving = benchmark_module("bench_serving")
    p = bench_serving.parser()
    args = p.parse(["--model=tiny-llama3", "--load-format=dummy", "--max-num-seqs=4", "--max_num_batched_tokens=64",
                    "--token-buckets=8,64", "--no-enable-prefix-caching", "--tensor-parallel-size=1", "--seed=7",
                    "--num-prompts=3", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'])
    config = options.engine_config(p, args)
    assert options.model_of(p, args) == "tiny-llama3" and args.load_seed == 7 and args.num_prompts == 3
    assert (config.max_num_seqs, config.max_num_batched_tokens, config.token_buckets) == (4, 64, (8, 64))
    assert not config.enable_prefix_caching and config.seed == EngineConfig().seed
    assert (config.speculative_method, config.num_speculative_tokens) == ("ngram", 2)
    assert config.max_model_len == serve.ENGINE_DEFAULTS["max_model_len"]  # the server's defaults, not LLM()'s
    server = serve.parser()
    assert options.engine_config(server, server.parse(["--model=tiny-llama3", *options.command_line(config)])) == config
