"""Workloads for the simulator: the shared workload JSON, or a synthetic spec string.

Only token counts matter here: each request's `prompt_len`, `max_tokens`, `arrival_s`,
`priority`, `tenant` and `prefix_group`. The prompt text is ignored.

Synthetic spec (comma-separated key=value)::

    n=512,prompt=uniform:128:1024,output=uniform:20:800,rate=8,seed=0
    n=256,prompt=lognormal:400:0.8:1024,output=const:128,rate=inf,priority=0.2:0.6:0.2,
        prefix=0.5:256

    n         number of requests (default 256)
    prompt    prompt length distribution (default uniform:128:1024)
    output    output length distribution (default uniform:20:800)
    rate      Poisson arrivals per second; 'inf' (default) = all arrive at t=0
    priority  fractions of tiers 0:1:2 (default 0:1:0, all standard)
    prefix    FRACTION:TOKENS - that fraction of requests shares one TOKENS-long system prompt
    tenants   number of tenants, assigned round-robin (default 1)
    seed      RNG seed (default 0)

Distributions: const:V, uniform:LO:HI (integers, inclusive), lognormal:MEDIAN:SIGMA[:MAX].
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class SimRequest:
    request_id: str
    prompt_len: int
    max_tokens: int
    arrival_s: float
    priority: int = 1
    tenant: str = "default"
    prefix_group: str | None = None
    prefix_len: int = 0  # leading tokens shared with the rest of its prefix_group


@dataclass(frozen=True)
class Workload:
    name: str
    requests: list[SimRequest]

    def with_rate(self, rate: float | None, seed: int = 0) -> Workload:
        """Same requests, Poisson arrivals at `rate` per second (None/inf: all at t=0)."""
        times = poisson_arrivals(len(self.requests), rate, random.Random(seed))
        reqs = [SimRequest(r.request_id, r.prompt_len, r.max_tokens, t, r.priority, r.tenant,
                           r.prefix_group, r.prefix_len) for r, t in zip(self.requests, times)]
        return Workload(f"{self.name}@{rate}/s", reqs)


def poisson_arrivals(n: int, rate: float | None, rng: random.Random) -> list[float]:
    if rate is None or math.isinf(rate) or rate <= 0:
        return [0.0] * n
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def sample_dist(spec: str, rng: random.Random) -> int:
    kind, *args = spec.split(":")
    if kind == "const":
        return int(args[0])
    if kind == "uniform":
        return rng.randint(int(args[0]), int(args[1]))
    if kind == "lognormal":
        value = rng.lognormvariate(math.log(float(args[0])), float(args[1]))
        cap = int(args[2]) if len(args) > 2 else 1 << 30
        return max(1, min(cap, round(value)))
    raise ValueError(f"unknown distribution {spec!r} (const, uniform, lognormal)")


def synthetic(spec: str) -> Workload:
    """Build a workload from a spec string (see the module docstring)."""
    opts = dict(item.split("=", 1) for item in spec.split(",") if item.strip())
    known = {"n", "prompt", "output", "rate", "priority", "prefix", "tenants", "seed"}
    if set(opts) - known:
        raise ValueError(f"unknown synthetic spec keys: {sorted(set(opts) - known)}")
    rng = random.Random(int(opts.get("seed", 0)))
    n = int(opts.get("n", 256))
    tiers = [float(x) for x in opts.get("priority", "0:1:0").split(":")]
    prefix_frac, prefix_len = (float(x) for x in opts.get("prefix", "0:0").split(":"))
    tenants = int(opts.get("tenants", 1))
    rate = float(opts.get("rate", "inf"))
    times = poisson_arrivals(n, rate, rng)
    reqs = []
    for i in range(n):
        shared = rng.random() < prefix_frac
        prompt = sample_dist(opts.get("prompt", "uniform:128:1024"), rng)
        reqs.append(SimRequest(
            f"r{i}", prompt + (int(prefix_len) if shared else 0),
            sample_dist(opts.get("output", "uniform:20:800"), rng), times[i],
            rng.choices([0, 1, 2], weights=tiers)[0], f"t{i % tenants}",
            "system" if shared else None, int(prefix_len) if shared else 0))
    return Workload(spec, reqs)


def load_workload(path: str | Path, default_prefix_len: int = 256) -> Workload:
    """Read the shared workload JSON (everystop.bench.workload writes it)."""
    data = json.loads(Path(path).read_text())
    spec = data.get("spec", {}) or {}
    prefix_len = int(spec.get("prefix_len", spec.get("shared_prefix_tokens", default_prefix_len)))
    reqs = []
    for r in data["requests"]:
        group = r.get("prefix_group")
        reqs.append(SimRequest(
            str(r["id"]), int(r["prompt_len"]), int(r["max_tokens"]),
            float(r["arrival_s"] or 0.0), int(r.get("priority", 1)),
            str(r.get("tenant", "default")), group,
            min(prefix_len, int(r["prompt_len"]) - 1) if group else 0))
    return Workload(str(data.get("name", Path(path).stem)), reqs)


def resolve_workload(arg: str) -> Workload:
    """A path to workload JSON, or a synthetic spec string."""
    if Path(arg).is_file():
        return load_workload(arg)
    return synthetic(arg)


def prompt_token_ids(req: SimRequest, index: int) -> list[int]:
    """Synthetic token ids: the prefix group's shared leading tokens, then tokens unique to this
    request (its first unique token encodes `index`, so no two requests' blocks collide)."""
    shared = []
    if req.prefix_group and req.prefix_len:
        seed = sum(ord(c) * 31 ** k for k, c in enumerate(req.prefix_group)) % 100_000
        shared = [10 + (seed + j) % 50_000 for j in range(req.prefix_len)]
    unique = [1_000_000 + index] + [10 + (index * 7919 + j) % 50_000
                                    for j in range(req.prompt_len - len(shared) - 1)]
    return (shared + unique)[:req.prompt_len]
