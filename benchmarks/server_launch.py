"""Starting ``jaxinfer serve`` from a benchmark and waiting for it to answer ``/health`` (benchmark.py's
start-up timer and bench_serving.py's ``--launch`` both do). Defines no flags, so any script may
import it."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from typing import Callable

import httpx

# The server's command, its flags to follow: the entry point ``make serve`` runs, in this interpreter.
SERVE = (sys.executable, "-m", "jaxinfer", "serve")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc: subprocess.Popen, url: str, timeout: float, log_tail: Callable[[], str]) -> float:
    """Seconds from now until ``url``/health answers 200 (polled every 50 ms, so the figure is a
    start-up time); RuntimeError with the server's log tail if the process exits or ``timeout`` passes."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"jaxinfer serve exited with {proc.returncode}:\n{log_tail()}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"jaxinfer serve was not healthy after {timeout:.0f}s:\n{log_tail()}")
