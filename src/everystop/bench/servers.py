"""Waiting for a server a benchmark started: its /health answers 200, or it failed."""

from __future__ import annotations

import subprocess
import time

import httpx


def wait_healthy(proc: subprocess.Popen, url: str, failure: str, timeout_s: float = 300.0,
                 poll_s: float = 0.2) -> None:
    """Return once `url`/health answers 200; SystemExit(`failure`) if `proc` exits first or
    `timeout_s` passes (the benchmark has nothing to measure then)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(failure)
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(poll_s)
