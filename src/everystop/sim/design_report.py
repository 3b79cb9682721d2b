"""`everystop simulate report`: regenerate docs/simulator-report.md, its plots
(docs/img/sim-*.png) and the raw numbers (benchmarks/results/sim/report.json):

    everystop simulate report
    everystop simulate report --markdown-only   # after a new calibration

Llama-3-70B BF16 on 4x A100 80GB (TP=4) through the real Scheduler/KVCacheManager: the design's
capacity arithmetic, the physical bounds of its targets, and its comparison table re-derived.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from everystop.plots import pyplot, save
from everystop.results import write_result
from everystop.sim.bounds import target_bounds
from everystop.sim.capacity import design_capacity_table
from everystop.sim.cost_model import CostModel, decode_shape
from everystop.sim.metrics import summarize
from everystop.sim.node import build_node
from everystop.sim.report import plot_latency_cdf, plot_occupancy
from everystop.sim.report_md import render
from everystop.sim.simulator import simulate
from everystop.sim.specs import load_hardware, load_model
from everystop.sim.speculation import sizing_table
from everystop.workload import synthetic

ROOT = Path(__file__).resolve().parents[3]  # the source checkout: docs/ and benchmarks/ live there
WORKLOAD = "n=800,prompt=uniform:128:1024,output=uniform:20:800,seed=1"
MODES = [  # label, scheduling, extra scheduler options
    ("Static batching, bs=32", "static", {"max_batch_size": 32}),
    ("Continuous, no chunked prefill", "continuous", {}),
    ("Continuous + chunked prefill (budget 2048, chunk 512)", "chunked", {}),
    ("Continuous + chunked prefill (budget 512, chunk 256)", "chunked",
     {"max_num_batched_tokens": 512, "chunk_size": 256}),
    ("Continuous + chunked prefill, TPOT target 40 ms (budget 2048, chunk 512)", "chunked",
     {"tpot_target_ms": 40.0}),
    ("Continuous + chunked prefill, speculative k <= 4 at acceptance 0.7 (budget 2048, "
     "chunk 512)", "chunked", {"speculative_tokens": 4, "spec_acceptance": 0.7}),
]
# The sizing rule priced by the node's cost model (sim/speculation.py): batches, acceptances.
SIZING_BATCHES = [1, 8, 32, 64, 128, 256]
SIZING_ACCEPTANCES = [0.5, 0.7, 0.9]
ALTERNATIVES = [("a100-80gb", 4), ("a100-80gb", 8), ("h100-sxm", 4), ("h200", 4)]


def run_modes(rate: float | None) -> tuple[dict, dict]:
    base = synthetic(WORKLOAD)
    workload = base.with_rate(rate, seed=7) if rate else base
    summaries, results = {}, {}
    for label, mode, opts in MODES:
        node = build_node("llama-3-70b", "a100-80gb", 4, mode, **opts)
        res = simulate(workload, node.setup, node.cost.latency)
        summaries[label] = {"scheduling": mode, **opts, **summarize(res, node.cost)}
        results[label] = res
    return summaries, results


def plot_decode_curve(path: Path) -> Path:
    plt = pyplot()
    m = load_model("llama-3-70b")
    fig, ax = plt.subplots(figsize=(7, 3.8))
    batches = list(range(1, 257))
    for hw_key, tp, style in (("a100-80gb", 4, "-"), ("h100-sxm", 4, "--")):
        cost = CostModel.from_specs(m, load_hardware(hw_key), tp)
        for ctx, color in ((1024, "tab:blue"), (2048, "tab:orange")):
            ax.plot(batches, [1e3 * cost.latency(decode_shape(b, ctx)) for b in batches],
                    style, color=color, label=f"{hw_key} TP{tp} modeled, ctx {ctx}")
            ax.plot(batches, [1e3 * cost.roofline_s(decode_shape(b, ctx)) for b in batches],
                    style, color=color, alpha=0.35, label=f"{hw_key} TP{tp} roofline, ctx {ctx}")
    ax.axhline(16, color="red", ls=":", label="design: 16 ms/iteration")
    ax.axvline(128, color="grey", ls=":")
    ax.set_xlabel("decode batch (sequences)")
    ax.set_ylabel("decode step (ms)")
    ax.set_title("Llama-3-70B BF16 decode step vs batch")
    ax.legend(fontsize=6.5, ncol=2)
    ax.grid(alpha=0.3)
    return save(fig, path)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rate", type=float, default=2.0, help="offered load for the latency table")
    p.add_argument("--calibration", type=Path, default=ROOT / "benchmarks/results/sim/"
                                                             "calibration.json")
    p.add_argument("--calibration-real", type=Path, default=ROOT / "benchmarks/results/sim/"
                                                                  "calibration_real.json")
    p.add_argument("--markdown-only", action="store_true",
                   help="re-render the markdown from report.json and the calibration files, "
                        "without rerunning the simulations or the plots")


REPORT_JSON = ROOT / "benchmarks/results/sim/report.json"
PAGE = ROOT / "docs/simulator-report.md"


def saved_report(args: argparse.Namespace) -> dict:
    """What the page renders from the committed results: report.json and the calibrations."""
    data = json.loads(REPORT_JSON.read_text())
    data.update(_calibrations(args))
    return data


def run(args: argparse.Namespace) -> int:
    report = REPORT_JSON
    if args.markdown_only:
        # NOTE: report.json is not rewritten: its numbers were not rerun, and a rewrite would
        # stamp them with this command. The calibrations come from their own files.
        _write_markdown(saved_report(args))
        return 0
    img = ROOT / "docs/img"
    img.mkdir(parents=True, exist_ok=True)
    m, hw = load_model("llama-3-70b"), load_hardware("a100-80gb")
    capacity = design_capacity_table(m, hw, 4)
    bounds = [target_bounds(m, load_hardware(k), tp) for k, tp in ALTERNATIVES]
    saturated, _ = run_modes(None)
    loaded, loaded_results = run_modes(args.rate)
    plot_decode_curve(img / "sim-decode-step.png")
    plot_latency_cdf({k.split(" (")[0] + (" (512)" if "512," in k else ""): v
                      for k, v in loaded_results.items()}, img / "sim-latency-cdf.png")
    for (label, mode, opts), res in zip(MODES, loaded_results.values()):
        suffix = mode + ("-512" if opts.get("max_num_batched_tokens") == 512 else "") + (
            "-tpot" if opts.get("tpot_target_ms") else "") + (
            "-spec" if opts.get("speculative_tokens") else "")
        plot_occupancy(res, img / f"sim-occupancy-{suffix}.png", 32 if mode == "static" else 128,
                       title=f"{label} at {args.rate} req/s")
    sizing = {"k_max": 4, "context": 1024, "rows": sizing_table(
        CostModel.from_specs(m, hw, 4), SIZING_BATCHES, SIZING_ACCEPTANCES)}
    data = {"workload": WORKLOAD, "rate": args.rate, "capacity": capacity, "bounds": bounds,
            "saturated": saturated, "loaded": loaded, "speculation_sizing": sizing,
            **_calibrations(args)}
    _write_json(report, data)
    _write_markdown(data)
    return 0


def _calibrations(args: argparse.Namespace) -> dict:
    """The synthetic self-test and the real-engine calibration (each None if not run yet); the
    real one without its raw per-pass records, which stay in its own file."""
    read = lambda path: json.loads(path.read_text()) if path.is_file() else None  # noqa: E731
    real = read(args.calibration_real)
    if real is not None:
        real.pop("calibration_records", None)
    return {"calibration": read(args.calibration), "calibration_real": real}


def _write_json(path: Path, data: dict[str, Any]) -> None:
    write_result(data, path, quiet=True)
    print(f"wrote {path}")


def _write_markdown(data: dict) -> None:
    PAGE.write_text(render(data))
    print("wrote docs/simulator-report.md")

