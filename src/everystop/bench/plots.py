"""PNG plots of a compare result: TTFT CDFs, throughput vs offered load, batch occupancy."""

from __future__ import annotations

from pathlib import Path
from typing import Any

COLORS = {"static": "tab:red", "continuous": "tab:orange", "chunked": "tab:green",
          "prefix": "tab:blue", "hf": "tab:gray"}


def _plt() -> Any:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _runs(data: dict[str, Any], prefix: str) -> dict[str, dict[str, Any]]:
    return {k.split("/", 1)[1]: v for k, v in data["runs"].items()
            if k.split("/", 1)[0] == prefix and "+" not in k}


def ttft_cdf(data: dict[str, Any], path: Path) -> None:
    plt = _plt()
    groups = sorted({k.split("/", 1)[0] for k in data["runs"] if not k.startswith("gate/")},
                    key=lambda g: (g != "offline", g))
    fig, axes = plt.subplots(1, len(groups), figsize=(5.5 * len(groups), 4), squeeze=False)
    for ax, group in zip(axes[0], groups):
        for mode, run in _runs(data, group).items():
            xs = sorted(r["ttft_s"] * 1000 for r in run["requests"] if r["success"])
            if xs:
                ys = [(i + 1) / len(xs) for i in range(len(xs))]
                ax.step(xs, ys, where="post", label=mode, color=COLORS.get(mode))
        ax.set_xscale("log")
        ax.set_xlabel("TTFT (ms, log scale)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"TTFT CDF - {group}")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def throughput_vs_load(data: dict[str, Any], path: Path) -> None:
    plt = _plt()
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
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def occupancy(data: dict[str, Any], path: Path, group: str = "offline") -> None:
    """The subway picture, measured: sequences on board each step, static vs continuous."""
    plt = _plt()
    runs = {m: r for m, r in _runs(data, group).items() if m in ("static", "chunked", "hf")}
    fig, axes = plt.subplots(len(runs), 1, figsize=(9, 2.6 * len(runs)), squeeze=False)
    for ax, (mode, run) in zip(axes[:, 0], runs.items()):
        steps = run.get("steps") or []
        ts = [s["t_s"] for s in steps]
        ax.step(ts, [s["num_seqs"] for s in steps], where="post", color=COLORS.get(mode),
                label="sequences in the step")
        if mode != "hf":
            ax.fill_between(ts, [s["num_waiting"] for s in steps], step="post", alpha=0.2,
                            color="gray", label="waiting")
        ax.set_ylabel("sequences")
        ax.set_title(f"{mode}: batch occupancy over time ({group})")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper right")
    axes[-1, 0].set_xlabel("time since start (s)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_all(data: dict[str, Any], out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "ttft_cdf.png", out_dir / "throughput_vs_load.png",
             out_dir / "occupancy.png"]
    ttft_cdf(data, paths[0])
    throughput_vs_load(data, paths[1])
    occupancy(data, paths[2])
    return paths
