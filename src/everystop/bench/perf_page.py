"""docs/performance.md: tables rendered from the committed results (`everystop bench all`),
one section per CPU kind that has results, then the simulator's GPU tables. Tables only: every
number on the page is read from a result file, and the page says which."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]  # the source checkout: docs/ and benchmarks/
RESULTS = ROOT / "benchmarks/results"
PAGE = ROOT / "docs/performance.md"
# The files of one CPU kind's directory (results/cpu/KIND/), as `everystop bench all` names them.
VS_LLAMACPP, THROUGHPUT = "vs_llamacpp.json", "throughput.json"
LOAD_SWEEP = "latency_vs_load.json"
# `everystop bench served` per file: everystop serve's defaults beside llama.cpp's server.
SERVED = {"Q4_1 (shipped)": "served_q4_1.json", "F16": "served_f16.json",
          "Qwen3-MoE 2B Q4_0 (random weights)": "served_moe_q4_0.json",
          "Qwen3-MoE 2B Q8_0 (random weights)": "served_moe_q8_0.json"}
SPECULATIVE = "speculative.json"
LORA = "lora.json"  # `everystop bench lora`


def cpu_kind(machine: dict[str, Any]) -> str:
    """A results directory's name for a machine: its vendor and the widest ISA the run used
    (an ISA capped in the environment, e.g. ONEDNN_MAX_CPU_ISA=AVX2, counts as that ISA)."""
    model = machine.get("model", "")
    vendor = "intel" if "Intel" in model else "amd" if "AMD" in model else "cpu"
    flags = set(machine.get("isa_flags", []))
    if machine.get("isa_env", {}).get("ONEDNN_MAX_CPU_ISA", "").upper() == "AVX2":
        isa = "avx2"
    elif "amx_bf16" in flags:
        isa = "amx"
    elif "avx512f" in flags:
        isa = "avx512"
    else:
        isa = "avx2" if "avx2" in flags else "generic"
    return f"{vendor}_{isa}"


def _load(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1e3:,.0f} ms"


def _mib(n: float | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:,.0f} MiB"


def _machine_line(m: dict[str, Any]) -> str:
    env = {k: v for k, v in m.get("isa_env", {}).items() if k != "GOMP_SPINCOUNT"}
    capped = f"; ISA capped by {', '.join(f'{k}={v}' for k, v in env.items())}" if env else ""
    return (f"CPU: {m.get('model', 'unknown')}, {m.get('cpus', '?')} cores; flags: "
            f"{' '.join(m.get('isa_flags', []))}{capped}.")


def concurrent_table(r: dict[str, Any]) -> list[str]:
    """128 requests at once through both servers: throughput, TTFT, memory."""
    out = ["| server | output tok/s | TTFT p50 | TTFT p99 | peak RSS |", "|---|---|---|---|---|"]
    for name, key in (("everystop", "everystop"), ("llama.cpp", "llamacpp")):
        s = r[key]
        out.append(f"| {name} | {s['output_tok_s']:,.1f} | {_ms(s['ttft_p50_s'])} | "
                   f"{_ms(s['ttft_p99_s'])} | {_mib(s.get('peak_rss_bytes'))} |")
    out.append("")
    out.append(f"everystop / llama.cpp: **{r['throughput_ratio']:.2f}x** output tok/s, "
               f"{r['ttft_p99_ratio']:.2f}x TTFT p99 ({r['num_requests']} requests, "
               f"{r['prompt_tokens']:,} prompt tokens; everystop {r['everystop']['dtype']}, "
               f"llama.cpp {r['llamacpp_slots']} slots).")
    return out


def _served_measures(r: dict[str, Any], server: str) -> dict[str, tuple[float, str]]:
    """One server's figures in a `bench served` result: measure -> (value, format)."""
    out: dict[str, tuple[float, str]] = {}
    if server in r.get("concurrent", {}):
        c = r["concurrent"]
        out[f"{c['num_requests']} at once, output tok/s"] = (c[server]["output_throughput"],
                                                              ",.1f")
    if server in r.get("single", {}):
        s = r["single"][server]
        out |= {"single stream, TPOT p50 (ms)": (s["tpot_ms"]["p50"], ".2f"),
                "single stream, TTFT p50 (ms)": (s["ttft_ms"]["p50"], ",.0f"),
                "single stream, peak RSS (MiB)": (s["peak_rss_bytes"] / 2**20, ",.0f"),
                f"single stream, share of the bound at {r['read_bandwidth_gb_s']:.1f} GB/s":
                    (s["bound_share"], ".2f"),
                "start to /health (s)": (s["start_to_health_s"], ".1f")}
    return out


def served_table(runs: dict[str, dict[str, Any]]) -> list[str]:
    """`everystop serve` with no flags beside llama.cpp's server (where the run had one), per
    file: the same client, each scenario on freshly started servers."""
    out = ["| file | measure | everystop | llama.cpp | everystop / llama.cpp |",
           "|---|---|---|---|---|"]
    for label, r in runs.items():
        theirs = _served_measures(r, "llamacpp")
        for name, (a, fmt) in _served_measures(r, "everystop").items():
            if name in theirs:
                b = theirs[name][0]
                out.append(f"| {label} | {name} | {a:{fmt}} | {b:{fmt}} | {a / b:.2f}x |")
            else:
                out.append(f"| {label} | {name} | {a:{fmt}} | - | - |")
    out += ["", "Bound: a decode step's weight bytes over the read bandwidth its run measured."]
    return out


def lora_lines(r: dict[str, Any]) -> list[str]:
    """Streams over many adapters against the same load on the base, one server."""
    m = r["median_output_tok_s"]
    return ["| load | output tok/s (median of "
            f"{r['repeats']}) |", "|---|---|",
            f"| {r['streams']} streams, base model | {m['base']:,.1f} |",
            f"| {r['streams']} streams over {r['adapters']} rank-{r['rank']} adapters | "
            f"{m['lora']:,.1f} |", "",
            f"Adapters / base: **{r['lora_over_base']:.2f}x** (target at least "
            f"{r['target']['lora_over_base_output_throughput_at_least']:.2f}x); "
            f"{r['failed_requests']} failed requests. Server: `{' '.join(r['serve_command'])}`."]


def load_table(r: dict[str, Any]) -> list[str]:
    """Poisson arrivals at fractions of a measured capacity, every server through one client."""
    out = ["| server | load | offered req/s | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 |",
           "|---|---|---|---|---|---|---|"]
    for target, runs in r["runs"].items():
        for load, run in sorted(runs.items(), key=lambda kv: float(kv[0])):
            s = run["summary"]
            out.append(f"| {target} | {float(load):.0%} | {run['offered_rps']:.2f} | "
                       f"{s['ttft_ms']['p50']:,.0f} ms | {s['ttft_ms']['p99']:,.0f} ms | "
                       f"{s['tpot_ms']['p50']:.1f} ms | {s['tpot_ms']['p99']:.1f} ms |")
    return out


def speculative_table(r: dict[str, Any]) -> list[str]:
    """`everystop bench speculative`: output tok/s per scenario, each method's speed-up over
    its server without speculation, TTFT p99 at 32 streams, the draft acceptance."""
    sc = r["scenarios"]
    out = ["| server | speculation | grounded, 1 stream | chat, 1 stream | grounded, "
           f"{sc['grounded_concurrent']['concurrency']} streams | TTFT p99, "
           f"{sc['grounded_concurrent']['concurrency']} streams | acceptance |",
           "|---|---|---|---|---|---|---|"]
    for run in r["runs"].values():
        base = r["runs"].get(f"{run['engine']}/off")
        cells = []
        for name in ("grounded_single", "chat_single", "grounded_concurrent"):
            tok_s = run["scenarios"][name]["output_tok_s"]
            gain = f" ({tok_s / base['scenarios'][name]['output_tok_s']:.2f}x)" \
                if base is not None and run is not base else ""
            cells.append(f"{tok_s:,.1f} tok/s{gain}")
        rate = run.get("acceptance_rate")
        ttft = run["scenarios"]["grounded_concurrent"]["ttft_ms"]["p99"]
        server = "everystop" if run["engine"] == "everystop" else "llama.cpp"
        out.append(f"| {server} | {run['method']} | {' | '.join(cells)} | {ttft:,.0f} ms | "
                   f"{'n/a' if rate is None else f'{rate:.0%}'} |")
    same = r.get("same_tokens_as_off", {}).get("everystop", {})
    verdicts = ", ".join(f"{m} {'yes' if ok else 'no'}" for m, ok in same.items()) or "n/a"
    # A result with a token check compared text on batch-invariant servers (bench/spec_tokens.py);
    # one without, the timed runs' token counts.
    same_what = ("The same text for every request with speculation as without, on "
                 f"batch-invariant {_check_dtype(r)} servers" if "token_check" in r else
                 "The same number of tokens for every request with speculation as without")
    out += ["", f"Target {Path(r['target']).name}, draft {Path(r['draft']).name}, at most "
            f"{r['num_speculative_tokens']} guesses a step; everystop {r['dtype']}. Grounded "
            f"requests stop at the end of their answer. {same_what} (everystop): {verdicts}."]
    return out


def _check_dtype(r: dict[str, Any]) -> str:
    """The activation dtype the token check's servers ran with (from their commands)."""
    command = next(iter(r["token_check"].get("commands", {}).values()), "")
    words = command.split()
    return words[words.index("--dtype") + 1] if "--dtype" in words[:-1] else r["dtype"]


def _spec_commands(run: dict[str, Any]) -> list[str]:
    """The commands of the servers one speculative run started (`commands`; a result from one
    server for every scenario names it once, as `command`)."""
    return run["commands"] if "commands" in run else [run["command"]]


def throughput_line(r: dict[str, Any]) -> str:
    return (f"Offline, {r['num_requests']} requests in one engine ({r['dtype']}): "
            f"**{r['output_tok_s']:,.1f} output tok/s** ({r['total_tok_s']:,.1f} with prompts), "
            f"TTFT p99 {_ms(r['ttft_p99_s'])}.")


def kind_section(kind_dir: Path, page_dir: Path) -> list[str]:
    """Everything measured on one CPU kind; the commands that measured it."""
    vs, offline = _load(kind_dir / VS_LLAMACPP), _load(kind_dir / THROUGHPUT)
    sweep, spec = _load(kind_dir / LOAD_SWEEP), _load(kind_dir / SPECULATIVE)
    served = {n: r for n, f in SERVED.items() if (r := _load(kind_dir / f)) is not None}
    lora = _load(kind_dir / LORA)
    present = [r for r in (*served.values(), vs, offline, sweep, spec, lora)
               if r is not None]
    if not present:
        return []
    rel = kind_dir.relative_to(ROOT).as_posix() if kind_dir.is_relative_to(ROOT) else kind_dir
    out = [f"## {kind_dir.name}", "", _machine_line(present[0]["machine"]), ""]
    if served:
        out += ["### everystop serve with its defaults, beside llama.cpp's server", "",
                *served_table(served), ""]
    if vs:
        out += ["### 128 concurrent requests", "", *concurrent_table(vs), ""]
    if offline:
        out += [throughput_line(offline), ""]
    if sweep:
        png = (kind_dir / LOAD_SWEEP).with_suffix(".png")
        out += ["### Latency under Poisson load", "",
                f"Capacity {sweep['meta']['capacity_rps']:.2f} req/s (measured on "
                f"{sweep['meta']['capacity_from']}); workload {sweep['meta']['workload']}.", "",
                *load_table(sweep), ""]
        if png.is_file():
            out += [f"![latency vs load]({os.path.relpath(png, page_dir)})", ""]
    if lora:
        out += ["### LoRA adapters", "", *lora_lines(lora), ""]
    if spec:
        png = (kind_dir / SPECULATIVE).with_suffix(".png")
        out += ["### Speculative decoding", "", *speculative_table(spec), ""]
        if png.is_file():
            out += [f"![speculative decoding]({os.path.relpath(png, page_dir)})", ""]
    commands = [r["command"] for r in present]
    commands += list((sweep or {}).get("meta", {}).get("server_commands", {}).values())
    commands += [" ".join(vs["llamacpp"]["command"])] if vs and vs["llamacpp"].get("command") \
        else []
    # (`bench served` records each server's exact command in its result, not here.)
    commands += [c for run in (spec or {}).get("runs", {}).values() for c in _spec_commands(run)]
    unique = list(dict.fromkeys(commands))  # a server started twice is listed once
    out += [f"Commands (results in `{rel}/`):", "", "```", *unique, "```", ""]
    return out


def bounds_table(bounds: list[dict[str, Any]]) -> list[str]:
    out = ["| GPUs | max sequences at 1,024 tokens | decode step at 128 seqs | tok/s at 128 | "
           "1,024-token prefill alone | TPOT p50 <= 16 ms | 8,000 tok/s at 128 |",
           "|---|---|---|---|---|---|---|"]
    for b in bounds:
        v = b["verdict"]
        out.append(f"| {b['tp']}x {b['hardware']} | {b['max_seqs_at_context']:,} | "
                   f"{b['decode_step_ms_at_128']['modeled']:.1f} ms | "
                   f"{b['tok_s_at_128']['modeled']:,.0f} | "
                   f"{b['prefill_ms_1024_alone']['modeled']:.0f} ms | "
                   f"{'yes' if v['tpot_p50_16ms'] else 'no'} | "
                   f"{'yes' if v['tok_s_8000_at_128'] else 'no'} |")
    return out


def modes_table(modes: dict[str, dict[str, Any]]) -> list[str]:
    out = ["| scheduling | output tok/s | TTFT p50 | TTFT p99 | TPOT p50 | $ / 1M output tokens |",
           "|---|---|---|---|---|---|"]
    for name, m in modes.items():
        out.append(f"| {name} | {m['output_tokens_per_s']:,.0f} | {m['ttft_p50_ms']:,.0f} ms | "
                   f"{m['ttft_p99_ms']:,.0f} ms | {m['tpot_p50_ms']:.1f} ms | "
                   f"${m['cost_per_1m_output_tokens']:.2f} |")
    return out


def sim_section(report: dict[str, Any] | None) -> list[str]:
    if report is None:
        return []
    return [
        "## Simulator: Llama-3-70B on modelled GPUs", "",
        "The real scheduler on a cost model of each node (`docs/simulator-report.md` explains "
        "the model and its calibration). Modelled figures, not measurements on GPUs.", "",
        *bounds_table(report["bounds"]), "",
        f"4x A100 80GB, workload `{report['workload']}`, all requests at once:", "",
        *modes_table(report["saturated"]), "",
        f"The same at {report['rate']:g} requests/s (Poisson):", "",
        *modes_table(report["loaded"]), "",
        "```", report["command"], "```", "",
    ]


def hostile_section(r: dict[str, Any] | None) -> list[str]:
    """/health latency while each hostile request is served (`everystop bench hostile`)."""
    if not r:
        return []
    t = r["target"]
    lines = ["## Isolation: /health while hostile requests are served", "",
             f"`everystop bench hostile`, 1-minute load average "
             f"{r['machine']['load_avg'][0]:.0f} at the start; {_machine_line(r['machine'])} "
             f"Target: p99 under {t['health_p99_ms_under']:g} ms, worst under "
             f"{t['health_worst_ms_under']:g} ms.", "",
             "| case | status | innocent failed | /health p99 | worst | target met |",
             "|---|---|---|---|---|---|"]
    for name, c in r["cases"].items():
        h = c["health"]
        lines.append(f"| {name} | {c.get('status', '-')} | {c.get('innocent_failed', 0)} "
                     f"| {h['p99_ms']:.0f} ms "
                     f"| {h['worst_ms']:.0f} ms | {'yes' if c['pass'] else 'no'} |")
    return lines + [""]


def startup_section(r: dict[str, Any] | None) -> list[str]:
    """Time to the first /health 200 and what the serving process holds
    (`everystop bench startup`)."""
    if not r:
        return []
    names = {"first": "first (kernels, costs, tokenizer built)", "second": "second (cached)"}
    lines = ["## Start-up and memory", "",
             f"`everystop bench startup`, 1-minute load average "
             f"{r['machine']['load_avg'][0]:.0f} at the end; {_machine_line(r['machine'])} "
             f"Target: second start under {r['target']['second_start_to_health_s_under']:g} s.",
             "", "| start | to /health 200 |", "|---|---|"]
    lines += [f"| {names.get(k, k)} | {v['to_health_s']:.1f} s |" for k, v in r["starts"].items()]
    s = r["single_stream"]
    lines += ["", f"RSS of the second server by start-up stage, then after a single stream of "
                  f"{s['requests']} completions of {s['max_tokens']} tokens:", "",
              "| what | MiB |", "|---|---|"]
    lines += [f"| {k} | {v:,.1f} |" for k, v in r["memory_breakdown_mib"].items()]
    return lines + [""]


def render(results: Path = RESULTS, page_dir: Path = PAGE.parent) -> str:
    """The whole page from the results under `results`, for a page in `page_dir` (the
    plots are linked relative to it)."""
    kinds = sorted(p for p in (results / "cpu").glob("*") if p.is_dir())
    lines = [
        "# Performance", "",
        "<!-- Generated by `everystop bench all` from benchmarks/results/; do not edit. -->", "",
        "Every table is read from a committed result; `make bench` (`everystop bench all --out "
        "benchmarks/results --llama-server PATH`) measures them again on this machine and "
        "rewrites its CPU kind's section and this page. Model: SmolLM2-135M-Instruct (the "
        "default). Each CPU kind is a directory of results; sections appear where results "
        "exist.", "",
    ]
    for kind_dir in kinds:
        lines += kind_section(kind_dir, page_dir)
    lines += hostile_section(_load(results / "hostile_health_latency.json"))
    lines += startup_section(_load(results / "startup.json"))
    lines += sim_section(_load(results / "sim/report.json"))
    return "\n".join(lines)
