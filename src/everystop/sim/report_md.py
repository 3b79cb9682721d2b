"""The markdown text of docs/simulator-report.md, filled from `everystop simulate report`'s
numbers (everystop.sim.design_report)."""

from __future__ import annotations

# The design's published table (seed design, section on batching), beside the simulated rows.
DESIGN = {"static": ("3,200", "$0.71", "~1,800 ms", "19 ms"),
          "continuous": ("6,200", "$0.37", "~450 ms", "17 ms"),
          "chunked": ("8,000+", "$0.28", "<200 ms", "15 ms")}

COMMAND = "everystop simulate report"
CAL_COMMAND = ("everystop simulate calibrate --self-test "
               "--out benchmarks/results/sim/calibration.json")
REAL_COMMAND = "everystop bench sim-calibrate --out benchmarks/results/sim/calibration_real.json"


def _f(x: float | None, nd: int = 0) -> str:
    return "n/a" if x is None else f"{x:,.{nd}f}"


def _design_row(summary: dict) -> tuple[str, ...]:
    return DESIGN.get(summary["scheduling"], ("", "", "", ""))


def _table(rows: dict, with_design: bool) -> list[str]:
    head = ("| Configuration | tokens/s | $ / 1M output tokens | TTFT p50 | TTFT p99 | TPOT p50 "
            "| TPOT p99 | mean running | roofline tokens/s for these passes |")
    out = [head, "|" + "---|" * 9]
    for label, s in rows.items():
        out.append(
            f"| {label} | {_f(s['output_tokens_per_s'])} | ${s['cost_per_1m_output_tokens']:.2f} "
            f"| {_f(s['ttft_p50_ms'])} ms | {_f(s['ttft_p99_ms'])} ms | {s['tpot_p50_ms']:.1f} ms "
            f"| {s['tpot_p99_ms']:.1f} ms | {s['mean_running_seqs']:.0f} "
            f"| {_f(s['bound']['roofline_output_tokens_per_s'])} |")
    if with_design:
        out += ["", "The design's table, for comparison:", "",
                "| Configuration | tokens/s | $ / 1M | TTFT p99 | TPOT p50 |", "|---|---|---|---|---|"]
        seen = set()
        for label, s in rows.items():
            if s["scheduling"] in seen:
                continue
            seen.add(s["scheduling"])
            d = _design_row(s)
            out.append(f"| {label.split(' (')[0]} (design) | {d[0]} | {d[1]} | {d[2]} | {d[3]} |")
    return out


def _bounds(bounds: list[dict]) -> list[str]:
    out = ["| | " + " | ".join(f"{b['hardware']} TP{b['tp']}" for b in bounds) + " |",
           "|---|" + "---|" * len(bounds)]

    def row(name: str, fn) -> None:
        out.append(f"| {name} | " + " | ".join(fn(b) for b in bounds) + " |")

    row("weights streamed per GPU per pass", lambda b: f"{b['pass_weight_bytes_per_gpu'] / 1e9:.1f} GB")
    row("decode floor: weights / HBM bw", lambda b: f"{b['decode_weight_read_floor_ms']:.1f} ms")
    row("decode step at 128 seqs, ctx 1024: roofline / modeled",
        lambda b: f"{b['decode_step_ms_at_128']['roofline']:.1f} / "
                  f"{b['decode_step_ms_at_128']['modeled']:.1f} ms")
    row("tokens/s at 128 seqs, ctx 1024: roofline / modeled",
        lambda b: f"{b['tok_s_at_128']['roofline']:,.0f} / {b['tok_s_at_128']['modeled']:,.0f}")
    row("linear-layer FLOP ceiling (tokens/s at 100% MFU)",
        lambda b: f"{b['linear_flops_ceiling_tok_s']:,.0f}")
    row("MFU needed for 8,000 decode tokens/s", lambda b: f"{100 * b['mfu_needed_for_8000_decode_only']:.0f}%")
    row("smallest decode batch reaching 8,000 tok/s: roofline / modeled",
        lambda b: f"{b['min_batch_for_8000']['roofline'] or 'never'} / "
                  f"{b['min_batch_for_8000']['modeled'] or 'never'}"
                  f" (memory ceiling {b['max_seqs_at_context']})")
    row("1,024-token prefill alone: roofline / modeled",
        lambda b: f"{b['prefill_ms_1024_alone']['roofline']:.0f} / "
                  f"{b['prefill_ms_1024_alone']['modeled']:.0f} ms")
    row("longest prompt with a first token in 80 ms (alone): roofline / modeled",
        lambda b: f"{b['max_prompt_for_ttft_80ms_alone']['roofline']} / "
                  f"{b['max_prompt_for_ttft_80ms_alone']['modeled']} tokens")
    return out


def _calibration(cal: dict | None) -> list[str]:
    if not cal:
        return [f"Not run yet: `{CAL_COMMAND}`."]
    fit = cal["fit"]
    out = [f"Fit over {fit['num_records']} iteration records of a synthetic engine (a hidden cost "
           f"model with +/-10% noise per pass): R^2 {fit['r2']:.3f}, mean |error| per pass "
           f"{100 * fit['mean_abs_rel_error']:.1f}%.", ""]
    return out + _errors_table(cal)


def _errors_table(cal: dict) -> list[str]:
    out = ["| metric | measured | predicted | error |", "|---|---|---|---|"]
    for k, e in cal.get("relative_error", {}).items():
        out.append(f"| {k} | {_f(cal['measured'][k], 1)} | {_f(cal['predicted'][k], 1)} "
                   f"| {100 * e:+.1f}% |")
    return out


def _real_calibration(cal: dict | None) -> list[str]:
    if not cal:
        return [f"Not run yet: `{REAL_COMMAND}`, then `{COMMAND} --markdown-only`."]
    return _real_setup(cal) + [""] + _errors_table(cal) + _real_runs(cal)


def _real_setup(cal: dict) -> list[str]:
    """Where and how the real engine ran, and the fit of its profile, as one table."""
    m, eng, prof, wl = cal["machine"], cal["engine"], cal["profile"], cal["workload"]
    fit, hold = cal["fit"], cal["holdout_passes"]
    rows = [
        ("command", f"`{cal.get('command', REAL_COMMAND)}` ({cal['total_wall_s']:.0f} s)"),
        ("model and machine", f"{cal['model']}; {m['cpu_count']} cores of an {m['cpu']}, "
                              f"{m['torch_threads']} torch threads"),
        ("other processes' CPU (profile / workload)",
         f"{_share(prof.get('other_processes_cpu'))} / {_share(wl.get('other_processes_cpu'))}"
         + ("" if _quiet(cal) else " (busy machine: timings not meaningful)")),
        ("engine", f"max_num_seqs {eng['max_num_seqs']}, budget {eng['max_num_batched_tokens']}, "
                   f"chunk {eng['chunk_size']}, {eng['num_gpu_blocks']} blocks of "
                   f"{eng['block_size']}"),
        ("profile", f"{prof['num_passes']} passes, batch x prompt "
                    f"{_grid(prof['rounds_batch_prompt_output'])}"),
        ("fit", f"R^2 {fit['r2']:.3f}, mean |error| per pass "
                f"{100 * fit['mean_abs_rel_error']:.1f}%, "
                f"{_coefficients(cal['fitted_coefficients'], fit['fraction_compute_bound'])}"),
        ("measured workload", f"`{wl['spec']}`, {len(cal['live_runs'])} draws, Poisson at "
                              f"{wl['load_fraction']:.0%} of modeled capacity, "
                              f"{wl['num_requests']} requests pooled"),
        ("out of sample, per pass", f"mean |error| {100 * hold['mean_abs_rel_error']:.1f}% "
                                    f"(p90 {100 * hold['p90_abs_rel_error']:.1f}%) over "
                                    f"{hold['num_passes']} passes; total time "
                                    f"{100 * hold['total_time_rel_error']:+.1f}%"),
        ("goal: throughput, TTFT p50/p99 within 10% pooled",
         "met" if cal["within_10pct"] else "not met"),
    ]
    return ["| | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows]


def _real_runs(cal: dict) -> list[str]:
    """One row per measured run: its load, whether it counts, its errors."""
    err = cal["relative_error"]
    out = [
        "",
        "| run | requests | rate req/s | others' CPU | counted | passes live / sim | "
        + " | ".join(f"{k} error" for k in err) + " |",
        "|---" * (6 + len(err)) + "|",
    ]
    for i, run in enumerate(cal["live_runs"]):
        out.append(f"| {i} | {run['num_requests']} | {run['rate_req_per_s']:.2f} | "
                   f"{_share(run.get('other_processes_cpu'))} | "
                   f"{'yes' if run.get('in_pooled_goal', True) else 'no'} | "
                   f"{run['num_passes']['live']} / {run['num_passes']['simulated']} | "
                   + " | ".join(f"{100 * run['relative_error'][k]:+.1f}%" for k in err) + " |")
    return out


def _coefficients(c: dict, compute_bound: float) -> str:
    rate = lambda sec: f"{1e-9 / sec:.1f}" if sec else "unused"  # noqa: E731
    # With every pass compute-bound the byte coefficient is unconstrained: not a bandwidth.
    memory = "memory term never binds" if compute_bound >= 1 else f"{rate(c['sec_per_byte'])} GB/s"
    return (f"{rate(c['sec_per_flop'])} GFLOP/s, {memory}, "
            f"{1e3 * c['overhead_s']:.1f} ms per pass + {1e3 * c['overhead_per_seq_s']:.2f} ms "
            "per sequence")


def _quiet(cal: dict) -> bool:
    """Other processes left the cores alone (older files: judged by the load average)."""
    others = [cal["profile"].get("other_processes_cpu"),
              cal["workload"].get("other_processes_cpu")]
    if None not in others:
        return max(others) < 0.10  # type: ignore[type-var]
    m = cal["machine"]
    return max(m["load_avg_1m_start"], m["load_avg_1m_end"]) < 1.5


def _share(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * max(x, 0.0):.0f}%"  # sampling noise dips below 0


def _grid(rounds: list) -> str:
    batches = sorted({r[0] for r in rounds})
    prompts = sorted({r[1] for r in rounds})
    return f"{{{', '.join(map(str, batches))}}} x {{{', '.join(map(str, prompts))}}}"


def render(d: dict) -> str:
    """The whole page: one function per section, in the page's order."""
    lines = (_intro() + _capacity_section(d["capacity"]) + _targets_section(d)
             + _comparison_section(d) + _speculation_section(d.get("speculation_sizing"))
             + _calibration_section(d) + _caveats())
    return "\n".join(lines)


def _intro() -> list[str]:
    """How to regenerate the page, and what the simulator models."""
    return [
        "# Simulator report: the everystop scheduler on a modeled 4x A100 80GB node",
        "",
        f"`{COMMAND}` regenerates this page, its plots and `benchmarks/results/sim/report.json`; "
        f"`{COMMAND} --markdown-only` re-renders it from the committed results.",
        "",
        "Llama-3-70B in BF16 on 4x A100 80GB SXM, tensor parallel 4. The production `Scheduler` "
        "and `KVCacheManager` run unmodified; `SimExecutor` advances a clock by a modeled pass "
        "time (peaks from datasheets, efficiencies assumed; `src/everystop/sim/specs/`):",
        "",
        "    time = max(FLOPs / (312 TFLOPS * 0.60), bytes / (2,039 GB/s * 0.80))",
        "         + 160 all-reduces * (8 us + ring bytes / (300 GB/s * 0.75)) + 2 ms + 5 us * seqs",
        "",
        "Roofline columns drop the efficiencies, communication and overhead.",
        "",
    ]


def _capacity_section(cap: list[dict]) -> list[str]:
    """Section 1: KV blocks and sequences per variant."""
    lines = [
        "## KV capacity",
        "",
        "| variant | KV budget | bytes/token/GPU | block | blocks | seqs at 2,048 tokens |",
        "|---|---|---|---|---|---|",
    ]
    for r in cap:
        seqs = f"{r['max_seqs']}"
        if "design_seq_division" in r:
            seqs += f" (design's division: {r['design_seq_division']:.1f})"
        lines.append(f"| {r['variant']} | {r['kv_budget_bytes'] / 1e9:.1f} GB "
                     f"| {r['kv_bytes_per_token_per_gpu']:,.0f} B | {r['block_bytes'] / 1e6:.3f} MB "
                     f"| {r['num_blocks']:,} | {seqs} |")
    return lines + ["", "The simulator uses the last row.", ""]


def _targets_section(d: dict) -> list[str]:
    """Section 2: the roofline bounds per alternative and the design's targets on the A100 node."""
    a100 = d["bounds"][0]
    chunk = _saturated(d, "chunked")
    verdict = a100["verdict"]

    def yes(key: str) -> str:
        return "reachable" if verdict[key] else "not reachable"

    lines = ["## The design's targets against physics", ""]
    lines += _bounds(d["bounds"])
    lines += [
        "",
        "![decode step vs batch](img/sim-decode-step.png)",
        "",
        "| target (A100 TP4) | verdict | the figure that decides it |",
        "|---|---|---|",
        f"| TPOT p50 < 16 ms | {yes('tpot_p50_16ms')} | weight-read floor "
        f"{a100['decode_weight_read_floor_ms']:.1f} ms per step |",
        f"| 8,000 tok/s at 128 concurrent | {yes('tok_s_8000_at_128')} | roofline "
        f"{a100['tok_s_at_128']['roofline']:,.0f} tok/s; chunked scheduler saturates at "
        f"{_f(chunk['output_tokens_per_s'])} on the workload below |",
        f"| TTFT p99 < 200 ms, prompts to 1,024 | "
        f"{'light load only' if verdict['ttft_p99_200ms_prompt_1024'] else 'not reachable'} | "
        f"1,024-token prefill alone: {a100['prefill_ms_1024_alone']['roofline']:.0f} ms roofline, "
        f"{a100['prefill_ms_1024_alone']['modeled']:.0f} ms modeled |",
        f"| TTFT p50 < 80 ms | short prompts only | longest prompt in 80 ms: "
        f"{a100['max_prompt_for_ttft_80ms_alone']['roofline']} tokens roofline, "
        f"{a100['max_prompt_for_ttft_80ms_alone']['modeled']} modeled |",
        "",
    ]
    return lines


def _comparison_section(d: dict) -> list[str]:
    """Section 3: static, continuous and chunked scheduling, saturated and at a set load."""
    sat, loaded = d["saturated"], d["loaded"]
    lines = [
        "## Static, continuous and chunked scheduling",
        "",
        f"Workload `{d['workload']}`, ignore_eos; static batching waits for 32 requests (or "
        "0.5 s); $8.20/hour for the node.",
        "",
        "### Saturated (all requests at t=0)",
        "",
    ]
    lines += _table(sat, with_design=True)
    lines += ["", f"### Poisson arrivals at {d['rate']} requests/s", ""]
    lines += _table(loaded, with_design=False)
    lines += [
        "",
        "![latency CDFs](img/sim-latency-cdf.png)",
        "",
        "![occupancy, static](img/sim-occupancy-static.png)",
        "![occupancy, chunked](img/sim-occupancy-chunked.png)",
        "",
    ]
    return lines


def _speculation_section(sizing: dict | None) -> list[str]:
    """Section 3b: what the speculation sizing rule chooses on this node, by batch size."""
    if not sizing:
        return []
    rows = sizing["rows"]
    rates = [key for key in rows[0] if key.startswith("a")]
    lines = [
        "## Speculative decoding sized by the step cost",
        "",
        "The speculative rows above verify up to 4 proposals per sequence, each kept with "
        "probability 0.7 (a simulator input, `everystop simulate --speculative-tokens K "
        "--spec-acceptance A`); the scheduler sizes each sequence's k every pass by its rule "
        "(`docs/speculative-decoding.md`) against its own step-cost fit, and each pass is "
        "priced with its 1+k rows per speculating sequence.",
        "",
        f"The rule priced by this node's cost model, for a decode batch at {sizing['context']:,} "
        f"tokens of context and k <= {sizing['k_max']}: the mean k it chooses and the modeled "
        "output tokens/s, by per-position acceptance a. Speculation pays while the pass is "
        "bound by reading the weights, and turns itself off once the batch makes it "
        "compute-bound.",
        "",
        "| decode batch | plain tokens/s | " + " | ".join(
            f"a = {key[1:]}: mean k, tokens/s" for key in rates) + " |",
        "|---|---|" + "---|" * len(rates),
    ]
    for r in rows:
        lines.append(f"| {r['batch']} | {_f(r['plain_tokens_per_s'])} | " + " | ".join(
            f"{r[key]['mean_k']:.2f}, {_f(r[key]['tokens_per_s'])}" for key in rates) + " |")
    return lines + [""]


def _calibration_section(d: dict) -> list[str]:
    """Section 4: the cost model fitted to the real engine, and the self-test."""
    lines = [
        "## Calibration against the real engine",
        "",
        "The cost model's form is fitted to measured passes (`src/everystop/sim/fit.py`), then "
        "predicts a different workload replayed on the real engine.",
        "",
    ]
    lines += _real_calibration(d.get("calibration_real"))
    lines += ["", "### Synthetic self-test (a pipeline check)", ""]
    lines += _calibration(d.get("calibration"))
    return lines + [""]


def _caveats() -> list[str]:
    """What the model leaves out."""
    return [
        "## Limits",
        "",
        "- Efficiencies (60% MFU, 80% of HBM bandwidth, 75% of NVLink, 2 ms per pass) are "
        "assumptions; the verdicts rest on the roofline columns.",
        "- Activation traffic, launch gaps, vocabulary-sized sampling and CUDA-graph padding "
        "are not modeled; each would make passes slower.",
        "- Real-engine timings need a quiet machine: `other_processes_cpu` in the JSON says "
        "whether a run was disturbed.",
        "",
    ]


def _saturated(d: dict, scheduling: str) -> dict:
    """The saturated run's summary of the first configuration with this scheduling mode."""
    return next(s for s in d["saturated"].values() if s["scheduling"] == scheduling)
