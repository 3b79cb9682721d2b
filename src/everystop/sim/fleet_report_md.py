"""The markdown of docs/fleet-simulation.md: tables rendered from `everystop bench
fleet-report`'s JSON and the saved `everystop bench fleet-speed` runs; no other numbers."""

from __future__ import annotations

import json
from pathlib import Path

MEAN_REPLY_TOKENS = 410  # the design's replies, uniform 20..800 tokens
ROOT = Path(__file__).resolve().parents[3]  # the source checkout: docs/ and benchmarks/ live there
SIM_RESULTS = ROOT / "benchmarks/results/sim"
# The simulator's speed on the target run (1M requests, 64 replicas): (label, saved result).
SPEED_RUNS = [
    ("CPython, one process", SIM_RESULTS / "fleet_speed_1m_cpython.json"),
    ("CPython, two processes", SIM_RESULTS / "fleet_speed_1m_cpython_2proc.json"),
    ("PyPy, one process", SIM_RESULTS / "fleet_speed_1m_pypy.json"),
    ("PyPy, two processes", SIM_RESULTS / "fleet_speed_1m_pypy_2proc.json"),
]


def _saved(path: Path) -> dict | None:
    """A saved result, or None where that run has not been made."""
    return json.loads(path.read_text()) if path.exists() else None


def _f(x: float | None, nd: int = 0) -> str:
    return "n/a" if x is None else f"{x:,.{nd}f}"


def _load_table(r: dict) -> list[str]:
    policies = list(r["load"])
    rates = sorted({p["rate_rps"] for pts in r["load"].values() for p in pts})
    out = ["| offered req/s | per replica | " + " | ".join(policies) + " |",
           "|---|---|" + "---|" * len(policies)]
    for rate in rates:
        cells = []
        for pol in policies:
            pt = next(p for p in r["load"][pol] if p["rate_rps"] == rate)
            cells.append(f"{_f(pt['ttft_p99_ms'] / 1e3, 2)} s")
        out.append(f"| {_f(rate)} | {rate / r['replicas']:.1f} | " + " | ".join(cells) + " |")
    out.append("| **p99 crosses 1 s at** (linear between points) | | " + " | ".join(
        f"**{_f(r['crossing_1s_rps'][p])} req/s**" if r["crossing_1s_rps"][p] else "not crossed"
        for p in policies) + " |")
    return out


def _chat_table(r: dict) -> list[str]:
    out = ["| policy | prefix-cache hit rate | TTFT p50 | TTFT p99 | TPOT p50 | output tok/s "
           "| requests per replica (min-max) |", "|---|---|---|---|---|---|---|"]
    for pol, s in r["chat"].items():
        out.append(f"| {pol} | {s['prefix_hit_rate'] * 100:.1f}% | {_f(s['ttft_p50_ms'])} ms "
                   f"| {_f(s['ttft_p99_ms'])} ms | {s['tpot_p50_ms']:.1f} ms "
                   f"| {_f(s['output_tokens_per_s'])} | {s['routed_min_max'][0]}-"
                   f"{s['routed_min_max'][1]} |")
    return out


def _plan_table(r: dict) -> list[str]:
    out = ["| req/s | replicas (one replica's sustained rate) | GPUs | fleet $/hour "
           "| $ / 1M output tokens, steady state | fleet point at that count: TTFT p99, TPOT "
           "p50, $ / 1M incl. warm-up and drain | fewest in the 6 s fleet grid (optimistic) |",
           "|---|---|---|---|---|---|---|"]
    for p in r["plans"]:
        n = p["first_guess_replicas"]
        at = next((c for c in p["curve"] if c["replicas"] == n), None)
        price = p["fleet_price_per_hour"] / p["replicas"] * n if p["replicas"] else None
        floor = min(c["replicas"] for c in p["curve"])
        fewest = ("none met" if p["chosen"] is None else
                  f"{p['replicas']}" + (" (the grid's floor)" if p["replicas"] == floor else ""))
        # Steady state: every request served, so output tokens/s = rate * mean reply length.
        steady = price / 3600 / (p["rate_rps"] * MEAN_REPLY_TOKENS) * 1e6 if price else None
        out.append(
            f"| {_f(p['rate_rps'])} | **{n}** | {n * r['tp']} | "
            + (f"${price:,.2f}" if price else "n/a") + " | "
            + (f"**${steady:.3f}**" if steady else "n/a") + " | "
            + (f"{_f(at['ttft_p99_ms'])} ms, {at['tpot_p50_ms']:.1f} ms, "
               f"${at['cost_per_1m_output_tokens']:.3f}" if at else "n/a")
            + f" | {fewest} |")
    return out


def _curves(r: dict) -> list[str]:
    out = []
    for p in r["plans"]:
        pts = ", ".join(f"{c['replicas']}: {_f(c['ttft_p99_ms'])} ms"
                        + ("" if c["meets_slo"] else " (miss)") for c in p["curve"])
        out.append(f"- {_f(p['rate_rps'])} req/s, replicas searched -> p99 TTFT: {pts}")
    single = r["plans"][0]["single_replica_curve"]
    out.append("- one replica, req/s -> p99 TTFT: " + ", ".join(
        f"{c['rate_rps']:g}: {_f(c['ttft_p99_ms'])} ms" + ("" if c["meets_slo"] else " (miss)")
        for c in sorted(single, key=lambda c: c["rate_rps"])))
    return out


def machine(s: dict) -> str:
    """The machine a result was timed on, as it records it: a VM names different CPUs alike
    ("AMD EPYC"), so the family and model, where recorded, and the vector flags say which."""
    m = s.get("machine", {})
    cpu_id = f" ({m['cpu_id']})" if m.get("cpu_id") else ""
    flags = f"; {' '.join(m['isa_flags'])}" if m.get("isa_flags") else ""
    return f"{m.get('model', 'unknown CPU')}{cpu_id}, {s['cpu_count']} cores{flags}"


def speed_table(runs: list[tuple[str, dict]]) -> list[str]:
    """One row per saved speed run: wall time against the target, and where it ran."""
    out = ["| run | requests x replicas | wall s | wall ms per request | target | machine |",
           "|---|---|---|---|---|---|"]
    for label, s in runs:
        verdict = "met" if s["meets_target_measured"] else "not met"
        out.append(f"| {label} | {s['requests']:,} x {s['replicas']} | {_f(s['wall_s'])} "
                   f"| {s['wall_s'] / s['requests'] * 1e3:.3f} | {verdict} (< {s['target_s']} s) "
                   f"| {machine(s)} |")
    return out


def _speed_section() -> list[str]:
    runs = [(label, s) for label, path in SPEED_RUNS if (s := _saved(path)) is not None]
    if not runs:
        return []
    return [
        "## Simulation speed",
        "",
        "The target: 1,000,000 requests over 64 replicas simulated in under 600 s. Each run "
        "below simulates the same traffic (the design's shape at 90% of capacity, router "
        "least-loaded); the two-process runs check that their simulated results equal the "
        "one-process run's. Speed depends on the interpreter and on the machine as much as on "
        "the code, so each row names both.",
        "",
        *speed_table(runs),
        "",
        "Commands, as recorded in each result:",
        "",
        "```",
        *[s["command"] for _, s in runs],
        "```",
        "",
    ]


def render(r: dict) -> str:
    """The whole page: one function per section, in the page's order."""
    lines = (_intro(r) + _load_section(r) + _chat_section(r) + _plan_section(r)
             + _speed_section() + _running_it() + _not_modeled())
    return "\n".join(lines)


def _intro(r: dict) -> list[str]:
    """What the fleet simulator runs, and where the numbers come from."""
    return [
        "# Fleet simulation and capacity planning",
        "",
        "<!-- Generated by `everystop bench fleet-report --render-only`; do not edit. -->",
        "",
        "The fleet simulator (`everystop simulate --replicas N --router POLICY`, "
        "`src/everystop/sim/fleet.py`) runs N copies of the production `Scheduler` and "
        "`KVCacheManager` on one discrete-event clock, each pass timed by the cost model "
        "(`sim/cost_model.py`), behind the production router (`everystop.routing`, the scoring "
        "function the Ray Serve router calls). The router sees each replica's load report as "
        f"of its last refresh (every {r['stats_interval_s']} s here), corrected by its own "
        "count of requests sent and finished since. With one replica it reproduces the "
        "single-node simulator request for request (`tests/sim/test_fleet.py`).",
        "",
        f"The numbers below come from `{r['command']}` ({r['wall_s']:,.0f} s wall on "
        f"{r['jobs']} processes; JSON: `benchmarks/results/sim/fleet_report.json`). Replicas: "
        f"{r['tp']}x `{r['hardware']}` running `{r['model']}` (tensor parallel {r['tp']}), "
        "chunked prefill, prefix caching on. Traffic: the design's shape (prompts 128-1,024 "
        "tokens, replies 20-800, Poisson arrivals) unless said otherwise. Each point starts "
        f"from an empty fleet and simulates {r['durations_s']['load']:g} s of arrivals (chats: "
        f"{r['durations_s']['chat']:g} s, plan points: {r['durations_s']['plan']:g} s).",
        "",
    ]


def _load_section(r: dict) -> list[str]:
    """p99 TTFT against offered load, one column per routing policy."""
    return [
        f"## p99 TTFT vs offered load, {r['replicas']} replicas",
        "",
        *_load_table(r),
        "",
        "![p99 TTFT vs offered load](img/fleet_ttft_vs_load.png)",
        "",
    ]


def _chat_section(r: dict) -> list[str]:
    """The prefix cache's hit rate per policy on multi-turn chats."""
    return [
        "## Prefix-cache hit rate on multi-turn chats",
        "",
        f"Traffic `{r['chat']['least-loaded']['traffic'] if 'least-loaded' in r['chat'] else ''}`"
        ": 80% of new chats run 4 turns ~10 s apart, each turn resending the whole history (the "
        "simulated reply included), half of them behind one of 8 tenants' 512-token system "
        "prompts. Hit rate = prompt tokens served from the prefix cache / all prompt tokens.",
        "",
        *_chat_table(r),
        "",
    ]


def _plan_section(r: dict) -> list[str]:
    """How many replicas each rate needs under the SLOs, what they cost, the curves searched."""
    plan0 = r["plans"][0]
    return [
        "## Capacity plan",
        "",
        f"SLOs: p99 TTFT <= {r['slo']['ttft_p99_s']:g} s, p50 TPOT <= "
        f"{r['slo']['tpot_p50_s'] * 1e3:g} ms, nothing rejected; router least-loaded. The plan "
        f"is rate / one replica's sustained rate ({plan0['single_replica_rate_rps']} req/s, "
        "`everystop simulate plan`); the fleet grid ("
        + ", ".join(f"{g:.0%}" for g in r["plan_grid"])
        + f" of it, {r['durations_s']['plan']:g} s of arrivals each) never fills, so its fewest "
        "passing count is optimistic.",
        "",
        *_plan_table(r),
        "",
        f"Price: {plan0['price_assumption']}. Cost = fleet $/hour / (output tokens per "
        "second x 3,600) x 10^6. The curves searched:",
        "",
        *_curves(r),
        "",
    ]


def _running_it() -> list[str]:
    """Example command lines for the fleet simulator, the planner and this page."""
    return [
        "## Running it",
        "",
        "```",
        "# 16 replicas of 4xH100 / 70B, prefix-affinity, multi-turn chats at 150 req/s",
        "everystop simulate --hardware h100-sxm --tp 4 --replicas 16 --router prefix-affinity \\",
        "    --traffic 'n=20000,rate=150,sessions=0.8:4:10,prefix=0.5:512,tenants=8'",
        "# bursty (10 s at 2x the mean rate, then 20 s quieter) or a diurnal ramp",
        "everystop simulate --replicas 16 --traffic 'n=20000,rate=150,arrival=onoff:10:20:2'",
        "everystop simulate --replicas 16 --traffic 'n=20000,rate=150,arrival=diurnal:600:0.5'",
        "# replay your own traffic: a JSON trace in the bench workload format",
        "everystop simulate --replicas 16 --workload my_trace.json",
        "# router information delay: fresh stats every 5 s (0 = every request)",
        "everystop simulate --replicas 16 --stats-interval-s 5 --traffic 'n=20000,rate=150'",
        "# the replicas on two processes (the same results)",
        "everystop simulate --replicas 64 --workers 2 --traffic 'n=20000,rate=500'",
        "# capacity plan",
        "everystop simulate plan --model llama-3-70b --hardware h100-sxm --tp 4 --rate 200 \\",
        "    --slo-ttft-p99 1.0 --slo-tpot-p50 0.05",
        "# this page: rerun everything, or re-render it from the saved JSONs",
        "everystop bench fleet-report",
        "everystop bench fleet-report --render-only",
        "# under PyPy (scripts/ensure_pypy.sh unpacks Debian's, no root)",
        "PYPY_GC_NURSERY=256MB PYPY_GC_MAJOR_COLLECT=4 PYTHONPATH=src \\",
        "    $(scripts/ensure_pypy.sh) -m everystop simulate --replicas 16 \\",
        "    --traffic 'n=20000,rate=150'",
        "```",
        "",
        "Traffic keys are documented in `src/everystop/sim/fleet_workload.py`; `rate` counts "
        "every request, follow-up turns included.",
        "",
    ]


def _not_modeled() -> list[str]:
    return [
        "## What this does not model",
        "",
        "- Network and router latency (a request reaches its replica at once), replica failures,",
        "  autoscaling delays; the prefix cache's hit rate depends on the simulated KV capacity.",
        "- Every pass's latency is the cost model's (a roofline with efficiency assumptions, see",
        "  `docs/simulator-report.md`), not a measurement on H100s.",
        "",
    ]
