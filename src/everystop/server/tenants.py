"""Tenant ids as clients send them (X-Tenant-Id, `user`) made safe to key queues, label
metrics and print in logs: short, printable, and still distinct.

A client controls these bytes, and each distinct id becomes a Prometheus label value and a
scheduler queue key: one 60,000-character id once grew /metrics from 9 KB to 9 MB.
"""

from __future__ import annotations

import hashlib
import re

MAX_TENANT_CHARS = 64
_UNSAFE = re.compile(r"[^A-Za-z0-9_.:@/+=~-]")


def clean_tenant(raw: str) -> str:
    """At most MAX_TENANT_CHARS characters from [A-Za-z0-9_.:@/+=~-]. An id that had to be
    changed keeps a hash of the original at its end, so two long or odd ids that share a
    prefix stay two tenants."""
    safe = _UNSAFE.sub("_", raw)
    if safe == raw and 0 < len(raw) <= MAX_TENANT_CHARS:
        return raw
    digest = hashlib.sha256(raw.encode("utf-8", "surrogatepass")).hexdigest()[:12]
    return f"{safe[:MAX_TENANT_CHARS - 13]}~{digest}"
