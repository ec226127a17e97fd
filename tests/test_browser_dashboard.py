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


# What a GRPO run logs through the trainer (TRL's names, as in a run's metrics.jsonl) and the stages.
TRAINER_KEYS = ("clip_ratio/high_max", "clip_ratio/high_mean", "clip_ratio/low_mean", "clip_ratio/low_min",
                "clip_ratio/region_mean", "completions/clipped_ratio", "completions/mean_length", "entropy", "epoch",
                "frac_reward_zero_std", "grad_norm", "learning_rate", "loss", "num_tokens", "reward", "reward_std",
                "rewards/exact_match/mean", "rewards/exact_match/std", "step_time")
STAGE_KEYS = ("eval/accuracy_before", "eval/accuracy_after", "prep/rows_in", "prep/rows_valid", "plan/generation_rounds")


def test_mlflow_run_page_opens_on_eval_and_training_curves(tmp_path, mlflow_server):
    """MLflow's run page (its "Model metrics" tab, in Chromium) groups charts by key prefix alphabetically, with
    unprefixed keys last: under TRL's names it opened on five all-zero clip_ratio charts and put reward at the bottom.
    With the trainer's metrics under train/ (MlflowCallback) it opens on eval; the train curves (reward among them)
    come before any diagnostics section. Saves test-output/mlflow-run-metrics.png and mlflow-run-train-metrics.png."""
    if not CHROMIUM.is_file():
        pytest.fail(f"{CHROMIUM} is missing: run .ci/run (it installs it)", pytrace=False)
    import re

    from playwright.sync_api import sync_playwright
    from transformers import TrainerControl, TrainerState

    from grpo.pipeline.tracking import MlflowCallback, MlflowTracker

    tracker = MlflowTracker(mlflow_server.uri, tmp_path / "spool", log_system_metrics=False)
    run_id = tracker.start("metrics-tab", "grpo-mlflow-page")
    callback, state = MlflowCallback(tracker), TrainerState()
    for step in range(1, 6):
        state.global_step = step
        callback.on_log(None, state, TrainerControl(), logs={
            k: (0.0 if k.startswith("clip_ratio") else 0.1 * step + i / 100) for i, k in enumerate(TRAINER_KEYS)})
    tracker.log_metrics({k: 0.5 for k in STAGE_KEYS}, step=0)
    experiment_id = tracker.experiment_id
    assert tracker.close(timeout=30)

    shot = REPO / "test-output" / "mlflow-run-metrics.png"
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(f"{mlflow_server.uri}/#/experiments/{experiment_id}/runs/{run_id}/model-metrics",
                      wait_until="load", timeout=60_000)  # MLflow's UI polls: the network never idles
            page.get_by_text("Add chart").first.wait_for(timeout=60_000)
            page.get_by_text("accuracy_after", exact=True).first.wait_for(timeout=30_000)
            lines = page.locator("body").inner_text().splitlines()
            shot.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(shot))
            page.get_by_text("train", exact=True).first.scroll_into_view_if_needed()
            page.get_by_text("entropy", exact=True).first.wait_for(timeout=30_000)  # the train section's first chart
            page.screenshot(path=str(shot.with_name("mlflow-run-train-metrics.png")))
        finally:
            browser.close()
    # section headers read "<prefix>" then "(<charts>)"
    sections = [lines[i - 1] for i in range(1, len(lines)) if re.fullmatch(r"\(\d+\)", lines[i].strip())]
    assert sections[0] == "eval", sections
    assert sections.index("train") < sections.index("train/clip_ratio"), sections
    assert not any(s.startswith("clip_ratio") for s in sections), sections
    train_charts = lines[lines.index("train") + 1]
    assert train_charts == f"({sum('/' not in k for k in TRAINER_KEYS)})", train_charts  # reward, loss, ... together
