"""``jaxinfer bench latency|throughput|serve`` on tiny models: each runs what it says (iterations,
requests, exact prompt and output lengths) and its figures are those of its own measurements."""

import json
import subprocess
import sys

import numpy as np
import pytest

from jaxinfer.cli import bench
from test_server import Server

# One engine for latency and throughput, so the steps one compiles the other finds.
TINY = ["--model=tiny-llama3", "--load-format=dummy", "--dtype=float32", "--max-num-seqs=4",
        "--max-num-batched-tokens=32", "--max-model-len=64", "--token-buckets=4,32", "--seq-buckets=4",
        "--page-buckets=4", "--num-pages=32"]


def test_help_lists_the_benchmarks_without_starting_jax():
    code = ("import sys; from jaxinfer.cli import main\n"
            "for args in (['bench', '--help'], ['bench', 'serve', '--help'], ['bench', 'latency', '--help']):\n"
            "    try:\n        main(['jaxinfer', *args])\n    except SystemExit:\n        pass\n"
            "assert 'jax' not in sys.modules, 'jax imported'")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    listing = out.stdout[out.stdout.index("benchmarks:"):]
    assert all(f"  {name}" in listing for name in ("latency", "throughput", "serve"))
    assert "--metric-percentiles" in out.stdout and "--num-iters-warmup" in out.stdout
    assert "--max-num-seqs" in out.stdout  # latency takes the engine options


@pytest.mark.parametrize("argv,words", [
    (["serve", "--percentile-metrics=ttft,xyz"], "unknown xyz"),
    (["serve", "--metric-percentiles=50,101"], "in [0, 100]"),
    (["latency", "--num-iters=0"], "--num-iters must be at least 1"),
    (["nothing"], "no benchmark 'nothing'"),
])
def test_bad_flags_exit_with_one_line(argv, words, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(argv)
    assert e.value.code == 2 and words in capsys.readouterr().err


def test_latency_times_num_iters_runs_and_reports_their_percentiles(tmp_path, capsys):
    out = tmp_path / "latency.json"
    bench.main(["latency", *TINY, "--input-len=8", "--output-len=4", "--batch-size=4", "--num-iters-warmup=1",
                "--num-iters=5", f"--output-json={out}", "--disable-tqdm"])
    r = json.loads(out.read_text())
    assert len(r["latencies"]) == 5 and all(x > 0 for x in r["latencies"])
    assert r["avg_latency"] == pytest.approx(np.mean(r["latencies"]))
    assert r["percentiles"]["50"] == pytest.approx(np.median(r["latencies"]))
    ordered = [r["percentiles"][q] for q in ("10", "25", "50", "75", "90", "99")]
    assert ordered == sorted(ordered) and min(r["latencies"]) <= ordered[0] and ordered[-1] <= max(r["latencies"])
    assert "Latency Benchmark Result" in capsys.readouterr().out


def test_throughput_generates_every_token_asked_and_divides_by_its_elapsed_time(tmp_path, capsys):
    out = tmp_path / "throughput.json"
    bench.main(["throughput", *TINY, "--input-len=8", "--output-len=5", "--num-prompts=6", "--n=2", "--ignore-eos",
                f"--output-json={out}", "--disable-tqdm"])
    r = json.loads(out.read_text())
    assert (r["num_requests"], r["total_prompt_tokens"], r["total_output_tokens"]) == (6, 6 * 8, 6 * 5 * 2)
    assert r["total_num_tokens"] == 6 * 8 + 6 * 5 * 2
    assert r["tokens_per_second"] == pytest.approx(r["total_num_tokens"] / r["elapsed_time"])
    assert r["output_tokens_per_second"] == pytest.approx(60 / r["elapsed_time"])
    assert r["requests_per_second"] == pytest.approx(6 / r["elapsed_time"])
    printed = capsys.readouterr().out
    assert "Throughput Benchmark Result" in printed and f"{r['tokens_per_second']:.2f}" in printed


def test_serving_figures_of_known_requests():
    """TPOT is per request, (latency - TTFT) / (tokens - 1); ITL pools every gap; failures count apart."""
    from jaxinfer.bench.client import Result
    from jaxinfer.bench.metrics import serving_summary

    results = [Result(ok=True, latency=1.0, ttft=0.2, itl=[0.1] * 8, output_tokens=9, prompt_tokens=5),
               Result(ok=True, latency=2.0, ttft=0.4, itl=[0.2] * 8, output_tokens=9, prompt_tokens=5),
               Result(ok=False, error="HTTP 503: busy")]
    s = serving_summary(results, 4.0, percentiles=(50, 99))
    assert (s["completed"], s["failed"], s["errors"]) == (2, 1, ["HTTP 503: busy"])
    assert (s["total_input_tokens"], s["total_output_tokens"]) == (10, 18)
    assert (s["request_throughput"], s["output_throughput"], s["total_token_throughput"]) == (0.5, 4.5, 7.0)
    assert s["mean_ttft_ms"] == pytest.approx(300) and s["p99_e2el_ms"] == pytest.approx(1990)
    assert s["mean_tpot_ms"] == pytest.approx(150) and s["p50_tpot_ms"] == pytest.approx(150)
    assert s["median_itl_ms"] == pytest.approx(150) and s["std_itl_ms"] == pytest.approx(50)


@pytest.fixture(scope="module")
def server():
    """tiny-llama3 starts in seconds; it has no tokenizer, so its streams carry no text, only the token
    counts of their usage chunk (no TTFT or ITL: the test above checks those figures)."""
    srv = Server(["--model=tiny-llama3", "--load_format=dummy", "--max_num_seqs=4", "--max_num_batched_tokens=32",
                  "--max_model_len=64", "--token_buckets=4,32", "--seq_buckets=4", "--page_buckets=4",
                  "--num_pages=32"])
    yield srv
    srv.stop()


def test_serve_completes_every_request_with_the_lengths_asked(server, tmp_path, capsys):
    bench.main(["serve", f"--base-url={server.url}", "--dataset-name=random", "--random-input-len=8",
                "--random-output-len=6", "--num-prompts=6", "--max-concurrency=3", "--request-rate=50",
                "--metric-percentiles=50,99", "--save-result", f"--result-dir={tmp_path}",
                "--result-filename=serve.json", "--disable-tqdm"])
    r = json.loads((tmp_path / "serve.json").read_text())
    assert (r["completed"], r["failed"], r["errors"]) == (6, 0, [])
    # Exact lengths, the ids below the served vocabulary (512, from /openapi.json; else every request is a 400).
    assert (r["total_input_tokens"], r["total_output_tokens"]) == (6 * 8, 6 * 6)
    assert r["model_id"] == "tiny-llama3" and r["max_concurrency"] == 3
    assert r["request_throughput"] == pytest.approx(6 / r["duration"])
    assert r["output_throughput"] == pytest.approx(36 / r["duration"])
    assert 0 < r["median_e2el_ms"] <= r["p99_e2el_ms"] and r["median_e2el_ms"] == pytest.approx(r["p50_e2el_ms"])
    printed = capsys.readouterr().out
    assert "Serving Benchmark Result" in printed and "Median E2EL (ms):" in printed
