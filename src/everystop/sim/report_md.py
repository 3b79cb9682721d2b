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


def _tpot_target_note(loaded: dict) -> list[str]:
    """One bullet: what the TPOT-target row does against the same budget without a target."""
    timed = next(((k, s) for k, s in loaded.items() if s.get("tpot_target_ms")), None)
    base = next((s for s in loaded.values() if s["scheduling"] == "chunked"
                 and not s.get("tpot_target_ms") and "max_num_batched_tokens" not in s), None)
    if timed is None or base is None:
        return []
    _, t = timed
    return [
        f"- A TPOT target of {t['tpot_target_ms']:.0f} ms (the live engine's step budget: the "
        "scheduler fits the modeled step cost online and gives prefill only what keeps a pass "
        f"within the target) takes TPOT p99 from {base['tpot_p99_ms']:.1f} to "
        f"{t['tpot_p99_ms']:.1f} ms and TTFT p50 from {_f(base['ttft_p50_ms'])} to "
        f"{_f(t['ttft_p50_ms'])} ms, at {_f(t['output_tokens_per_s'])} vs "
        f"{_f(base['output_tokens_per_s'])} tokens/s."]


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
        return ["No calibration results found (run the calibration command below)."]
    out = [f"Mode: **{cal['mode']}**. Fit over {cal['fit']['num_records']} iteration records: "
           f"R^2 = {cal['fit']['r2']:.3f}, mean |error| per pass "
           f"{100 * cal['fit']['mean_abs_rel_error']:.1f}%.", "",
           "| metric | measured | predicted | error |", "|---|---|---|---|"]
    for k, e in cal.get("relative_error", {}).items():
        out.append(f"| {k} | {_f(cal['measured'][k], 1)} | {_f(cal['predicted'][k], 1)} "
                   f"| {100 * e:+.1f}% |")
    return out


def _real_calibration(cal: dict | None) -> list[str]:
    if not cal:
        return [f"Not run yet: `{REAL_COMMAND}`, then `{COMMAND} --markdown-only`."]
    return (_real_setup(cal) + _real_workloads(cal) + _real_runs(cal)
            + _speed_probe(cal.get("speed_probe")) + _real_how_to_read(cal))


def _real_setup(cal: dict) -> list[str]:
    """Where and how the real engine ran, and the fit of its profile."""
    m, eng, prof, wl = cal["machine"], cal["engine"], cal["profile"], cal["workload"]
    fit, c = cal["fit"], cal["fitted_coefficients"]
    quiet = _quiet(cal)
    return [
        f"Written by `{cal.get('command', REAL_COMMAND)}` ({cal['total_wall_s']:.0f} s of wall "
        "time): "
        f"{cal['model']}, on {m['cpu_count']} cores of an {m['cpu']} with "
        f"{m['torch_threads']} torch threads. Other processes used "
        f"{_share(prof.get('other_processes_cpu'))} of the cores while profiling and "
        f"{_share(wl.get('other_processes_cpu'))} during the measured workload (1-minute load "
        f"average, this run's own threads included: {m['load_avg_1m_start']:.2f} at the start, "
        f"{m['load_avg_1m_end']:.2f} at the end)"
        + (": a quiet machine. " if quiet else
           ": **a shared, busy machine, so these timings are not meaningful**. ")
        +
        f"Engine: max_num_seqs {eng['max_num_seqs']}, budget {eng['max_num_batched_tokens']} "
        f"tokens, chunk {eng['chunk_size']}, {eng['num_gpu_blocks']} KV blocks of "
        f"{eng['block_size']}; the simulator gets exactly this config and pool.",
        "",
        f"**Profile (fit data).** {len(prof['rounds_batch_prompt_output'])} rounds, each a batch "
        "of requests arriving together"
        + (" (then the same rounds again with half of each batch joining three passes late, so "
           "prefill chunks ride with running decodes)" if prof.get("staggered_rounds_too") else "")
        + ": batch sizes x prompt lengths "
        f"{_grid(prof['rounds_batch_prompt_output'])}, {prof['rounds_batch_prompt_output'][0][2]} "
        f"output tokens each; {prof['num_passes']} passes logged by the engine's iteration "
        "listener "
        "(its own step time: schedule + forward + sampling + output processing). "
        f"Fit: R^2 = {fit['r2']:.3f}, mean |error| per pass "
        f"{100 * fit['mean_abs_rel_error']:.1f}%, "
        f"{100 * fit['fraction_compute_bound']:.0f}% of passes compute-bound. Coefficients: "
        f"{_coefficients(c, fit['fraction_compute_bound'])}.",
    ]


def _real_workloads(cal: dict) -> list[str]:
    """The measured workloads, measured against predicted, and the pooled goal."""
    wl, hold, err = cal["workload"], cal["holdout_passes"], cal["relative_error"]
    runs = cal["live_runs"]
    goal = [k for k in ("output_tokens_per_s", "ttft_p50_ms", "ttft_p99_ms") if k in err]
    worst = max(goal, key=lambda k: abs(err[k]))
    out = [
        "",
        f"**Measured workloads (a different mix).** `{wl['spec']}` and {len(runs) - 1} more "
        "draws of the same mix (length seed +1, +2, ...), each with Poisson arrivals at "
        f"{wl['load_fraction']:.0%} of the fitted model's capacity on that draw, replayed in real "
        "time: a request is added once its scheduled arrival passes, and TTFT runs from that "
        "scheduled time to the first token in `RequestOutput.metrics`. The goal is judged on "
        f"all {wl['num_requests']} requests pooled (throughput = all tokens / all makespans; "
        "percentiles over every request).",
        "",
        "| metric | measured (real engine) | predicted (simulator) | error |",
        "|---|---|---|---|",
    ]
    for k, e in err.items():
        out.append(f"| {k} | {_f(cal['measured'][k], 1)} | {_f(cal['predicted'][k], 1)} "
                   f"| {100 * e:+.1f}% |")
    out += [
        "",
        "Goal (throughput, TTFT p50 and p99 within 10%, pooled): "
        f"**{'met' if cal['within_10pct'] else 'not met'}** in this run (other runs: "
        "Repeatability below); the largest pooled error is "
        f"{worst} at {100 * err[worst]:+.1f}%. "
        f"Runs within 10% on their own: {sum(cal['live_runs_within_10pct'])} of {len(runs)}. "
        "Out of sample, pass by pass, the fitted model is off by "
        f"{100 * hold['mean_abs_rel_error']:.1f}% "
        f"on average (p90 {100 * hold['p90_abs_rel_error']:.1f}%) on the measured workloads' "
        f"{hold['num_passes']} passes, and by {100 * hold['total_time_rel_error']:+.1f}% on their "
        "total time.",
    ]
    return out


def _real_runs(cal: dict) -> list[str]:
    """One row per measured run: its load, whether it counts, its errors."""
    wl, err = cal["workload"], cal["relative_error"]
    out = [
        "",
        f"Which runs count: {wl.get('quiet_rule', 'every run')}.",
        "",
        "| run | requests | rate req/s | others' CPU | counted | speed probe "
        "| passes live / sim | "
        + " | ".join(f"{k} error" for k in err) + " |",
        "|---" * (7 + len(err)) + "|",
    ]
    for i, run in enumerate(cal["live_runs"]):
        probe = f"{run['speed_factor']:.2f}x" if "speed_factor" in run else "-"
        out.append(f"| {i} | {run['num_requests']} | {run['rate_req_per_s']:.2f} | "
                   f"{_share(run.get('other_processes_cpu'))} | "
                   f"{'yes' if run.get('in_pooled_goal', True) else 'no'} | {probe} | "
                   f"{run['num_passes']['live']} / {run['num_passes']['simulated']} | "
                   + " | ".join(f"{100 * run['relative_error'][k]:+.1f}%" for k in err) + " |")
    return out


def _real_how_to_read(cal: dict) -> list[str]:
    """Which of the errors say something about the cost model, and how much a p99 rests on."""
    runs, fit = cal["live_runs"], cal["fit"]
    return [
        "",
        "How to read it: below capacity, output tokens/s is set by the arrivals (the engine "
        "keeps up), so its error says little about the cost model; TTFT is the real test, since "
        "it adds up queueing and the length of the passes a prompt waits behind and rides in. "
        f"A p99 over one run's {runs[0]['num_requests']} requests rests on its worst "
        f"{max(1, round(runs[0]['num_requests'] / 100))} or so, so it moves between runs (table "
        "above); pooled, it rests on a few more. Per pass the fit is rougher than per request: "
        "errors on single passes average out over the dozens of passes behind each TTFT. The "
        f"fit finds the FLOP term binding in {100 * fit['fraction_compute_bound']:.0f}% of "
        "passes.",
    ]


def _speed_probe(probe: dict | None) -> list[str]:
    if not probe or not probe.get("factors"):
        return []
    f = probe["factors"]
    e = probe["relative_error_probe_scaled"]
    scaled = probe.get("predictions_scaled_by_it")
    return [
        "",
        "**Speed probe.** Right before each run the engine ran the same few profile rounds "
        "(" + ", ".join(f"{b} requests of {n} prompt tokens"
                        for b, n, _ in probe["rounds_batch_prompt_output"])
        + ", staggered): their measured time over "
        f"the model's ('speed probe' above) ranged {min(f):.2f}-{max(f):.2f}x: the model's own "
        "error on these shapes (the same in every run) plus how much slower or faster the "
        "machine ran them than during the profile a few minutes before. "
        + ("The predictions above are scaled by it. " if scaled else
           "The predictions above are the fitted model as is. ")
        + ("Had each run's prediction been scaled by its probe instead, the pooled errors would "
           if not scaled else "Unscaled, the pooled errors would ")
        + "be " + ", ".join(f"{k} {100 * v:+.1f}%" for k, v in e.items()) + ".",
    ]


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
             + _comparison_section(d) + _calibration_section(d) + _caveats())
    return "\n".join(lines)


def _intro() -> list[str]:
    """How to regenerate the page, and what the simulator models."""
    return [
        "# Simulator report: the everystop scheduler on a modeled 4x A100 80GB node",
        "",
        f"Regenerate everything here (numbers, plots, `benchmarks/results/sim/report.json`) with `{COMMAND}`.",
        "The calibration section reads `benchmarks/results/sim/calibration_real.json` (the real "
        f"engine, written by `{REAL_COMMAND}`) and `benchmarks/results/sim/calibration.json` "
        f"(the synthetic self-test, `{CAL_COMMAND}`); `{COMMAND} --markdown-only` re-renders "
        "this page from them without rerunning the simulations.",
        "",
        "**What is simulated.** Llama-3-70B in BF16 (80 layers, 64 query / 8 KV heads, head_dim 128; "
        "70.55B parameters derived from the shapes) on 4x A100 80GB SXM with tensor parallelism 4. "
        "The production `Scheduler` and `KVCacheManager` run unmodified; only the executor is "
        "replaced by `SimExecutor`, which advances a discrete-event clock by a modeled pass latency:",
        "",
        "    time = max(FLOPs / (312 TFLOPS * 0.60), bytes / (2,039 GB/s * 0.80))",
        "         + 160 all-reduces * (8 us + ring bytes / (300 GB/s * 0.75)) + 2 ms + 5 us * seqs",
        "",
        "FLOPs and bytes come from each pass's actual batch (weights streamed once per pass, the KV of "
        "every scheduled sequence's whole context read, attention FLOPs from the real positions). "
        "Peak figures are vendor datasheet numbers; the efficiencies and overheads are stated "
        "assumptions (`src/everystop/sim/specs/hardware.json`, every figure with its source). "
        "The **roofline** columns drop the efficiencies, comm and overhead: no implementation can beat them.",
        "",
    ]


def _capacity_section(cap: list[dict]) -> list[str]:
    """Section 1: KV blocks and sequences per variant, and the design's two slips."""
    lines = [
        "## 1. KV capacity (the design's 'Scaling and Performance' arithmetic)",
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
    lines += [
        "",
        "0.90 x 80 GB x 4 = 288 GB; minus 140 GB weights, minus 8 GB reserve = 140 GB; "
        "2 x 2 KV heads/GPU x 128 x 2 B x 80 layers = 81,920 B/GPU/token (327,680 B across 4 GPUs); "
        "a 16-token block is 5,242,880 B. The design's ~27,340 blocks come from writing 81,920 B as "
        "\"80 KB\" and then treating 1 KB as 1,000 B (block = 5.12 MB); its ~218 sequences need a "
        "second, opposite slip (140 GB read as 143,360 MB; 27,343 blocks / 128 per sequence is 213). "
        "In exact bytes: **26,702 blocks, 208 sequences**; with the real 141.1 GB of weights, "
        f"**{cap[2]['num_blocks']:,} blocks, {cap[2]['max_seqs']} sequences**. The simulator uses "
        "the last row. Either way max_num_seqs = 128 sits well inside the memory ceiling, as the design says.",
        "",
    ]
    return lines


def _targets_section(d: dict) -> list[str]:
    """Section 2: the roofline bounds per alternative and the verdict on each design target."""
    a100 = d["bounds"][0]
    chunk = _saturated(d, "chunked")
    lines = ["## 2. The design's targets against physics", ""]
    lines += _bounds(d["bounds"])
    lines += [
        "",
        "![decode step vs batch](img/sim-decode-step.png)",
        "",
        "**Verdict for 4x A100 80GB, TP=4, BF16:**",
        "",
        f"- **TPOT p50 < 16 ms: not reachable, at any batch size.** Every decode pass streams "
        f"{a100['pass_weight_bytes_per_gpu'] / 1e9:.1f} GB of weights per GPU; at 2,039 GB/s that "
        f"alone is {a100['decode_weight_read_floor_ms']:.1f} ms, before any KV read, all-reduce or "
        f"CPU overhead (modeled: {a100['decode_step_ms_at_1']['modeled']:.1f} ms at batch 1, "
        f"{a100['decode_step_ms_at_128']['modeled']:.1f} ms at 128 x 1,024 tokens). It becomes "
        "reachable with half the bytes per GPU: TP=8, H100/H200 (3.35/4.8 TB/s), or FP8 weights.",
        f"- **8,000 tok/s at 128 concurrent: not reachable.** 128 tokens in 16 ms needs a 16 ms step "
        f"(see above). The roofline at 128 x 1,024 is {a100['tok_s_at_128']['roofline']:,.0f} tok/s, "
        f"modeled {a100['tok_s_at_128']['modeled']:,.0f}. Beyond concurrency, 8,000 decode tokens/s of a "
        f"70.55B model is 2 x 70.55e9 x 8,000 = 1.13 PFLOP/s, {100 * a100['mfu_needed_for_8000_decode_only']:.0f}% "
        f"of the node's 1.25 PFLOP/s peak: on the roofline it needs >= {a100['min_batch_for_8000']['roofline']} "
        "concurrent decodes at 1,024 context and ~100% efficiency; with realistic efficiency "
        "(60% MFU) the ceiling is ~5,300 tok/s and it is never reached. Prompts make it worse: on "
        f"the workload below (mean prompt 576, mean output 410 tokens) prefill is about half of all "
        f"GPU time, and the chunked-prefill scheduler saturates at {_f(chunk['output_tokens_per_s'])} "
        f"output tok/s (roofline for the same passes: {_f(chunk['bound']['roofline_output_tokens_per_s'])}).",
        f"- **TTFT p99 < 200 ms for prompts up to 1,024: reachable only at light load.** A 1,024-token "
        f"prefill takes at least {a100['prefill_ms_1024_alone']['roofline']:.0f} ms (compute-bound at "
        f"peak), modeled {a100['prefill_ms_1024_alone']['modeled']:.0f} ms alone - already past 200 ms "
        "at 60% MFU, and more when it shares the pass with 100+ decodes. So p99 < 200 ms needs "
        "prefill at >= ~60% MFU with little comm/overhead on top, an idle queue, and few co-scheduled decodes.",
        f"- **TTFT p50 < 80 ms: reachable only for short prompts.** At peak FLOPs a prompt of at most "
        f"{a100['max_prompt_for_ttft_80ms_alone']['roofline']} tokens can produce its first token in 80 ms; "
        f"with the modeled efficiency, {a100['max_prompt_for_ttft_80ms_alone']['modeled']} tokens. With "
        "prompts uniform on 128-1,024 the median prompt (576) already misses it.",
        "",
    ]
    return lines


def _comparison_section(d: dict) -> list[str]:
    """Section 3: static, continuous and chunked scheduling, saturated and at a set load."""
    sat, loaded = d["saturated"], d["loaded"]
    chunk, static = _saturated(d, "chunked"), _saturated(d, "static")
    lines = [
        "## 3. The design's comparison table, re-derived",
        "",
        f"Workload: `{d['workload']}` (800 requests, prompts uniform 128-1,024 tokens, outputs uniform "
        "20-800 as in the design's straggler example, ignore_eos). Static batching waits for 32 "
        "requests (or 0.5 s) and runs them to completion; 'continuous' admits whole prompts only "
        "(decodes first, prompts while the 2,048-token budget lasts); 'chunked' is the default "
        "scheduler. $8.20/hour for the node.",
        "",
        "### 3a. Saturated (all 800 requests at t=0): throughput and cost",
        "",
    ]
    lines += _table(sat, with_design=True)
    lines += [
        "",
        f"### 3b. Latency at an offered load of {d['rate']} requests/s (Poisson)",
        "",
    ]
    lines += _table(loaded, with_design=False)
    ratio = chunk["output_tokens_per_s"] / static["output_tokens_per_s"]
    lines += [
        "",
        "![latency CDFs](img/sim-latency-cdf.png)",
        "",
        "![occupancy, static](img/sim-occupancy-static.png)",
        "![occupancy, chunked](img/sim-occupancy-chunked.png)",
        "",
        "**What this shows.**",
        "",
        f"- The design's ordering holds and its biggest lever is real: continuous batching gives "
        f"{ratio:.1f}x the static-batching throughput here (design: 2.5x), because static batches "
        "idle behind their longest output (mean occupancy ~17 of 32) and queue new arrivals behind "
        "whole batches (TTFT in minutes once offered load exceeds its capacity).",
        "- The absolute numbers are 3-4x below the design's: the node cannot do 8,000 tok/s "
        "(section 2), and the design's 16 ms step is below the weight-streaming floor.",
        "- Chunked vs unchunked makes little difference with this scheduler, unlike the design's "
        "6,200 -> 8,000 tok/s. Our unchunked mode already runs decodes first and packs whole "
        "prompts beside them, so it has no prefill-only passes that stall decode; with a 2,048-token "
        "budget both modes put up to ~1,900 prefill tokens in a pass. Chunking trades TTFT for TPOT: "
        "a smaller budget (512) lowers TPOT p99 but raises TTFT p50, since each prompt takes more passes.",
        "- TPOT p50 is 2-4x the design's 15 ms (2x at 2 req/s, 4x saturated) because passes that carry prefill take "
        "hundreds of ms; pure decode passes at 128 sequences are ~35-40 ms (modeled).",
        *_tpot_target_note(loaded),
        "",
    ]
    return lines


def _calibration_section(d: dict) -> list[str]:
    """Section 4: the cost model fitted to the real engine, and the self-test."""
    lines = [
        "## 4. Calibration against a real engine",
        "",
        "The same cost-model form is fitted by least squares to measured iterations "
        "(`src/everystop/sim/fit.py`: alternating assignment of the compute- or memory-bound term, "
        "non-negative least squares for max(a*FLOPs, b*bytes) + c0 + c1*seqs), then the fitted model "
        "drives the simulator on a *different* workload and the predicted throughput and TTFT p50/p99 "
        "are compared with measurement.",
        "",
    ]
    lines += ["### 4.1 The real engine on this CPU", ""]
    lines += _real_calibration(d.get("calibration_real"))
    lines += ["", "### 4.2 Synthetic self-test (a pipeline check, not a measurement)", ""]
    lines += _calibration(d.get("calibration"))
    lines += [
        "",
        "Here a hidden 'true' CPU cost model with +/-10% per-pass noise stands in for the engine, "
        "so the fit-and-predict pipeline can be checked without one. Its workload is below capacity on purpose: at 0.5 req/s (just over "
        "capacity) the same fit still predicts throughput within 1% but TTFT p50 is off by 14%, "
        "because queueing near saturation amplifies small per-pass errors. "
        "`everystop simulate calibrate` also takes measured records from any engine: "
        "`--records iters.json --workload W.json --measured measured.json` plus the engine's "
        "--max-num-seqs, --max-num-batched-tokens, --chunk-size and --num-gpu-blocks.",
        "",
    ]
    return lines


def _caveats() -> list[str]:
    """What the model leaves out, and why real-engine timings need a quiet machine."""
    return [
        "## Caveats",
        "",
        "- Efficiencies (60% MFU, 80% of HBM bandwidth, 75% of NVLink, 2 ms per-pass overhead) are "
        "assumptions, not measurements of this code on an A100; the verdicts in section 2 rest on "
        "the roofline columns, which do not depend on them.",
        "- Activation traffic, kernel launch gaps, sampling cost scaling with vocabulary and "
        "CUDA-graph padding are not modeled; each would make real passes slower, not faster.",
        "- Requests run with ignore_eos, so output lengths are exactly max_tokens.",
        "- Real-engine timings need a quiet machine. On this shared 2-core box, with another job "
        "running, torch's two threads spin-wait for a descheduled sibling and passes got up to "
        "~20x slower (a one-sequence decode: ~35 ms quiet, 1.2 s contended); two runs disturbed "
        "by other jobs (load average 3-5) missed TTFT by 70-90%. `other_processes_cpu` in the "
        "JSON shows whether a run was disturbed.",
        "",
    ]


def _saturated(d: dict, scheduling: str) -> dict:
    """The saturated run's summary of the first configuration with this scheduling mode."""
    return next(s for s in d["saturated"].values() if s["scheduling"] == scheduling)
