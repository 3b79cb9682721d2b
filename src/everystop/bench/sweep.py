"""Latency vs offered load, several servers, one client: `everystop bench sweep`.

Each target (a name and the base URL of an OpenAI-compatible server: everystop's, llama.cpp's
`llama-server`, vLLM ...) gets the same workload at each offered load, as Poisson arrivals,
through the same streaming client (`client.run_serve`). Loads are fractions of a capacity in
requests/s: given, or measured first by sending the whole workload at once to one target.
Writes one JSON (per target and load: the client's summary and per-tier breakdown) and a plot.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

from everystop.bench.client import ServeOptions, run_serve
from everystop.bench.table import machine_description
from everystop.workload import Workload

METRICS = (  # (label, summary key, field) plotted against offered load
    ("TTFT p50 (ms)", "ttft_ms", "p50"), ("TTFT p99 (ms)", "ttft_ms", "p99"),
    ("TPOT p50 (ms)", "tpot_ms", "p50"), ("TPOT p99 (ms)", "tpot_ms", "p99"),
    ("ITL p99 (ms)", "itl_ms", "p99"), ("output tokens/s", "output_throughput", None))


def tokenize_prompts(workload: Workload, tokenizer: Any) -> dict[str, list[int]]:
    """Request id -> token ids of its prompt, for ServeOptions.prompt_token_ids."""
    return {r.id: list(tokenizer.encode(r.prompt)) for r in workload.requests}


async def run_sweep(workload: Workload, targets: dict[str, str], loads: list[float],
                    base: ServeOptions, *, capacity_rps: float | None = None,
                    capacity_from: str | None = None) -> dict[str, Any]:
    """Run every target at every load (fractions of capacity_rps, or of capacity_from's
    measured saturated request rate). Returns the sweep's JSON-ready result."""
    meta: dict[str, Any] = {"kind": "sweep", "machine": machine_description(),
                            "workload": workload.name, "num_requests": len(workload.requests),
                            "targets": targets, "loads": loads,
                            "token_id_prompts": base.prompt_token_ids is not None,
                            "started": time.strftime("%Y-%m-%dT%H:%M:%S")}
    saturated = None
    if capacity_rps is None:
        if capacity_from not in targets:
            raise ValueError("give capacity_rps, or capacity_from naming one of the targets")
        opts = dataclasses.replace(base, base_url=targets[capacity_from], rate=float("inf"))
        saturated = await run_serve(workload, opts)
        capacity_rps = saturated["summary"]["request_throughput"]
    meta.update(capacity_rps=capacity_rps, capacity_from=capacity_from)
    runs: dict[str, dict[str, Any]] = {name: {} for name in targets}
    for load in loads:
        for name, url in targets.items():
            opts = dataclasses.replace(base, base_url=url, rate=load * capacity_rps)
            report = await run_serve(workload, opts)
            runs[name][f"{load:g}"] = {"offered_rps": load * capacity_rps,
                                       "summary": report["summary"],
                                       "by_priority": report["by_priority"]}
    result: dict[str, Any] = {"meta": meta, "runs": runs}
    if saturated is not None:
        result["saturated"] = {"target": capacity_from, "summary": saturated["summary"]}
    return result


def plot_sweep(data: dict[str, Any], path: Path) -> Path:
    """One panel per metric, one line per target, offered load on x."""
    from everystop.plots import pyplot, save

    plt = pyplot()
    fig, axes = plt.subplots(2, 3, figsize=(13, 7))
    for ax, (label, key, field) in zip(axes.flat, METRICS):
        for name, by_load in data["runs"].items():
            pts = sorted((run["offered_rps"], run["summary"][key] if field is None
                          else run["summary"][key][field]) for run in by_load.values())
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=name)
        ax.set_xlabel("offered load (requests/s, Poisson)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    meta = data["meta"]
    fig.suptitle(f"{meta['workload']} ({meta['num_requests']} requests) on {meta['machine']}",
                 fontsize=10)
    return save(fig, path)
