r"""Latency vs offered load, several servers, one client: `everystop bench sweep`.

Each target (a name and the base URL of an OpenAI-compatible server: everystop's, llama.cpp's
`llama-server`, vLLM ...) gets the same workload at each offered load, as Poisson arrivals,
through the same streaming client (`client.run_serve`). Loads are fractions of a capacity in
requests/s: given, or measured first by sending the whole workload at once to one target.

Before anything is measured every target gets a warm-up: a few requests not in the measured
workload, all at once (first-call costs - thread pools spinning up, allocator growth, kernel
selection - would otherwise land in whichever load runs first). Its summary is kept in the JSON
under "warmup", apart from the results. A tier mix (`--tier-mix 0.2:0:0.8`) re-assigns the
requests' priority tiers, seeded, and sends them, for a per-tier TPOT-target run. A sweep too
long for one sitting runs in pieces (`--append`: one load per call), merged into one JSON.

Every run (warm-up, capacity run, each target at each load) sends its prompts behind a tag of
its own ("[llamacpp at 0.5] "): the same requests at every load, but no run finds another's
prompts in a server's prefix or prompt cache (llama-server keeps each slot's last prompt;
everystop caches prefixes). Without it a later run measures cache hits - and a target that ran
the capacity run had seen the prompts before anything was measured.
Writes one JSON (per target and load: the client's summary, per-tier breakdown, one row per
request - sent at, prompt length, TTFT, TPOT, longest token gap - and the load average around
the run) and a plot. The servers can be started by the command itself (their
command lines go into the JSON's meta.server_commands); the side-by-side run of the issue:

    everystop bench sweep \
        --start-everystop "--dtype bfloat16 --tpot-target-ms 200 --ttft-target-ms auto" \
        --start-llamacpp "-np 32 -c 65536 -t 2 -tb 2" --capacity-from llamacpp \
        --workload benchmarks/workloads/mixed-128.json --num-requests 48 --token-ids \
        --out benchmarks/results/cpu/amd_avx512/latency_vs_load.json
"""

from __future__ import annotations

import dataclasses
import os
import random
import time
from collections.abc import Callable
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


def parse_tier_mix(text: str) -> tuple[float, float, float]:
    """'0.2:0:0.8' -> fractions of tiers 0, 1, 2 (normalized)."""
    parts = [float(x) for x in text.split(":")]
    if len(parts) != 3 or min(parts) < 0 or sum(parts) <= 0:
        raise ValueError(f"a tier mix is three non-negative fractions a:b:c, not {text!r}")
    total = sum(parts)
    return (parts[0] / total, parts[1] / total, parts[2] / total)


def with_tier_mix(workload: Workload, mix: tuple[float, float, float], seed: int = 0) -> Workload:
    """The same requests with priority tiers re-assigned: round(fraction * n) of each tier
    (tier 2 takes the rounding rest), on requests picked by a seeded shuffle."""
    n = len(workload.requests)
    counts = [round(mix[0] * n), round(mix[1] * n)]
    counts.append(n - counts[0] - counts[1])
    tiers = [t for t, c in enumerate(counts) for _ in range(c)]
    order = list(range(n))
    random.Random(seed).shuffle(order)
    tier_of = {i: tiers[k] for k, i in enumerate(order)}
    reqs = [dataclasses.replace(r, priority=tier_of[i]) for i, r in enumerate(workload.requests)]
    name = f"{workload.name}+tiers{mix[0]:g}:{mix[1]:g}:{mix[2]:g}"
    return Workload(name, workload.seed, workload.spec, reqs)


def tagged(workload: Workload, opts: ServeOptions, tag: str,
           encode: Callable[[str], list[int]] | None = None) -> tuple[Workload, ServeOptions]:
    """The workload with `tag` in front of every prompt (text, and token ids when the options
    send ids: `encode(tag)` in front of each), so this run shares no prompt prefix with
    another run; the requests within it keep their shared prefixes."""
    reqs = [dataclasses.replace(r, prompt=tag + r.prompt) for r in workload.requests]
    ids = opts.prompt_token_ids
    if ids is not None:
        if encode is None:
            raise ValueError("tagging token-id prompts needs the tokenizer's encode")
        head = encode(tag)
        ids = {r.id: head + ids[r.id] for r in workload.requests}
    return (Workload(workload.name, workload.seed, workload.spec, reqs),
            dataclasses.replace(opts, prompt_token_ids=ids))


def _load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


async def run_sweep(workload: Workload, targets: dict[str, str], loads: list[float],
                    base: ServeOptions, *, capacity_rps: float | None = None,
                    capacity_from: str | None = None,
                    warmup: Workload | None = None,
                    on_progress: Callable[[dict[str, Any]], None] | None = None,
                    encode: Callable[[str], list[int]] | None = None, fresh_prompts: bool = True
                    ) -> dict[str, Any]:
    """Run every target at every load (fractions of capacity_rps, or of capacity_from's
    measured saturated request rate), each target warmed up first with `warmup` (all at once;
    excluded from the results). Returns the sweep's JSON-ready result; `on_progress` gets it
    as it stands after every finished run (so a sweep cut short keeps what it measured).
    `fresh_prompts`: each run's prompts behind a tag of its own (`tagged`; `encode` turns the
    tag into token ids when prompts go as ids)."""
    def fresh(wl: Workload, opts: ServeOptions, label: str) -> tuple[Workload, ServeOptions]:
        return tagged(wl, opts, f"[{label}] ", encode) if fresh_prompts else (wl, opts)

    meta: dict[str, Any] = {"kind": "sweep", "machine": machine_description(),
                            "workload": workload.name, "num_requests": len(workload.requests),
                            "targets": targets, "loads": loads,
                            "token_id_prompts": base.prompt_token_ids is not None,
                            "send_priority": base.send_priority,
                            "fresh_prompts_per_run": fresh_prompts,
                            "started": time.strftime("%Y-%m-%dT%H:%M:%S")}
    result: dict[str, Any] = {"meta": meta}
    if warmup is not None and warmup.requests:
        result["warmup"] = {"workload": warmup.name, "num_requests": len(warmup.requests),
                            "rate": "all at once", "excluded_from_results": True,
                            "by_target": {}}
        for name, url in targets.items():
            report = await run_serve(*fresh(warmup, dataclasses.replace(
                base, base_url=url, rate=float("inf")), f"{name} warm-up"))
            result["warmup"]["by_target"][name] = report["summary"]
    if capacity_rps is None:
        if capacity_from not in targets:
            raise ValueError("give capacity_rps, or capacity_from naming one of the targets")
        opts = dataclasses.replace(base, base_url=targets[capacity_from], rate=float("inf"))
        saturated = await run_serve(*fresh(workload, opts, f"{capacity_from} at capacity"))
        capacity_rps = saturated["summary"]["request_throughput"]
        result["saturated"] = {"target": capacity_from, "summary": saturated["summary"]}
    meta.update(capacity_rps=capacity_rps, capacity_from=capacity_from)
    runs: dict[str, dict[str, Any]] = {name: {} for name in targets}
    result["runs"] = runs
    for load in loads:
        for name, url in targets.items():
            opts = dataclasses.replace(base, base_url=url, rate=load * capacity_rps)
            before = _load_average()
            report = await run_serve(*fresh(workload, opts, f"{name} at {load:g}"))
            runs[name][f"{load:g}"] = {"offered_rps": load * capacity_rps,
                                       "summary": report["summary"],
                                       "by_priority": report["by_priority"],
                                       "requests": request_rows(report["requests"]),
                                       "load_average_before": before,
                                       "load_average_after": _load_average()}
            if on_progress is not None:
                on_progress(result)
    return result


def request_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per request, what says why a percentile is what it is: when it was sent, its prompt
    length, TTFT, TPOT and its longest gap between tokens (ms), in sending order."""
    def ms(x: float | None) -> float | None:
        return None if x is None else round(1e3 * x, 1)

    return [{"id": r["id"], "prompt_len": r["prompt_len"], "output_tokens": r["output_tokens"],
             "sent_s": round(r["sent_s"], 3), "ttft_ms": ms(r["ttft_s"]),
             "tpot_ms": ms(r["tpot_s"]), "itl_max_ms": ms(max(r["itl_s"], default=None)),
             **({} if r["success"] else {"error": r["error"]})}
            for r in sorted(rows, key=lambda r: r["sent_s"])]


def merge_sweeps(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """One sweep from two pieces of it (`--append`): the same workload and capacity, the new
    piece's runs added (a load run again replaces the old one). Each piece's meta, warm-up and
    saturated run are kept under "pieces"."""
    for key in ("workload", "num_requests", "capacity_rps"):
        if old["meta"].get(key) != new["meta"].get(key):
            raise ValueError(f"cannot append: {key} differs ({old['meta'].get(key)!r} vs "
                             f"{new['meta'].get(key)!r}); pass --capacity-rps to keep it")
    pieces = old.get("pieces") or [_piece(old)]
    merged = {k: v for k, v in old.items() if k not in ("runs", "pieces")}
    merged["meta"] = dict(old["meta"])
    merged["meta"]["targets"] = {**old["meta"]["targets"], **new["meta"]["targets"]}
    merged["meta"]["loads"] = sorted({*old["meta"]["loads"], *new["meta"]["loads"]})
    runs = {name: dict(by_load) for name, by_load in old["runs"].items()}
    for name, by_load in new["runs"].items():
        runs.setdefault(name, {}).update(by_load)
    merged["runs"] = runs
    merged["pieces"] = [*pieces, _piece(new)]
    return merged


def _piece(data: dict[str, Any]) -> dict[str, Any]:
    return {"started": data["meta"].get("started"), "loads": data["meta"]["loads"],
            "command": data.get("command"), "git_commit": data.get("git_commit"),
            "load_average": (data.get("machine") or {}).get("load_avg"),
            "warmup": data.get("warmup"), "saturated": data.get("saturated")}


def plot_sweep(data: dict[str, Any], path: Path) -> Path:
    """One panel per metric, one line per target, offered load on x."""
    from everystop.plots import pyplot, save

    plt = pyplot()
    fig, axes = plt.subplots(2, 3, figsize=(13, 7))
    lines = _plot_lines(data)
    for ax, (label, key, field) in zip(axes.flat, METRICS):
        for name, pts_by_load in lines.items():
            pts = sorted((rps, s[key] if field is None else s[key][field])
                         for rps, s in pts_by_load if s.get(key) is not None)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=name)
        ax.set_xlabel("offered load (requests/s, Poisson)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    meta = data["meta"]
    fig.suptitle(f"{meta['workload']} ({meta['num_requests']} requests) on {meta['machine']}",
                 fontsize=10)
    return save(fig, path)


def _plot_lines(data: dict[str, Any]) -> dict[str, list[tuple[float, dict[str, Any]]]]:
    """Line label -> (offered req/s, summary) points: one line per target, and with priorities
    sent, one per target and tier as well."""
    lines: dict[str, list[tuple[float, dict[str, Any]]]] = {}
    for name, by_load in data["runs"].items():
        for run in by_load.values():
            lines.setdefault(name, []).append((run["offered_rps"], run["summary"]))
            if data["meta"].get("send_priority"):
                for tier, summary in run["by_priority"].items():
                    lines.setdefault(f"{name} tier {tier}", []).append(
                        (run["offered_rps"], summary))
    return lines


def warmup_workload(full: Workload, num_measured: int, num_warmup: int) -> Workload:
    """`num_warmup` requests from after the first `num_measured` (so the warm-up leaves no
    measured prompt in a prefix cache); from the start when the workload has no more."""
    reqs = full.requests[num_measured:num_measured + num_warmup]
    if len(reqs) < num_warmup:
        reqs = full.requests[:num_warmup]
    return Workload(f"{full.name}[warmup]", full.seed, full.spec, list(reqs))
