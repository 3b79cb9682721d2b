"""The simulator report's per-pass calibration section (calibration (a)), from
`everystop bench sim-pass-calibrate`'s JSON."""

from __future__ import annotations

PASS_COMMAND = ("everystop bench sim-pass-calibrate "
                "--out benchmarks/results/sim/pass_calibration.json")


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def pass_calibration_lines(cal: dict | None) -> list[str]:
    """Markdown lines: the held-out per-pass errors of both fits and their residual trend."""
    if not cal:
        return [f"Not run yet: `{PASS_COMMAND}`, then `everystop simulate report "
                "--markdown-only`."]
    m, wl, goal = cal["machine"], cal["workload"], cal["goal"]
    out = [
        f"`{cal.get('file', '')}`: written by `{cal.get('command', PASS_COMMAND)}`"
        + (f" (re-judging the passes of `{cal['refit_of']['command']}`)"
           if cal.get("refit_of") else "")
        + f" ({cal['total_wall_s']:.0f} s wall): "
        f"{cal['model']}, {m['torch_threads']} torch threads on an {m['cpu']}. One live run of "
        f"{wl['num_requests']} requests (`{wl['spec']}`, Poisson at {wl['rate_req_per_s']} "
        f"req/s, {cal['live_wall_s']:.0f} s), {cal['num_passes']} passes; {cal['split']}. "
        f"Load average {m['load_avg_1m_start']:.2f} at the start, {m['load_avg_1m_end']:.2f} "
        f"at the end; other processes used {_pct(cal['other_processes_cpu'])} of the cores "
        "during the run"
        + (" (**a disturbed run: these timings are not meaningful**)"
           if cal["other_processes_cpu"] > 0.05 else "")
        + (f" ({cal['source_note']})" if cal.get("source_note") else "")
        + ". Goal: median |error| <= "
        f"{_pct(goal['median_abs_rel_error'])}, p90 <= {_pct(goal['p90_abs_rel_error'])}.",
        "",
        "| fit | held-out passes | median abs error | p90 abs error | mean abs error "
        "| total time error | goal |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, label in (("base", "simulator's form: max(a*FLOPs, b*bytes) + c0 + c1*seqs"),
                        ("attention", "with attention term: max(a*dense FLOPs, b*weight bytes) "
                                      "+ e*attention FLOPs + f*KV bytes + c0 + c1*seqs")):
        h = cal[name]["holdout"]
        out.append(f"| {label} | {h['num_passes']} | {_pct(h['median_abs_rel_error'])} "
                   f"| {_pct(h['p90_abs_rel_error'])} | {_pct(h['mean_abs_rel_error'])} "
                   f"| {100 * h['total_rel_error']:+.1f}% "
                   f"| {'met' if cal[name]['meets_goal'] else 'not met'} |")
    out += ["", "Median signed residual (measured - predicted) / predicted by attention share of "
            "the pass's FLOPs (quartiles of the held-out passes):", "",
            "| attention share | passes | simulator's form | with attention term |",
            "|---|---|---|---|"]
    for b, a in zip(cal["base"]["residual_by_attention_share"],
                    cal["attention"]["residual_by_attention_share"]):
        out.append(f"| {_pct(b['attention_share_from'])}-{_pct(b['attention_share_to'])} "
                   f"| {b['num_passes']} | {100 * b['median_rel_residual']:+.1f}% "
                   f"| {100 * a['median_rel_residual']:+.1f}% |")
    c = cal["attention"]["coefficients"]
    out += ["", "Fitted attention-form coefficients: "
            + ", ".join(f"{k} {v:.3g}" for k, v in c.items()) + "."]
    return out
