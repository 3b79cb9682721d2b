"""Where a process's start-up memory and time go: resident memory and seconds since the
process began, read at named stages of start-up (interpreter, imports, weights, KV pool,
tokenizer, warm-up, app), so that `everystop bench startup` can attribute a server's RSS to
the stages that grew it.

A checkpoint reads /proc/self/status (VmRSS, RssAnon, RssFile) and costs microseconds; the
server logs all of them as one JSON line at DEBUG once it is ready (`log_stages`). Linux
only: elsewhere a checkpoint records zeros.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Any

logger = logging.getLogger(__name__)

# The prefix of the log line `everystop bench startup` reads the stages from.
LOG_PREFIX = "start-up stages: "

_FIELDS = {"VmRSS": "rss_bytes", "RssAnon": "anon_bytes", "RssFile": "file_bytes",
           "VmHWM": "peak_rss_bytes"}
_STAGES: list[dict[str, Any]] = []
_LOCK = threading.Lock()  # the engine is built on its own thread


def read_status(pid: int | str = "self") -> dict[str, int]:
    """A process's resident memory now (rss, anon, file) and at its peak, in bytes."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in _FIELDS:
                    out[_FIELDS[key]] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return out


def process_age_s() -> float:
    """Seconds since this process started (its /proc start time), or since this module was
    imported where /proc cannot tell."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: starttime
        with open("/proc/uptime") as f:
            return float(f.read().split()[0]) - started
    except (OSError, ValueError, IndexError):
        return time.monotonic() - _IMPORTED


_IMPORTED = time.monotonic()


def checkpoint(stage: str) -> None:
    """Record this process's memory and age now, as the end of `stage`."""
    row = {"stage": stage, "t_s": round(process_age_s(), 3), **read_status()}
    with _LOCK:
        _STAGES.append(row)


def stages() -> list[dict[str, Any]]:
    """The checkpoints so far, in order."""
    with _LOCK:
        return list(_STAGES)


def log_stages() -> None:
    """One DEBUG line with every checkpoint so far (LOG_PREFIX, then a JSON list)."""
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug("%s%s", LOG_PREFIX, json.dumps(stages()))


def parse_stages(log_text: str) -> list[dict[str, Any]]:
    """The stages a server logged (the last such line in `log_text`); [] when there is none."""
    found: list[dict[str, Any]] = []
    for line in log_text.splitlines():
        at = line.find(LOG_PREFIX)
        if at >= 0:
            found = json.loads(line[at + len(LOG_PREFIX):])
    return found
