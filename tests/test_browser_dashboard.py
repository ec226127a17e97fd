"""The dashboard HTML in a real Chromium (the Debian package, driven by Playwright): every plot renders, offline,
without console errors. Saves a screenshot to test-output/dashboard.png."""

from __future__ import annotations

from pathlib import Path

import pytest

from dashboards.comparison import build_dashboard
from tests.conftest import REPO
from tests.test_dashboard import SWEEP_PLOTS, SWEEP_RUNS, make_experiment

pytestmark = pytest.mark.integration

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
SCREENSHOT = REPO / "test-output" / "dashboard.png"


def test_dashboard_renders_in_chromium(tmp_path, mlflow_server):
    if not CHROMIUM.is_file():
        pytest.fail(f"{CHROMIUM} is missing: run .ci/run (it installs it) or `apt-get update && apt-get install -y "
                    "chromium`; the browser test needs the Debian chromium package", pytrace=False)
    from playwright.sync_api import sync_playwright

    exp = make_experiment(mlflow_server.uri)
    page_file = build_dashboard(mlflow_server.uri, exp["experiment"], exp["sweep"], out=tmp_path / "dashboard.html")

    errors: list[str] = []
    foreign: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.on("console", lambda msg: errors.append(f"console: {msg.text}") if msg.type == "error" else None)
            page.on("pageerror", lambda err: errors.append(f"pageerror: {err}"))
            page.on("request", lambda req: None if req.url.startswith(("file:", "data:", "blob:"))
                    else foreign.append(req.url))
            page.goto(page_file.as_uri(), wait_until="load")
            n = len(SWEEP_PLOTS)
            page.wait_for_function(
                f"document.querySelectorAll('.js-plotly-plot').length === {n} && "
                "[...document.querySelectorAll('.js-plotly-plot')].every(d => d.querySelector('svg.main-svg'))",
                timeout=20_000,
            )
            rendered = page.eval_on_selector_all(".js-plotly-plot", "els => els.map(e => e.id)")
            svgs = page.eval_on_selector_all(".js-plotly-plot",
                                             "els => els.map(e => e.querySelectorAll('svg.main-svg').length)")
            # Lines and bars were drawn, not just empty axes.
            reward_lines = page.locator("#panel-reward .scatterlayer .trace").count()
            bars = page.locator("#panel-eval .barlayer .point").count()
            legend = page.locator("#panel-reward .legend .legendtext").all_text_contents()
            table_rows = page.locator("#final-metrics tbody tr").count()
            title = page.locator("#dashboard-title").inner_text()
            SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(SCREENSHOT), full_page=True)
        finally:
            browser.close()

    assert rendered == SWEEP_PLOTS
    assert all(count >= 1 for count in svgs), dict(zip(rendered, svgs))
    assert reward_lines == 2 * len(SWEEP_RUNS)  # reward and reward_std subplots
    assert bars == 2 * len(SWEEP_RUNS)  # before and after per run
    # trials are told apart by the params that differ between them, as a user reads the legend (#15)
    assert legend == ["learning_rate=1e-05, num_generations=4", "learning_rate=3e-05, num_generations=4",
                      "learning_rate=0.0001, num_generations=8"]
    assert table_rows == len(SWEEP_RUNS)
    assert title == "GRPO sweep sweep-lr"
    assert not errors, errors
    assert not foreign, f"the dashboard loaded something from outside the file: {foreign}"
    assert SCREENSHOT.stat().st_size > 10_000
