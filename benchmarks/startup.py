"""Start-up as a person meets it: ``jaxinfer serve`` from a cold cache to ``/health``, the longest
silence in its log on the way, the first chat request after ``/health``, and whether a first
``json_object`` request (its grammar compiled, its constrained steps compiled) holds up a plain
request sent beside it.

    .venv/bin/python benchmarks/startup.py --out results/startup.json
    .venv/bin/python benchmarks/startup.py --warm          # the same with the caches a first run left

Cold means a fresh ``$XDG_CACHE_HOME`` (no XLA compilation cache, no converted tokenizer) holding only
the native CPU kernels, as ``make serve`` leaves a machine (it runs ``jaxinfer build-kernels`` after
installing); ``--build-kernels-cold`` leaves them out too, so the server builds them. The server runs with its defaults (the embedded model); extra arguments after ``--`` go
to ``jaxinfer serve``. Targets (the 2-core CPU): ``/health`` within 20 s with no silent stretch over
3 s, the first chat request within 2 s, a concurrent plain request delayed by at most 1 s.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

import httpx

from server_launch import SERVE, free_port, wait_healthy

CHAT = [{"role": "user", "content": "Name three colors."}]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="where the JSON goes")
    p.add_argument("--warm", action="store_true", help="keep the caches of a first (cold) run and time a second")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for /health")
    p.add_argument("--build-kernels-cold", action="store_true", help="the cold run builds the CPU kernels too")
    p.add_argument("serve_args", nargs="*", help="more `jaxinfer serve` arguments (after --)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as cache:
        if not args.build_kernels_cold:
            subprocess.run([*SERVE[:-1], "build-kernels"], env={**os.environ, "XDG_CACHE_HOME": cache}, check=True,
                           capture_output=True)
        runs = [measure(cache, args.serve_args, args.timeout, "cold")]
        if args.warm:
            runs.append(measure(cache, args.serve_args, args.timeout, "warm"))
    print(f"{'run':<5} {'/health s':>10} {'longest silence s':>18}  {'first chat s':>12} {'plain alone s':>13} "
          f"{'plain beside json s':>19} {'json_object s':>13}")
    for r in runs:
        print(f"{r['run']:<5} {r['health_s']:>10.1f} {r['longest_silence_s']:>18.1f}  {r['first_chat_s']:>12.2f} "
              f"{r['plain_alone_s']:>13.2f} {r['plain_beside_json_s']:>19.2f} {r['json_object_s']:>13.2f}")
        print(f"      longest silence after: {r['silence_after']!r}")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(dict(runs=runs, date=time.strftime("%Y-%m-%d"), command=" ".join(sys.argv)), f, indent=1)
    return 0


def measure(cache: str, serve_args: list[str], timeout: float, run: str) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "XDG_CACHE_HOME": cache, "PYTHONUNBUFFERED": "1"}
    t0 = time.monotonic()
    proc = subprocess.Popen([*SERVE, f"--port={port}", *serve_args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[tuple[float, str]] = [(0.0, "(started)")]
    reader = threading.Thread(target=lambda: [lines.append((time.monotonic() - t0, line.rstrip()))
                                              for line in proc.stdout], daemon=True)
    reader.start()
    try:
        wait_healthy(proc, url, timeout, lambda: "\n".join(line for _, line in lines[-30:]))
        health = time.monotonic() - t0
        startup = [entry for entry in lines if entry[0] <= health] + [(health, "(healthy)")]
        startup = [entry for entry in startup if "GET /health" not in entry[1]]  # its own polling
        gaps = [(b[0] - a[0], a[1]) for a, b in zip(startup, startup[1:])]
        silence, after = max(gaps)
        with httpx.Client(base_url=url, timeout=300) as client:
            first = _chat(client, {})
            alone = _chat(client, {})
            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                constrained = pool.submit(_chat, client, {"response_format": {"type": "json_object"}})
                time.sleep(0.05)  # the constrained request first, so its compile is what a plain one meets
                beside = pool.submit(_chat, client, {})
                beside_s, json_s = beside.result(), constrained.result()
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    return dict(run=run, health_s=health, longest_silence_s=silence, silence_after=after[-200:], first_chat_s=first,
                plain_alone_s=alone, plain_beside_json_s=beside_s, json_object_s=json_s,
                delay_beside_json_s=beside_s - alone, log=[f"{t:7.2f} {line}" for t, line in lines[:400]])


def _chat(client: httpx.Client, extra: dict) -> float:
    t = time.monotonic()
    r = client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 16, "temperature": 0, **extra})
    r.raise_for_status()
    return time.monotonic() - t


if __name__ == "__main__":
    sys.exit(main())
