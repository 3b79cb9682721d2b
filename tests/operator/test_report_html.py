"""`everystop report --html`: the telemetry store's percentiles per tenant / tier / both over
a time range, as a page with PNG plots beside it."""

from __future__ import annotations

from pathlib import Path

from everystop.cli import main as cli_main
from everystop.telemetry.rows import AlertRow
from everystop.telemetry.store import open_store
from tests.telemetry.test_report import populate
from tests.telemetry.test_store import T0, seq_row


def test_html_report_over_a_time_range_with_plots(tmp_path: Path, capsys) -> None:
    db = tmp_path / "t.db"
    store = open_store(str(db))
    populate(store)  # acme tier 0 and beta tier 2, from T0 to T0 + 10 s
    store.insert([seq_row(300, tenant_id="<b>evil</b>", priority_tier=1, ttft_ms=7.0),
                  AlertRow(T0 + 1000, "kv_leak", None, "late", 1.0, 1.0, "outside the range")])
    store.close()
    out = tmp_path / "incident" / "report.html"
    code = cli_main(["report", "--db", str(db), "--html", str(out), "--start", str(T0 - 1),
                     "--end", str(T0 + 200)])
    assert code == 0
    page = out.read_text()
    # Per tenant x tier rows, tier names, alerts in the range only; tenant names escaped.
    assert "<td>acme</td><td>0 premium</td><td>10</td>" in page
    assert "<td>beta</td><td>2 best-effort</td><td>5</td>" in page
    assert "tier 2 p99 queue wait 42s" in page and "outside the range" not in page
    assert "&lt;b&gt;evil" not in page  # arrived at T0 + 300: outside the range
    pngs = sorted(p.name for p in out.parent.glob("*.png"))
    assert pngs == ["report-queue_by_tier.png", "report-tpot_by_tier.png",
                    "report-ttft_by_tenant_tier.png", "report-ttft_by_tier.png"]
    for name in pngs:
        assert f'src="{name}"' in page
        assert (out.parent / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "wrote" in capsys.readouterr().err
    # The whole store: the late tenant appears, its name escaped.
    cli_main(["report", "--db", str(db), "--html", str(out)])
    page = out.read_text()
    assert "&lt;b&gt;evil&lt;/b&gt;" in page and "<b>evil" not in page
    assert "outside the range" in page


def test_time_arguments_take_iso_or_epoch(tmp_path: Path, capsys) -> None:
    db = tmp_path / "t.db"
    store = open_store(str(db))
    populate(store)
    store.close()
    assert cli_main(["report", "--db", str(db), "--start", "2000-01-01T00:00",
                     "--end", "2000-01-02", "--json"]) == 0
    assert '"requests": 0' in capsys.readouterr().out  # nothing in 2000
