"""The simulator report's per-pass calibration section (calibration (a)), from
`everystop bench sim-pass-calibrate`'s JSON."""

from __future__ import annotations

PASS_COMMAND = ("everystop bench sim-pass-calibrate "
                "--out benchmarks/results/sim/pass_calibration.json")


FITS = (("base", "simulator's form: max(a*FLOPs, b*bytes) + c0 + c1*seqs"),
        ("attention", "with attention term: max(a*dense FLOPs, b*weight bytes) "
                      "+ e*attention FLOPs + f*KV bytes + c0 + c1*seqs"),
        ("regimes", "regime form: tokens <= limit: (chunks of 8 rows*g_w + chunks of "
                    "narrow rows or more*g_n)*weight bytes + g_f*dense FLOPs; above: "
                    "h_w*weight bytes + a*dense FLOPs; both + e*attention FLOPs + f*KV bytes "
                    "+ c0 + c1*seqs"))
SHORT = {"base": "simulator's form", "attention": "with attention term", "regimes": "regime form"}
# The regime form's own coefficients (the rest of `Coefficients` is the GPU's comm and swap).
REGIME_KEYS = ("sec_per_gemv_weight_byte", "sec_per_gemv_narrow_weight_byte",
               "sec_per_gemv_flop", "sec_per_gemm_weight_byte", "sec_per_flop", "sec_per_byte",
               "sec_per_attention_flop", "sec_per_kv_byte", "overhead_s", "overhead_per_seq_s")


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _repeatability_lines(rep: dict | None) -> list[str]:
    if not rep or not rep["num_passes"]:
        return []
    return ["", f"Repeatability, no model involved: {rep['num_passes']} pure decode passes in "
            f"{rep['num_groups']} groups of the same rows and context (within 128 tokens per "
            "row) strayed from their group's median time by "
            f"{_pct(rep['median_abs_rel_deviation'])} (median) and "
            f"{_pct(rep['p90_abs_rel_deviation'])} (p90): about as close as any model can get "
            "to these passes."]


def pass_calibration_lines(cal: dict | None) -> list[str]:
    """Markdown lines: the held-out per-pass errors of each fit and their residuals by attention
    share and by kind of pass (files written before a fit existed show the fits they have)."""
    if not cal:
        return [f"Not run yet: `{PASS_COMMAND}`, then `everystop simulate report "
                "--markdown-only`."]
    m, wl, goal = cal["machine"], cal["workload"], cal["goal"]
    out = [
        f"`{cal.get('file', '')}`: written by `{cal.get('command', PASS_COMMAND)}`"
        + (f" (re-judging the passes of `{cal['refit_of']['command']}`)"
           if cal.get("refit_of") else "")
        + f" ({cal['total_wall_s']:.0f} s wall): "
        f"{cal['model']}, {m['torch_threads']} torch thread{'s' * (m['torch_threads'] != 1)} on "
        f"an {m['cpu']}. One live run of "
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
        *_repeatability_lines(cal.get("repeatability")),
        "",
        "| fit | held-out passes | median abs error | p90 abs error | mean abs error "
        "| total time error | goal |",
        "|---|---|---|---|---|---|---|",
    ]
    fits = [(name, label) for name, label in FITS if name in cal]
    for name, label in fits:
        h = cal[name]["holdout"]
        out.append(f"| {label} | {h['num_passes']} | {_pct(h['median_abs_rel_error'])} "
                   f"| {_pct(h['p90_abs_rel_error'])} | {_pct(h['mean_abs_rel_error'])} "
                   f"| {100 * h['total_rel_error']:+.1f}% "
                   f"| {'met' if cal[name]['meets_goal'] else 'not met'} |")
    short = " | ".join(SHORT[name] for name, _ in fits)
    out += ["", "Median signed residual (measured - predicted) / predicted by attention share of "
            "the pass's FLOPs (quartiles of the held-out passes):", "",
            f"| attention share | passes | {short} |", "|---|---|" + "---|" * len(fits)]
    for bins in zip(*(cal[name]["residual_by_attention_share"] for name, _ in fits)):
        b = bins[0]
        out.append(f"| {_pct(b['attention_share_from'])}-{_pct(b['attention_share_to'])} "
                   f"| {b['num_passes']} | "
                   + " | ".join(f"{100 * x['median_rel_residual']:+.1f}%" for x in bins) + " |")
    if all("residual_by_pass_kind" in cal[name] for name, _ in fits):
        out += ["", "By kind of pass (held out): median signed residual, and median |error| in "
                "brackets:", "", f"| pass | passes | {short} |", "|---|---|" + "---|" * len(fits)]
        for kinds in zip(*(cal[name]["residual_by_pass_kind"] for name, _ in fits)):
            out.append(f"| {kinds[0]['kind']} | {kinds[0]['num_passes']} | "
                       + " | ".join(f"{100 * k['median_rel_residual']:+.1f}% "
                                    f"({_pct(k['median_abs_rel_error'])})" for k in kinds) + " |")
    c = cal["attention"]["coefficients"]
    out += ["", "Fitted attention-form coefficients: "
            + ", ".join(f"{k} {v:.3g}" for k, v in c.items()) + "."]
    if "regimes" in cal:
        r = cal["regimes"]
        c = r["coefficients"]
        out += ["", f"Fitted regime-form coefficients (GEMVs up to {c['gemv_max_tokens']} "
                f"tokens, narrow chunks from {c['gemv_narrow_rows']} rows (0: none): the pair "
                "with the lowest sum of squared relative errors on the fitted passes, "
                "limit/narrow rows: "
                + ", ".join(f"{k} {v:g}"
                            for k, v in r["fit_error_by_gemv_limit_and_narrow_rows"].items())
                + "; a `Coefficients` of `sim/cost_model.py` as is): "
                + ", ".join(f"{k} {c[k]:.3g}" for k in REGIME_KEYS) + "."]
    return out


def pass_calibration_summary(runs: list[dict]) -> list[str]:
    """Markdown lines: one row per run, the regime form's held-out errors beside how busy the
    machine was and how repeatable identical passes were (runs without the regime form are
    left out)."""
    rows = [r for r in runs if r and "regimes" in r]
    if not rows:
        return []
    out = ["| run | others' share of the cores | identical decodes' spread, p90 | regime form: "
           "median, p90 abs error | simulator's form: median, p90 | goal (regime form) |",
           "|---|---|---|---|---|---|"]
    for r in rows:
        rep, reg, base = r.get("repeatability") or {}, r["regimes"]["holdout"], r["base"]["holdout"]
        spread = (_pct(rep["p90_abs_rel_deviation"]) if rep.get("num_passes") else "n/a")
        out.append(f"| `{r.get('file', '')}` | {_pct(r['other_processes_cpu'])} | {spread} "
                   f"| {_pct(reg['median_abs_rel_error'])}, {_pct(reg['p90_abs_rel_error'])} "
                   f"| {_pct(base['median_abs_rel_error'])}, {_pct(base['p90_abs_rel_error'])} "
                   f"| {'met' if r['regimes']['meets_goal'] else 'not met'} |")
    met = sum(r["regimes"]["meets_goal"] for r in rows)
    quiet = [r for r in rows if r["other_processes_cpu"] <= 0.05]
    quiet_met = sum(r["regimes"]["meets_goal"] for r in quiet)
    out += ["", f"The regime form met the goal in {met} of {len(rows)} runs; in {quiet_met} of "
            f"{len(quiet)} runs where other processes used at most 5% of the cores."]
    return out
