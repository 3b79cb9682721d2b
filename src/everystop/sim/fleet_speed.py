"""How fast the fleet simulator runs: requests simulated per CPU-second across 64 replicas, where
the time goes (the real scheduler vs the simulator around it), and the 1M-request extrapolation.

    everystop bench fleet-speed [--requests 20000] [--replicas 64] \
        [--out benchmarks/results/sim/fleet_speed.json]
    pypy3 -m everystop.sim.fleet_speed [the same options]   # under PyPy (see main)

The traffic is the design's shape (prompts 128-1,024, replies 20-800 tokens) at `--load` times
what one 4xH100/70B replica serves within a 1 s p99 TTFT (~9.25 req/s, `everystop simulate
plan`), so batches look like a busy fleet's. A smaller profiled run splits the time by module.
The machine is shared: CPU seconds (process time) are the figure to trust, wall is reported
beside it, and the load average before and after. The timed run also splits its CPU between
the passes the scheduler runs itself and everything else (stretches, routing, the event loop),
without a profiler: process time around each replica's `start_pass` and `end_pass`.

The cost per request is not flat over a run: the fleet starts empty and its replicas' running
batches fill up over the first ~20 simulated seconds (mean rows per scheduler pass ~35 in the
first 10 s, ~88 from 20 s on, at 64 replicas and 0.9 load), and every pass the scheduler runs
itself walks all of them; then, once the KV pools have turned over, every block taken evicts a
cached prefix. So the run is timed per tenth of its arrivals (`by_tenth`), and the 1M-request
extrapolation uses the rate over tenths 6-9 (`steady_cpu_ms_per_request`), not the whole run's
mean, which a short run's warm-up pulls down.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import resource
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from everystop.results import write_result
from everystop.routing import make_router
from everystop.sim.fleet import Replica
from everystop.sim.fleet_metrics import summarize_fleet
from everystop.sim.fleet_run import simulate_fleet
from everystop.sim.fleet_workload import FleetRequest, fleet_traffic
from everystop.sim.node import build_node
from everystop.sim.plan import DESIGN_TRAFFIC

SINGLE_REPLICA_RPS = 9.25  # `everystop simulate plan` at 1 s p99 TTFT / 50 ms p50 TPOT


# The same timed run against another source tree (--baseline-src), in a fresh process; it uses
# only what the fleet simulator has exposed since it was written.
_BASELINE_DRIVER = """
import json, sys, time
from everystop.routing import make_router
from everystop.sim.fleet_run import simulate_fleet
from everystop.sim.fleet_metrics import summarize_fleet
from everystop.sim.fleet_workload import fleet_traffic
from everystop.sim.node import build_node
replicas, router, spec, n = json.loads(sys.argv[1])
node = build_node("llama-3-70b", "h100-sxm", 4)
marks = []
def timed(requests):  # process time at every tenth of the arrivals (as tenth_marks does)
    for i, r in enumerate(requests):
        if i * 10 % n < 10:
            marks.append(time.process_time())
        yield r
cpu0, wall0 = time.process_time(), time.perf_counter()
result = simulate_fleet(timed(fleet_traffic(spec)), node.setup, node.cost.latency, replicas,
                        make_router(router), stats_interval_s=1.0)
cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
marks.append(time.process_time())
import platform
print(json.dumps({"summary": summarize_fleet(result, 12.0), "cpu_s": cpu, "wall_s": wall,
                  "marks": marks,
                  "python": sys.implementation.name + " " + platform.python_version()}))
"""


def traffic_spec(requests: int, replicas: int, load: float) -> str:
    rate = load * SINGLE_REPLICA_RPS * replicas
    return f"{DESIGN_TRAFFIC},n={requests},rate={rate},seed=0"


def baseline_run(src: str, requests: int, replicas: int, load: float, router: str,
                 python: str | None = None) -> dict:
    """timed_run on the sources under `src` (e.g. an export of the commit before a speed-up),
    on the interpreter `python` (default: this one)."""
    env = dict(os.environ, PYTHONPATH=str(Path(src).resolve()))
    arg = json.dumps([replicas, router, traffic_spec(requests, replicas, load), requests])
    out = subprocess.run([python or sys.executable, "-c", _BASELINE_DRIVER, arg], env=env,
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


@contextmanager
def scheduler_pass_cpu(spent: list[float], marks: list[float] | None = None,
                       rows: list[list[int]] | None = None) -> Iterator[None]:
    """Adds to spent[0] the process time of the passes the scheduler runs itself
    (Replica.start_pass: schedule() and the pass's latency; Replica.end_pass:
    update_from_output()). Two clock reads per such pass, well under 1% of a run.
    With `rows`: per tenth of the arrivals (len(marks) - 1, see tenth_marks), how many such
    passes started and the rows running as each started (before its admissions), summed."""
    originals = {name: getattr(Replica, name) for name in ("start_pass", "end_pass")}

    def timed(method: Callable) -> Callable:
        counting = rows is not None and marks is not None and method.__name__ == "start_pass"

        def run(self: Replica) -> object:
            if counting:
                assert rows is not None and marks is not None
                while len(rows) < len(marks):
                    rows.append([0, 0])
                if rows:
                    rows[-1][0] += 1
                    rows[-1][1] += len(self.sched.running)
            t0 = time.process_time()
            try:
                return method(self)
            finally:
                spent[0] += time.process_time() - t0
        return run

    for name, method in originals.items():
        setattr(Replica, name, timed(method))
    try:
        yield
    finally:
        for name, method in originals.items():
            setattr(Replica, name, method)


def tenth_marks(requests: Iterable[FleetRequest], n: int, marks: list[float],
                clock: Callable[[], float] = time.process_time) -> Iterator[FleetRequest]:
    """The requests, appending the process time to `marks` as the simulator takes the first of
    each tenth of the n (a multiple of 10; one more mark after the run closes the last tenth
    and the drain)."""
    for i, r in enumerate(requests):
        if i * 10 % n < 10:
            marks.append(clock())
        yield r


def by_tenth(marks: list[float], n: int) -> dict:
    """CPU-ms per request in each tenth of the arrivals (the last one includes the drain after
    the last arrival and the teardown), and the rate over tenths 6-9: the steady state a long
    run settles in (the drain's finishes are work its requests owe, paid late; a 1M run's
    warm-up and drain are a sliver of it)."""
    if len(marks) != 11:
        return {"cpu_ms_per_request_by_tenth": None, "steady_cpu_ms_per_request": None}
    tenth = n / 10
    return {"cpu_ms_per_request_by_tenth": [round((b - a) / tenth * 1e3, 3)
                                            for a, b in zip(marks, marks[1:])],
            "steady_cpu_ms_per_request": round((marks[9] - marks[5]) / (4 * tenth) * 1e3, 3)}


def timed_run(requests: int, replicas: int, load: float, router: str,
              marks: list[float] | None = None) -> tuple[dict, float, float]:
    node = build_node("llama-3-70b", "h100-sxm", 4)
    spec = traffic_spec(requests, replicas, load)
    traffic: Iterable[FleetRequest] = fleet_traffic(spec)
    if marks is not None:
        traffic = tenth_marks(traffic, requests, marks)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    result = simulate_fleet(traffic, node.setup, node.cost.latency, replicas,
                            make_router(router), stats_interval_s=1.0)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    if marks is not None:
        marks.append(time.process_time())
    return summarize_fleet(result, 12.0), cpu, wall


def timed_split_run(requests: int, replicas: int, load: float,
                    router: str) -> tuple[dict, float, float, float, dict]:
    """timed_run, plus the CPU seconds of the scheduler's own passes within it, and the run
    by tenths of its arrivals (CPU per request, and mean running rows per scheduler pass)."""
    spent = [0.0]
    marks: list[float] = []
    rows: list[list[int]] = []  # per tenth: [scheduler passes, running rows summed over them]
    with scheduler_pass_cpu(spent, marks, rows):
        summary, cpu, wall = timed_run(requests, replicas, load, router, marks)
    tenths = by_tenth(marks, requests)
    tenths["running_rows_per_scheduler_pass_by_tenth"] = [
        round(r / p, 1) if p else None for p, r in rows]
    return summary, cpu, wall, spent[0], tenths


def parallel_run(requests: int, replicas: int, load: float, router: str,
                 workers: int) -> dict:
    """The same run on `workers` processes (sim/fleet_parallel.py): wall time, the parent's and
    the workers' CPU, and wall time per request by tenth of the arrivals (the parent takes
    arrivals in order, so its wall clock at each tenth times the whole fleet up to there)."""
    node = build_node("llama-3-70b", "h100-sxm", 4)
    marks: list[float] = []
    traffic = tenth_marks(fleet_traffic(traffic_spec(requests, replicas, load)), requests,
                          marks, time.perf_counter)
    children0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    result = simulate_fleet(traffic, node.setup, node.cost.latency, replicas,
                            make_router(router), stats_interval_s=1.0, workers=workers)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    marks.append(time.perf_counter())
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    tenths = by_tenth(marks, requests)
    return {"workers": workers, "wall_s": round(wall, 2), "parent_cpu_s": round(cpu, 2),
            "workers_cpu_s": round(children.ru_utime + children.ru_stime
                                   - children0.ru_utime - children0.ru_stime, 2),
            "wall_ms_per_request_by_tenth": tenths["cpu_ms_per_request_by_tenth"],
            "steady_wall_ms_per_request": tenths["steady_cpu_ms_per_request"],
            "summary": summarize_fleet(result, 12.0)}


def profile_split(requests: int, replicas: int, load: float, router: str) -> dict:
    """Share of profiled time per part of the code (cProfile inflates everything about 3x, but
    evenly enough to show where the time goes)."""
    prof = cProfile.Profile()
    prof.enable()
    timed_run(requests, replicas, load, router)
    prof.disable()
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    parts: dict[str, float] = {}
    for (path, _, _), (_, _, tottime, _, _) in stats.items():
        if "/everystop/core/" in path:
            key = "core (Scheduler, KVCacheManager, block pool)"
        elif "/everystop/routing/" in path:
            key = "routing"
        elif "/everystop/sim/" in path:
            key = "sim (" + Path(path).name + ")"
        else:
            key = "python builtins and stdlib"
        parts[key] = parts.get(key, 0.0) + tottime
    total = sum(parts.values())
    return {k: round(v / total, 3) for k, v in sorted(parts.items(), key=lambda kv: -kv[1])}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--requests", type=int, default=20_000)
    ap.add_argument("--replicas", type=int, default=64)
    ap.add_argument("--load", type=float, default=0.9)
    ap.add_argument("--router", default="least-loaded")
    ap.add_argument("--profile-requests", type=int, default=3_000)
    ap.add_argument("--target-requests", type=int, default=1_000_000)
    ap.add_argument("--baseline-src", default=None,
                    help="also time the same run on the sources in this directory (an export "
                         "of another commit's src/), first, and check it simulates the same")
    ap.add_argument("--baseline-python", default=None, metavar="INTERPRETER",
                    help="run the --baseline-src run on this interpreter (e.g. CPython beside "
                         "a PyPy run of the same sources)")
    ap.add_argument("--workers", type=int, default=1,
                    help="also time the run on this many processes (sim/fleet_parallel.py) and "
                         "check it simulates the same; its wall time is the figure then")
    ap.add_argument("--parallel-only", default=None, metavar="ONE_PROCESS_JSON",
                    help="time only the run on --workers processes (a run of the target's "
                         "size takes half an hour in one process), and check what it "
                         "simulated against this earlier one-process result of the same run")
    ap.add_argument("--out", default=None)


def run(args: argparse.Namespace) -> int:
    if args.parallel_only:
        return run_parallel_only(args)
    load_before = os.getloadavg()
    baseline = None
    if args.baseline_src:
        baseline = baseline_run(args.baseline_src, args.requests, args.replicas, args.load,
                                args.router, args.baseline_python)
    summary, cpu, wall, sched_cpu, tenths = timed_split_run(args.requests, args.replicas,
                                                            args.load, args.router)
    parallel = None
    if args.workers > 1:
        parallel = parallel_run(args.requests, args.replicas, args.load, args.router,
                                args.workers)
        par_summary = parallel.pop("summary")
        parallel["same_summary"] = json.loads(json.dumps(par_summary)) == json.loads(
            json.dumps(summary))
        par_steady = parallel["steady_wall_ms_per_request"]
        parallel["extrapolated_wall_s_for_target"] = (
            round(par_steady / 1e3 * args.target_requests, 1) if par_steady else None)
        if par_steady and tenths["steady_cpu_ms_per_request"]:
            parallel["speedup_steady_vs_one_process"] = round(
                tenths["steady_cpu_ms_per_request"] / par_steady, 3)
    load_after = os.getloadavg()
    per_req_cpu = cpu / args.requests
    steady = tenths["steady_cpu_ms_per_request"]
    # the 1M run is almost all steady state: its rate, where the run was long enough to time it
    per_req_target = steady / 1e3 if steady is not None else per_req_cpu
    if baseline is not None:
        base_tenths = by_tenth(baseline.get("marks", []), args.requests)
        base_steady = base_tenths["steady_cpu_ms_per_request"]
        baseline = {"src": args.baseline_src, "python": baseline.get("python"),
                    "cpu_s": round(baseline["cpu_s"], 2),
                    "wall_s": round(baseline["wall_s"], 2),
                    "cpu_ms_per_request": round(baseline["cpu_s"] / args.requests * 1e3, 3),
                    "speedup_cpu": round(baseline["cpu_s"] / cpu, 3),
                    **base_tenths,
                    "speedup_steady": (round(base_steady / steady, 3)
                                       if base_steady and steady else None),
                    "same_summary": json.loads(json.dumps(summary)) == baseline["summary"]}
    write_result({
        "benchmark": "fleet_sim_speed",
        "command": (f"{invocation(args)} --requests {args.requests} --replicas "
                    f"{args.replicas} --load {args.load} --router {args.router} "
                    f"--profile-requests {args.profile_requests}"
                    + (f" --baseline-src {args.baseline_src}" if args.baseline_src else "")
                    + (f" --baseline-python {args.baseline_python}"
                       if args.baseline_python else "")
                    + (f" --workers {args.workers}" if args.workers > 1 else "")),
        "model": "llama-3-70b", "hardware": "h100-sxm", "tp": 4,
        "replicas": args.replicas, "router": args.router, "traffic": DESIGN_TRAFFIC,
        "offered_load_fraction": args.load, "requests": args.requests,
        "cpu_s": round(cpu, 2), "wall_s": round(wall, 2),
        "cpu_ms_per_request": round(per_req_cpu * 1e3, 3),
        "cpu_us_per_output_token": round(cpu / summary["output_tokens"] * 1e6, 3),
        "requests_per_cpu_s": round(args.requests / cpu, 1),
        # the passes the scheduler runs itself (admissions, prefill chunks, with every row of
        # the replica) and everything else (decode stretches, routing, the event loop)
        "scheduler_pass_cpu_s": round(sched_cpu, 2),
        "scheduler_pass_cpu_ms_per_request": round(sched_cpu / args.requests * 1e3, 3),
        "other_cpu_ms_per_request": round((cpu - sched_cpu) / args.requests * 1e3, 3),
        **tenths,
        "extrapolated_cpu_s_for_target": round(per_req_target * args.target_requests, 1),
        "target_requests": args.target_requests, "target_s": 600,
        "meets_target_extrapolated": per_req_target * args.target_requests < 600,
        # A run of the target's size or more is the measurement itself, not an extrapolation.
        "measured_cpu_s_for_target": (round(per_req_cpu * args.target_requests, 1)
                                      if args.requests >= args.target_requests else None),
        "meets_target_measured": (per_req_cpu * args.target_requests < 600
                                  if args.requests >= args.target_requests else None),
        # peak resident memory of this process (the timed one-process run is the biggest)
        "max_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "extrapolation": "the CPU per request over tenths 6-9 of the arrivals (steady_cpu_ms_"
                         "per_request) times the target: the fleet fills up over the first "
                         "simulated seconds (running_rows_per_scheduler_pass_by_tenth), and "
                         "every scheduler pass walks all running rows, so the whole run's mean "
                         "understates a long run's cost",
        "loadavg_before": load_before, "loadavg_after": load_after, "cpu_count": os.cpu_count(),
        "simulated": {k: summary[k] for k in ("num_finished", "makespan_s", "output_tokens",
                                              "num_passes", "ttft_p99_ms", "tpot_p50_ms",
                                              "busy_fraction_min_max")},
        "baseline": baseline,
        "parallel": parallel,
        "profile_time_share": profile_split(args.profile_requests, args.replicas, args.load,
                                            args.router),
    }, args.out)
    return 0


def run_parallel_only(args: argparse.Namespace) -> int:
    """The run on --workers processes alone, its wall time the measurement; what it simulated
    is checked against a one-process result of the same command (its `simulated`)."""
    if args.workers < 2:
        raise SystemExit("--parallel-only needs --workers 2 or more")
    one = json.loads(Path(args.parallel_only).read_text())
    if (one["requests"], one["replicas"], one["router"], one["offered_load_fraction"]) != (
            args.requests, args.replicas, args.router, args.load):
        raise SystemExit(f"{args.parallel_only} is not a one-process run of this size")
    load_before = os.getloadavg()
    parallel = parallel_run(args.requests, args.replicas, args.load, args.router, args.workers)
    summary = parallel.pop("summary")
    simulated = {k: summary[k] for k in one["simulated"]}
    wall = parallel["wall_s"]
    target = args.requests >= args.target_requests
    write_result({
        "benchmark": "fleet_sim_speed_parallel",
        "command": (f"{invocation(args)} --requests {args.requests} --replicas "
                    f"{args.replicas} --load {args.load} --router {args.router} "
                    f"--workers {args.workers} --parallel-only {args.parallel_only}"),
        "model": "llama-3-70b", "hardware": "h100-sxm", "tp": 4,
        "replicas": args.replicas, "router": args.router, "traffic": DESIGN_TRAFFIC,
        "offered_load_fraction": args.load, "requests": args.requests,
        **parallel,
        "wall_ms_per_request": round(wall / args.requests * 1e3, 3),
        "target_requests": args.target_requests, "target_s": 600,
        "measured_wall_s_for_target": wall if target else None,
        "meets_target_measured": wall < 600 if target else None,
        "one_process": {"result": args.parallel_only, "cpu_s": one["cpu_s"],
                        "wall_s": one["wall_s"],
                        "speedup_wall": round(one["wall_s"] / wall, 3)},
        "same_simulated_as_one_process": json.loads(json.dumps(simulated)) == one["simulated"],
        "simulated": simulated,
        "max_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
        "cpu_count": os.cpu_count(),
    }, args.out)
    return 0


def invocation(args: argparse.Namespace) -> str:
    """How the benchmark was started, for the result's `command`."""
    return getattr(args, "invocation", "everystop bench fleet-speed")


def main(argv: list[str] | None = None) -> int:
    """`python -m everystop.sim.fleet_speed [options]`: the benchmark on its own, for an
    interpreter `everystop bench` does not run on (PyPy: the bench module imports the HTTP
    client's packages, its other subcommands torch; this needs only the simulator and numpy)."""
    ap = argparse.ArgumentParser(prog="python -m everystop.sim.fleet_speed",
                                 description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(ap)
    args = ap.parse_args(argv)
    args.invocation = f"{Path(sys.executable).name} -m everystop.sim.fleet_speed"
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
