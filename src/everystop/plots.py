"""Every PNG the project draws: latency CDFs, batch occupancy, throughput vs offered load,
speculative decoding's tok/s.

The drawing takes plain data (lists of numbers, the compare JSON), so the bench, the simulator
and the benchmark commands share one look: `cdf_axes` and `occupancy_axes` draw on an axis;
`ttft_cdf`, `throughput_vs_load` and `occupancy` render a compare result (`everystop bench
compare`); `latency_cdfs` and `occupancy_plot` are the simulator's run plots;
`speculative_bars` is `everystop bench speculative`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

COLORS = {"static": "tab:red", "continuous": "tab:orange", "chunked": "tab:green",
          "prefix": "tab:blue", "hf": "tab:gray"}


def pyplot() -> Any:
    """matplotlib.pyplot on the file-only Agg backend (no display needed)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save(fig: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot().close(fig)
    return path


# -- on one axis --------------------------------------------------------------------------------
def cdf_axes(ax: Any, series: dict[str, Sequence[float]], xlabel: str, log_x: bool = True,
             title: str | None = None) -> None:
    """The empirical CDF of each series (empty ones skipped), one step line per label."""
    for label, values in series.items():
        xs = sorted(values)
        if xs:
            ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=label,
                    color=COLORS.get(label))
    if log_x:
        ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("fraction of requests")
    if title:
        ax.set_title(title)
    ax.grid(alpha=0.3)


def occupancy_axes(ax: Any, t: Sequence[float], running: Sequence[int],
                   waiting: Sequence[int] | None, *, color: str | None = None,
                   max_num_seqs: int | None = None, kv_usage: Sequence[float] | None = None,
                   title: str = "Batch occupancy") -> None:
    """Sequences in each step over time (the subway picture), the queue shaded beneath, and
    optionally the batch limit and the KV pool's use (%, right axis)."""
    ax.step(t, running, where="post", color=color, label="sequences in the step")
    if waiting is not None:
        ax.fill_between(t, waiting, step="post", alpha=0.2, color="gray", label="waiting")
    if max_num_seqs:
        ax.axhline(max_num_seqs, color="grey", ls=":", label="max_num_seqs")
    ax.set_ylabel("sequences")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if kv_usage is not None:
        ax2 = ax.twinx()
        ax2.plot(t, [100 * u for u in kv_usage], color="tab:red", lw=0.8, label="KV used %")
        ax2.set_ylabel("KV blocks used (%)")
        ax2.set_ylim(0, 105)
        more = ax2.get_legend_handles_labels()
        handles, labels = handles + more[0], labels + more[1]
    ax.legend(handles, labels, fontsize=8, loc="upper right")


# -- a simulated run ----------------------------------------------------------------------------
def latency_cdfs(ttft_ms: dict[str, Sequence[float]], tpot_ms: dict[str, Sequence[float]],
                 path: Path) -> Path:
    """TTFT (log x) and TPOT CDFs side by side, one line per run."""
    plt = pyplot()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.6))
    cdf_axes(a1, ttft_ms, "TTFT (ms)")
    cdf_axes(a2, tpot_ms, "TPOT (ms)", log_x=False)
    a1.legend(fontsize=8)
    return save(fig, path)


def occupancy_plot(t: Sequence[float], running: Sequence[int], waiting: Sequence[int],
                   kv_usage: Sequence[float], path: Path, max_num_seqs: int | None = None,
                   title: str = "Batch occupancy") -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 3.6))
    occupancy_axes(ax, t, running, waiting, max_num_seqs=max_num_seqs, kv_usage=kv_usage,
                   title=title)
    ax.set_xlabel("simulated time (s)")
    return save(fig, path)


# -- a compare result (everystop bench compare) -------------------------------------------------
def _runs(data: dict[str, Any], prefix: str) -> dict[str, dict[str, Any]]:
    return {k.split("/", 1)[1]: v for k, v in data["runs"].items()
            if k.split("/", 1)[0] == prefix and "+" not in k}


def ttft_cdf(data: dict[str, Any], path: Path) -> Path:
    plt = pyplot()
    groups = sorted({k.split("/", 1)[0] for k in data["runs"] if not k.startswith("gate/")},
                    key=lambda g: (g != "offline", g))
    fig, axes = plt.subplots(1, len(groups), figsize=(5.5 * len(groups), 4), squeeze=False)
    for ax, group in zip(axes[0], groups):
        series = {mode: [r["ttft_s"] * 1000 for r in run["requests"] if r["success"]]
                  for mode, run in _runs(data, group).items()}
        cdf_axes(ax, series, "TTFT (ms, log scale)", title=f"TTFT CDF - {group}")
        ax.legend()
    return save(fig, path)


def throughput_vs_load(data: dict[str, Any], path: Path) -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    points: dict[str, list[tuple[float, float]]] = {}
    for name, run in data["runs"].items():
        group, mode = name.split("/", 1)
        if group.startswith("online") and "+" not in mode:
            points.setdefault(mode, []).append((run["meta"]["rate"],
                                                run["summary"]["output_throughput"]))
    for mode, pts in points.items():
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=f"{mode} (online)",
                color=COLORS.get(mode))
    for mode, run in _runs(data, "offline").items():
        ax.axhline(run["summary"]["output_throughput"], ls="--", lw=1, color=COLORS.get(mode),
                   label=f"{mode} capacity (offline)")
    ax.set_xlabel("offered load (requests/s, Poisson)")
    ax.set_ylabel("output tokens/s")
    ax.set_title("Throughput vs offered load")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save(fig, path)


def occupancy(data: dict[str, Any], path: Path, group: str = "offline") -> Path:
    """The subway picture, measured: sequences on board each step, static vs continuous."""
    plt = pyplot()
    runs = {m: r for m, r in _runs(data, group).items() if m in ("static", "chunked", "hf")}
    fig, axes = plt.subplots(len(runs), 1, figsize=(9, 2.6 * len(runs)), squeeze=False)
    for ax, (mode, run) in zip(axes[:, 0], runs.items()):
        steps = run.get("steps") or []
        occupancy_axes(ax, [s["t_s"] for s in steps], [s["num_seqs"] for s in steps],
                       None if mode == "hf" else [s["num_waiting"] for s in steps],
                       color=COLORS.get(mode),
                       title=f"{mode}: batch occupancy over time ({group})")
    axes[-1, 0].set_xlabel("time since start (s)")
    return save(fig, path)


def write_compare_plots(data: dict[str, Any], out_dir: Path) -> list[Path]:
    """The three plots of a compare result, in out_dir."""
    out_dir.mkdir(parents=True, exist_ok=True)
    return [ttft_cdf(data, out_dir / "ttft_cdf.png"),
            throughput_vs_load(data, out_dir / "throughput_vs_load.png"),
            occupancy(data, out_dir / "occupancy.png")]


def speculative_bars(data: dict[str, Any], path: Path) -> Path:
    """`everystop bench speculative`: output tok/s of each server and method, per scenario."""
    plt = pyplot()
    scenarios = list(data["scenarios"])
    runs = data["runs"]
    fig, axes = plt.subplots(1, len(scenarios), figsize=(4.5 * len(scenarios), 4), squeeze=False)
    for ax, scenario in zip(axes[0], scenarios):
        names = list(runs)
        values = [runs[n]["scenarios"][scenario]["output_tok_s"] for n in names]
        colors = ["tab:blue" if n.startswith("everystop") else "tab:gray" for n in names]
        ax.barh(names, values, color=colors)
        ax.invert_yaxis()
        ax.set_xlabel("output tok/s")
        ax.set_title(f"{scenario} (x{data['scenarios'][scenario]['concurrency']})")
        ax.grid(axis="x", alpha=0.3)
    return save(fig, path)
