"""Workloads: seeded request streams (lengths, arrivals, tiers, tenants, optional text) shared by
the bench, the simulator and the benchmark commands, read from and written to one JSON format.

One length syntax everywhere (`LengthDist.parse`)::

    fixed:N  (or const:N)        always N
    uniform:A:B                  integers in [A, B]
    log_uniform:A:B              most lengths short, a long tail up to B
    lognormal:MEDIAN:SIGMA       [:MAX] clips to [1, MAX]; [:MIN:MAX] clips to [MIN, MAX]

One arrival generator (`arrival_offsets`): all at t=0, or a gamma process at `rate` requests/s
(burstiness 1 = Poisson). Two ways to build a workload, both seeded:

- `generate_workload(WorkloadSpec, tokenizer)`: real English text (CPython's own documentation,
  `pydoc_data.topics`) cut at exact token counts when a tokenizer is given, word slices when not;
  what `everystop bench workload` writes.
- `synthetic("n=512,prompt=uniform:128:1024,...")`: token counts only (no text), the compact
  spec string the simulator takes (keys in `SYNTHETIC_KEYS`).

The JSON: {"name", "seed", "spec", "requests": [{"id", "prompt", "prompt_len", "max_tokens",
"arrival_s", "priority", "tenant", "prefix_group"} ...]}; a request may add "prefix_len" (tokens
shared with its group) and "prompt_token_ids" (so every engine under test gets the same ids).
"""

from __future__ import annotations

import json
import math
import random
import re
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Protocol

DIST_KINDS = ("fixed", "uniform", "log_uniform", "lognormal")


class TextTokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


@dataclass(frozen=True)
class LengthDist:
    """A length distribution over [min, max]; `lognormal` also has a median and a sigma."""

    dist: str = "uniform"
    min: int = 32
    max: int = 512
    median: float | None = None  # lognormal only
    sigma: float | None = None  # lognormal only

    def __post_init__(self) -> None:
        if self.dist not in DIST_KINDS:
            raise ValueError(f"unknown length distribution {self.dist!r} ({', '.join(DIST_KINDS)})")
        if self.min < 1 or (self.dist != "fixed" and self.max < self.min):
            raise ValueError(f"bad length range {self.min}..{self.max}")
        if (self.dist == "lognormal") != (self.median is not None and self.sigma is not None):
            raise ValueError("median and sigma go with (and only with) lognormal")

    def sample(self, rng: random.Random) -> int:
        if self.dist == "fixed":
            return self.min
        if self.dist == "uniform":
            return rng.randint(self.min, self.max)
        if self.dist == "lognormal":
            assert self.median is not None and self.sigma is not None
            value = rng.lognormvariate(math.log(self.median), self.sigma)
            return max(self.min, min(self.max, round(value)))
        # log-uniform: most lengths short, a long tail up to max (like real chat outputs)
        return min(self.max, int(math.exp(rng.uniform(math.log(self.min),
                                                        math.log(self.max + 1)))))

    @classmethod
    def parse(cls, text: str) -> LengthDist:
        """The module docstring's syntax, e.g. 'fixed:128', 'uniform:32:512'."""
        kind, *args = text.split(":")
        try:
            if kind in ("fixed", "const") and len(args) == 1:
                return cls("fixed", int(args[0]), int(args[0]))
            if kind in ("uniform", "log_uniform") and len(args) == 2:
                return cls(kind, int(args[0]), int(args[1]))
            if kind == "lognormal" and 2 <= len(args) <= 4:
                lo, hi = (1, 1 << 30) if len(args) == 2 else (
                    (1, int(args[2])) if len(args) == 3 else (int(args[2]), int(args[3])))
                return cls("lognormal", lo, hi, float(args[0]), float(args[1]))
        except ValueError as exc:
            raise ValueError(f"length spec {text!r}: {exc}") from exc
        raise ValueError(f"length spec {text!r}: use fixed:N, uniform:A:B, log_uniform:A:B or "
                         "lognormal:MEDIAN:SIGMA[:MAX | :MIN:MAX]")

    def to_dict(self) -> dict[str, Any]:
        """Only the fields its kind uses (a uniform spec reads as it always did)."""
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass(frozen=True)
class WorkloadSpec:
    """Everything that determines a generated workload; stored in the JSON so a file explains
    itself."""

    num_requests: int = 128
    seed: int = 0
    prompt_len: LengthDist = field(default_factory=lambda: LengthDist("uniform", 32, 512))
    output_len: LengthDist = field(default_factory=lambda: LengthDist("log_uniform", 16, 256))
    # Shared prefix: this fraction of requests start with one of `prefix_groups` common
    # passages of `prefix_len` tokens (a system prompt / few-shot block), counted in prompt_len.
    prefix_fraction: float = 0.0
    prefix_groups: int = 4
    prefix_len: int = 128
    priorities: dict[str, float] = field(default_factory=lambda: {"0": 0.2, "1": 0.6, "2": 0.2})
    tenants: dict[str, float] = field(default_factory=lambda: {"acme": 0.5, "globex": 0.3,
                                                               "initech": 0.2})
    # Arrivals: None = all at t=0; else a Poisson (burstiness 1) or gamma process at `rate` req/s.
    rate: float | None = None
    burstiness: float = 1.0

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> WorkloadSpec:
        d = dict(d)
        for key in ("prompt_len", "output_len"):
            if isinstance(d.get(key), dict):
                d[key] = LengthDist(**d[key])
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["prompt_len"], out["output_len"] = self.prompt_len.to_dict(), self.output_len.to_dict()
        return out


@dataclass
class WorkloadRequest:
    id: str
    prompt: str = ""  # empty when only token counts matter (the simulator)
    prompt_len: int = 0
    max_tokens: int = 16
    arrival_s: float | None = None  # None: at t=0
    priority: int = 1
    tenant: str = "default"
    prefix_group: str | None = None
    prefix_len: int = 0  # leading tokens shared with the rest of its prefix_group
    prompt_token_ids: list[int] | None = None

    @property
    def request_id(self) -> str:  # the simulator's former name for `id`
        return self.id

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        if not self.prefix_len:
            del out["prefix_len"]
        if self.prompt_token_ids is None:
            del out["prompt_token_ids"]
        return out


@dataclass
class Workload:
    name: str
    seed: int
    spec: dict[str, Any]
    requests: list[WorkloadRequest]

    @property
    def total_output_tokens(self) -> int:
        return sum(r.max_tokens for r in self.requests)

    def head(self, n: int) -> Workload:
        return Workload(f"{self.name}[:{n}]", self.seed, self.spec, self.requests[:n])

    def with_rate(self, rate: float | None, seed: int = 0) -> Workload:
        """Same requests, Poisson arrivals at `rate` per second (None/inf: all at t=0)."""
        times = arrival_offsets(len(self.requests), rate, 1.0, random.Random(seed))
        reqs = [replace(r, arrival_s=t) for r, t in zip(self.requests, times)]
        return Workload(f"{self.name}@{rate}/s", self.seed, self.spec, reqs)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "seed": self.seed, "spec": self.spec,
                "requests": [r.to_dict() for r in self.requests]}

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")


def load_workload(path: str | Path, default_prefix_len: int = 256) -> Workload:
    """Read the workload JSON. A grouped request without its own `prefix_len` shares
    min(spec prefix_len, prompt_len - 1) leading tokens (spec default: `default_prefix_len`)."""
    data = json.loads(Path(path).read_text())
    spec = data.get("spec", {}) or {}
    shared = int(spec.get("prefix_len", spec.get("shared_prefix_tokens", default_prefix_len)))
    known = {f.name for f in fields(WorkloadRequest)}
    reqs = []
    for r in data["requests"]:
        req = WorkloadRequest(**{k: v for k, v in r.items() if k in known})
        req.id = str(req.id)
        if req.prefix_group and "prefix_len" not in r:
            req.prefix_len = min(shared, req.prompt_len - 1)
        reqs.append(req)
    return Workload(str(data.get("name", Path(path).stem)), int(data.get("seed", 0)), spec, reqs)


def resolve_workload(arg: str) -> Workload:
    """A path to workload JSON, or a synthetic spec string."""
    if Path(arg).is_file():
        return load_workload(arg)
    return synthetic(arg)


# -- arrivals -----------------------------------------------------------------------------------
def arrival_offsets(n: int, rate: float | None, burstiness: float,
                    rng: random.Random) -> list[float]:
    """Arrival times from 0: a gamma process at `rate` per second (burstiness 1 = Poisson;
    < 1 burstier); all zeros when rate is None, infinite or <= 0."""
    if rate is None or math.isinf(rate) or rate <= 0:
        return [0.0] * n
    if burstiness <= 0:
        raise ValueError("burstiness must be > 0")
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    return out


# -- text ---------------------------------------------------------------------------------------
def english_corpus(collapse_whitespace: bool = True) -> str:
    """CPython's help topics, in a fixed order, with whitespace runs collapsed (or as written,
    topics apart by a blank line: the single-stream benchmark's prompt)."""
    from pydoc_data.topics import topics
    if not collapse_whitespace:
        return "\n\n".join(topics[k] for k in sorted(topics))
    return re.sub(r"\s+", " ", " ".join(topics[k] for k in sorted(topics)))


class _TextSlicer:
    """Cuts token-exact slices of the corpus (or word slices without a tokenizer)."""

    def __init__(self, tokenizer: TextTokenizer | None) -> None:
        self.tokenizer = tokenizer
        corpus = english_corpus()
        self.units: list[Any] = tokenizer.encode(corpus) if tokenizer else corpus.split(" ")

    def take(self, rng: random.Random, n: int) -> str:
        start = rng.randrange(0, max(1, len(self.units) - n))
        piece = self.units[start:start + n]
        if self.tokenizer is None:
            return " ".join(piece)
        return self.tokenizer.decode(piece).strip()

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text)) if self.tokenizer else len(text.split())


def _weighted(rng: random.Random, weights: dict[str, float]) -> str:
    keys = sorted(weights)
    return rng.choices(keys, weights=[weights[k] for k in keys])[0]


def generate_workload(spec: WorkloadSpec, name: str = "synthetic",
                      tokenizer: TextTokenizer | None = None) -> Workload:
    """Deterministic for a given spec and tokenizer (None: word slices, lengths estimated)."""
    slicer = _TextSlicer(tokenizer)
    rng = random.Random(spec.seed)
    prefixes = [slicer.take(rng, spec.prefix_len) for _ in range(spec.prefix_groups)]
    arrivals = (arrival_offsets(spec.num_requests, spec.rate, spec.burstiness,
                                random.Random(spec.seed + 1)) if spec.rate else None)
    reqs = []
    for i in range(spec.num_requests):
        target = spec.prompt_len.sample(rng)
        group = None
        if spec.prefix_groups and rng.random() < spec.prefix_fraction and target > spec.prefix_len:
            g = rng.randrange(spec.prefix_groups)
            group = f"p{g}"
            prompt = prefixes[g] + "\n\n" + slicer.take(rng, target - spec.prefix_len)
        else:
            prompt = slicer.take(rng, target)
        reqs.append(WorkloadRequest(
            id=f"r{i}", prompt=prompt, prompt_len=slicer.count(prompt),
            max_tokens=spec.output_len.sample(rng),
            arrival_s=round(arrivals[i], 6) if arrivals else None,
            priority=int(_weighted(rng, spec.priorities)), tenant=_weighted(rng, spec.tenants),
            prefix_group=group))
    spec_dict = spec.to_dict()
    spec_dict["tokenizer"] = "default" if tokenizer is not None else "whitespace-estimate"
    return Workload(name, spec.seed, spec_dict, reqs)


# -- token counts only: the simulator's spec string ---------------------------------------------
SYNTHETIC_KEYS = {
    "n": "number of requests (default 256)",
    "prompt": "prompt length distribution (default uniform:128:1024)",
    "output": "output length distribution (default uniform:20:800)",
    "rate": "Poisson arrivals per second; 'inf' (default) = all arrive at t=0",
    "priority": "fractions of tiers 0:1:2 (default 0:1:0, all standard)",
    "prefix": "FRACTION:TOKENS - that fraction of requests shares one TOKENS-long system prompt",
    "tenants": "number of tenants, assigned round-robin (default 1)",
    "seed": "RNG seed (default 0)",
}


def synthetic(spec: str) -> Workload:
    """A token-count workload from 'n=512,prompt=uniform:128:1024,output=uniform:20:800,rate=8'
    (comma-separated key=value, keys in SYNTHETIC_KEYS; lengths in the module's syntax)."""
    opts = dict(item.split("=", 1) for item in spec.split(",") if item.strip())
    if set(opts) - set(SYNTHETIC_KEYS):
        raise ValueError(f"unknown synthetic spec keys: {sorted(set(opts) - set(SYNTHETIC_KEYS))}")
    rng = random.Random(int(opts.get("seed", 0)))
    n = int(opts.get("n", 256))
    prompt_dist = LengthDist.parse(opts.get("prompt", "uniform:128:1024"))
    output_dist = LengthDist.parse(opts.get("output", "uniform:20:800"))
    tiers = [float(x) for x in opts.get("priority", "0:1:0").split(":")]
    prefix_frac, prefix_len = (float(x) for x in opts.get("prefix", "0:0").split(":"))
    tenants = int(opts.get("tenants", 1))
    times = arrival_offsets(n, float(opts.get("rate", "inf")), 1.0, rng)
    reqs = []
    for i in range(n):
        shared = rng.random() < prefix_frac
        prompt = prompt_dist.sample(rng)
        reqs.append(WorkloadRequest(
            f"r{i}", prompt_len=prompt + (int(prefix_len) if shared else 0),
            max_tokens=output_dist.sample(rng), arrival_s=times[i],
            priority=rng.choices([0, 1, 2], weights=tiers)[0], tenant=f"t{i % tenants}",
            prefix_group="system" if shared else None,
            prefix_len=int(prefix_len) if shared else 0))
    return Workload(spec, int(opts.get("seed", 0)), {"synthetic": spec}, reqs)


def synthetic_prompt_ids(req: WorkloadRequest, index: int) -> list[int]:
    """Token ids for a request without text: the prefix group's shared leading tokens, then
    tokens unique to this request (its first unique token encodes `index`, so no two requests'
    blocks collide)."""
    shared = []
    if req.prefix_group and req.prefix_len:
        seed = sum(ord(c) * 31 ** k for k, c in enumerate(req.prefix_group)) % 100_000
        shared = [10 + (seed + j) % 50_000 for j in range(req.prefix_len)]
    unique = [1_000_000 + index] + [10 + (index * 7919 + j) % 50_000
                                    for j in range(req.prompt_len - len(shared) - 1)]
    return (shared + unique)[:req.prompt_len]


# The benchmarks' 128-request workload: all at t=0, prompts 32-512 tokens (~34k), long-tailed
# outputs 16-256 (~13k), with token ids so every engine under test gets the same ones. Committed
# (generated once by the retired benchmarks/perf_workload.py); `head(n)` is its n-request form.
PERF_WORKLOAD = Path(__file__).resolve().parents[2] / "benchmarks/workloads/perf-mixed-128.json"


def perf_workload(num_requests: int = 128, path: str | Path | None = None) -> Workload:
    """The benchmarks' workload (PERF_WORKLOAD in a source checkout, or `path`), cut to its
    first `num_requests`."""
    wl = load_workload(path or PERF_WORKLOAD)
    return wl if num_requests >= len(wl.requests) else wl.head(num_requests)
