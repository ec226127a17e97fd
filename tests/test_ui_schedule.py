"""A recurring sweep as a person sets one up: `grpo serve --schedule CRON` (docs: Schedules) with a cron due the next
minute, against the session's real Prefect and MLflow servers: the schedule really starts a sweep with the sweep
form's defaults, which completes (three trials of 50 steps); the sweep's run form reads as titled fields, in
Chromium."""

from __future__ import annotations

import datetime as dt
import json
import subprocess
import time

import pytest

from tests.browser import SCREENSHOTS, chromium_page
from tests.servers import BIN, interrupt

pytestmark = pytest.mark.integration


def _next_minute_cron(margin_s: float = 40) -> tuple[str, dt.datetime]:
    """A daily cron (UTC) for the first whole minute at least ``margin_s`` ahead: it fires once during the test."""
    at = (dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=margin_s + 60)).replace(second=0, microsecond=0)
    return f"{at.minute} {at.hour} * * *", at


def _serve_a_schedule_whose_next_minute_is_still_ahead(s, env: dict, tmp_path):
    """``grpo serve --schedule CRON`` with a cron due the next minute, whose first run the server really schedules.

    Prefect's server schedules a cron's runs from the time its scheduler first sees the deployment: a minute that has
    passed by then is skipped, as cron skips it. On a busy machine serving can take longer than the margin (imports,
    registration, the scheduler's loop); the test then serves again with a wider margin instead of depending on how
    fast this machine is."""
    for attempt, margin_s in enumerate((40, 150, 400)):
        cron, due = _next_minute_cron(margin_s)
        log = tmp_path / f"serve-{attempt}.log"
        with log.open("w") as out:
            proc = subprocess.Popen([str(BIN / "grpo"), "serve", "--schedule", cron, "--name", "scheduled"],
                                    cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        try:
            deadline = time.monotonic() + margin_s + 600
            while True:
                response = s._request("GET", "deployments/name/grpo-sweep/scheduled")
                sweep = response.json() if response.status_code == 200 else {}
                if [c["schedule"].get("cron") for c in sweep.get("schedules", [])] == [cron] and not sweep["paused"]:
                    scheduled = {"state": {"type": {"any_": ["SCHEDULED"]}}}
                    runs = s.post("flow_runs/filter", {"deployments": {"id": {"any_": [sweep["id"]]}},
                                                       "flow_runs": scheduled}).json()
                    if runs:
                        break
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.5)
        except BaseException:
            interrupt(proc, timeout=90)
            raise
        starts = sorted(dt.datetime.fromisoformat(r["expected_start_time"].replace("Z", "+00:00")) for r in runs)
        if starts[0] == due:
            return proc, log, sweep, cron, due
        interrupt(proc, timeout=90)  # the minute passed before the server scheduled it: its first run is tomorrow
    raise AssertionError(f"serving took longer than {margin_s} s three times; last log: {log.read_text()[-3000:]}")


def test_a_schedule_due_next_minute_starts_a_sweep_that_completes(prefect_server, mlflow_server, tmp_path):
    from grpo.app.serve import SWEEP_PARAMETERS

    s = prefect_server
    env = s.env(MLFLOW_TRACKING_URI=mlflow_server.uri)
    proc, log, sweep, cron, due = _serve_a_schedule_whose_next_minute_is_still_ahead(s, env, tmp_path)
    try:
        [schedule] = sweep["schedules"]
        assert schedule["schedule"]["cron"] == cron and schedule["active"]
        assert sweep["parameters"] == {"preset": "tiny", **SWEEP_PARAMETERS}

        _look_at_the_sweep_form(s, sweep["id"])

        # The served runner starts the due run (it polls every 10 s); the bound only ends a hung test.
        deadline = time.monotonic() + (due - dt.datetime.now(dt.timezone.utc)).total_seconds() + 900
        while True:
            runs = s.post("flow_runs/filter", {"deployments": {"id": {"any_": [sweep["id"]]}}}).json()
            started = [r for r in runs if r["state_type"] not in ("SCHEDULED", "PENDING")]
            if started:
                [run] = started
                break
            assert proc.poll() is None and time.monotonic() < deadline, (
                [(r["state_name"], r["expected_start_time"]) for r in runs], log.read_text()[-3000:])
            time.sleep(2)
        assert run["auto_scheduled"] and run["parameters"]["max_steps"] == 50
        deadline = time.monotonic() + 1800
        while run["state_type"] not in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
            assert time.monotonic() < deadline, (run["state"], log.read_text()[-3000:])
            time.sleep(3)
            run = s.get(f"flow_runs/{run['id']}")
        assert run["state_type"] == "COMPLETED", (run["state"], log.read_text()[-4000:])
    finally:
        interrupt(proc, timeout=90)
    [sweep_json] = list(tmp_path.glob("runs/*/sweep.json"))
    result = json.loads(sweep_json.read_text())
    assert [t["status"] for t in result["trials"]] == ["completed"] * 3, result["trials"]
    assert sorted(t["grpo.learning_rate"] for t in result["trials"]) == [5.0e-5, 1.0e-4, 2.0e-4]
    for trial in result["trials"]:
        assert json.loads((tmp_path / trial["run_dir"] / "summary.json").read_text())["steps"] == 50
    assert s.get("deployments/name/grpo-sweep/scheduled")["paused"]  # serving stopped: the schedule is paused


def _look_at_the_sweep_form(s, deployment_id: str) -> None:
    """Titled fields in a person's words, complete help (placeholders survive the markdown), no None toggles."""
    from playwright.sync_api import expect

    ui = s.url.removesuffix("/api")
    with chromium_page() as page:
        page.goto(f"{ui}/deployments/deployment/{deployment_id}/run", wait_until="networkidle")
        expect(page.locator(".schema-form-property__label")).to_have_count(13, timeout=120_000)
        labels = [t.removesuffix(" (Optional)") for t in
                  page.locator(".schema-form-property__label").all_inner_texts()]
        assert labels == ["Search space", "Preset", "Training steps per trial", "Trials at once",
                          "Metric to optimise", "Direction", "Sweep name", "Optuna study", "Optuna storage",
                          "Registered model name", "Run trials on a deployment", "Trial timeout (seconds)",
                          "Whole config (advanced)"]
        body = page.locator("body").inner_text()
        assert 'Property is type "None"' not in body and page.get_by_role("button", name="None").count() == 0
        assert "sqlite:///<output_dir>/optuna.db" in body and "<config name>-sweep-<time>" in body
        page.screenshot(path=str(SCREENSHOTS / "prefect-sweep-form.png"), full_page=True)
