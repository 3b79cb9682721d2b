"""The design's deploy gate: a scheduler change ships only if tail TTFT and median TPOT did not
regress beyond set percentages against the previous build's run of the same workload.

Aggregate throughput can look fine while p99 quietly gets worse, hence latency, not throughput.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from everystop.stats import percentile


def check_latency_regression(baseline_ttft_p99: float, baseline_tpot_p50: float,
                             candidate_ttft_samples: list[float],
                             candidate_tpot_samples: list[float],
                             ttft_regression_pct: float = 0.20,
                             tpot_regression_pct: float = 0.15) -> dict[str, Any]:
    """Fractions in, fractions out (0.20 = 20%); times in any one unit."""
    cand_ttft = percentile(candidate_ttft_samples, 99, empty=math.nan)
    cand_tpot = percentile(candidate_tpot_samples, 50, empty=math.nan)
    ttft_delta = (cand_ttft - baseline_ttft_p99) / baseline_ttft_p99
    tpot_delta = (cand_tpot - baseline_tpot_p50) / baseline_tpot_p50
    ttft_ok = ttft_delta <= ttft_regression_pct
    tpot_ok = tpot_delta <= tpot_regression_pct
    return {"passed": bool(ttft_ok and tpot_ok),
            "ttft_p99": {"baseline": baseline_ttft_p99, "candidate": cand_ttft,
                         "delta": ttft_delta, "limit": ttft_regression_pct, "ok": ttft_ok},
            "tpot_p50": {"baseline": baseline_tpot_p50, "candidate": cand_tpot,
                         "delta": tpot_delta, "limit": tpot_regression_pct, "ok": tpot_ok}}


def load_run(path: str | Path, run: str | None = None) -> dict[str, Any]:
    """A run report (bench serve, or one run of a compare file picked by name)."""
    data = json.loads(Path(path).read_text())
    if "runs" in data:
        if run is None:
            raise ValueError(f"{path} holds several runs ({', '.join(data['runs'])}): pick one "
                             f"with --run")
        return data["runs"][run]
    return data


def latency_samples(report: dict[str, Any]) -> tuple[list[float], list[float]]:
    """TTFT and TPOT samples in ms of the successful requests of a run report."""
    rows = [r for r in report.get("requests", []) if r.get("success", True)]
    ttft = [r["ttft_s"] * 1000 for r in rows]
    tpot = [r["tpot_s"] * 1000 for r in rows if r.get("tpot_s") is not None]
    return ttft, tpot


def gate(baseline: dict[str, Any], candidate: dict[str, Any], ttft_pct: float = 20.0,
         tpot_pct: float = 15.0) -> dict[str, Any]:
    """Percent limits in, verdict out. Baseline statistics come from its samples when present
    (the same percentile rule on both sides), else from its summary."""
    b_ttft, b_tpot = latency_samples(baseline)
    if b_ttft and b_tpot:
        base_ttft_p99 = percentile(b_ttft, 99, empty=math.nan)
        base_tpot_p50 = percentile(b_tpot, 50, empty=math.nan)
    else:
        base_ttft_p99 = baseline["summary"]["ttft_ms"]["p99"]
        base_tpot_p50 = baseline["summary"]["tpot_ms"]["p50"]
    c_ttft, c_tpot = latency_samples(candidate)
    if not c_ttft or not c_tpot:
        raise ValueError("the candidate run has no per-request samples")
    return check_latency_regression(base_ttft_p99, base_tpot_p50, c_ttft, c_tpot,
                                    ttft_pct / 100.0, tpot_pct / 100.0)


def verdict_line(result: dict[str, Any]) -> str:
    def part(name: str, d: dict[str, Any]) -> str:
        mark = "ok" if d["ok"] else "REGRESSED"
        return (f"{name} {d['baseline']:.1f} -> {d['candidate']:.1f} ms "
                f"({d['delta']:+.1%}, limit +{d['limit']:.0%}, {mark})")
    head = "PASS" if result["passed"] else "FAIL"
    return f"{head}: {part('TTFT p99', result['ttft_p99'])}; {part('TPOT p50', result['tpot_p50'])}"
