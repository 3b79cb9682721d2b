"""/dashboard in headless Chromium (Debian's `chromium` + `chromium-driver`, driven by
Selenium) while the load runs: the charts update, two tenants and three tiers show non-zero
values, the console stays clean, the admin key is needed; a screenshot is saved.

The screenshot goes to $EVERYSTOP_SCREENSHOT, else artifacts/dashboard.png (README's picture:
`EVERYSTOP_SCREENSHOT=docs/img/dashboard.png`)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from tests.operator.live.conftest import ADMIN_KEY, LiveServer, ensure_tools
from tests.operator.live.load import TENANTS, TIERS
from tests.server.conftest import ROOT

pytestmark = [pytest.mark.server, pytest.mark.model]


@pytest.fixture(scope="module")
def browser() -> Iterator[webdriver.Chrome]:
    chromium, chromedriver = ensure_tools("chromium", "chromedriver")
    real = Path("/usr/lib/chromium/chromium")  # Debian's /usr/bin/chromium is a shell wrapper
    options = webdriver.ChromeOptions()
    options.binary_location = str(real if real.exists() else chromium)
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--window-size=1500,2500", "--disable-extensions", "--no-first-run"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(executable_path=chromedriver))
    driver.set_page_load_timeout(30)
    yield driver
    driver.quit()


# The table's rows read in one script call: the page rebuilds the table on every poll, so
# elements found in one call may be gone by the next (a stale element reference).
_ROWS = ("return Array.from(document.querySelectorAll('#rows tbody tr')).map(r => ["
         "r.getAttribute('data-tenant'), r.getAttribute('data-tier'), "
         "r.getAttribute('data-requests'), r.getAttribute('data-ttft-p99'), r.className]);")


def _rows(driver: webdriver.Chrome) -> list[list[str | None]]:
    """Each table row's tenant, tier, request count, TTFT p99 and class."""
    return list(driver.execute_script(_ROWS))


def _latest(chart: dict[str, Any], name: str) -> float:
    values = [v for v in chart["values"].get(name, []) if v is not None]
    return values[-1] if values else 0.0


def test_live_page_shows_tenants_and_tiers_under_load(live_server: LiveServer,
                                                      browser: webdriver.Chrome) -> None:
    live_server.load.wait_for(per_group=1, timeout_s=120)
    browser.get(f"{live_server.server.url}/dashboard#key={ADMIN_KEY}")
    wait = WebDriverWait(browser, 30, poll_frequency=0.2)
    state = "return window.everystopDashboard"
    wait.until(lambda d: d.execute_script(state + ".updates") >= 1)
    first = browser.execute_script(state + ".updates")
    first_points = len(browser.execute_script(state + ".times"))
    # The charts update: more polls, each adding a point.
    wait.until(lambda d: d.execute_script(state + ".updates") >= first + 4)
    assert len(browser.execute_script(state + ".times")) >= first_points + 4

    def every_group_shown(d: webdriver.Chrome) -> bool:
        seen = {(tenant, tier) for tenant, tier, requests, ttft_p99, _ in _rows(d)
                if int(requests or 0) > 0 and float(ttft_p99 or 0) > 0}
        return {(t, str(p)) for t in TENANTS for p in TIERS} <= seen

    wait.until(every_group_shown)
    charts = browser.execute_script(state + ".charts")
    for tier in TIERS:
        for chart in ("ttft_tier", "tpot_tier", "itl_tier"):
            assert _latest(charts[chart], f"tier {tier} p99") > 0, (chart, tier)
    for tenant in TENANTS:
        assert _latest(charts["tenant_tokens"], tenant) > 0, tenant
        assert _latest(charts["ttft_tenant"], f"{tenant} p99") > 0, tenant
    assert _latest(charts["throughput"], "generated") > 0
    # SLA colouring, the scheduler config and its history are on the page.
    classes = {row[4] for row in _rows(browser)}
    assert classes <= {"ok", "warn", "breach"} and classes
    assert browser.find_element(By.ID, "config-version").text.startswith("version ")
    assert browser.find_elements(By.CSS_SELECTOR, "#history tbody tr")
    assert len(browser.find_elements(By.CSS_SELECTOR, "#charts .uplot")) >= 15
    errors = browser.execute_script(state + ".errors")
    console = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors and not console, (errors, console)
    shot = Path(os.environ.get("EVERYSTOP_SCREENSHOT") or ROOT / "artifacts" / "dashboard.png")
    shot.parent.mkdir(parents=True, exist_ok=True)
    assert browser.save_screenshot(str(shot)), shot
    print(f"screenshot: {shot}")

    # Without the key the page holds no numbers: it asks for the key.
    browser.execute_script("sessionStorage.clear()")
    browser.get(f"{live_server.server.url}/dashboard")
    wait.until(lambda d: d.find_element(By.ID, "keyform").is_displayed())
    assert browser.execute_script(state + ".updates") == 0
