"""`everystop bench speculative`: speculative decoding's speed, off / ngram / draft, in one run.

    everystop bench speculative [--llama-server PATH] [--quick] [--scenarios A,B]
                                [--max-tokens N] [--out FILE]

Each configuration is measured through one client (`everystop bench serve`'s) in three
scenarios, on servers started on loopback and stopped after:

- `grounded_single`: spec-grounded-32 (fix code, correct text, extract fields, reformat: answers
  copy their input), one request at a time;
- `chat_single`: single-16 (text with nothing to copy), one at a time;
- `grounded_concurrent`: spec-grounded-32, all 32 at once (throughput, TTFT p99).

everystop runs with `--speculative off`, `ngram` and `draft:DRAFT`; with `--llama-server`,
llama.cpp's server runs on the same files with no speculation, `--spec-type ngram-simple` and
the draft model (`-md`), K draft tokens at most throughout. everystop serves every scenario
from one server; llama.cpp serves the single streams with its own defaults (but threads, and
the metrics the acceptance is read from), as a user running one stream would, and the
concurrent scenario with a slot per stream, each holding the longest request. The target is
an F16 copy of the default model (written once to --work-dir; `--target` to give one) and
the draft the default model's Q4_1 file: the same model, the draft four times fewer bytes per
weight.

The grounded requests stop at the model's end of turn (`ignore_eos` false): past its answer a
model writes text its input does not contain, which is not what this workload measures. Greedy
speculation is lossless, so every everystop configuration emits the same tokens; rates are per
emitted token. Whether it did is checked on servers run once more with `--batch-invariant`
and fp32 activations (bench/spec_tokens.py: 16-bit activations are not batch-invariant, and bf16
logits tie at their rounding step; `--token-check none` skips it). The chat scenario
keeps the client's `ignore_eos` (64 tokens each). Recorded: the exact command and peak RSS of
the server each scenario ran on, the draft acceptance (each server's /metrics), the CPU's
flags (the result's envelope); a PNG of output tok/s per scenario goes next to the JSON.
`--quick`: 2-4 requests of at most 16 tokens per scenario and the default model as its own
target (a smoke test, not a result).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import re
import shlex
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx

from everystop.bench.client import ServeOptions, run_serve
from everystop.results import write_result
from everystop.workload import Workload, load_workload

WORKLOADS = Path(__file__).resolve().parents[3] / "benchmarks/workloads"
GROUNDED, CHAT = "spec-grounded-32.json", "single-16.json"
METHODS = ("off", "ngram", "draft")
# (name, workload file, concurrency, the grounded workload's natural stops)
SCENARIOS = (("grounded_single", GROUNDED, 1, True), ("chat_single", CHAT, 1, False),
             ("grounded_concurrent", GROUNDED, 32, True))
_SPEC_COUNTER = re.compile(
    r"^\S*spec_decode_num_(draft|accepted)_tokens_total(?:\{[^}]*\})? (\S+)$")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--out", type=Path, help="result JSON, the plot next to it (.png); default: "
                    "benchmarks/results/cpu/KIND/speculative.json for this CPU kind, where the "
                    "performance page reads it (--quick: printed only)")
    ap.add_argument("--quick", action="store_true", help="a smoke test: a few short requests")
    ap.add_argument("--llama-server", help="a llama-server binary: measure llama.cpp too")
    ap.add_argument("--target", help="the target GGUF (default: an F16 copy of the default "
                    "model, written to --work-dir; --quick: the default model)")
    ap.add_argument("--draft", help="the draft GGUF (default: the default model's Q4_1 file)")
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/everystop-f16"),
                    help="where the F16 copy is written (kept: a rerun reuses it)")
    ap.add_argument("--num-speculative-tokens", type=int, default=4, help="K for every method")
    ap.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                    help="everystop's dtype (auto: bfloat16 where the CPU has bf16 units)")
    ap.add_argument("--methods", default=",".join(METHODS), help="a subset of off,ngram,draft")
    ap.add_argument("--scenarios", default=",".join(s[0] for s in SCENARIOS),
                    help="a subset of the scenarios, by name")
    ap.add_argument("--max-tokens", type=int, default=0,
                    help="cap each request's output tokens (0: the workload's own)")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                    help="llama.cpp's threads (-t, -tb)")
    ap.add_argument("--everystop-flags", default="", help="more `everystop serve` flags")
    ap.add_argument("--token-check", default="batch-invariant",
                    choices=("batch-invariant", "none"),
                    help="check that speculation emits off's text, on batch-invariant servers "
                         "(none: skip)")


def _models(args: argparse.Namespace) -> tuple[str, str]:
    from everystop.executor.models.loader import default_model_path

    default = default_model_path()
    if args.target:
        return args.target, args.draft or default
    if args.quick:
        return default, args.draft or default
    from everystop.bench.gguf_f16 import default_model_f16

    return str(default_model_f16(args.work_dir)), args.draft or default


def _workloads(quick: bool, names: list[str], max_tokens: int = 0
               ) -> dict[str, tuple[Workload, int, bool]]:
    """Each named scenario's workload, concurrency and whether its requests may stop
    naturally; each request's output capped at `max_tokens` (0: no cap)."""
    out = {}
    for name, file, concurrency, natural in SCENARIOS:
        if name not in names:
            continue
        wl = load_workload(WORKLOADS / file)
        if quick:
            concurrency = min(concurrency, 4)
            wl = wl.head(concurrency if concurrency > 1 else 2)
            max_tokens = min(max_tokens or 16, 16)
        if max_tokens:
            for r in wl.requests:
                r.max_tokens = min(r.max_tokens, max_tokens)
        out[name] = (wl, concurrency, natural)
    return out


def everystop_flags(method: str, target: str, draft: str, args: argparse.Namespace) -> list[str]:
    """`everystop serve` flags for one method (off, ngram, draft)."""
    spec = {"off": "off", "ngram": "ngram", "draft": f"draft:{draft}"}[method]
    flags = ["--model", target, "--dtype", args.dtype, "--speculative", spec]
    if method != "off":
        flags += ["--num-speculative-tokens", str(args.num_speculative_tokens)]
    return flags + shlex.split(args.everystop_flags)


def llamacpp_flags(method: str, draft: str, args: argparse.Namespace,
                   longest: int, streams: int) -> list[str]:
    """llama-server flags for one method serving `streams` streams at once: for one, its own
    defaults; for more, a slot per stream, each holding the longest request. ngram is its
    prompt lookup (`ngram-simple`, looking up the last 4 tokens as everystop's longest n-gram,
    K tokens guessed), draft its draft model (`-md`, at most K a step)."""
    t, k = str(args.threads), str(args.num_speculative_tokens)
    slots = ["-np", str(streams), "-c", str(streams * longest)] if streams > 1 else []
    flags = [*slots, "-t", t, "-tb", t, "--metrics"]
    if method == "ngram":
        flags += ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "4",
                  "--spec-ngram-simple-size-m", k]
    elif method == "draft":
        flags += ["-md", draft, "--spec-type", "draft-simple", "--spec-draft-n-max", k,
                  "--spec-draft-n-min", "0", "-td", t, "-tbd", t]
    return flags


def spec_counters(url: str) -> dict[str, float]:
    """The draft and accepted token counters from /metrics, as everystop and llama.cpp (with
    --metrics) both name them (zeros where absent)."""
    out = {"draft": 0.0, "accepted": 0.0}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if (m := _SPEC_COUNTER.match(line)) is not None:
            out[m.group(1)] = max(out[m.group(1)], float(m.group(2)))
    return out


def measure(url: str, workloads: dict[str, tuple[Workload, int, bool]]) -> dict[str, Any]:
    """Every scenario against one server (a short warm-up first): summary numbers and each
    request's output token count."""
    out: dict[str, Any] = {}
    first = next(iter(workloads.values()))[0]
    warm = Workload("warm-up", 0, {}, [replace(first.requests[0], max_tokens=8)])
    asyncio.run(run_serve(warm, ServeOptions(base_url=url, progress=False)))
    for name, (wl, concurrency, natural) in workloads.items():
        ids = {r.id: r.prompt_token_ids for r in wl.requests if r.prompt_token_ids}
        opts = ServeOptions(base_url=url, rate=math.inf, max_concurrency=concurrency,
                            progress=False, prompt_token_ids=ids or None,
                            extra_body={"ignore_eos": False} if natural else {})
        report = asyncio.run(run_serve(wl, opts))
        s = report["summary"]
        out[name] = {"workload": wl.name, "concurrency": concurrency, "natural_stops": natural,
                     "completed": s["completed"], "failed": s["failed"],
                     "output_tokens": s["output_tokens"], "duration_s": s["duration_s"],
                     "output_tok_s": s["output_throughput"],
                     "ttft_ms": s["ttft_ms"], "tpot_ms": s["tpot_ms"], "itl_ms": s["itl_ms"],
                     "output_tokens_per_request": [r["output_tokens"]
                                                   for r in report["requests"]]}
    return out


def server_groups(engine: str, workloads: dict[str, tuple[Workload, int, bool]]
                  ) -> list[dict[str, tuple[Workload, int, bool]]]:
    """The scenarios each of `engine`'s servers serves, in start order: everystop's one server
    all of them; llama.cpp one server per number of streams (its defaults for one, slots for
    more), so a server restarts only where its configuration changes."""
    groups: dict[int, dict[str, tuple[Workload, int, bool]]] = {}
    for name, spec in workloads.items():
        groups.setdefault(spec[1] if engine == "llamacpp" else 0, {})[name] = spec
    return list(groups.values())


@contextmanager
def _server(engine: str, method: str, target: str, draft: str, args: argparse.Namespace,
            longest: int, streams: int) -> Iterator[tuple[str, str, int]]:
    """(base URL, command line, pid) of one started configuration serving `streams` at once."""
    from everystop.bench.servers import everystop_server, llama_server

    if engine == "everystop":
        flags = everystop_flags(method, target, draft, args)
        with everystop_server(flags, failure=f"everystop serve {shlex.join(flags)} did not "
                                             "come up") as (proc, url):
            yield url, shlex.join(["everystop", "serve", *flags]), proc.pid
    else:
        with llama_server(args.llama_server, target,
                          llamacpp_flags(method, draft, args, longest, streams)) as ls:
            yield ls.url, shlex.join(ls.command), ls.proc.pid


def run_one(engine: str, method: str, target: str, draft: str, args: argparse.Namespace,
            workloads: dict[str, tuple[Workload, int, bool]]) -> dict[str, Any]:
    """One engine and method in every scenario: each scenario's numbers with its server's
    command and memory, every command started, the acceptance over all of its servers."""
    from everystop.bench.servers import process_memory

    longest = max(r.prompt_len + r.max_tokens for wl, _, _ in workloads.values()
                  for r in wl.requests) + 64
    print(f"+ {engine} {method}", flush=True)
    scenarios: dict[str, Any] = {}
    commands: list[str] = []
    drafted = accepted = 0.0
    for group in server_groups(engine, workloads):
        streams = max(concurrency for _, concurrency, _ in group.values())
        with _server(engine, method, target, draft, args, longest, streams) as (url, command,
                                                                                pid):
            before = spec_counters(url)
            measured = measure(url, group)
            after = spec_counters(url)
            memory = process_memory(pid)
        commands.append(command)
        drafted += after["draft"] - before["draft"]
        accepted += after["accepted"] - before["accepted"]
        scenarios.update({name: {**m, "command": command, **memory}
                          for name, m in measured.items()})
    return {"engine": engine, "method": method, "commands": commands,
            "scenarios": {name: scenarios[name] for name in workloads},
            "draft_tokens": drafted, "acceptance_rate": accepted / drafted if drafted else None}


def run(args: argparse.Namespace) -> int:
    methods = [m for m in args.methods.split(",") if m]
    if not methods or set(methods) - set(METHODS):
        raise SystemExit(f"--methods: a subset of {','.join(METHODS)}, not {args.methods!r}")
    from everystop.bench import perf_page
    from everystop.bench.run_all import default_dtype
    from everystop.results import cpu_info

    machine = cpu_info()
    if args.dtype == "auto":
        args.dtype = default_dtype(machine)
    if args.out is None and not args.quick:
        args.out = perf_page.RESULTS / "cpu" / perf_page.cpu_kind(machine) / perf_page.SPECULATIVE
    names = [n for n in args.scenarios.split(",") if n]
    known = [s[0] for s in SCENARIOS]
    if not names or set(names) - set(known):
        raise SystemExit(f"--scenarios: a subset of {','.join(known)}, not {args.scenarios!r}")
    target, draft = _models(args)
    workloads = _workloads(args.quick, names, args.max_tokens)
    out: dict[str, Any] = {"bench": "speculative", "quick": args.quick, "target": target,
                           "max_tokens": args.max_tokens,
                           "draft": draft, "num_speculative_tokens": args.num_speculative_tokens,
                           "dtype": args.dtype,
                           "scenarios": {n: {"workload": wl.name, "requests": len(wl.requests),
                                             "concurrency": c, "natural_stops": nat}
                                         for n, (wl, c, nat) in workloads.items()},
                           "load_avg_before": os.getloadavg(), "runs": {}}
    engines = ["everystop"] + (["llamacpp"] if args.llama_server else [])
    for engine in engines:
        for method in methods:
            out["runs"][f"{engine}/{method}"] = run_one(engine, method, target, draft, args,
                                                        workloads)
            if args.out:  # what is measured survives a later failure
                write_result(out, args.out, quiet=True)
    if args.token_check == "batch-invariant" and set(methods) - {"off"}:
        from everystop.bench.spec_tokens import check_tokens

        check = check_tokens(methods, lambda m: everystop_flags(m, target, draft, args),
                             workloads)
        out["token_check"] = check
        out["same_tokens_as_off"] = {"everystop": check["same"]}
    out["load_avg_after"] = os.getloadavg()
    write_result(out, args.out, quiet=args.out is not None)
    if args.out:
        from everystop.plots import speculative_bars

        speculative_bars(out, Path(args.out).with_suffix(".png"))
        print(f"wrote {args.out} and its plot (docs/performance.md: `everystop bench all "
              "--render-only`)")
    return 0
