"""A steady streaming load from two tenants over three tiers, plus one burst that draws 429s,
against a live server, for the operator tests (Prometheus queries, the /dashboard page)."""

from __future__ import annotations

import json
import threading
from collections import Counter

import httpx

TENANTS = ("acme", "zeta")
TIERS = (0, 1, 2)
BURST_TENANT = "burst"


class Load:
    """One thread per (tenant, tier) sending streamed completions back to back until `stop`;
    at start, `burst` concurrent requests from one more tenant (beyond its queue cap)."""

    def __init__(self, url: str, *, max_tokens: int = 8, burst: int = 14,
                 headers: dict[str, str] | None = None) -> None:
        self.url = url
        self.max_tokens = max_tokens
        self.headers = headers or {}
        self.done: Counter[tuple[str, int]] = Counter()
        self.rejected = 0
        self.errors: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._loop, args=(t, p), daemon=True)
                         for t in TENANTS for p in TIERS]
        self._threads += [threading.Thread(target=self._once, args=(BURST_TENANT, 2, i),
                                           daemon=True) for i in range(burst)]

    def start(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        """Stop sending; failures from here on are not errors (the server may be gone)."""
        self._stop.set()

    def join(self) -> None:
        for t in self._threads:
            t.join(timeout=60)

    def wait_for(self, per_group: int, timeout_s: float) -> None:
        """Until every (tenant, tier) finished `per_group` requests and the burst drew a 429."""
        deadline = threading.Event()
        timer = threading.Timer(timeout_s, deadline.set)
        timer.start()
        try:
            while not deadline.wait(0.2):
                with self._lock:
                    if self.errors:
                        raise AssertionError(f"load failed: {self.errors[:3]}")
                    if self.rejected and all(self.done[(t, p)] >= per_group
                                             for t in TENANTS for p in TIERS):
                        return
            raise AssertionError(f"load too slow: {dict(self.done)}, {self.rejected} 429s")
        finally:
            timer.cancel()

    def _loop(self, tenant: str, tier: int) -> None:
        with httpx.Client(timeout=120, headers=self.headers) as client:
            n = 0
            while not self._stop.is_set():
                # A shared per-tenant preamble (longer than a KV block) gives the prefix cache
                # something to hit.
                ok = self._request(client, tenant, tier, f"You are the assistant of {tenant}. "
                                   f"Answer in one short sentence, politely. Question {n}: "
                                   "what is a cat?")
                n += 1
                if not ok:  # a 429 (this tenant's queue is full): back off as a client would
                    self._stop.wait(0.25)

    def _once(self, tenant: str, tier: int, i: int) -> None:
        with httpx.Client(timeout=120, headers=self.headers) as client:
            self._request(client, tenant, tier, f"burst {i}: the weather today")

    def _request(self, client: httpx.Client, tenant: str, tier: int, prompt: str) -> bool:
        """Send one streamed completion; False when it was refused or failed."""
        body = {"prompt": prompt, "max_tokens": self.max_tokens, "stream": True,
                "user": tenant, "priority": tier, "temperature": 0}
        try:
            with client.stream("POST", self.url + "/v1/completions", json=body) as r:
                if r.status_code == 429:
                    with self._lock:
                        self.rejected += 1
                    return False
                if r.status_code != 200:
                    raise AssertionError(f"{r.status_code}: {r.read()[:200]!r}")
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        json.loads(line[6:])
        except Exception as exc:  # reported by wait_for, on the test's thread
            if not self._stop.is_set():
                with self._lock:
                    self.errors.append(f"{tenant}/{tier}: {exc!r}")
            return False
        with self._lock:
            self.done[(tenant, tier)] += 1
        return True
