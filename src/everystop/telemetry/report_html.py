"""`everystop report --html OUT.html`: the report as a page with PNG plots beside it, for a
post-incident look at one time range: percentiles per tenant, per tier and per (tenant, tier),
p99 latency per tier over time with the guardrail alerts marked, and the config versions.

The plots are PNG files next to the page (OUT-<plot>.png), so the page opens offline and the
pictures can be pasted into an incident note on their own.
"""

from __future__ import annotations

import html
import time
from pathlib import Path
from typing import Any

from everystop.stats import percentile
from everystop.telemetry.rows import AlertRow, SequenceRow
from everystop.telemetry.store import Store, fetch_range

TIER_NAMES = {0: "premium", 1: "standard", 2: "best-effort"}
NUM_BUCKETS = 30
_COLUMNS = (("requests", "requests", ""), ("aborted", "aborted", ""),
            ("queue_wait_p50_ms", "queue p50", "ms"), ("queue_wait_p99_ms", "queue p99", "ms"),
            ("ttft_p50_ms", "TTFT p50", "ms"), ("ttft_p99_ms", "TTFT p99", "ms"),
            ("tpot_p50_ms", "TPOT p50", "ms"), ("tpot_p99_ms", "TPOT p99", "ms"),
            ("generated_tokens", "generated tokens", ""),
            ("preemptions_per_request", "preemptions/request", ""))


def _stamp(t: float | None) -> str:
    return "-" if t is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.1f}" if abs(v) >= 1 else f"{v:.3f}"
    return html.escape(str(v))


def _table(keys: list[str], groups: list[dict[str, Any]]) -> str:
    head = "".join(f"<th>{html.escape(k)}</th>" for k in keys) + "".join(
        f"<th>{label}{' (' + unit + ')' if unit else ''}</th>" for _, label, unit in _COLUMNS)
    rows = []
    for g in groups:
        cells = [_cell(g[k]) if k != "tier" else f"{g[k]} {TIER_NAMES.get(g[k], '')}"
                 for k in keys]
        cells += [_cell(g[f]) for f, _, _ in _COLUMNS]
        rows.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"


def _buckets(seqs: list[SequenceRow]) -> tuple[list[float], float]:
    """Bucket start times over the sequences' completion span, and the bucket width."""
    ends = [s.completed_at for s in seqs if s.completed_at is not None]
    if not ends:
        return [], 1.0
    t0, t1 = min(ends), max(ends)
    width = max((t1 - t0) / NUM_BUCKETS, 1.0)
    return [t0 + i * width for i in range(int((t1 - t0) // width) + 1)], width


def _plots(seqs: list[SequenceRow], alerts: list[AlertRow], report: dict[str, Any],
           stem: Path) -> list[tuple[str, Path]]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out: list[tuple[str, Path]] = []
    starts, width = _buckets(seqs)
    tiers = sorted({s.priority_tier for s in seqs})
    for field, title in (("ttft_ms", "TTFT p99 by tier over time"),
                         ("queue_wait_ms", "Queue wait p99 by tier over time"),
                         ("tpot_p50_ms", "TPOT p99 by tier over time")):
        fig, ax = plt.subplots(figsize=(9, 3.2))
        for tier in tiers:
            ys = []
            for b in starts:
                vals = [getattr(s, field) for s in seqs if s.priority_tier == tier
                        and s.completed_at is not None and b <= s.completed_at < b + width]
                ys.append(percentile(vals, 99))
            xs = [(b - starts[0]) if starts else 0.0 for b in starts]
            ax.plot(xs, [float("nan") if y is None else y for y in ys], marker="o",
                    markersize=3, label=f"tier {tier} {TIER_NAMES.get(tier, '')}")
        for a in alerts:
            if starts:
                ax.axvline(a.raised_at - starts[0], color="red", alpha=0.3, linewidth=1)
        ax.set_title(title + (" (red: guardrail alerts)" if alerts else ""))
        ax.set_xlabel(f"seconds after {_stamp(starts[0] if starts else None)}")
        ax.set_ylabel("ms")
        if tiers:
            ax.legend(fontsize=8)
        fig.tight_layout()
        path = stem.with_name(f"{stem.name}-{field.split('_')[0]}_by_tier.png")
        fig.savefig(path, dpi=100)
        plt.close(fig)
        out.append((title, path))
    groups = report["tenant_tiers"]
    if groups:
        fig, ax = plt.subplots(figsize=(9, 0.45 * len(groups) + 1.2))
        labels = [f"{g['tenant']} / tier {g['tier']}" for g in groups]
        for offset, (key, name) in enumerate((("ttft_p50_ms", "TTFT p50"),
                                              ("ttft_p99_ms", "TTFT p99"))):
            ax.barh([i + 0.4 * offset for i in range(len(groups))],
                    [g[key] or 0.0 for g in groups], height=0.4, label=name)
        ax.set_yticks([i + 0.2 for i in range(len(groups))], labels, fontsize=8)
        ax.set_xlabel("ms")
        ax.set_title("TTFT per tenant and tier")
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = stem.with_name(f"{stem.name}-ttft_by_tenant_tier.png")
        fig.savefig(path, dpi=100)
        plt.close(fig)
        out.append(("TTFT per tenant and tier", path))
    return out


def write_html_report(store: Store, report: dict[str, Any], out: str | Path) -> list[str]:
    """Write `out` and its PNG plots (from the same time range as `report`); returns the paths
    written."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    seqs = fetch_range(store, SequenceRow, report["since"], report["until"])
    alerts = fetch_range(store, AlertRow, report["since"], report["until"])
    plots = _plots(seqs, alerts, report, out.with_suffix(""))
    first = min((s.arrival_time for s in seqs), default=None)
    last = max((s.completed_at for s in seqs if s.completed_at is not None), default=None)
    it = report["iterations"]
    alert_rows = "".join(
        f"<tr><td>{_stamp(a['raised_at'])}</td><td>{html.escape(a['kind'])}</td>"
        f"<td>{_cell(a['tier'])}</td><td>{html.escape(a['message'])}</td></tr>"
        for a in report["alerts"]["recent"])
    configs = "".join(
        f"<tr><td>{c['version']}</td><td>{html.escape(c['source'])}</td>"
        f"<td>{_stamp(c['updated_at'])}</td><td>{c['max_num_seqs']}</td>"
        f"<td>{c['max_num_batched_tokens']}</td><td>{c['chunk_size']}</td>"
        f"<td>{_cell(c['watermark'])}</td></tr>" for c in report["config_versions"])
    images = "".join(f'<figure><img src="{html.escape(p.name)}" alt="{html.escape(t)}">'
                     f"<figcaption>{html.escape(t)}</figcaption></figure>" for t, p in plots)
    page = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>everystop report</title>
<style>
body {{ font: 13px/1.4 system-ui, sans-serif; margin: 16px; color: #222; }}
table {{ border-collapse: collapse; margin-bottom: 12px; }}
th, td {{ border: 1px solid #ccc; padding: 2px 8px; text-align: right; }}
th {{ background: #f3f4f6; }} td:first-child {{ text-align: left; }}
figure {{ margin: 8px 0; }} img {{ max-width: 100%; }}
</style></head><body>
<h1>everystop report</h1>
<p>Range: {_stamp(report['since'] or first)} to {_stamp(report['until'] or last)};
{report['overall']['requests']} requests, {it['count']} iterations (latency p50
{_cell(it['latency_p50_ms'])} ms, p99 {_cell(it['latency_p99_ms'])} ms). TPOT is each request's
median time per output token; percentiles are over requests.</p>
<h2>Per tenant and tier</h2>{_table(["tenant", "tier"], report["tenant_tiers"])}
<h2>Per tier</h2>{_table(["tier"], report["tiers"])}
<h2>Per tenant</h2>{_table(["tenant"], report["tenants"])}
<h2>Plots</h2>{images}
<h2>Guardrail alerts</h2>
<table><thead><tr><th>raised</th><th>kind</th><th>tier</th><th>message</th></tr></thead>
<tbody>{alert_rows}</tbody></table>
<h2>Scheduler config versions</h2>
<table><thead><tr><th>version</th><th>source</th><th>updated</th><th>max_num_seqs</th>
<th>max_num_batched_tokens</th><th>chunk_size</th><th>watermark</th></tr></thead>
<tbody>{configs}</tbody></table>
</body></html>
"""
    out.write_text(page)
    return [str(out)] + [str(p) for _, p in plots]
