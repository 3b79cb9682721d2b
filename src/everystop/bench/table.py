"""The design's 'Cost and Token Economics' table, rebuilt from a compare result, as markdown."""

from __future__ import annotations

import os
import platform
from typing import Any

from everystop.stats import cost_per_million

LABELS = {
    "static": "Static batching, bs={bs}",
    "continuous": "Continuous batching, no chunked prefill",
    "chunked": "Continuous batching + chunked prefill",
    "prefix": "Continuous + chunked prefill + prefix caching",
    "hf": "HF transformers generate, static bs={bs} (reference)",
}


def machine_description() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = ""
    try:
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        mem = f", {pages / 2**30:.0f} GiB RAM"
    except (ValueError, OSError):
        pass
    return f"{cpu}, {os.cpu_count()} cores{mem}, {platform.system()} {platform.release()}"


def _fmt(x: float | None, digits: int = 0) -> str:
    if x is None:
        return "n/a"
    return f"{x:,.{digits}f}"


def _row(label: str, s: dict[str, Any], dollars: float, base_tps: float | None) -> str:
    tps = s["output_throughput"]
    speedup = f"{tps / base_tps:.2f}x" if base_tps else ""
    cost = cost_per_million(tps, dollars)
    return (f"| {label} | {_fmt(tps, 1)} | {speedup} | ${cost:.3g} "
            f"| {_fmt(s['ttft_ms']['p99'])} ms | {_fmt(s['tpot_ms']['p50'], 1)} ms |")


def _section(data: dict[str, Any], prefix: str, title: str) -> list[str]:
    opts = data["meta"].get("options", {})
    bs = opts.get("static_batch_size", 32)
    dollars = float(opts.get("dollars_per_hour", 0.10))
    runs = {k.split("/", 1)[1]: v for k, v in data["runs"].items()
            if k.startswith(prefix + "/") and "+" not in k}
    if not runs:
        return []
    base = runs.get("static", {}).get("summary", {}).get("output_throughput")
    lines = [f"### {title}", "",
             "| Configuration | Output tok/s | vs static | Cost / 1M output tokens "
             "| TTFT p99 | TPOT p50 |", "|---|---:|---:|---:|---:|---:|"]
    for mode in ("static", "continuous", "chunked", "prefix", "hf"):
        if mode in runs:
            label = LABELS[mode].format(bs=bs)
            if mode == "hf":
                label += f" - first {runs[mode]['meta'].get('subset')} requests"
            lines.append(_row(label, runs[mode]["summary"], dollars, base))
    lines.append("")
    return lines


def markdown_report(data: dict[str, Any], command: str = "") -> str:
    meta = data["meta"]
    opts = meta.get("options", {})
    lines = ["# Cost and token economics, measured", "",
             f"- Machine: {meta.get('machine', machine_description())}",
             f"- Model: {meta.get('model', 'default (SmolLM2-135M-Instruct Q4_1 GGUF)')}",
             f"- Workload: `{meta.get('workload_file', meta.get('workload'))}` "
             f"({meta.get('num_requests')} requests)",
             f"- Pricing: ${opts.get('dollars_per_hour')}/hour for this machine"]
    if command:
        lines.append(f"- Command: `{command}`")
    lines.append("")
    lines += _section(data, "offline", "Offline: all requests at t=0")
    for key in sorted({k.split("/", 1)[0] for k in data["runs"] if k.startswith("online")}):
        run = next(v for k, v in data["runs"].items() if k.startswith(key + "/"))
        m = run["meta"]
        lines += _section(data, key, f"Online: Poisson arrivals at {m['rate']:.3f} req/s "
                                     f"({m['load']:.0%} of {m['capacity_from']}'s capacity)")
    static = data["runs"].get("offline/static", {}).get("stragglers")
    if static:
        lines.append(f"Static batching: {static['frac_steps_over_half_finished']:.0%} of decode "
                     f"steps ran with more than half the batch already finished (mean seat "
                     f"occupancy {static['mean_occupancy']:.0%} over "
                     f"{static['decode_steps']} decode steps).")
        lines.append("")
    loads = [x for r in data["runs"].values() for x in r["meta"].get("loadavg_1m", []) if x]
    if loads:
        lines.append(f"Machine load average (1 min) during the runs: {min(loads):.1f} to "
                     f"{max(loads):.1f} on {os.cpu_count()} cores (a shared machine: the ratios "
                     f"between modes are the robust numbers).")
        lines.append("")
    for name, g in data.get("gate", {}).items():
        lines.append(f"- Gate, {name}: `{g['verdict']}`")
    return "\n".join(lines).rstrip() + "\n"
