"""Write dashboards/grafana/everystop.json, the Grafana dashboard for everystop's /metrics.

    python scripts/make_grafana_dashboard.py            # rewrite the file
    python scripts/make_grafana_dashboard.py --check    # exit 1 if the file is stale

Panels are listed here once, as (title, unit, [(PromQL, legend)]); the file is generated so the
queries stay uniform (every one filtered by the template variables) and a test can evaluate
each against a real Prometheus (tests/operator/live/test_prometheus_queries.py). Legends name the
labels each query keeps, and that test checks the results carry them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "dashboards" / "grafana" / "everystop.json"
M = 'model_name=~"$model_name"'
REQ = f'{M}, tier=~"$tier", tenant=~"$tenant"'
RATE = "$__rate_interval"


def quantiles(metric: str, by: str) -> list[tuple[str, str]]:
    return [(f"histogram_quantile({q}, sum by (le, {by}) "
             f"(rate(everystop:{metric}_bucket{{{REQ}}}[{RATE}])))",
             f"p{int(q * 100)} {by} {{{{{by}}}}}") for q in (0.5, 0.99)]


PANELS: list[tuple[str, str, list[tuple[str, str]]]] = [
    ("Throughput (tokens/s)", "short", [
        (f"sum by (model_name) (rate(everystop:generation_tokens_total{{{REQ}}}[{RATE}]))",
         "generated {{model_name}}"),
        (f"sum by (model_name) (rate(everystop:prompt_tokens_total{{{REQ}}}[{RATE}]))",
         "prompt {{model_name}}")]),
    ("Generated tokens/s by tenant", "short", [
        (f"sum by (tenant) (rate(everystop:generation_tokens_total{{{REQ}}}[{RATE}]))",
         "{{tenant}}")]),
    ("Finished requests/s by tier and reason", "reqps", [
        (f'sum by (tier, finished_reason) (rate(everystop:request_success_total{{{M}, '
         f'tier=~"$tier"}}[{RATE}]))', "tier {{tier}} {{finished_reason}}")]),
    ("TTFT by tier", "s", quantiles("time_to_first_token_seconds", "tier")),
    ("TTFT by tenant", "s", quantiles("time_to_first_token_seconds", "tenant")),
    ("TPOT by tier", "s", quantiles("time_per_output_token_seconds", "tier")),
    ("TPOT by tenant", "s", quantiles("time_per_output_token_seconds", "tenant")),
    ("ITL by tier", "s", quantiles("inter_token_latency_seconds", "tier")),
    ("ITL by tenant", "s", quantiles("inter_token_latency_seconds", "tenant")),
    ("Queue wait by tier", "s", quantiles("request_queue_time_seconds", "tier") + [
        (f'max by (tier) (everystop:queue_wait_p99_seconds{{{M}, tier=~"$tier"}})',
         "guardrail p99 tier {{tier}} (incl. waiting)")]),
    ("Running / waiting / swapped", "short", [
        (f"sum by (model_name) (everystop:num_requests_running{{{M}}})", "running"),
        (f"sum by (model_name) (everystop:num_requests_waiting{{{M}}})", "waiting"),
        (f"sum by (model_name) (everystop:num_requests_swapped{{{M}}})", "swapped")]),
    ("KV cache usage and watermark", "percentunit", [
        (f"max by (model_name) (everystop:kv_cache_usage_perc{{{M}}})", "usage {{model_name}}"),
        (f"max by (model_name) (everystop:kv_cache_watermark_perc{{{M}}})",
         "watermark {{model_name}}")]),
    ("Preemptions/s by strategy", "short", [
        (f"sum by (strategy) (rate(everystop:num_preemptions_total{{{M}}}[{RATE}]))",
         "{{strategy}}")]),
    ("Prefix-cache hit rate (tokens)", "percentunit", [
        (f"sum by (model_name) (rate(everystop:prefix_cache_hits_total{{{M}}}[{RATE}])) / "
         f"sum by (model_name) (rate(everystop:prefix_cache_queries_total{{{M}}}[{RATE}]))",
         "hit rate {{model_name}}")]),
    ("429s/s by reason", "reqps", [
        (f'sum by (reason, tier) (rate(everystop:requests_rejected_total{{{M}, '
         f'tier=~"$tier"}}[{RATE}]))', "{{reason}} tier {{tier}}")]),
    # Per-tier kinds (starvation, kv_leak) also count a tier-less total; Prometheus drops the
    # empty label, so the two are separate queries.
    ("Guardrail alerts (last 5m)", "short", [
        (f'sum by (kind) (increase(everystop:guardrail_alerts_total{{{M}}}[5m]))', "{{kind}}"),
        (f'sum by (kind, tier) (increase(everystop:guardrail_alerts_total{{{M}, tier=~"$tier", '
         f'tier!=""}}[5m]))', "{{kind}} tier {{tier}}")]),
]


def variable(name: str, query: str) -> dict[str, object]:
    return {"name": name, "label": name, "type": "query",
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "query": {"query": query, "refId": f"{name}-var"}, "definition": query,
            "refresh": 2, "multi": True, "includeAll": True, "allValue": ".*",
            "current": {"selected": True, "text": ["All"], "value": ["$__all"]}, "sort": 1}


def dashboard() -> dict[str, object]:
    panels = []
    for i, (title, unit, targets) in enumerate(PANELS):
        panels.append({
            "id": i + 1, "type": "timeseries", "title": title,
            "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "options": {"legend": {"displayMode": "table", "placement": "bottom"}},
            "targets": [{"refId": chr(ord("A") + j), "expr": expr, "legendFormat": legend,
                         "datasource": {"type": "prometheus", "uid": "${datasource}"}}
                        for j, (expr, legend) in enumerate(targets)]})
    return {
        "title": "everystop", "uid": "everystop", "schemaVersion": 39, "version": 1,
        "tags": ["everystop", "llm"], "timezone": "browser", "refresh": "5s",
        "time": {"from": "now-15m", "to": "now"},
        "description": "everystop serving: throughput, latency by tier and tenant, scheduler, "
                       "KV cache, preemptions, prefix cache, 429s and guardrail alerts. "
                       "Series: docs/metrics.md.",
        "templating": {"list": [
            {"name": "datasource", "label": "Prometheus", "type": "datasource",
             "query": "prometheus", "current": {}},
            variable("model_name", "label_values(everystop:num_requests_running, model_name)"),
            variable("tier", "label_values(everystop:time_to_first_token_seconds_count, tier)"),
            variable("tenant",
                     "label_values(everystop:time_to_first_token_seconds_count, tenant)")]},
        "panels": panels,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    text = json.dumps(dashboard(), indent=2) + "\n"
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT} is stale: run python scripts/make_grafana_dashboard.py",
                  file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT} ({len(PANELS)} panels)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
