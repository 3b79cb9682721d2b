"""Fleet-scale traffic for the fleet simulator, generated lazily in arrival order.

Arrivals: Poisson, bursty on/off (a Markov-modulated Poisson process) and a diurnal ramp
(a sinusoidal rate, drawn by thinning). Tenants with tiers, long-tailed (lognormal, capped)
prompt and output lengths, shared system prompts, and multi-turn sessions whose every turn
resends the whole history (so a replica that served the last turn holds it in its prefix cache).
A JSON trace in the bench workload format replays as it is.

Spec string (comma-separated key=value; `everystop simulate --fleet-workload`)::

    n=100000,rate=200,arrival=poisson,prompt=lognormal:400:0.8:4096,output=lognormal:200:0.9:2048
    arrival=onoff:ON_S:OFF_S:PEAK_FACTOR  (rate is the mean; bursts at PEAK_FACTOR * rate)
    arrival=diurnal:PERIOD_S:DEPTH        (rate * (1 + DEPTH * sin(2 pi t / PERIOD_S)))
    tenants=4, tiers=0.2:0.6:0.2          (tenant k has weight 1/(k+1); tier fractions 0:1:2)
    prefix=0.5:256                        (that fraction starts with its tenant's system prompt)
    sessions=0.6:4:30                     (that fraction of new chats runs 4 turns, one every
                                           ~30 s, each resending its history; `rate` counts
                                           every turn)
    seed=0
"""

from __future__ import annotations

import heapq
import math
import random
from array import array
from collections.abc import Iterator
from dataclasses import dataclass

from everystop.workload import LengthDist, Workload, synthetic_prompt_ids

SAMPLED_TOKEN = 7  # what the simulated executor returns: a chat's history contains these


@dataclass(frozen=True, slots=True)
class FleetRequest:
    request_id: str
    arrival_s: float
    prompt_token_ids: list[int]
    max_tokens: int
    priority: int = 1
    tenant: str = "default"

    def __reduce__(self) -> tuple:
        """Pickled with its prompt packed as 32-bit ints (one bytes object), not int by int:
        the parallel fleet (sim/fleet_parallel.py) sends every arrival to its group, and
        pickle writes a list an item at a time (under PyPy, whose pickle is Python code, that
        was 14% of the parent's time at 64 replicas)."""
        try:
            packed: array | list[int] = array("i", self.prompt_token_ids)
        except OverflowError:  # ids beyond 32 bits: as they are
            packed = self.prompt_token_ids
        return (_unpack_request, (self.request_id, self.arrival_s, packed, self.max_tokens,
                                  self.priority, self.tenant))


def _unpack_request(request_id: str, arrival_s: float, prompt: array | list[int],
                    max_tokens: int, priority: int, tenant: str) -> FleetRequest:
    return FleetRequest(request_id, arrival_s, list(prompt), max_tokens, priority, tenant)


def from_workload(workload: Workload) -> Iterator[FleetRequest]:
    """The single-node simulator's requests, in its order and with its token ids."""
    order = sorted(range(len(workload.requests)),
                   key=lambda k: workload.requests[k].arrival_s or 0.0)
    for k in order:
        spec = workload.requests[k]
        yield FleetRequest(spec.request_id, spec.arrival_s or 0.0, synthetic_prompt_ids(spec, k),
                           spec.max_tokens, spec.priority, spec.tenant)


@dataclass
class _Session:
    tenant: int
    priority: int
    history: list[int]
    turns_left: int


class _Arrivals:
    """Arrival times of new conversations at `rate` per second on average."""

    def __init__(self, kind: str, rate: float, rng: random.Random) -> None:
        name, *args = kind.split(":")
        if len(args) != {"poisson": 0, "onoff": 3, "diurnal": 2}.get(name, len(args)):
            raise ValueError(f"arrival={kind!r}: poisson, onoff:ON_S:OFF_S:PEAK_FACTOR or "
                             "diurnal:PERIOD_S:DEPTH")
        if rate <= 0 or math.isinf(rate):
            raise ValueError(f"fleet traffic needs a finite positive rate, not {rate}")
        if name not in ("poisson", "onoff", "diurnal"):
            raise ValueError(f"unknown arrival process {kind!r} (poisson, onoff, diurnal)")
        self.name, self.args, self.rate, self.rng, self.t = name, [float(a) for a in args], \
            rate, rng, 0.0
        if name == "onoff":
            on_s, off_s, peak = self.args
            if peak * on_s / (on_s + off_s) > 1.0 + 1e-9:
                raise ValueError("onoff: PEAK_FACTOR * ON_S / (ON_S + OFF_S) must be <= 1 "
                                 "(the off periods carry the rest of the mean rate)")
            # Off periods carry what the bursts leave of the mean rate.
            self.off_rate = rate * (1 - peak * on_s / (on_s + off_s)) * (on_s + off_s) / off_s
        if name == "diurnal" and not 0 <= self.args[1] <= 1:
            raise ValueError("diurnal: DEPTH must be in [0, 1]")
        self.peak_rate = rate if name == "poisson" else (
            rate * (1 + self.args[1]) if name == "diurnal" else max(rate * self.args[2],
                                                                    self.off_rate))

    def rate_at(self, t: float) -> float:
        if self.name == "onoff":
            on_s, off_s, peak = self.args
            return self.rate * peak if t % (on_s + off_s) < on_s else self.off_rate
        if self.name == "diurnal":
            period, depth = self.args
            return self.rate * (1 + depth * math.sin(2 * math.pi * t / period))
        return self.rate

    def next(self) -> float:
        """Thinning (Lewis-Shedler): candidates at the peak rate, kept with rate(t)/peak."""
        peak = self.peak_rate
        while True:
            self.t += self.rng.expovariate(peak)
            if self.rng.random() * peak <= self.rate_at(self.t):
                return self.t


def fleet_traffic(spec: str, max_model_len: int = 8192) -> Iterator[FleetRequest]:
    """Requests from a spec string (see the module docstring), in arrival order."""
    opts = dict(item.split("=", 1) for item in spec.split(",") if item.strip())
    known = {"n", "rate", "arrival", "prompt", "output", "tenants", "tiers", "prefix",
             "sessions", "seed"}
    if set(opts) - known:
        raise ValueError(f"unknown fleet traffic keys: {sorted(set(opts) - known)}")
    rng = random.Random(int(opts.get("seed", 0)))
    n = int(opts.get("n", 1000))
    prompt_dist = LengthDist.parse(opts.get("prompt", "uniform:128:1024"))
    output_dist = LengthDist.parse(opts.get("output", "uniform:20:800"))
    num_tenants = int(opts.get("tenants", 1))
    tenant_weights = [1.0 / (k + 1) for k in range(num_tenants)]
    tiers = [float(x) for x in opts.get("tiers", "0:1:0").split(":")]
    prefix_frac, prefix_len = (float(x) for x in opts.get("prefix", "0:0").split(":"))
    session_frac, max_turns, think_s = (float(x) for x in opts.get("sessions", "0:1:1").split(":"))
    # `rate` counts every request, follow-up turns included: new chats arrive more slowly.
    turns_per_chat = 1 + session_frac * (max_turns - 1)
    arrivals = _Arrivals(opts.get("arrival", "poisson"),
                         float(opts.get("rate", 10)) / turns_per_chat, rng)
    system = [list(range(2_000_000 + k * 100_000, 2_000_000 + k * 100_000 + int(prefix_len)))
              for k in range(num_tenants)]
    pending: list[tuple[float, int, _Session]] = []  # next turns of open chats
    # A new message's tokens after its first, as one set of int objects every prompt slices:
    # at fleet scale the prefix cache keeps millions of blocks' token tuples alive, and their
    # own copies of these ints made a run's memory larger and colder as it went.
    filler = list(range(10, 10 + max_model_len))  # (a longer message is cut to fit below)
    next_new = arrivals.next()
    for i in range(n):
        if pending and pending[0][0] < next_new:
            t, _, session = heapq.heappop(pending)
        else:
            t, next_new = next_new, arrivals.next()
            tenant = rng.choices(range(num_tenants), weights=tenant_weights)[0]
            history = list(system[tenant]) if rng.random() < prefix_frac else []
            session = _Session(tenant, rng.choices([0, 1, 2], weights=tiers)[0], history,
                               int(max_turns) if rng.random() < session_frac else 1)
        # A new user message: its first token is unique, so no two requests share it by chance.
        new = prompt_dist.sample(rng)
        prompt = session.history + [3_000_000 + i] + filler[:new - 1]
        out = output_dist.sample(rng)
        if len(prompt) + out > max_model_len:  # the chat has outgrown the context: start over
            prompt = prompt[len(session.history):][:max_model_len - out]
            session.history, session.turns_left = [], 1
        yield FleetRequest(f"q{i}", t, prompt, out, session.priority, f"t{session.tenant}")
        session.turns_left -= 1
        if session.turns_left > 0:
            # The next turn resends everything, the reply included (what the simulated executor
            # sampled), after the user has read it and typed: ~think_s later.
            session.history = prompt + [SAMPLED_TOKEN] * out
            heapq.heappush(pending, (t + rng.expovariate(1.0 / think_s), i, session))
