"""In a real Chromium (the Debian package, driven by Playwright): the dashboard HTML (every plot renders, offline,
without console errors; test-output/dashboard.png) and the MLflow pages a run's links open
(test-output/mlflow-*.png)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dashboards.comparison import build_dashboard
from grpo.tracking.model_logging import log_model
from grpo.tracking.run_tracking import eval_metrics, log_numbers, log_plan, log_prep
from grpo.tracking.store import mlflow_ui_url
from grpo.tracking.tracker import MlflowCallback, MlflowTracker
from tests.browser import chromium_page
from tests.conftest import REPO
from tests.test_dashboard import SWEEP_PLOTS, SWEEP_RUNS, TINY_LEGENDS, make_experiment, make_tiny_experiment

pytestmark = pytest.mark.integration

SCREENSHOT = REPO / "test-output" / "dashboard.png"


def test_dashboard_renders_in_chromium(tmp_path, mlflow_server):
    exp = make_experiment(mlflow_server.uri)
    page_file = build_dashboard(mlflow_server.uri, exp["experiment"], exp["sweep"], out=tmp_path / "dashboard.html")

    errors: list[str] = []
    foreign: list[str] = []
    with chromium_page(1280, 900) as page:
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

    assert rendered == SWEEP_PLOTS
    assert all(count >= 1 for count in svgs), dict(zip(rendered, svgs))
    assert reward_lines == 2 * len(SWEEP_RUNS)  # reward and reward_std subplots
    assert bars == 2 * len(SWEEP_RUNS)  # before and after per run
    # trials are told apart by the params that differ between them, as a user reads the legend (#15)
    assert legend == ["learning_rate=1e-5, num_generations=4", "learning_rate=3e-5, num_generations=4",
                      "learning_rate=1e-4, num_generations=8"]
    assert table_rows == len(SWEEP_RUNS)
    assert title == "GRPO sweep sweep-lr"
    assert not errors, errors
    assert not foreign, f"the dashboard loaded something from outside the file: {foreign}"
    assert SCREENSHOT.stat().st_size > 10_000


def test_experiment_dashboard_shows_settings_and_eval_columns_in_chromium(tmp_path, mlflow_server):
    """The experiment view of #44 (two demo runs and two sweeps, 11 runs) in Chromium at 1280x900: the reward plot's
    legend names the runs by the settings that differ (it listed the run names), and the final-metrics table shows
    its eval columns within the page (they were past its right edge, behind 8 param columns): each header cell's box
    lies inside the viewport and inside the table's scroll area. Screenshot: test-output/dashboard-experiment.png."""

    exp = make_tiny_experiment(mlflow_server.uri)
    page_file = build_dashboard(mlflow_server.uri, exp["experiment"], out=tmp_path / "experiment.html")
    shot = REPO / "test-output" / "dashboard-experiment.png"
    with chromium_page(1280, 900) as page:
        page.goto(page_file.as_uri(), wait_until="load")
        page.wait_for_function("document.querySelector('#panel-reward svg.main-svg')", timeout=20_000)
        legend = page.locator("#panel-reward .legend .legendtext").all_text_contents()
        page.locator("#final-metrics").scroll_into_view_if_needed()
        wrap = page.locator("#final-metrics-section .table-wrap").bounding_box()
        boxes = {h: page.locator("#final-metrics th", has_text=re.compile(rf"^{re.escape(h)}$")).bounding_box()
                 for h in ("run", "eval accuracy before", "eval accuracy after", "pass@k after", "final reward")}
        shot.parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(shot))

    assert legend == TINY_LEGENDS
    viewport_right = min(1280, wrap["x"] + wrap["width"])
    for header, box in boxes.items():
        assert box and box["x"] >= wrap["x"] and box["x"] + box["width"] <= viewport_right, (header, box, wrap)


# What a GRPO run logs through the trainer (TRL's names, as in a run's metrics.jsonl).
TRAINER_KEYS = ("clip_ratio/high_max", "clip_ratio/high_mean", "clip_ratio/low_mean", "clip_ratio/low_min",
                "clip_ratio/region_mean", "completions/clipped_ratio", "completions/mean_length", "entropy", "epoch",
                "frac_reward_zero_std", "grad_norm", "learning_rate", "loss", "num_tokens", "reward", "reward_std",
                "rewards/exact_match/mean", "rewards/exact_match/std", "step_time")
STEPS = 5
PREP = {"source": "synthetic:addition", "content_hash": "ab" * 32, "rows_in": 5500, "rows_valid": 5500,
        "rows_quarantined": 0, "prompt_chars": {"min": 4, "mean": 5.5, "max": 6},
        "splits": {"train": {"rows_in": 5000, "rows_valid": 5000, "rows_quarantined": 0},
                   "eval": {"rows_in": 500, "rows_valid": 500, "rows_quarantined": 0}}}
PLAN = {"generation_rounds": 10, "epochs": 1, "predicted_imbalance": {"plan_order": {"max_over_mean": 1.0312345}}}


def _log_run(uri: str, tmp_path: Path, name: str, lr: float, after: float, model_dir: Path) -> MlflowTracker:
    """One run as the recipe logs it (grpo.tracking.run_tracking): prep and plan, eval before, the trainer's metrics
    through MlflowCallback, eval after, the model at the last step."""
    from transformers import TrainerControl, TrainerState

    tracker = MlflowTracker(uri, tmp_path / name / "spool", log_system_metrics=False)
    tracker.start(name, "grpo-mlflow-ui", params={"grpo.learning_rate": lr, "grpo.beta": 0.0, "model.name": "tiny"})
    PREP["data_dir"] = str(tmp_path / "data")
    log_prep(tracker, PREP)
    log_plan(tracker, PLAN)
    # the system metrics sampler's first sample: in a run it comes while the evaluation before training runs (logged
    # here the way the sampler logs it, so the order is forced rather than raced)
    tracker.log_metrics({"system/cpu_utilization_percentage": 50.0 + lr * 1e5,
                         "system/system_memory_usage_percentage": 40.0}, step=0)
    log_numbers(tracker, eval_metrics({"accuracy": 0.2, "pass@4": 0.4}), step=0)
    callback, state = MlflowCallback(tracker), TrainerState()
    for step in range(1, STEPS + 1):
        state.global_step = step
        callback.on_log(None, state, TrainerControl(), logs={
            k: (0.0 if k.startswith("clip_ratio") else 0.1 * step + i / 100 + lr * 1e3)
            for i, k in enumerate(TRAINER_KEYS)})
    log_numbers(tracker, eval_metrics({"accuracy": after, "pass@4": 0.9}), step=STEPS)
    log_model(tracker, model_dir, model_dir, step=STEPS)
    return tracker


@pytest.fixture(scope="module")
def mlflow_ui_runs(tmp_path_factory, mlflow_server) -> dict:
    """Two finished runs of one experiment, logged the way the platform logs a run, each with its logged model."""
    from mlflow import MlflowClient

    from grpo.training.tiny_model import build_char_tokenizer, build_tiny_qwen2

    tmp_path = tmp_path_factory.mktemp("mlflow-ui")
    tokenizer = build_char_tokenizer("0123456789+= ")
    model = build_tiny_qwen2(tokenizer, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                             intermediate_size=64, max_position_embeddings=32, seed=0)
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    runs = []
    for name, lr, after in (("ui-a", 1e-5, 0.6), ("ui-b", 3e-5, 0.7)):
        tracker = _log_run(mlflow_server.uri, tmp_path, name, lr, after, tmp_path / "model")
        runs.append(tracker.run_id)
        experiment_id = tracker.experiment_id
        assert tracker.close(timeout=30)
    client = MlflowClient(mlflow_server.uri)
    models = {m.source_run_id: m.model_id for m in client.search_logged_models(experiment_ids=[experiment_id])}
    return {"experiment_id": experiment_id, "runs": runs, "model": models[runs[1]]}


def _chart_titles_in_page_order(page, until: str, max_scrolls: int = 40) -> list[str]:
    """The run page's chart titles from the top down to ``until``: MLflow draws only the cards in view, so the page is
    scrolled a screen at a time and the titles are collected in the order they appear."""
    seen: list[str] = []
    page.mouse.move(600, 600)
    for _ in range(max_scrolls):
        for title in page.eval_on_selector_all("[data-testid=experiment-view-compare-runs-card]",
                                               "els => els.map(e => e.innerText.split('\\n')[0].trim())"):
            if title not in seen:
                seen.append(title)
        if until in seen:
            page.locator("[data-testid=experiment-view-compare-runs-card]",
                         has_text=until).first.scroll_into_view_if_needed()
            page.wait_for_timeout(1000)  # its chart draws once in view
            return seen
        page.mouse.wheel(0, 600)
        page.wait_for_timeout(500)
    return seen


def test_mlflow_ui_opens_on_the_result(mlflow_server, mlflow_ui_runs):
    """The MLflow pages a person opens from the platform's links (mlflow_ui_url), in Chromium with a fresh profile:

    * the experiment opens on its runs, not MLflow 3's GenAI overview (3.17.2 picks the view from the link's
      workflowType, not from the experiment's mlflow.experimentKind tag);
    * the run's "Model metrics" tab opens on eval/accuracy, one chart of two points (before and after training), then
      the train section on train/reward and train/reward_std (it was the 8th chart, behind TRL's other figures, now
      in train/aux); no single-value prep/plan charts (those figures are params);
    * the experiment's Models list names each logged model after its run (every one was "model");
    * the logged model's page lists the evaluation after training and the run's params;
    * Compare opens on a metric that varies between the runs (eval/accuracy), not a constant row count, nor the
      system metric sampled before the evaluation (system/cpu_utilization_percentage).
    Screenshots: test-output/mlflow-experiment.png, mlflow-run-metrics.png, mlflow-run-train-metrics.png,
    mlflow-models.png, mlflow-logged-model.png, mlflow-compare.png."""

    uri, experiment_id = mlflow_server.uri, mlflow_ui_runs["experiment_id"]
    run_a, run_b = mlflow_ui_runs["runs"]
    out = REPO / "test-output"
    out.mkdir(parents=True, exist_ok=True)
    with chromium_page() as page:
        # MLflow's UI polls: the network never idles, so each step waits for what it reads
        page.goto(mlflow_ui_url(uri, experiment_id), wait_until="load", timeout=60_000)
        # MLflow redirects the experiment's page to the tab it opens on
        page.wait_for_url(re.compile(rf".*/experiments/{experiment_id}/\w+.*"), timeout=60_000)
        if "/runs" in page.url:
            page.get_by_text("ui-b", exact=True).first.wait_for(timeout=60_000)
        experiment_url = page.url
        experiment_text = page.locator("body").inner_text()
        page.screenshot(path=str(out / "mlflow-experiment.png"))

        page.goto(mlflow_ui_url(uri, experiment_id, run_a).replace("?", "/model-metrics?"), wait_until="load",
                  timeout=60_000)
        page.get_by_text("Add chart").first.wait_for(timeout=60_000)
        page.wait_for_function("document.querySelector('.js-plotly-plot') && "
                               "document.querySelector('.js-plotly-plot').data", timeout=30_000)
        lines = page.locator("body").inner_text().splitlines()
        first_chart = page.evaluate("() => document.querySelector('.js-plotly-plot').data.map(t => t.x.length)")
        page.screenshot(path=str(out / "mlflow-run-metrics.png"))
        cards = _chart_titles_in_page_order(page, until="reward")
        page.screenshot(path=str(out / "mlflow-run-train-metrics.png"))

        page.goto(f"{uri}/#/experiments/{experiment_id}/models?workflowType=machine_learning", wait_until="load",
                  timeout=60_000)
        page.get_by_text("ui-b").first.wait_for(timeout=60_000)
        # the links of the grid's "Model name" column (ag-grid column id "name")
        model_names = page.eval_on_selector_all(".ag-row [col-id=name] a", "links => links.map(a => a.innerText)")
        models_text = page.locator("body").inner_text()
        page.screenshot(path=str(out / "mlflow-models.png"))

        page.goto(f"{uri}/#/experiments/{experiment_id}/models/{mlflow_ui_runs['model']}?workflowType="
                  "machine_learning", wait_until="load", timeout=60_000)
        page.get_by_text(re.compile(r"^Parameters \(\d+\)$")).first.wait_for(timeout=60_000)
        # the model's metrics arrive in a request of their own, after its parameters
        page.get_by_text("eval/accuracy", exact=True).first.wait_for(timeout=60_000)
        model_lines = [line.strip() for line in page.locator("body").inner_text().splitlines()]
        page.screenshot(path=str(out / "mlflow-logged-model.png"), full_page=True)

        page.goto(f'{uri}/#/compare-runs?runs=["{run_a}","{run_b}"]&experiments=["{experiment_id}"]',
                  wait_until="load", timeout=60_000)
        page.get_by_text("Parallel Coordinates Plot").first.wait_for(timeout=60_000)
        page.get_by_text("Run details").first.wait_for(timeout=60_000)
        compare = [line.strip() for line in page.locator("body").inner_text().splitlines()]
        page.screenshot(path=str(out / "mlflow-compare.png"))

    # the experiment: its runs view (MLflow's URL says the tab), not the GenAI overview
    assert f"/experiments/{experiment_id}/runs" in experiment_url and "/overview" not in experiment_url, experiment_url
    assert "Run Name" in experiment_text and "ui-a" in experiment_text

    # the run page: section headers read "<prefix>" then "(<charts>)"
    sections = [lines[i - 1] for i in range(1, len(lines)) if re.fullmatch(r"\(\d+\)", lines[i].strip())]
    assert sections[0] == "eval" and lines[lines.index("eval") + 1] == "(2)", sections  # accuracy, pass_at_4
    assert not {"prep", "plan"} & set(sections), sections
    assert sections[1:3] == ["train", "train/aux"] and lines[lines.index("train") + 1] == "(2)", sections
    assert sections.index("train/aux") < sections.index("train/clip_ratio"), sections
    # the train curves right after eval's two, train/reward first
    assert cards[:4] == ["accuracy", "pass_at_4", "reward", "reward_std"], cards
    assert first_chart and set(first_chart) == {2}, first_chart  # eval/accuracy: before and after, one line

    # the Models list: each run's model by the run's name
    assert sorted(model_names) == ["ui-a", "ui-b"], (model_names, models_text[:2000])

    # the logged model: the evaluation after training (0.6 for ui-a... this is ui-b: 0.7) and the run's params
    metrics = model_lines[model_lines.index("eval/accuracy"):model_lines.index("eval/accuracy") + 8]
    assert "0.7" in metrics and "0.2" not in metrics, metrics
    assert any(re.fullmatch(r"Parameters \((\d+)\)", line) and int(line[12:-1]) >= 3 for line in model_lines)
    assert model_lines[model_lines.index("grpo.learning_rate") + 1] == "3e-05"

    # Compare: the parallel coordinates plot starts on the param and the metric that differ between the runs
    params_at = compare.index("Parameters:")
    assert compare[params_at + 1:params_at + 4] == ["grpo.learning_rate", "Metrics:", "eval/accuracy"], compare[
        params_at:params_at + 6]
