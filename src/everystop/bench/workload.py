"""Seeded synthetic workloads built from real English text, written to and read from JSON.

The text is CPython's own documentation (`pydoc_data.topics`, ~460 KB of English prose and
examples shipped with every CPython), so prompts look like real text to the tokenizer and the
attention kernels rather than random token ids. The format is the project's shared workload JSON
(see the brief): one object per request with its prompt, prompt_len under the default tokenizer,
max_tokens (sent with ignore_eos, so output lengths are exact), arrival offset, tier and tenant.
"""

from __future__ import annotations

import json
import math
import random
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol


class TextTokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


@dataclass(frozen=True)
class LengthDist:
    """A length distribution: fixed (min only), uniform or log-uniform over [min, max]."""

    dist: str = "uniform"
    min: int = 32
    max: int = 512

    def __post_init__(self) -> None:
        if self.dist not in ("fixed", "uniform", "log_uniform"):
            raise ValueError(f"unknown length distribution {self.dist!r}")
        if self.min < 1 or (self.dist != "fixed" and self.max < self.min):
            raise ValueError(f"bad length range {self.min}..{self.max}")

    def sample(self, rng: random.Random) -> int:
        if self.dist == "fixed":
            return self.min
        if self.dist == "uniform":
            return rng.randint(self.min, self.max)
        # log-uniform: most lengths short, a long tail up to max (like real chat outputs)
        return min(self.max, int(math.exp(rng.uniform(math.log(self.min),
                                                        math.log(self.max + 1)))))

    @classmethod
    def parse(cls, text: str) -> LengthDist:
        """'fixed:128', 'uniform:32:512' or 'log_uniform:16:256'."""
        parts = text.split(":")
        if parts[0] == "fixed" and len(parts) == 2:
            return cls("fixed", int(parts[1]), int(parts[1]))
        if len(parts) != 3:
            raise ValueError(f"length spec {text!r}: use fixed:N, uniform:A:B or log_uniform:A:B")
        return cls(parts[0], int(parts[1]), int(parts[2]))


@dataclass(frozen=True)
class WorkloadSpec:
    """Everything that determines a workload; stored in the JSON so a file explains itself."""

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


@dataclass
class WorkloadRequest:
    id: str
    prompt: str
    prompt_len: int
    max_tokens: int
    arrival_s: float | None = None
    priority: int = 1
    tenant: str = "default"
    prefix_group: str | None = None


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

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "seed": self.seed, "spec": self.spec,
                "requests": [asdict(r) for r in self.requests]}

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")


def load_workload(path: str | Path) -> Workload:
    data = json.loads(Path(path).read_text())
    reqs = [WorkloadRequest(**r) for r in data["requests"]]
    return Workload(data.get("name", Path(path).stem), int(data.get("seed", 0)),
                    data.get("spec", {}), reqs)


# -- text ---------------------------------------------------------------------------------------
def english_corpus() -> str:
    """CPython's help topics, in a fixed order, with whitespace runs collapsed."""
    from pydoc_data.topics import topics
    return re.sub(r"\s+", " ", " ".join(topics[k] for k in sorted(topics)))


def default_tokenizer() -> TextTokenizer | None:
    """The engine's default-model tokenizer, or None when the model or its loader is missing."""
    try:
        from everystop.tokenizer import load_tokenizer
        return load_tokenizer()
    except Exception:  # any failure: no tokenizer, slice words instead
        return None


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


def arrival_offsets(n: int, rate: float, burstiness: float, rng: random.Random) -> list[float]:
    """Gamma-process arrival times (burstiness 1 = Poisson; < 1 burstier), starting at 0."""
    if rate <= 0 or burstiness <= 0:
        raise ValueError("rate and burstiness must be > 0")
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    return out


def generate_workload(spec: WorkloadSpec, name: str = "synthetic",
                      tokenizer: TextTokenizer | str | None = "default") -> Workload:
    """Deterministic for a given spec and tokenizer. tokenizer="default" tries the model's."""
    tok = default_tokenizer() if tokenizer == "default" else tokenizer
    slicer = _TextSlicer(tok)  # type: ignore[arg-type]
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
    spec_dict = asdict(spec)
    spec_dict["tokenizer"] = "default" if tok is not None else "whitespace-estimate"
    return Workload(name, spec.seed, spec_dict, reqs)
