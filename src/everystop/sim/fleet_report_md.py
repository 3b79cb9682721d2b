"""The markdown text of docs/fleet-simulation.md, filled from `everystop bench fleet-report`'s
numbers (and `everystop bench fleet-speed`'s, when its JSON is there)."""

from __future__ import annotations

import json
from pathlib import Path

MEAN_REPLY_TOKENS = 410  # the design's replies, uniform 20..800 tokens
ROOT = Path(__file__).resolve().parents[3]  # the source checkout: docs/ and benchmarks/ live there
SPEED_JSON = ROOT / "benchmarks/results/sim/fleet_speed.json"
# A longer run of the same command (no baseline), the basis of the 1M extrapolation if present.
LONG_SPEED_JSON = ROOT / "benchmarks/results/sim/fleet_speed_long.json"
# The whole target run, 1M requests x 64 replicas, if it has been run (a measurement, not an
# extrapolation).
MILLION_SPEED_JSON = ROOT / "benchmarks/results/sim/fleet_speed_1m.json"
# The target run on worker processes alone (`--parallel-only`), checked against the one above.
MILLION_PARALLEL_JSON = ROOT / "benchmarks/results/sim/fleet_speed_1m_parallel.json"
PARALLEL_SPEED_JSON = ROOT / "benchmarks/results/sim/fleet_speed_parallel.json"
# The same sources under PyPy: the target run on two processes (with the collector's settings
# the command names, and with its defaults), and PyPy against CPython in one command.
MILLION_PYPY_PARALLEL_JSON = ROOT / "benchmarks/results/sim/fleet_speed_1m_pypy_parallel.json"
MILLION_PYPY_DEFAULT_GC_JSON = (ROOT / "benchmarks/results/sim/"
                                "fleet_speed_1m_pypy_parallel_default_gc.json")
# The same, one commit before prompts crossed to the worker packed.
MILLION_PYPY_UNPACKED_JSON = (ROOT / "benchmarks/results/sim/"
                              "fleet_speed_1m_pypy_parallel_before_packing.json")
PYPY_VS_CPYTHON_JSON = ROOT / "benchmarks/results/sim/fleet_speed_pypy_vs_cpython.json"
# Session 20: 100,000 requests under PyPy, one process and two, on session 20's machine.
PYPY_100K_S20_JSON = ROOT / "benchmarks/results/sim/fleet_speed_pypy_100k_s20.json"
# Session 20, on another machine kind (its cpu_id): the target run under PyPy on one process,
# and on two.
MILLION_PYPY_JSON = ROOT / "benchmarks/results/sim/fleet_speed_1m_pypy.json"
MILLION_PYPY_PARALLEL_S20_JSON = (ROOT / "benchmarks/results/sim/"
                                  "fleet_speed_1m_pypy_parallel_s20.json")
# Their first runs, one commit earlier (before results named the CPU's family and model).
MILLION_PYPY_FIRST_S20_JSON = ROOT / "benchmarks/results/sim/fleet_speed_1m_pypy_first_s20.json"
MILLION_PYPY_PARALLEL_FIRST_S20_JSON = (ROOT / "benchmarks/results/sim/"
                                        "fleet_speed_1m_pypy_parallel_first_s20.json")
# Session 16's first run of the speed command (the same machine, an earlier commit).
FIRST_S16_SPEED_JSON = ROOT / "benchmarks/results/sim/fleet_speed_s16_first.json"
FIRST_S17_SPEED_JSON = ROOT / "benchmarks/results/sim/fleet_speed_s17_first.json"


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


def _crossing_order(r: dict) -> str:
    known = {p: x for p, x in r["crossing_1s_rps"].items() if x is not None}
    if not known:
        return "No policy's p99 crossed 1 s between the loads simulated."
    order = sorted(known, key=lambda p: known[p])
    rest = [p for p in r["crossing_1s_rps"] if p not in known]
    return ("In this run the p99 crosses 1 s first for " + ", then ".join(
        f"{p} ({known[p]:,.0f} req/s)" for p in order) + "."
        + (f" Not crossed within the loads simulated: {', '.join(rest)}." if rest else ""))


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


def _speed() -> list[str]:
    if not SPEED_JSON.exists():
        return ["(run `everystop bench fleet-speed` for the simulator's own speed)"]
    s = json.loads(SPEED_JSON.read_text())
    return [
        *_target_headline(),
        f"`{s['command']}` ({s['replicas']} replicas, {s['requests']:,} requests of the "
        f"design's shape at {s['offered_load_fraction']:.0%} of capacity): "
        f"{s['cpu_s']:,} CPU-s ({s['wall_s']:,} s wall, load average "
        f"{s['loadavg_before'][0]:.1f} before and {s['loadavg_after'][0]:.1f} after, on "
        f"{_cpu(s)}), {s['cpu_ms_per_request']} CPU-ms per request, "
        f"{s['cpu_us_per_output_token']} CPU-us per output token. {_extrapolation(s)} to "
        f"{s['target_requests']:,} requests: **{s['extrapolated_cpu_s_for_target']:,.0f} CPU-s**"
        f" against the 600 s target: "
        + ("met." if s["meets_target_extrapolated"] else "**not met**."),
        *_speed_baseline(s),
        *_speed_million(),
        *_speed_million_parallel(s),
        *_speed_pypy(),
        *_speed_long(),
        *_speed_growth(),
        *_speed_parallel(s),
        "",
        "How: a replica whose running sequences all decode with nothing waiting runs a decode "
        "stretch (`sim/decode_stretch.py`): its pass times are planned ahead from the cost model "
        "and their effects (tokens, prefix-cache registrations, block growth through the real "
        "`KVCacheManager`, finishes through `Scheduler.finish_request`) applied lazily, where the "
        "per-pass loop would show them. The results are the same as running every pass through "
        "the scheduler (tests/sim/test_decode_stretch.py, and the pinned digests of "
        "tests/sim/test_fleet_pinned.py). The router (`routing/policies.py`) redoes a "
        "replica's in-flight correction only when that replica's report or its books changed, "
        "and scores each replica once per request: the same rankings. The cyclic garbage "
        "collector is off while the fleet runs (`sim/fleet.py`, `_gc_frozen`; session 9: 1.38x "
        "at 50,000 requests, `fleet_speed_ab_50k.json`). Session 10: the KV manager's "
        "allocation computes the blocks it needs once and "
        "registration hashes each block from the token tuple the pool keeps (one slice, not "
        "two), KV blocks have slots, and the stretches' per-row bookkeeping is inlined where it "
        "runs once per row per block; all of it the same behaviour (the same summary, the "
        "exactness tests, and a new test of the registered hash chain). Session 12: a pass's "
        "rows share the KV manager's block-id "
        "list instead of copying it (the manager never changes a list once made, growth "
        "replaces it; the executor's input building, the tensor-parallel wire format and the "
        "out-of-memory back-off only read it); `ScheduledSequence`, `RequestUpdate` and "
        "`Request` have slots; `PassBuilder.emit` and `update_from_output` inline the token "
        "slice, a decode row's budget, the stop check and the registration check; the "
        "step-cost fit's re-solve after every pass does the same arithmetic with less "
        "interpreter work (checked bit for bit against the old code); the cost model's "
        "latency builds no `Work` per pass; and the 64 block pools are built with the cyclic "
        "collector off (its passes over the growing pools tripled their build time). The same "
        "behaviour again: the same summary above, the exactness tests, tests/core and "
        "tests/engine.",
        "",
        "Session 15: a stretch's rows ride along the passes the scheduler runs itself "
        "(`Scheduler.lazy`, sim/decode_stretch.py's module note). Before, every pass that "
        "admitted or prefilled a newcomer (1.6 per request) walked every running row of the "
        "replica (~88) through `schedule()` and `update_from_output()`, and the stretch was "
        "closed before and rebuilt after over every row; now the scheduler grows and budgets "
        "the stretch's rows in bulk, in running order, walks only the others, and takes the "
        "rows back, up to date, wherever a preemption would rank them. The same decisions "
        "(the exactness tests above, which now also check that these passes and the give-backs "
        "ran).",
        "",
        "Session 16: the router finishes each replica's (tier, score) for a request from "
        "parts kept with its in-flight correction (`routing.load.score_parts`, redone only "
        "when that replica's report or books change) instead of calling `tier_and_score` per "
        "replica, and takes a report's unseen sends from the end of its books instead of "
        "copying all of them; a stretch's rows join a mixed pass's budget in one call "
        "(`StepBudget.add_decode_rows`); the rows at a block boundary grow and register their "
        "blocks in one KV call each (`KVCacheManager.grow_by_one_block`, `cache_next_blocks`) "
        "instead of one `allocate` and one `cache_computed_blocks` per row. The same floats and "
        "the same pool states as the row-by-row calls (hypothesis tests in tests/routing and "
        "tests/core, evictions and duplicate hashes included) and the same summary; the "
        "baseline paragraph above times them against session 15's tree.",
        "",
        *_speed_split(s),
        "",
        "Session 17: the parallel run looks ahead instead of stepping in lockstep (above, "
        "and `sim/fleet_parallel.py`'s module note): a replica's event is split into its end "
        "(the pass's finishes, which no later arrival can change: `fleet.end_part`) and its "
        "continuation (the queued arrivals joining, the next pass: `fleet.continuation`), "
        "run back to back in one process; a decode stretch can be cut at a pass whose end "
        "was applied ahead (`DecodeStretch.cut_at`). The one-process run does the same work "
        "as before but for those calls, yet came out 9-11% slower than session 16's tree in "
        "both 60,000-request commands this session (the baseline paragraph above; the "
        "baseline always runs first); paired 20,000-request runs alternated with that tree "
        "gave 23.5/26.0, 24.7/27.2, 29.4/32.0, 32.5/29.2 CPU-s (before/after) on a busy "
        "hour and 22.7/24.2, 22.4/21.9, 22.7/22.8 on a quiet one: a few per cent at most "
        "that this machine's noise does not let me pin down, left as it is. The same "
        "command's first run this session (`fleet_speed_s17_first.json`, one commit "
        "earlier, before the parked continuations got a heap of their own) gave two "
        + _first_s17() + ". Session 17's target run on two processes took 1,273 s wall "
        "(`fleet_speed_1m_parallel_s17.json`), 1.37x session 16's one-process run of 1,750 s "
        "(`fleet_speed_1m_s16.json`), with the same simulated figures.",
        "",
        "Session 18: five changes, the same simulated results (the exactness tests, the "
        "pinned digests, the same summary above). Without queue caps no replica refuses what "
        "another would take, so the fleet asks the router only for its first choice "
        "(`Router.best`: `rank()`'s scores, reason and pick, the least (tier, score, id) found "
        "without sorting 64 replicas; a hypothesis test holds it to `rank()[0]` for every "
        "policy, ties included). The fleet workload's prompts slice one shared list of token "
        "ids instead of making new int objects for every prompt (the same ids): the prefix "
        "caches keep millions of blocks' token tuples alive, and with them their own copies "
        "of those ints, so memory grew larger and colder as a run went on (60,000 requests, "
        "one run each: 94.9 to 86.0 CPU-s). The step-cost fit's first active-set round, "
        "all four coefficients free, is a written-out 4x4 elimination, the same operations "
        "in the same order (hypothesis tests against the general loop, bit for bit, nan and "
        "inf included). Growth in bulk drops a block table's id list instead of copying it "
        "with one more id at every block (`KVCacheManager.block_ids` makes it again when the "
        "scheduler asks, which it does only for rows it runs itself). A stretch's rows join "
        "a mixed pass's budget from positions and tier counts it keeps up to date, not from "
        "a list and a set rebuilt over every row. Instructions per request under cachegrind "
        "(3,000 requests less 500, deterministic where this machine's timings are not): "
        "3.01M to 2.77M, the memory change not counted. Tried and dropped: Cython 3.3 on the "
        "eleven hot modules as they are (no type declarations): within the noise of the "
        "interpreted run at 10,000 requests. The target run, measured on this session's code "
        "on one process and on two (above, minutes apart): 1,553 CPU-s on one, against "
        "session 16's 1,750; 1,350 s wall on two, against session 17's 1,273, so two "
        "processes gained only 1.15x over one this session (1.37x over another session's one "
        "process in session 17). The 60,000-request command shows the same swing between "
        "its runs: two processes 0.94x one process in an earlier run this session (two "
        "commits earlier; not kept, the tree changed while it ran), the figure above in the "
        "final one.",
        "",
        *_session_19(),
        "",
        *_session_20(),
        "",
        _why_600(),
        "",
        "Where the time goes (cProfile of the command's --profile-requests run, share of self "
        "time; building the 64 replicas' KV block pools is in it, which weighs heavily in a "
        "short run): "
        + ", ".join(f"{k} {v:.0%}" for k, v in s["profile_time_share"].items() if v >= 0.01)
        + ".",
    ]


def _session_19() -> list[str]:
    """What session 19 changed: the interpreter."""
    return [
        "Session 19: the same code under PyPy. The simulator needs nothing beyond the "
        "standard library but numpy (its percentiles), so it runs on PyPy 7.3.19 (Python "
        "3.11): Debian 13's package, which `scripts/ensure_pypy.sh` unpacks into a cache "
        "folder with the glibc it was built against (Debian 12's is older), checking the "
        "release signature and every checksum, and numpy from PyPy's own wheel on PyPI. "
        "`everystop simulate` runs there; `everystop bench` does not (its module imports the "
        "HTTP client's packages, its other subcommands torch), so the benchmark also runs as "
        "`python -m everystop.sim.fleet_speed`, and every "
        "result now names its interpreter (`machine.python`, with PyPy's collector settings). "
        "Two things were needed for speed there. PyPy's collector: with its default 4 MB "
        "nursery a 50,000-request run took 75 CPU-s, 19.5 s of it collecting; with a 256 MB "
        "nursery and a major collection only when the heap has grown 4x "
        "(`PYPY_GC_NURSERY=256MB PYPY_GC_MAJOR_COLLECT=4`) 46-57 CPU-s, 9-12 s collecting "
        "(the same target run on two processes: 1,047 s with the defaults, 728 s with "
        "these). And the messages to the worker: pickle writes a list an item at a time, in "
        "PyPy in Python, and every arrival's prompt (up to 1,024 ids) went that way; a "
        "`FleetRequest` now crosses packed as 32-bit ints (`FleetRequest.__reduce__`): the "
        "parent's sending fell from 16.5% to 7% of its time (vmprof), 100,000 requests on two "
        "processes 96.6 -> 92.8 s wall (one pair of runs of `fleet_speed.parallel_run`, not "
        "kept as JSON). Left as they are: the collector off (PyPy keeps every "
        "dead object then: 2.2 GiB at 20,000 requests), larger nurseries (1 GB) or rarer "
        "major collections (10x), and the JIT's trace limits: none better within this "
        "machine's noise. The cyclic collector stays off under CPython only "
        "(`fleet._gc_frozen`). The pinned digests and the stretch exactness tests run under "
        "PyPy too (`tests/sim/test_fleet_pypy.py`), and every PyPy run here checked its "
        "simulated figures against CPython's.",
    ]


def _machine(s: dict) -> str:
    """`_cpu`, and the interpreter that ran the result."""
    return f"{_cpu(s)}, {s.get('machine', {}).get('python', 'python')}"


def _target_headline() -> list[str]:
    """Where the 1M x 64 target stands, first: the run that decides it, and the machine."""
    one = _saved(MILLION_PYPY_JSON)
    if one is None:
        return []
    old = _saved(MILLION_PYPY_PARALLEL_JSON)
    cmp, here = _saved(PYPY_VS_CPYTHON_JSON), _saved(PYPY_100K_S20_JSON)
    par = _saved(MILLION_PYPY_PARALLEL_S20_JSON)
    return [
        f"**Where the target stands** ({one['target_requests']:,} requests over "
        f"{one['replicas']} replicas in under {one['target_s']} s): "
        + ("**met**" if one["meets_target_measured"] else "**not met**")
        + f" by a measured run under PyPy on one process, **{one['wall_s']:,.0f} s wall** "
        f"({one['cpu_s']:,.0f} CPU-s; `{one['command']}`), on {_machine(one)} (session 20, "
        "below)"
        + (f"; on two processes of the same machine, {par['wall_s']:,.0f} s wall"
           + ("" if par["same_simulated_as_one_process"] else
              " (**different simulated figures**)")
           if par is not None else "") + "."
        + (f" The machine matters as much as the code here: session 19's machine, which this "
           "VM also names an AMD EPYC with 2 vCPUs, had no AVX-512 "
           f"({' '.join(old['machine']['isa_flags'])}), and the same interpreter took "
           f"{old['wall_s']:,.0f} s on two processes there"
           + (f" and {cmp['steady_cpu_ms_per_request']} CPU-ms per request on one over "
              f"the steady state of {cmp['requests']:,} requests (this machine: "
              f"{here['steady_cpu_ms_per_request']}, `fleet_speed_pypy_100k_s20.json`)"
              if cmp is not None and here is not None else "")
           + "; so this target is met on this session's machine kind, not on that one. "
             "The CPython figures below are from the earlier machines."
           if old is not None else ""),
        "",
    ]


def _session_20() -> list[str]:
    """Session 20: the same code on another machine kind."""
    one = _saved(MILLION_PYPY_JSON)
    if one is None:
        return []
    first = _saved(MILLION_PYPY_FIRST_S20_JSON)
    par = _saved(MILLION_PYPY_PARALLEL_S20_JSON)
    out = [
        f"Session 20 ran on another machine kind: {_machine(one)}. Results now name the "
        "CPU's family, model and stepping (`machine.cpu_id`), since the VM gives both kinds "
        f"one model name. **The target run under PyPy on one process**, `{one['command']}` "
        f"(at {one['git_commit'][:7]}): **{one['cpu_s']:,.1f} CPU-s, {one['wall_s']:,.1f} s "
        f"wall**, against 600 s: " + _verdict(one["meets_target_measured"])
        + f" {one['cpu_ms_per_request']} CPU-ms per request, by tenth of the arrivals: "
        + _tenths(one["cpu_ms_per_request_by_tenth"])
        + f"; peak resident memory {one['max_rss_mib']:,.0f} MiB; "
        + _same_as_cpython(one) + "."
        + (f" Its first run, at {first['git_commit'][:7]} (the same simulator code; "
           f"`fleet_speed_1m_pypy_first_s20.json`): {first['cpu_s']:,.1f} CPU-s, "
           f"{first['wall_s']:,.1f} s wall, " + _same_as_cpython(first) + "."
           if first is not None else ""),
    ]
    small = _saved(PYPY_100K_S20_JSON)
    if small is not None and small.get("parallel"):
        sp = small["parallel"]
        out[0] += (
            f" At {small['requests']:,} requests, one command (`{small['command']}`, "
            "`fleet_speed_pypy_100k_s20.json`): one process "
            f"{small['cpu_s']:,.1f} CPU-s (steady state {small['steady_cpu_ms_per_request']} "
            f"CPU-ms per request), two processes {sp['wall_s']:,.1f} s wall "
            f"({sp['steady_wall_ms_per_request']} ms per request at the steady state, "
            f"{sp['speedup_steady_vs_one_process']:.2f}x one process)"
            + (", the same summary." if sp["same_summary"] else ", **a different summary**."))
    if par is not None:
        ratio = one["wall_s"] / par["wall_s"]
        out[0] += (
            f" On two processes, `{par['command']}`: {par['wall_s']:,.0f} s wall "
            f"({par['parent_cpu_s']:,.0f} CPU-s in the parent, {par['workers_cpu_s']:,.0f} "
            f"in the worker), {ratio:.2f}x the one-process run"
            + (", the same simulated figures" if par["same_simulated_as_one_process"]
               else ", **different simulated figures**")
            + (": on this machine the groups' waiting for each other and the messages cost "
               "more than the second vCPU gives, so one process is the way to run it here."
               if ratio < 1 else "."))
        pf = _saved(MILLION_PYPY_PARALLEL_FIRST_S20_JSON)
        if pf is not None:
            out[0] += (
                f" Its first run, at {pf['git_commit'][:7]} "
                "(`fleet_speed_1m_pypy_parallel_first_s20.json`, checked against the first "
                f"one-process run): {pf['wall_s']:,.0f} s wall ({pf['parent_cpu_s']:,.0f} and "
                f"{pf['workers_cpu_s']:,.0f} CPU-s)"
                + (", the same simulated figures." if pf["same_simulated_as_one_process"]
                   else ", **different simulated figures**."))
    return out


def _same_as_cpython(s: dict) -> str:
    """Whether a run's simulated figures are CPython's one-process run's."""
    cp = _saved(MILLION_SPEED_JSON)
    if cp is None:
        return "no CPython run to compare with"
    return ("the same simulated figures as CPython's one-process run" if cp["simulated"]
            == s["simulated"] else "**simulated figures different from CPython's run**")


def _why_600() -> str:
    """Where the target stands on session 19's machine (AVX2), from its PyPy run on two
    processes, and why two processes gave no more there."""
    p = _saved(MILLION_PYPY_PARALLEL_JSON)
    if p is None:
        return "(no PyPy run of the target yet)"
    if p["meets_target_measured"]:
        return (f"The 600 s target is met under PyPy on two processes ({p['wall_s']:,.0f} s "
                "wall, above).")
    return (
        f"Why 600 s was not met on session 19's machine ({_machine(p)}): PyPy on two "
        f"processes (above) took {p['wall_s']:,.0f} s "
        f"wall, {p['wall_s'] / 600:.2f}x the target. Each process was "
        "busy about three quarters of the time: a group may run ahead of the arrivals only by "
        "the cost model's shortest pass (~16 ms simulated, ~8 arrivals at 64 replicas), and "
        "the work of a few arrivals is uneven between the groups, so each waits for the "
        "other about a quarter of the time (idle, not stolen: /proc/stat over a 100,000-"
        "request run, 25% idle, 0.5% steal; three processes on these two vCPUs were slower, "
        "128.6 s against 102.5). Two independent one-process runs at once are each ~25% "
        "slower than one alone (session 18), so this VM's two vCPUs give at most ~1.6x one "
        "process whatever the simulator does. Under CPython the work is spread thin: py-spy "
        "at 250 Hz over 20,000 requests (session 18), inclusive: a stretch's rows growing and "
        "registering their blocks and finishing ~33%, the passes the scheduler runs itself "
        "~38%, the router's scoring of 64 replicas per arrival ~8%; compiling it as it is did "
        "not pay (mypyc ~8% on three modules, Cython nothing measurable on eleven). What is "
        "left to try there: moving the router's scoring and the block pool's books out of "
        "Python objects (a native block pool behind `KVCacheManager`)."
    )


def _cpu(s: dict) -> str:
    """The machine the run was timed on, as the result records it: the VM names different
    CPUs alike ("AMD EPYC"), so the family and model, where recorded, and the vector flags
    say which."""
    m = s.get("machine", {})
    model = m.get("model")
    if not model:
        return f"{s['cpu_count']} cores"
    cpu_id = f" ({m['cpu_id']})" if m.get("cpu_id") else ""
    flags = f" ({' '.join(m['isa_flags'])})" if m.get("isa_flags") else ""
    return f"{model}{cpu_id}, {s['cpu_count']} cores{flags}"


def _speed_split(s: dict) -> list[str]:
    """The timed run's CPU split between the scheduler's own passes and the rest, if recorded."""
    if "scheduler_pass_cpu_ms_per_request" not in s:
        return []
    sched, other = s["scheduler_pass_cpu_ms_per_request"], s["other_cpu_ms_per_request"]
    over = [name for name, v in (("the scheduler's passes", sched), ("the rest", other))
            if v / 1e3 * s["target_requests"] > s["target_s"]]
    if len(over) == 2:
        verdict = "each alone above the budget"
    else:
        verdict = f"{over[0]} alone above the budget" if over else "both within the budget"
    return [
        f"Split without a profiler in the timed run above (process time around every "
        f"replica's `start_pass` and `end_pass`): the scheduler's own passes took {sched} "
        f"CPU-ms per request ({sched / s['cpu_ms_per_request']:.0%}) and everything else "
        f"{other}: {verdict}.",
    ]


def _extrapolation(s: dict) -> str:
    """How the result's 1M figure was made: from its steady state where it was timed by tenths
    (fleet_speed.py), else the whole run's mean (older results)."""
    if s.get("steady_cpu_ms_per_request") is None:
        return ("Linear extrapolation of the whole run's mean (which the fleet's fill-up pulls "
                "down in a short run, see below)")
    return (f"Extrapolated from its steady state ({s['steady_cpu_ms_per_request']} CPU-ms per "
            "request over tenths 6-9 of the arrivals)")


def _verdict(met: bool) -> str:
    return "met." if met else "**not met**."


def _tenths(values: list[float]) -> str:
    """A run's figures by tenth of its arrivals, as the page lists them."""
    return ", ".join(f"{t:g}" for t in values)


def _speed_million() -> list[str]:
    """The target run itself on one process, where one was made."""
    if not MILLION_SPEED_JSON.exists():
        return []
    s = json.loads(MILLION_SPEED_JSON.read_text())
    if s.get("measured_cpu_s_for_target") is None:
        return []
    short = _saved(SPEED_JSON) or {}
    ratio = (s["steady_cpu_ms_per_request"] / short["steady_cpu_ms_per_request"]
             if short.get("steady_cpu_ms_per_request") else None)
    return [
        "",
        f"**The target run itself**, `{s['command']}`: {s['requests']:,} requests over "
        f"{s['replicas']} replicas, **{s['cpu_s']:,.0f} CPU-s** ({s['wall_s']:,.0f} s wall, one "
        f"process, peak resident memory {s['max_rss_mib']:,.0f} MiB) against 600 s: "
        + _verdict(s["meets_target_measured"])
        + f" {s['cpu_ms_per_request']} CPU-ms per request, by tenth of the arrivals: "
        + _tenths(s["cpu_ms_per_request_by_tenth"])
        + (f"; its steady state ({s['steady_cpu_ms_per_request']}) is {ratio:.2f}x the "
           "60,000-request command's above (this machine's speed moves by 20-35% between "
           "hours, and a run of 60,000 may not reach the long run's state, below)"
           if ratio else "")
        + ". The scheduler's own "
        f"passes took {s['scheduler_pass_cpu_ms_per_request']} CPU-ms per request of it."
        + (f" ({s['source_note']}.)" if s.get("source_note") else ""),
    ]


def _speed_pypy() -> list[str]:
    """The same sources under PyPy: PyPy against CPython in one command, and the target run on
    two processes, where those were made."""
    out: list[str] = []
    if PYPY_VS_CPYTHON_JSON.exists():
        c = json.loads(PYPY_VS_CPYTHON_JSON.read_text())
        b = c["baseline"]
        out += [
            "",
            f"**Under PyPy** (session 19). `{c['command']}`, on {_cpu(c)}: the same sources "
            f"and {c['requests']:,} requests on {c['machine']['python']} and then, in the same "
            f"command, on {b['python']} (its baseline, run first): **{c['cpu_s']:,.1f} CPU-s "
            f"against {b['cpu_s']:,.1f}, {b['speedup_cpu']:.2f}x less CPU** (steady state "
            f"{c['steady_cpu_ms_per_request']} against {b['steady_cpu_ms_per_request']} CPU-ms "
            f"per request, {b['speedup_steady']:.2f}x), "
            + ("the same simulated summary" if b["same_summary"]
               else "**a different simulated summary**")
            + f"; peak resident memory of the PyPy process {c['max_rss_mib']:,.0f} MiB. By "
            "tenth under PyPy: "
            + _tenths(c["cpu_ms_per_request_by_tenth"]) + "; under CPython: "
            + _tenths(b["cpu_ms_per_request_by_tenth"]) + ".",
        ]
    if MILLION_PYPY_PARALLEL_JSON.exists():
        p = json.loads(MILLION_PYPY_PARALLEL_JSON.read_text())
        cp = _saved(MILLION_PARALLEL_JSON)
        d = _saved(MILLION_PYPY_DEFAULT_GC_JSON)
        u = _saved(MILLION_PYPY_UNPACKED_JSON)
        out += [
            "",
            f"**The target run under PyPy on {p['workers']} processes**, `{p['command']}` "
            f"({p['machine']['python']}): **{p['wall_s']:,.0f} s wall** ({p['parent_cpu_s']:,.0f}"
            f" CPU-s in the parent, {p['workers_cpu_s']:,.0f} in the worker) against 600 s: "
            + _verdict(p["meets_target_measured"])
            + f" By tenth, ms wall per request: {_tenths(p['wall_ms_per_request_by_tenth'])}. "
            f"{p['one_process']['speedup_wall']:.2f}x CPython's one-process run above"
            + (f", {cp['wall_s'] / p['wall_s']:.2f}x CPython's two-process run"
               if cp is not None else "")
            + (", the same simulated figures" if p["same_simulated_as_one_process"]
               else ", **different simulated figures**")
            + "."
            + (f" With PyPy's default collector settings ({d['machine']['python']}, its 4 MB "
               f"nursery) the same run took {d['wall_s']:,.0f} s "
               "(`fleet_speed_1m_pypy_parallel_default_gc.json`)"
               + (", the same simulated figures" if d["same_simulated_as_one_process"]
                  else ", **different simulated figures**") + "."
               if d is not None else "")
            + (f" One commit earlier, before prompts crossed to the worker packed, the run "
               f"above took {u['wall_s']:,.0f} s ({u['parent_cpu_s']:,.0f} and "
               f"{u['workers_cpu_s']:,.0f} CPU-s; `fleet_speed_1m_pypy_parallel_before_"
               "packing.json`): the packing's gain at this size is within the machine's "
               "drift between the two runs."
               if u is not None else ""),
        ]
    return out


def _speed_million_parallel(s: dict) -> list[str]:
    """The target run on worker processes alone, where one was made (`s`: the 60,000-request
    command's result, whose extrapolation it is set against), beside the one-process run."""
    if not MILLION_PARALLEL_JSON.exists():
        return []
    short = s.get("parallel") or {}
    p = json.loads(MILLION_PARALLEL_JSON.read_text())
    one = _saved(MILLION_SPEED_JSON)
    same = one is not None and one.get("simulated") == p["simulated"]
    return [
        "",
        f"**The target run on {p['workers']} processes**, `{p['command']}`: "
        f"**{p['wall_s']:,.0f} s wall** ({p['parent_cpu_s']:,.0f} CPU-s in the parent, "
        f"{p['workers_cpu_s']:,.0f} in the worker, peak resident memory of the parent "
        f"{p['max_rss_mib']:,.0f} MiB) against 600 s: "
        + _verdict(p["meets_target_measured"])
        + f" {p['wall_ms_per_request']} ms wall per request, by tenth of the arrivals: "
        + _tenths(p["wall_ms_per_request_by_tenth"])
        + (f". {one['wall_s'] / p['wall_s']:.2f}x the one-process run above "
           f"({one['wall_s']:,.0f} s wall), "
           + ("the same simulated figures (finished, makespan, output tokens, passes, TTFT "
              "p99, TPOT p50, busy fractions)" if same
              else "**different simulated figures**")
           if one is not None else "")
        + (f". The 60,000-request command below extrapolated "
           f"{short['extrapolated_wall_s_for_target']:,.0f} s for it from tenths of "
           + _tenths(short["wall_ms_per_request_by_tenth"])
           + " ms; the measured figure is the one that counts"
           if short.get("extrapolated_wall_s_for_target") else "")
        + "." + (f" ({p['source_note']}.)" if p.get("source_note") else ""),
    ]


def _speed_long() -> list[str]:
    if not LONG_SPEED_JSON.exists():
        return []
    s = json.loads(LONG_SPEED_JSON.read_text())
    return [
        "",
        f"A longer run, `{s['command']}`: {s['cpu_s']:,} CPU-s ({s['wall_s']:,} s wall, load "
        f"average {s['loadavg_before'][0]:.1f} before and {s['loadavg_after'][0]:.1f} after), "
        f"{s['cpu_ms_per_request']} CPU-ms per request. {_extrapolation(s)} to "
        f"{s['target_requests']:,} requests: **{s['extrapolated_cpu_s_for_target']:,.0f} CPU-s**"
        " against 600 s: " + ("met." if s["meets_target_extrapolated"] else "**not met**.")
        + (f" ({s['source_note']}.)" if s.get("source_note") else ""),
        *_speed_baseline(s),
        "",
        *_speed_split(s),
    ]


def _speed_growth() -> list[str]:
    """Why a request costs more CPU in a longer run, from the long run's tenths if timed."""
    if not LONG_SPEED_JSON.exists():
        return []
    s = json.loads(LONG_SPEED_JSON.read_text())
    tenths, rows = (s.get("cpu_ms_per_request_by_tenth"),
                    s.get("running_rows_per_scheduler_pass_by_tenth"))
    if not tenths or not rows:
        return []
    return [
        "",
        "Why a request costs more in a longer run (that run, "
        f"{s['cpu_ms_per_request']} CPU-ms at {s['requests']:,}): not a leak, two fill-ups. "
        "By tenth "
        "of the long run's arrivals, CPU-ms per request: " + ", ".join(f"{t:g}" for t in tenths)
        + " (the last one with the drain after the last arrival and the teardown of the "
        "replicas); rows running as each scheduler pass starts, on average: "
        + ", ".join(f"{r:g}" for r in rows if r is not None) + ". "
        "The fleet starts empty, and every pass the scheduler runs itself walks all of its "
        "replica's running rows, so the first tenth costs half. Then the prefix caches fill "
        "(session 13: the pools' cached blocks, each keeping its token tuple, grew from 0.6M "
        "to 1.67M of 1.7M between 10,000 and 30,000 requests, resident memory from 0.76 to "
        "1.27 GB), after which every block taken evicts a cached one: the cost climbs at "
        "constant rows per pass until about the fifth tenth, then holds. Nothing else found "
        "grows with the run: the event heap, the router's books and every per-request map "
        "are bounded by the requests in flight, and a run that kept no finished-request "
        "records drifted the same. So the 1M figure comes from tenths 6-9.",
    ]


def _speed_parallel(s: dict) -> list[str]:
    """The run on worker processes (sim/fleet_parallel.py), timed beside one process."""
    p = s.get("parallel")
    if not p:
        return []
    saved = _saved(PARALLEL_SPEED_JSON)
    before = saved["parallel"] if saved is not None else None
    return [
        "",
        f"On {p['workers']} processes (`everystop simulate --workers N`, "
        "`sim/fleet_parallel.py`: the replicas dealt into groups, one in the parent with the "
        "router, the others in forked workers; each group applies pass ends ahead of the "
        "arrivals that cannot change them, below), timed in the same command: "
        f"{p['wall_s']:,} s wall ({p['parent_cpu_s']:,} CPU-s in the parent, "
        f"{p['workers_cpu_s']:,} in the worker), {p['steady_wall_ms_per_request']} ms per "
        f"request at the steady state: **{p['speedup_steady_vs_one_process']:.2f}x** one "
        "process's, "
        + ("the same simulated summary" if p["same_summary"] else "**a different summary**")
        + f"; extrapolated to {s['target_requests']:,} requests: "
        f"**{p['extrapolated_wall_s_for_target']:,.0f} s wall** against 600: "
        + ("met." if p["extrapolated_wall_s_for_target"] < 600 else "**not met**.")
        + " Until session 17 the groups stepped in lockstep, one round trip per arrival"
        + (f" (before session 15's lazy rows, `fleet_speed_parallel.json`: "
           f"{before['speedup_steady_vs_one_process']:.2f}x one process)" if before else "")
        + _parallel_first_s16()
        + " The same results as one process, record for record (tests/sim/"
        "test_fleet_parallel.py, a workload busy enough that groups look several arrivals "
        "ahead included; the pinned digests run on two processes too).",
    ]


def _parallel_first_s16() -> str:
    """Session 16's run of the command, where two processes in lockstep were even with one."""
    if not FIRST_S16_SPEED_JSON.exists():
        return ""
    first = json.loads(FIRST_S16_SPEED_JSON.read_text())
    p = first["parallel"]
    return (f"; in session 16 (`{FIRST_S16_SPEED_JSON.name}`) two processes gave "
            f"{p['speedup_steady_vs_one_process']:.2f}x: the parent waited ~240 us per "
            "arrival for the worker's answer (the heavy events between two arrivals land on "
            "one group or the other) and the worker spent ~150 us per message outside its "
            "events. Now a group that knows every arrival before t applies the ends of the "
            "passes that end before t plus the cost model's floor under any pass "
            "(`CostModel.min_latency_s`, 16.3 ms for a 4xH100/70B replica, while arrivals "
            "come ~1.9 ms apart at 64 replicas: such passes started before t, so nothing to "
            "come can change them) and tells their finishes, parking the rest of each event "
            "(the queued arrivals joining, the next pass) until its arrivals are known; the "
            "parent ranks an arrival once every group has told every finish before it, so "
            "the worker runs up to ~8 arrivals behind without holding the parent up, and "
            "the parent keeps a smaller share of the replicas (it also ranks: 29 of 64).")


def _first_s17() -> str:
    """Session 17's first run of the speed command: its two-process figures."""
    p = json.loads(FIRST_S17_SPEED_JSON.read_text())["parallel"]
    return (f"processes {p['speedup_steady_vs_one_process']:.2f}x one process, "
            f"{p['extrapolated_wall_s_for_target']:,.0f} s extrapolated")


def _speed_baseline(s: dict) -> list[str]:
    b = s.get("baseline")
    if not b:
        return []
    return [
        "",
        f"The same run on the sources before the latest speed-ups (`{b['src']}`, an export "
        "of the commit before them, timed first in the same command): "
        f"{b['cpu_s']:,} CPU-s, {b['cpu_ms_per_request']} CPU-ms per request; "
        + (f"**{b['speedup_cpu']:.2f}x** less CPU now, and " if b["speedup_cpu"] >= 1 else
           f"**{1 / b['speedup_cpu']:.2f}x** the CPU now (steady state "
           f"{b['steady_cpu_ms_per_request']} CPU-ms per request then, "
           f"{s['steady_cpu_ms_per_request']} now), and ")
        + ("the same simulated summary (every percentile, pass count and token count)."
           if b["same_summary"] else "**a different simulated summary** (a behaviour change).")
        + (f" ({s['source_note']}.)" if s.get("source_note") else ""),
    ]


def render(r: dict) -> str:
    """The whole page: one function per section, in the page's order."""
    lines = (_intro(r) + _load_section(r) + _chat_section(r) + _plan_section(r)
             + ["## Simulation speed", "", *_speed(), ""] + _running_it() + _not_modeled())
    return "\n".join(lines)


def _intro(r: dict) -> list[str]:
    """Where the numbers come from, and what the fleet simulator runs."""
    return [
        "# Fleet simulation and capacity planning",
        "",
        "<!-- Generated by `" + r["command"] + "`; do not edit by hand. -->",
        "",
        f"Every number here comes from one command, `{r['command']}` "
        f"({r['wall_s']:,.0f} s wall with {r['jobs']} processes, load average "
        f"{r['loadavg_before'][0]:.1f} -> {r['loadavg_after'][0]:.1f}); its JSON is "
        "`benchmarks/results/sim/fleet_report.json`."
        + (f" The load curve was then rerun alone (`{r['load_rerun']['command']}`, the same "
           "settings as the full command's defaults)." if "load_rerun" in r else ""),
        "",
        "Rerun in session 10 by today's command (the run before it was session 8's). Only "
        "what the load-aware routers decide moved: least-loaded's and prefix-affinity's "
        "columns and the fleet plan points (which route least-loaded); every round-robin and "
        "power-of-two number is unchanged, and so are the plans' replica counts and steady-"
        "state costs. Prefix-affinity's hit rate on the chats rose from 46.0% to 56.3%.",
        "",
        "The fleet simulator (`everystop simulate --replicas N --router POLICY`, "
        "`src/everystop/sim/fleet.py`) runs N copies of the production `Scheduler` + "
        "`KVCacheManager` on one discrete-event clock, each pass timed by the cost model "
        "(`sim/cost_model.py`), behind the production router (`everystop.routing`, the same "
        "scoring function the Ray Serve router calls). The router sees each replica's load "
        f"report as of its last refresh (every {r['stats_interval_s']} s here), corrected by "
        "its own count of requests sent and finished since, as the live router does. With one "
        "replica the fleet simulator reproduces the single-node simulator request for request "
        "(`tests/sim/test_fleet.py`). Both routers describe a request the same way "
        "(`routing.route_request`: its prompt's blocks plus its first sampled token's), and "
        "a simulation's every routing call replayed through the Ray Serve router gets the "
        "same ranking (`tests/cluster/test_cluster_units.py`).",
        "",
        f"Replicas: {r['tp']}x `{r['hardware']}` running `{r['model']}` (tensor parallel "
        f"{r['tp']}), chunked prefill, prefix caching on. Traffic: the design's shape (prompts "
        "128-1,024 tokens, replies 20-800, Poisson arrivals) unless said otherwise. Each point "
        "starts from an empty fleet and simulates "
        f"{r['durations_s']['load']:g} s of arrivals (chats: {r['durations_s']['chat']:g} s, "
        f"plan points: {r['durations_s']['plan']:g} s), so a load a little above capacity "
        "shows as a growing p99 rather than as a collapse.",
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
        "Least-loaded and prefix-affinity rank by the same score (on this traffic no two prompts "
        "share a block, so affinity never fires); power-of-two compares only the queue lengths "
        "of two random replicas; round-robin is blind to load and to the spread of reply "
        "lengths. " + _crossing_order(r),
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
        f"{r['slo']['tpot_p50_s'] * 1e3:g} ms, nothing rejected; router least-loaded. The "
        "planner of `everystop simulate plan` (`src/everystop/sim/plan.py`) first finds what one "
        f"replica sustains ({plan0['single_replica_rate_rps']} req/s, bisecting the rate, >= 400 "
        "requests per point); `rate / that` is the first guess. Here its fleet points are run "
        "in parallel over a grid of " + ", ".join(f"{g:.0%}" for g in r["plan_grid"])
        + " of the guess (the CLI gallops and bisects instead, one point at a time). Each fleet "
        f"point simulates only {r['durations_s']['plan']:g} s of arrivals from an empty fleet, "
        "shorter than a request's life at load (~10 s): the fleet never fills, so those points "
        "are optimistic and the fewest count that passed them is a lower bound at best. The "
        "plan is therefore the count from one replica's sustained rate, which was simulated "
        "long enough to saturate; its cost is the fleet point at that count.",
        "",
        *_plan_table(r),
        "",
        f"Price assumption: {plan0['price_assumption']}. Cost = fleet $/hour / (output tokens "
        "per second x 3,600) x 10^6, the design's formula. Steady state: the fleet emits what "
        "arrives, rate x 410 tokens per second (the mean reply of 20-800 tokens). The short "
        "fleet points pay every replica for the whole simulated span, warm-up and drain "
        "included, so their cost is higher. The curves searched:",
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
        "# (the rest run on the default node, 4x A100 80GB / 70B)",
        "# bursty (10 s at 2x the mean rate, then 20 s quieter) or a diurnal ramp",
        "everystop simulate --replicas 16 --traffic 'n=20000,rate=150,arrival=onoff:10:20:2'",
        "everystop simulate --replicas 16 --traffic 'n=20000,rate=150,arrival=diurnal:600:0.5'",
        "# long tails, tenants and tiers",
        "everystop simulate --replicas 16 --traffic 'n=20000,rate=150,"
        "prompt=lognormal:400:0.9:8000,output=lognormal:150:1.0:4000,tenants=4,"
        "tiers=0.2:0.6:0.2'",
        "# replay your own traffic: a JSON trace in the bench workload format",
        "everystop simulate --replicas 16 --workload my_trace.json",
        "# router information delay: fresh stats every 5 s (0 = every request)",
        "everystop simulate --replicas 16 --stats-interval-s 5 --traffic 'n=20000,rate=150'",
        "# the replicas on two processes (the same results; 0.9-1.8x one process on these",
        "# 2 vCPUs, depending on the hour)",
        "everystop simulate --replicas 64 --workers 2 --traffic 'n=20000,rate=500'",
        "# capacity plan",
        "everystop simulate plan --model llama-3-70b --hardware h100-sxm --tp 4 --rate 200 \\",
        "    --slo-ttft-p99 1.0 --slo-tpot-p50 0.05",
        "# this page (--render-only: from the saved JSONs) and the simulator's own speed",
        "everystop bench fleet-report",
        "everystop bench fleet-speed --requests 20000 --baseline-src OLD_TREE/src \\",
        "    --out benchmarks/results/sim/fleet_speed.json",
        "everystop bench fleet-speed --requests 60000 --profile-requests 1000 --workers 2 \\",
        "    --out benchmarks/results/sim/fleet_speed_parallel.json",
        "# the target run on two processes, checked against a one-process run of it",
        "everystop bench fleet-speed --requests 1000000 --workers 2 \\",
        "    --parallel-only benchmarks/results/sim/fleet_speed_1m.json \\",
        "    --out benchmarks/results/sim/fleet_speed_1m_parallel.json",
        "# the same under PyPy (Debian 13's, unpacked by the script: signature and checksums",
        "# checked, no root), its collector given a 256 MB nursery; and PyPy beside CPython",
        "PYPY=$(scripts/ensure_pypy.sh)",
        "# the target run on one process (under 600 s on session 20's machine, above)",
        "PYPY_GC_NURSERY=256MB PYPY_GC_MAJOR_COLLECT=4 PYTHONPATH=src \\",
        "    $PYPY -m everystop.sim.fleet_speed --requests 1000000 --profile-requests 1000 \\",
        "    --out benchmarks/results/sim/fleet_speed_1m_pypy.json",
        "# on two processes",
        "PYPY_GC_NURSERY=256MB PYPY_GC_MAJOR_COLLECT=4 PYTHONPATH=src \\",
        "    $PYPY -m everystop.sim.fleet_speed --requests 1000000 --workers 2 \\",
        "    --parallel-only benchmarks/results/sim/fleet_speed_1m.json \\",
        "    --out benchmarks/results/sim/fleet_speed_1m_pypy_parallel.json",
        "PYPY_GC_NURSERY=256MB PYPY_GC_MAJOR_COLLECT=4 PYTHONPATH=src \\",
        "    $PYPY -m everystop.sim.fleet_speed --requests 100000 --profile-requests 1000 \\",
        "    --baseline-src src --baseline-python .venv/bin/python \\",
        "    --out benchmarks/results/sim/fleet_speed_pypy_vs_cpython.json",
        "# any simulation under PyPy: the simulate subcommand needs only numpy",
        "PYTHONPATH=src $PYPY -m everystop simulate --replicas 16 --traffic 'n=20000,rate=150'",
        "```",
        "",
        "`--replicas 1` gives exactly the single-node simulator's results for the same workload. "
        "Traffic keys are documented in `src/everystop/sim/fleet_workload.py`; `rate` counts "
        "every request, follow-up turns included (the first think-times are a ramp-up).",
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
