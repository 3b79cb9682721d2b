"""Write a simulation's results: summary JSON, per-iteration records, and PNG plots."""

from __future__ import annotations

import json
from pathlib import Path

from everystop.sim.simulator import SimResult


def write_json(path: Path, data: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")


def write_run(out_dir: Path, summary: dict, result: SimResult, node: dict,
              plots: bool = True) -> list[Path]:
    """summary.json, iterations.json (the calibration record format) and plots in out_dir."""
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json(out_dir / "summary.json", {"node": node, "summary": summary})
    write_json(out_dir / "iterations.json", [it.to_dict() for it in result.iterations])
    written = [out_dir / "summary.json", out_dir / "iterations.json"]
    if plots:
        written += [plot_occupancy(result, out_dir / "occupancy.png",
                                   node.get("max_num_seqs")),
                    plot_latency_cdf({"run": result}, out_dir / "latency_cdf.png")]
    return written


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_occupancy(result: SimResult, path: Path, max_num_seqs: int | None = None,
                   title: str = "Batch occupancy") -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 3.6))
    t = [o.time_s for o in result.occupancy]
    ax.step(t, [o.num_running for o in result.occupancy], where="post", label="running seqs")
    ax.step(t, [o.num_waiting for o in result.occupancy], where="post", label="waiting",
            alpha=0.7)
    if max_num_seqs:
        ax.axhline(max_num_seqs, color="grey", ls=":", label="max_num_seqs")
    ax2 = ax.twinx()
    ax2.plot(t, [100 * o.kv_usage for o in result.occupancy], color="tab:red", lw=0.8,
             label="KV used %")
    ax2.set_ylabel("KV blocks used (%)")
    ax2.set_ylim(0, 105)
    ax.set_xlabel("simulated time (s)")
    ax.set_ylabel("sequences")
    ax.set_title(title)
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_latency_cdf(results: dict[str, SimResult], path: Path) -> Path:
    """TTFT and TPOT distributions, one line per run."""
    plt = _pyplot()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.6))
    for label, res in results.items():
        done = [r for r in res.requests if r.finished_time is not None and r.first_token_time]
        ttft = sorted(1e3 * (r.first_token_time - r.arrival_time) for r in done)
        tpot = sorted(1e3 * (r.finished_time - r.first_token_time) / (r.num_output_tokens - 1)
                      for r in done if r.num_output_tokens > 1)
        for ax, xs in ((a1, ttft), (a2, tpot)):
            if xs:
                ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=label)
    a1.set_xscale("log")
    a1.set_xlabel("TTFT (ms)")
    a2.set_xlabel("TPOT (ms)")
    for ax in (a1, a2):
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
    a1.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
