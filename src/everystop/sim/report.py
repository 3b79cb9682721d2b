"""Write a simulation's results: summary JSON, per-iteration records, and PNG plots (drawn by
everystop.plots)."""

from __future__ import annotations

import json
from pathlib import Path

from everystop.plots import latency_cdfs, occupancy_plot
from everystop.results import write_result
from everystop.sim.simulator import SimResult


def write_json(path: Path, data: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")


def write_run(out_dir: Path, summary: dict, result: SimResult, node: dict,
              plots: bool = True) -> list[Path]:
    """summary.json, iterations.json (the calibration record format) and plots in out_dir."""
    out_dir.mkdir(parents=True, exist_ok=True)
    write_result({"node": node, "summary": summary}, out_dir / "summary.json", quiet=True)
    write_json(out_dir / "iterations.json", [it.to_dict() for it in result.iterations])
    written = [out_dir / "summary.json", out_dir / "iterations.json"]
    if plots:
        written += [plot_occupancy(result, out_dir / "occupancy.png",
                                   node.get("max_num_seqs")),
                    plot_latency_cdf({"run": result}, out_dir / "latency_cdf.png")]
    return written


def plot_occupancy(result: SimResult, path: Path, max_num_seqs: int | None = None,
                   title: str = "Batch occupancy") -> Path:
    occ = result.occupancy
    return occupancy_plot([o.time_s for o in occ], [o.num_running for o in occ],
                          [o.num_waiting for o in occ], [o.kv_usage for o in occ], path,
                          max_num_seqs, title)


def plot_latency_cdf(results: dict[str, SimResult], path: Path) -> Path:
    """TTFT and TPOT distributions, one line per run."""
    ttft, tpot = {}, {}
    for label, res in results.items():
        done = [r for r in res.requests if r.finished_time is not None and r.first_token_time]
        ttft[label] = [1e3 * (r.first_token_time - r.arrival_time) for r in done]
        tpot[label] = [1e3 * (r.finished_time - r.first_token_time) / (r.num_output_tokens - 1)
                       for r in done if r.num_output_tokens > 1]
    return latency_cdfs(ttft, tpot, path)
