"""`everystop bench {workload,serve,compare,gate,sweep,report}` and the measurements
(`everystop bench throughput`, ... : the MEASUREMENTS list)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import json
import shlex
import sys
from pathlib import Path
from typing import Any

from everystop.bench.metrics import SLO, format_summary
from everystop.results import write_result
from everystop.subcommands import add_module_commands
from everystop.workload import TextTokenizer

# Measurements of the engine on this machine: (subcommand, module with add_arguments(parser)
# and run(args), help). Each writes one result JSON (everystop.results.write_result).
MEASUREMENTS = [
    ("all", "everystop.bench.run_all", "this machine's canonical results and "
     "docs/performance.md (`make bench`)"),
    ("throughput", "everystop.bench.throughput", "offline throughput on the 128-request workload, "
     "or single-stream decode latency"),
    ("profile", "everystop.bench.profile", "where one engine step's time goes, at 128 sequences"),
    ("roofline", "everystop.bench.roofline", "this machine's roofline; MFU and bound of results"),
    ("vs-llamacpp", "everystop.bench.vs_llamacpp", "head to head with llama.cpp's server"),
    ("served", "everystop.bench.served", "everystop serve's defaults against llama.cpp's server "
     "over one client: 128 at once, a single stream, memory, start-up"),
    ("speculative", "everystop.bench.speculative", "speculative decoding off, ngram and draft "
     "(and llama.cpp's), single stream and 32 streams, on input-grounded and chat requests"),
    ("sim-calibrate", "everystop.bench.sim_calibration", "fit the simulator's cost model to "
     "this machine's engine and check its predictions"),
    ("fleet-report", "everystop.sim.fleet_report", "every number in docs/fleet-simulation.md: "
     "router policies vs load, prefix hits on chats, capacity plans"),
    ("fleet-speed", "everystop.sim.fleet_speed", "how fast the fleet simulator runs (64 "
     "replicas; the 1M-request extrapolation)"),
    ("routing", "everystop.bench.routing", "routing policies side by side on 2 Ray Serve "
     "replicas (skewed and shared-prefix workloads)"),
    ("soak", "everystop.bench.soak", "20 minutes of mixed, hostile traffic against a live server"),
    ("quant-accuracy", "everystop.bench.quant_accuracy", "quantized weights' agreement with fp32"),
    ("hostile", "everystop.bench.hostile", "/health latency while each hostile request "
     "of the robustness suite is served, at full size"),
    ("startup", "everystop.bench.startup", "time to the first /health 200 (kernels built, "
     "then cached) and what the serving process's memory holds"),
    ("lora", "everystop.bench.lora", "32 streams over 8 random LoRA adapters vs the same load "
     "on the base model"),
]


def script_main(name: str) -> None:
    """The body of a thin benchmarks/ script: `everystop bench NAME` with the script's flags."""
    module = importlib.import_module(dict((n, m) for n, m, _ in MEASUREMENTS)[name])
    ap = argparse.ArgumentParser(description=module.__doc__.splitlines()[0])
    module.add_arguments(ap)
    raise SystemExit(module.run(ap.parse_args()))


def default_tokenizer() -> TextTokenizer | None:
    """The engine's default-model tokenizer, or None when the model or its loader is missing
    (workloads then slice words and estimate lengths)."""
    try:
        from everystop.tokenizer import load_tokenizer
        return load_tokenizer()
    except Exception:  # any failure: no tokenizer, slice words instead
        return None


def register(subparsers: Any) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks: workloads, serve, compare, gate")
    sub = bench.add_subparsers(dest="bench_command", metavar="BENCH_COMMAND")
    bench.set_defaults(func=lambda args: (bench.print_help(), 2)[1])
    _workload_parser(sub)
    _serve_parser(sub)
    _compare_parser(sub)
    _gate_parser(sub)
    _sweep_parser(sub)
    add_module_commands(sub, MEASUREMENTS)
    rep = sub.add_parser("report", help="re-render the table and plots of a compare JSON")
    rep.add_argument("compare_json")
    rep.add_argument("--out-dir", default=None, help="default: next to the JSON")
    rep.set_defaults(func=cmd_report)


# -- workload -----------------------------------------------------------------------------------
def _workload_parser(sub: Any) -> None:
    p = sub.add_parser("workload", help="generate a seeded synthetic workload JSON")
    p.add_argument("--out", required=True)
    p.add_argument("--name", default=None)
    p.add_argument("--num-requests", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompt-len", default="uniform:32:512",
                   help="fixed:N | uniform:A:B | log_uniform:A:B | lognormal:MEDIAN:SIGMA"
                   "[:MAX | :MIN:MAX] (tokens; the syntax of everystop.workload)")
    p.add_argument("--output-len", default="log_uniform:16:256")
    p.add_argument("--prefix-fraction", type=float, default=0.0,
                   help="fraction of requests that start with a shared prefix")
    p.add_argument("--prefix-groups", type=int, default=4)
    p.add_argument("--prefix-len", type=int, default=128)
    p.add_argument("--priorities", default="0=0.2,1=0.6,2=0.2", help="tier=weight,...")
    p.add_argument("--tenants", default="acme=0.5,globex=0.3,initech=0.2")
    p.add_argument("--rate", type=float, default=None, help="store Poisson arrivals (req/s)")
    p.add_argument("--burstiness", type=float, default=1.0)
    p.add_argument("--tokenizer", choices=("default", "whitespace"), default="default")
    p.set_defaults(func=cmd_workload)


def _weights(text: str) -> dict[str, float]:
    return {k: float(v) for k, v in (kv.split("=") for kv in text.split(",") if kv)}


def cmd_workload(args: argparse.Namespace) -> int:
    from everystop.workload import LengthDist, WorkloadSpec, generate_workload
    spec = WorkloadSpec(num_requests=args.num_requests, seed=args.seed,
                        prompt_len=LengthDist.parse(args.prompt_len),
                        output_len=LengthDist.parse(args.output_len),
                        prefix_fraction=args.prefix_fraction, prefix_groups=args.prefix_groups,
                        prefix_len=args.prefix_len, priorities=_weights(args.priorities),
                        tenants=_weights(args.tenants), rate=args.rate,
                        burstiness=args.burstiness)
    wl = generate_workload(spec, args.name or Path(args.out).stem,
                           tokenizer=default_tokenizer() if args.tokenizer == "default" else None)
    wl.save(args.out)
    lens = [r.prompt_len for r in wl.requests]
    print(f"wrote {args.out}: {len(wl.requests)} requests, prompt tokens {min(lens)}..{max(lens)} "
          f"({wl.spec['tokenizer']}), {wl.total_output_tokens} output tokens")
    return 0


# -- serve --------------------------------------------------------------------------------------
def _slo_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--slo-ttft-ms", type=float, default=None, help="goodput SLO on TTFT")
    p.add_argument("--slo-tpot-ms", type=float, default=None)
    p.add_argument("--slo-e2e-ms", type=float, default=None)


def _slo(args: argparse.Namespace) -> SLO:
    return SLO(args.slo_ttft_ms, args.slo_tpot_ms, args.slo_e2e_ms)


def _serve_parser(sub: Any) -> None:
    p = sub.add_parser("serve", help="benchmark any OpenAI-compatible server (streaming)")
    p.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000 (or .../v1)")
    p.add_argument("--workload", required=True)
    p.add_argument("--rate", default="inf",
                   help="requests/s (Poisson), 'inf' = all at once, 'workload' = its arrival_s")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    p.add_argument("--model", default=None, help="default: the first of GET /v1/models")
    p.add_argument("--num-requests", type=int, default=None, help="only the first N requests")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--send-priority", action="store_true",
                   help="send each request's tier as 'priority' (vLLM needs its priority policy)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--result-json", default=None)
    p.add_argument("--no-progress", action="store_true")
    _slo_args(p)
    p.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    from everystop.bench.client import ServeOptions, run_serve
    from everystop.workload import load_workload
    wl = load_workload(args.workload)
    if args.num_requests:
        wl = wl.head(args.num_requests)
    rate = None if args.rate == "workload" else float(args.rate)
    opts = ServeOptions(base_url=args.base_url, endpoint=args.endpoint, model=args.model,
                        rate=rate, burstiness=args.burstiness,
                        max_concurrency=args.max_concurrency, seed=args.seed,
                        send_priority=args.send_priority, api_key=args.api_key,
                        progress=not args.no_progress)
    report = asyncio.run(run_serve(wl, opts, _slo(args)))
    print(format_summary(report["summary"]))
    for key, title in (("by_priority", "tier"), ("by_tenant", "tenant")):
        for name, s in report[key].items():
            print(f"  {title} {name:<10} {s['completed']:4d} req  TTFT p99 "
                  f"{s['ttft_ms']['p99']:9.1f} ms  TPOT p50 {s['tpot_ms']['p50']:7.1f} ms")
    if args.result_json:
        write_result(report, args.result_json, quiet=True)
        print(f"wrote {args.result_json}")
    return 0 if report["summary"]["completed"] else 1


# -- sweep --------------------------------------------------------------------------------------
def _sweep_parser(sub: Any) -> None:
    p = sub.add_parser("sweep", help="TTFT/TPOT/ITL and tokens/s vs offered load, several "
                                     "servers, one client")
    p.add_argument("--target", action="append", default=[], metavar="NAME=URL",
                   help="an OpenAI-compatible server, e.g. everystop=http://127.0.0.1:8000 "
                        "(repeat; llama.cpp's llama-server serves /v1/completions too)")
    p.add_argument("--start-everystop", default=None, metavar="FLAGS",
                   help="start `everystop serve FLAGS` from these sources on a free port as "
                        "target everystop, stop it at the end (e.g. '--dtype bfloat16')")
    p.add_argument("--start-llamacpp", default=None, metavar="FLAGS",
                   help="start `LLAMA_SERVER -m GGUF FLAGS` on a free port as target "
                        "llamacpp, stop it at the end (e.g. '-np 32 -c 65536 -t 2 -tb 2')")
    p.add_argument("--llama-server", default="/root/llama/build-native/bin/llama-server")
    p.add_argument("--gguf", default="/root/llama/smollm2-f16.gguf")
    p.add_argument("--reuse-prompts", dest="fresh_prompts", action="store_false",
                   help="send every run the same prompt text (by default each run's prompts "
                        "carry a tag of their own, so no run hits another's cached prompts)")
    p.add_argument("--workload", required=True)
    p.add_argument("--loads", default="0.25,0.5,0.75", help="fractions of the capacity")
    p.add_argument("--capacity-rps", type=float, default=None,
                   help="capacity in requests/s (default: measured on --capacity-from)")
    p.add_argument("--capacity-from", default=None,
                   help="target whose saturated run (all requests at once) sets the capacity")
    p.add_argument("--num-requests", type=int, default=None, help="only the first N requests")
    p.add_argument("--token-ids", action="store_true",
                   help="send prompts as token ids (the default model's tokenizer), so every "
                        "server sees the same tokens")
    p.add_argument("--send-priority", action="store_true")
    p.add_argument("--tier-mix", default=None, metavar="T0:T1:T2",
                   help="re-assign priority tiers in these fractions (seeded) and send them, "
                        "e.g. 0.2:0:0.8 (20%% premium, the rest best-effort)")
    p.add_argument("--warmup-requests", type=int, default=8,
                   help="per target, before anything is measured: this many requests from "
                        "after the measured ones, all at once; recorded, not in the results "
                        "(0: none)")
    p.add_argument("--append", action="store_true",
                   help="merge into the JSON at --out (one piece of a long sweep; same "
                        "workload and --capacity-rps)")
    p.add_argument("--notes", default=None, help="free text kept in the JSON's meta (e.g. "
                                                 "the servers' flags)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    p.add_argument("--out", default="benchmarks/results/sweep.json",
                   help="JSON path; the plot goes next to it (.png)")
    p.set_defaults(func=cmd_sweep)


def cmd_sweep(args: argparse.Namespace) -> int:
    with contextlib.ExitStack() as servers:
        targets = dict(t.split("=", 1) for t in args.target)
        commands = _start_sweep_servers(args, servers, targets)
        if not targets:
            print("everystop: give --target NAME=URL or --start-everystop/--start-llamacpp",
                  file=sys.stderr)
            return 2
        return _sweep(args, targets, commands)


def _start_sweep_servers(args: argparse.Namespace, stack: contextlib.ExitStack,
                         targets: dict[str, str]) -> dict[str, str]:
    """Start the servers --start-everystop/--start-llamacpp ask for (stopped when `stack`
    closes), add them to `targets`; their command lines, for the JSON."""
    from everystop.bench.servers import everystop_server, llama_server
    commands: dict[str, str] = {}
    if args.start_everystop is not None:
        flags = shlex.split(args.start_everystop)
        _, targets["everystop"] = stack.enter_context(everystop_server(flags))
        commands["everystop"] = shlex.join(["everystop", "serve", *flags])
    if args.start_llamacpp is not None:
        server = stack.enter_context(llama_server(args.llama_server, args.gguf,
                                                  shlex.split(args.start_llamacpp)))
        targets["llamacpp"] = server.url
        commands["llamacpp"] = shlex.join(server.command)
    return commands


def _sweep(args: argparse.Namespace, targets: dict[str, str], commands: dict[str, str]) -> int:
    from everystop.bench.client import ServeOptions
    from everystop.bench.sweep import (
        merge_sweeps,
        parse_tier_mix,
        plot_sweep,
        run_sweep,
        tokenize_prompts,
        warmup_workload,
        with_tier_mix,
    )
    from everystop.results import write_result
    from everystop.workload import load_workload
    full = load_workload(args.workload)
    wl = full.head(args.num_requests) if args.num_requests else full
    warm = warmup_workload(full, len(wl.requests), args.warmup_requests)
    send_priority = args.send_priority
    if args.tier_mix:
        wl = with_tier_mix(wl, parse_tier_mix(args.tier_mix), args.seed)
        send_priority = True
    ids, tokenizer = None, None
    if args.token_ids:
        tokenizer = default_tokenizer()
        if tokenizer is None:
            print("everystop: --token-ids needs the default model's tokenizer", file=sys.stderr)
            return 2
        ids = tokenize_prompts(wl, tokenizer) | tokenize_prompts(warm, tokenizer)
    base = ServeOptions(seed=args.seed, send_priority=send_priority, progress=False,
                        timeout_s=args.timeout, prompt_token_ids=ids)
    loads = [float(x) for x in args.loads.split(",") if x]
    out = Path(args.out)
    previous = json.loads(out.read_text()) if args.append and out.exists() else None

    def save(result: dict[str, Any]) -> dict[str, Any]:
        """Write the sweep as it stands (merged into --out's with --append)."""
        data = {**result, "meta": {**result["meta"], "notes": args.notes,
                                   "server_commands": commands}}
        if previous is not None:
            data = merge_sweeps(previous, write_result(data, None, quiet=True))
        return write_result(data, str(out), quiet=True)

    data = save(asyncio.run(run_sweep(wl, targets, loads, base, capacity_rps=args.capacity_rps,
                                      capacity_from=args.capacity_from, warmup=warm,
                                      on_progress=save, fresh_prompts=args.fresh_prompts,
                                      encode=tokenizer.encode if tokenizer else None)))
    plot = plot_sweep(data, out.with_suffix(".png"))
    for name, by_load in data["runs"].items():
        for load, run in by_load.items():
            s = run["summary"]
            print(f"{name:<12} load {load:>5} ({run['offered_rps']:.2f} req/s): "
                  f"{s['output_throughput']:7.1f} tok/s  TTFT p50/p99 {s['ttft_ms']['p50']:.0f}/"
                  f"{s['ttft_ms']['p99']:.0f} ms  TPOT p50/p99 {s['tpot_ms']['p50']:.0f}/"
                  f"{s['tpot_ms']['p99']:.0f} ms  ITL p99 {s['itl_ms']['p99']:.0f} ms")
    print(f"wrote {out} and {plot}")
    return 0


# -- compare ------------------------------------------------------------------------------------
def _compare_parser(sub: Any) -> None:
    p = sub.add_parser("compare", help="the workload through every batching mode, one process")
    p.add_argument("--workload", required=True)
    p.add_argument("--out-dir", default="benchmarks/results/compare")
    p.add_argument("--modes", default="static,continuous,chunked,prefix")
    p.add_argument("--loads", default="0.7", help="online loads, fractions of capacity ('' = none)")
    p.add_argument("--online-modes", default=None, help="modes to run online (default: --modes)")
    p.add_argument("--capacity-from", default="chunked",
                   help="mode whose offline capacity sets the online rate, or 'self'")
    p.add_argument("--num-requests", type=int, default=None, help="only the first N requests")
    p.add_argument("--static-batch-size", type=int, default=32)
    p.add_argument("--chunk-budget", type=int, default=256,
                   help="max_num_batched_tokens and chunk_size of the chunked modes")
    p.add_argument("--dollars-per-hour", type=float, default=0.10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--burstiness", type=float, default=1.0)
    p.add_argument("--hf-requests", type=int, default=0,
                   help="also run transformers generate on the first N requests (0: skip)")
    p.add_argument("--gate-delay-ms", type=float, default=0.0,
                   help="also run the gate check: chunked online, baseline, rerun and with this "
                        "per-step delay, back to back")
    p.add_argument("--gate-requests", type=int, default=48, help="requests in the gate check")
    p.add_argument("--resume", action="store_true",
                   help="keep the runs already in OUT_DIR/compare.json; run only the missing")
    p.add_argument("--model", default=None)
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--kv-cache-memory", type=int, default=None, help="bytes (CPU KV pool)")
    p.add_argument("--dtype", default=None)
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (1 is far faster on an oversubscribed shared machine)")
    p.add_argument("--no-progress", action="store_true")
    _slo_args(p)
    p.set_defaults(func=cmd_compare)


def cmd_compare(args: argparse.Namespace) -> int:
    from everystop.bench.compare import CompareOptions, run_compare, shared_model_factory
    from everystop.bench.table import machine_description
    from everystop.workload import load_workload
    if args.threads:
        import torch
        torch.set_num_threads(args.threads)
    wl = load_workload(args.workload)
    if args.num_requests:
        wl = wl.head(args.num_requests)
    opts = CompareOptions(
        modes=[m for m in args.modes.split(",") if m],
        loads=[float(x) for x in args.loads.split(",") if x], capacity_from=args.capacity_from,
        online_modes=(None if args.online_modes is None
                      else [m for m in args.online_modes.split(",") if m]),
        static_batch_size=args.static_batch_size, chunk_budget=args.chunk_budget,
        dollars_per_hour=args.dollars_per_hour, seed=args.seed, burstiness=args.burstiness,
        hf_requests=args.hf_requests, gate_delay_ms=args.gate_delay_ms, slo=_slo(args),
        gate_requests=args.gate_requests,
        progress=not args.no_progress)
    base = {"model": args.model, "max_num_seqs": args.max_num_seqs,
            "max_model_len": args.max_model_len, "kv_cache_memory": args.kv_cache_memory,
            "dtype": args.dtype}
    # The static scheduler prefills a whole batch in one pass: size buffers for the biggest.
    biggest = sorted((r.prompt_len for r in wl.requests), reverse=True)[:opts.static_batch_size]
    max_budget = max(args.max_model_len, sum(biggest) + 64 * opts.static_batch_size)
    out_dir = Path(args.out_dir)
    command = "everystop " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    meta = {"machine": machine_description(), "command": command, "workload_file": args.workload,
            "model": args.model or "default (SmolLM2-135M-Instruct Q4_1 GGUF)",
            "engine_options": base, "torch_threads": args.threads}
    previous = None
    if args.resume and (out_dir / "compare.json").exists():
        previous = json.loads((out_dir / "compare.json").read_text())
        meta["command"] = previous["meta"].get("command", command) + f"; then {command}"
    data = run_compare(wl, shared_model_factory(base, max_budget), opts,
                       max_model_len=args.max_model_len, out_json=out_dir / "compare.json",
                       meta=meta, resume=previous)
    _render(data, out_dir, meta["command"])
    return 0


def _render(data: dict[str, Any], out_dir: Path, command: str) -> None:
    from everystop.bench.table import markdown_report
    from everystop.plots import write_compare_plots
    text = markdown_report(data, command)
    (out_dir / "README.md").write_text(text)
    print(text)
    for path in write_compare_plots(data, out_dir):
        print(f"wrote {path}")


def cmd_report(args: argparse.Namespace) -> int:
    path = Path(args.compare_json)
    data = json.loads(path.read_text())
    _render(data, Path(args.out_dir) if args.out_dir else path.parent,
            data["meta"].get("command", ""))
    return 0


# -- gate ---------------------------------------------------------------------------------------
def _gate_parser(sub: Any) -> None:
    p = sub.add_parser("gate", help="latency-regression deploy gate: exit 0 pass, 1 fail")
    p.add_argument("--baseline", required=True)
    p.add_argument("--candidate", required=True)
    p.add_argument("--ttft-p99-pct", type=float, default=20.0)
    p.add_argument("--tpot-p50-pct", type=float, default=15.0)
    p.add_argument("--baseline-run", default=None, help="run name inside a compare JSON")
    p.add_argument("--candidate-run", default=None)
    p.set_defaults(func=cmd_gate)


def cmd_gate(args: argparse.Namespace) -> int:
    from everystop.bench.gate import gate, load_run, verdict_line
    result = gate(load_run(args.baseline, args.baseline_run),
                  load_run(args.candidate, args.candidate_run or args.baseline_run),
                  args.ttft_p99_pct, args.tpot_p50_pct)
    print(verdict_line(result))
    return 0 if result["passed"] else 1
