"""Schemathesis's own command against a live server, with its default budget and every check:

    python tests/fuzz_openapi.py [--seed N] [--out fuzz.json] [-- more schemathesis options]

builds the tiny chat model (random weights, SmolLM2's tokenizer and template: a step costs
milliseconds, so chat, constraints and text prompts all run), serves it with ``FUZZ_ARGS``, and runs
``schemathesis run URL/openapi.json --checks all`` with tests/openapi_hooks.py (what the description
cannot say) and a response-time limit of ``MAX_RESPONSE_SECONDS``. Positive and negative data, the coverage and fuzzing phases (stateful links: the API has
no resource to link). Exits with Schemathesis's status; ``--out`` gets its counts as JSON.
``tests/test_server_fuzz.py`` runs the same checks with a small budget in the suite.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from test_server import ROOT, Server  # noqa: E402

MAX_MODEL_LEN, MAX_NUM_SEQS, MAX_WAITING = 256, 16, 64  # tests/openapi_hooks.py keeps valid requests within them
FUZZ_ARGS = ["--load_format=dummy", f"--max_num_seqs={MAX_NUM_SEQS}", "--max_num_batched_tokens=64",
             f"--max_model_len={MAX_MODEL_LEN}", "--token_buckets=16,64", "--seq_buckets=16", "--page_buckets=16",
             f"--max_waiting={MAX_WAITING}", "--chat_template=jaxinfer/server/templates/smollm2_tools.jinja"]

# The most work one valid request can ask of this server: n = 64 sequences (4 waves of 16 slots) of 255
# tokens each, with penalties (one token a step); ~10 s on a 2-core CPU, past Schemathesis's default 10 s.
MAX_RESPONSE_SECONDS = 60


def make_tiny_chat_model(path: str) -> str:
    """A tiny random Llama (2 layers, hidden 64) with SmolLM2's tokenizer and chat template, in ``path``."""
    subprocess.run([sys.executable, "benchmarks/make_dummy_model.py", "--shapes=llama3-8b", "--num_layers=2",
                    "--hidden_size=64", "--num_heads=4", "--intermediate_size=128", f"--out={path}"],
                   cwd=ROOT, check=True, capture_output=True)
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=None, help="Schemathesis's seed (default: a random one)")
    parser.add_argument("--out", default=None, help="where the JSON summary goes")
    parser.add_argument("extra", nargs="*", help="more `schemathesis run` options (after --)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        server = Server([f"--model={make_tiny_chat_model(tmp)}", *FUZZ_ARGS])
        try:
            command = [os.path.join(os.path.dirname(sys.executable), "schemathesis"), "run",
                       f"{server.url}/openapi.json", "--checks", "all", "--request-timeout", "60",
                       "--max-response-time", str(MAX_RESPONSE_SECONDS),
                       *(["--seed", str(args.seed)] if args.seed is not None else []), *args.extra]
            env = {**os.environ, "SCHEMATHESIS_HOOKS": "openapi_hooks",
                   "PYTHONPATH": os.pathsep.join(filter(None, [os.path.dirname(os.path.abspath(__file__)),
                                                               os.environ.get("PYTHONPATH")]))}
            t0 = time.monotonic()
            done = subprocess.run(command, env=env, cwd=tmp, capture_output=True, text=True)
            seconds = time.monotonic() - t0
            alive = server.proc.poll() is None
        finally:
            server.stop()
    print(done.stdout[-20000:], done.stderr[-5000:], sep="\n")
    counts = re.search(r"(\d+) generated, (\d+) found (\d+) unique failures|(\d+) generated, (\d+) passed",
                       done.stdout)
    summary = {"command": " ".join(command[1:]), "server_flags": FUZZ_ARGS, "exit_status": done.returncode,
               "seconds": round(seconds, 1), "server_alive_after": alive,
               "seed": (re.search(r"Seed: (\d+)", done.stdout) or [None, None])[1],
               "summary_line": counts.group(0) if counts else None}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)
    print(json.dumps(summary, indent=1))
    return done.returncode or (0 if alive else 1)


if __name__ == "__main__":
    sys.exit(main())
