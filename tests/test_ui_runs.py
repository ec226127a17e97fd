"""The docs' UI path, as a person takes it: `grpo serve` with no options (the second time it is started, as on a
person's second day), then Deployments → grpo-pipeline/local → Run, in Chromium, against the session's real Prefect
and MLflow servers.

- a Custom run with nothing changed and every section opened trains exactly the tiny preset, to the end;
- a Quick run is the preset too, and Cancel in the UI stops it: the train subflow ends Cancelled and says which step
  was saved and how to resume, and no flow run's log has an ERROR or a traceback;
- a Custom run with changed fields, stopped, is resumed from the form (every section opened) and completes, saying
  where it continues and counting its ETA from there; a resume whose config really differs fails with that one line;
- a crash in a served run keeps its traceback in the run's log;
- the guide's API parameters run.

A stop that must land while training runs is forced, not timed: the run's reward blocks at its first call while a
gate file exists, and the gate opens once the run has received the stop.
"""

from __future__ import annotations

import json
import logging
import re
import subprocess
import time
from pathlib import Path

import pytest

from tests.browser import SCREENSHOTS, SECTION_TITLES, form_property, open_section, open_select, park, submit
from tests.servers import BIN, interrupt

pytestmark = pytest.mark.integration

FINAL = ("COMPLETED", "FAILED", "CRASHED", "CANCELLED")
GATED_REWARD = """
import os, time
from grpo.rewards import register_reward, exact_match


def hold(gate):
    # Blocks while the gate file exists: the test holds training inside a step until its stop has arrived.
    open(gate + ".reached", "w").close()
    while os.path.exists(gate):
        time.sleep(0.1)


@register_reward("exact_match_gated")
def exact_match_gated(completions, answer, **kwargs):
    hold(os.environ["GRPO_TEST_GATE"])
    return exact_match(completions, answer)


@register_reward("exact_match_crashing")
def exact_match_crashing(completions, answer, **kwargs):
    raise RuntimeError("this reward function crashes on purpose")


if "GRPO_TEST_GATE" in os.environ:  # the served runs' processes, not the test's own
    import functools
    from grpo import rewards

    _preset_reward = rewards.get_reward("exact_match")

    @functools.wraps(_preset_reward)
    def exact_match_held(completions, answer, **kwargs):
        # The preset's own reward, held inside a training step (TRL passes trainer_state; evaluation does not) while
        # the preset gate exists: a Quick run can not name another reward, and its stop must land mid-run.
        gate = os.environ["GRPO_TEST_GATE"] + "-preset"
        if "trainer_state" in kwargs and os.path.exists(gate):
            hold(gate)
        return _preset_reward(completions, answer, **kwargs)

    rewards.REWARDS._entries["exact_match"] = exact_match_held
"""


class Served:
    """`grpo serve` (no options) in ``home``, its log, and the server it registered with."""

    def __init__(self, server, home: Path, env: dict[str, str]) -> None:
        self.server, self.home, self.env = server, home, env
        self.log = home / "serve.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        before = {}
        for name in ("grpo-pipeline/local", "grpo-sweep/local"):
            response = self.server._request("GET", f"deployments/name/{name}")
            before[name] = response.json()["updated"] if response.status_code == 200 else None
        with self.log.open("a") as out:
            self.proc = subprocess.Popen([str(BIN / "grpo"), "serve"], cwd=self.home, env=self.env, stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 600  # a hung server's bound: the shared one has stalled for minutes
        while True:  # the runner registers (creates or updates) both deployments when it starts
            now = {}
            for name in before:
                response = self.server._request("GET", f"deployments/name/{name}")
                now[name] = response.json()["updated"] if response.status_code == 200 else None
            if all(now[n] is not None and now[n] != before[n] for n in before):
                return
            assert self.proc.poll() is None and time.monotonic() < deadline, self.log.read_text()[-3000:]
            time.sleep(0.5)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        interrupt(self.proc, timeout=90)

    def deployment(self, name: str = "grpo-pipeline/local") -> dict:
        return self.server.get(f"deployments/name/{name}")

    def wait(self, flow_run_id: str, timeout: float = 1200, until: tuple[str, ...] = FINAL) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            run = self.server.get(f"flow_runs/{flow_run_id}")
            if run["state"]["type"] in until:
                return run
            assert time.monotonic() < deadline, (run["state"], self.log.read_text()[-3000:])
            time.sleep(2)

    def subflows(self, flow_run_id: str) -> dict[str, dict]:
        runs = self.server.post("flow_runs/filter", {"flow_runs": {"parent_flow_run_id": {"any_": [flow_run_id]}}})
        return {r["name"]: r for r in runs.json()}

    def run_dir(self, flow_run: dict) -> Path:
        name = flow_run["parameters"].get("run_name") or f"tiny-{flow_run['name']}"
        return self.home / "runs" / name


@pytest.fixture(scope="module")
def served(prefect_server, mlflow_server, tmp_path_factory):
    home = tmp_path_factory.mktemp("serve-home")
    (home / "gated_reward.py").write_text(GATED_REWARD)
    from grpo.rewards import load_reward_module

    load_reward_module(home / "gated_reward.py")  # this process reads the runs' configs, which name it
    env = prefect_server.env(MLFLOW_TRACKING_URI=mlflow_server.uri, GRPO_REWARD_MODULES=str(home / "gated_reward.py"),
                             GRPO_TEST_GATE=str(home / "gate"))
    s = Served(prefect_server, home, env)
    s.start()  # the first `grpo serve` creates the deployments ...
    s.stop()
    s.start()  # ... the second one updates them: the form must read the same
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def browser_page(served):
    from tests.browser import chromium_page

    with chromium_page() as page:
        errors: list[str] = []
        page.on("pageerror", lambda err: errors.append(str(err)))
        yield page
        assert not errors, errors


@pytest.fixture
def page(browser_page):
    """The module's page, left on a blank page after each test: a flow run's page, even a finished run's, keeps
    repainting its run graph (WebGL, drawn by Chromium's software renderer) at more than a core's worth of CPU while
    the next test runs (see :func:`tests.browser.park`)."""
    yield browser_page
    park(browser_page)


def _run_page(page, served) -> str:
    from playwright.sync_api import expect

    deployment_id = served.deployment()["id"]
    ui = served.server.url.removesuffix("/api")
    page.goto(f"{ui}/deployments/deployment/{deployment_id}/run", wait_until="networkidle")
    # 22 labels: every section collapsed (a busy shared server may take a while to load the deployment)
    expect(page.locator(".schema-form-property__label")).to_have_count(22, timeout=120_000)
    return deployment_id


def _known(served, deployment_id: str) -> set[str]:
    runs = served.server.post("flow_runs/filter", {"deployments": {"id": {"any_": [deployment_id]}}}).json()
    return {r["id"] for r in runs}


def _flat_config(path: Path) -> dict:
    from grpo.config import flatten, load_config

    return flatten(load_config(path))


def _tiny() -> dict:
    from grpo.config import flatten, load_config

    return flatten(load_config("tiny"))


def _log_size(served) -> int:
    """The served log's size now: what :func:`_release_once_stopping` reads after."""
    return served.log.stat().st_size


def _release_once_stopping(served, gate: Path, since: int) -> None:
    """Once the served run's log says, after byte ``since`` (its size before the stop was sent), that the stop has
    arrived, remove the gate its held step waits on: the step ends and its checkpoint is saved. The log is shared by
    the module's runs and an earlier test's stop says the same: read from the whole log, that line released the gate
    before this run's stop arrived, and the run saved a later step."""
    deadline = time.monotonic() + 300
    while b"SIGTERM: saving a checkpoint at the end of this step" not in served.log.read_bytes()[since:]:
        assert time.monotonic() < deadline, served.log.read_text()[-3000:]
        time.sleep(0.5)
    gate.unlink()


def _changed(path: Path) -> dict:
    tiny = _tiny()
    return {k: v for k, v in _flat_config(path).items() if tiny[k] != v}


def _logs_when_done(served, flow_run_id: str, timeout: float = 600) -> list[dict]:
    """Every log line of a served flow run and its subflows, oldest first, read once the run's process has ended: its
    log handler ships lines in batches and sends the last ones as the process exits (Prefect's engine logs after the
    run's final state too), so only then is a line's absence final."""
    import psutil

    deadline = time.monotonic() + timeout  # a hung process's bound
    while True:
        running = []
        for child in psutil.Process(served.proc.pid).children(recursive=True):
            try:
                if (child.environ().get("PREFECT__FLOW_RUN_ID") == flow_run_id
                        and child.status() != psutil.STATUS_ZOMBIE):
                    running.append(child)
            except psutil.NoSuchProcess:
                pass
        if not running:
            break
        assert time.monotonic() < deadline, (running, served.log.read_text()[-3000:])
        time.sleep(0.5)
    ids = [flow_run_id, *(r["id"] for r in served.subflows(flow_run_id).values())]
    return served.server.post("logs/filter", {"logs": {"flow_run_id": {"any_": ids}}, "sort": "TIMESTAMP_ASC",
                                              "limit": 200}).json()


def _errors(logs: list[dict]) -> list[str]:
    """The log lines a person reads as something gone wrong: ERROR (or worse), or a traceback."""
    return [e["message"] for e in logs if e["level"] >= logging.ERROR or "Traceback" in e["message"]]


def _wait_file(path: Path, timeout: float = 600, log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared; " + (log.read_text()[-3000:] if log else "")
        time.sleep(0.5)


def test_a_second_grpo_serve_keeps_the_forms_as_designed(served):
    """Prefect's server hydrates an updated deployment's json-kind parameters: from the second `grpo serve` on every
    section opened into its ~130 fields. The served deployments read as on the first day."""
    from flows.run_form import collapsed_sections
    from grpo.app.serve import SWEEP_PARAMETERS

    assert served.deployment()["parameters"] == {"preset": "tiny", "resume": False, **collapsed_sections()}
    assert served.deployment("grpo-sweep/local")["parameters"] == {"preset": "tiny", **SWEEP_PARAMETERS}


def test_a_custom_run_with_nothing_changed_trains_the_preset_to_the_end(served, page):
    """Every section opened (its on/off fields start empty, not "off"), nothing typed, Submit: the run trains the tiny
    preset field for field and learns (mean sampled reward and greedy held-out accuracy rise), evaluates before and
    after, saves and logs its model, and its progress shows on the pipeline's own run with the last step's reward."""
    deployment_id = _run_page(page, served)
    page.screenshot(path=str(SCREENSHOTS / "prefect-run-form-default.png"))
    known = _known(served, deployment_id)
    for title in SECTION_TITLES:
        open_section(page, title)
    enabled = form_property(page, "Enabled (Evaluation)")
    assert "Every preset: true." in enabled.inner_text() and enabled.locator("[role=switch]").count() == 0
    enabled.scroll_into_view_if_needed()
    page.screenshot(path=str(SCREENSHOTS / "prefect-run-form-default-sections.png"))
    created = submit(page, served.server, deployment_id, known)
    park(page)
    run = served.wait(created["id"])
    assert run["state"]["type"] == "COMPLETED", (run["state"], served.log.read_text()[-4000:])

    run_dir = served.run_dir(run)
    assert _changed(run_dir / "config.yaml") == {}  # the preset, field for field
    summary = json.loads((run_dir / "summary.json").read_text())
    tiny = _tiny()
    steps, every = tiny["grpo.max_steps"], tiny["grpo.logging_steps"]
    assert summary["steps"] == steps
    # It learns: the mean reward of sampled completions rises, and greedy held-out accuracy with it.
    rewards = [row["metrics"]["reward"] for row in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
               if "reward" in row.get("metrics", {})]
    assert len(rewards) == steps // every >= 10  # each the mean over `every` steps of 256 sampled completions
    assert sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5 + 0.03, rewards
    assert summary["eval_accuracy_after"] >= summary["eval_accuracy_before"] + 0.1, summary
    assert {"reward", "reward_std", "frac_reward_zero_std", "rewards/exact_match/mean", "entropy", "step_time",
            "learning_rate", "grad_norm", "completions/mean_length"} <= set(summary["metrics"])
    # Saved for generation: the KV cache on (transformers' Trainer turned it off for training)
    assert json.loads((run_dir / "model" / "config.json").read_text())["use_cache"] is True
    from mlflow import MlflowClient

    mlflow_run = MlflowClient(served.env["MLFLOW_TRACKING_URI"]).get_run(summary["mlflow_run_id"])
    assert mlflow_run.info.status == "FINISHED"
    [progress] = served.server.post("artifacts/filter", {"artifacts": {
        "key": {"any_": ["run-training-progress"]}, "flow_run_id": {"any_": [created["id"]]}}}).json()
    last = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if "reward" in json.loads(line).get("metrics", {})][-1]
    assert progress["data"] == 100.0 and progress["description"].startswith(
        f"step {steps}/{steps} · reward {last['metrics']['reward']:.3f}"), (progress, last)
    ui = served.server.url.removesuffix("/api")
    page.goto(f"{ui}/runs/flow-run/{created['id']}", wait_until="networkidle")
    page.get_by_text("Completed").first.wait_for(timeout=120_000)
    page.screenshot(path=str(SCREENSHOTS / "prefect-flow-run-default.png"))


def test_a_quick_run_is_the_preset_and_cancel_in_the_ui_saves_a_checkpoint(served, page):
    """Run → Quick run trains the tiny preset (its config.yaml); Cancel on its page, pressed while the first step
    waits in the preset's reward, stops training at the end of that step with a checkpoint: the train subflow ends
    Cancelled and its log says which step was saved and how to resume."""
    from playwright.sync_api import expect

    deployment_id = served.deployment()["id"]
    ui = served.server.url.removesuffix("/api")
    known = _known(served, deployment_id)
    gate = Path(served.env["GRPO_TEST_GATE"] + "-preset")
    Path(f"{gate}.reached").unlink(missing_ok=True)
    gate.touch()
    page.goto(f"{ui}/deployments/deployment/{deployment_id}", wait_until="networkidle")
    created = submit(page, served.server, deployment_id, known, button="Quick run")
    park(page)
    run_dir = served.run_dir(served.server.get(f"flow_runs/{created['id']}"))
    _wait_file(Path(f"{gate}.reached"), log=served.log)  # training is inside its first step
    assert _changed(run_dir / "config.yaml") == {}

    page.goto(f"{ui}/runs/flow-run/{created['id']}", wait_until="networkidle")
    since = _log_size(served)
    page.get_by_role("button", name="Cancel", exact=True).first.click()
    page.get_by_role("dialog").get_by_role("button", name="Confirm", exact=True).click()
    served.wait(created["id"], timeout=300, until=("CANCELLING", "CANCELLED"))  # the UI's request arrived: may go
    park(page)
    _release_once_stopping(served, gate, since)
    run = served.wait(created["id"], timeout=600)
    assert run["state"]["type"] == "CANCELLED", run["state"]
    train = served.subflows(created["id"])["train"]
    message = train["state"]["message"]
    assert train["state"]["type"] == "CANCELLED", train["state"]
    step = int(re.search(r"checkpoint at step (\d+) saved", message).group(1))
    assert step == 1 and (run_dir / "checkpoints" / "checkpoint-1").is_dir()
    assert f"MLflow run name {run_dir.name!r} and Resume on" in message
    # The flow run's log handler ships records in batches: the line may reach the server after the final state.
    deadline = time.monotonic() + 600  # a hung server's bound
    while True:
        logs = served.server.post("logs/filter", {"logs": {"flow_run_id": {"any_": [train["id"]]}},
                                                  "sort": "TIMESTAMP_DESC", "limit": 200}).json()  # the newest
        if any("training stopped by SIGTERM: checkpoint at step" in entry["message"] for entry in logs):
            break
        assert time.monotonic() < deadline, [entry["message"] for entry in logs][:20]
        time.sleep(1)
    # The cancel reads as one: no ERROR and no traceback after "Finished in state Cancelled" (the engine took the
    # runner's SIGTERM, which training's own handler had held until its step ended, for a crash and logged it so)
    assert _errors(_logs_when_done(served, created["id"])) == []
    page.goto(f"{ui}/runs/flow-run/{train['id']}", wait_until="networkidle")
    expect(page.get_by_text("Cancelled").first).to_be_visible(timeout=120_000)
    page.screenshot(path=str(SCREENSHOTS / "prefect-train-cancelled.png"))


def _fill_run(page, run_name: str, steps: int, resume: bool = False) -> None:
    form_property(page, "Training steps").locator("input").fill(str(steps))
    form_property(page, "MLflow run name").locator("textarea").fill(run_name)
    from playwright.sync_api import expect

    reward = form_property(page, "Reward functions")
    assert "exact_match_gated" in open_select(page, reward)
    page.get_by_role("option", name="exact_match_gated", exact=True).click()  # instead of the preset's exact_match
    reward.locator(".schema-form-property__label").click()  # a multi-select stays open: close it by clicking away
    expect(page.get_by_role("option")).to_have_count(0)
    if resume:
        form_property(page, "Resume").get_by_role("switch").click()


def test_a_changed_run_stopped_mid_step_resumes_from_the_form(served, page):
    """A Custom run with three fields changed, stopped while its first step waits in the reward, then Resume from the
    form (same fields, every section opened): it completes, and its config is the preset with exactly those
    fields. The cancel logs no ERROR or traceback; the resume says where it continues (console and flow-run log),
    its progress line counts the steps left, and the checkpoint's tied weights load without a "missing keys"
    message. A resume that changes the config fails with that one line, no traceback."""
    gate = Path(served.env["GRPO_TEST_GATE"])
    Path(f"{gate}.reached").unlink(missing_ok=True)
    gate.touch()
    deployment_id = _run_page(page, served)
    known = _known(served, deployment_id)
    _fill_run(page, "ui-changed", 12)
    created = submit(page, served.server, deployment_id, known)
    park(page)
    _wait_file(Path(f"{gate}.reached"), log=served.log)  # training is inside its first step
    since = _log_size(served)
    served.server.post(f"flow_runs/{created['id']}/set_state",
                       {"state": {"type": "CANCELLING", "name": "Cancelling"}})  # what Cancel in the UI sends
    _release_once_stopping(served, gate, since)
    run = served.wait(created["id"], timeout=600)
    assert run["state"]["type"] == "CANCELLED", run["state"]
    assert served.subflows(created["id"])["train"]["state"]["type"] == "CANCELLED"
    run_dir = served.home / "runs" / "ui-changed"
    assert (run_dir / "checkpoints" / "checkpoint-1").is_dir()
    logs = _logs_when_done(served, created["id"])
    assert any(e["message"].startswith("training stopped by SIGTERM: checkpoint at step 1 saved") for e in logs)
    assert _errors(logs) == []

    _run_page(page, served)
    known = _known(served, deployment_id)
    _fill_run(page, "ui-changed", 12, resume=True)
    for title in SECTION_TITLES:
        open_section(page, title)
    page.screenshot(path=str(SCREENSHOTS / "prefect-run-form-resume.png"))
    console_before = len(served.log.read_text())
    resumed = submit(page, served.server, deployment_id, known)
    park(page)
    run = served.wait(resumed["id"])
    assert run["state"]["type"] == "COMPLETED", (run["state"], served.log.read_text()[-4000:])
    said = [e["message"] for e in _logs_when_done(served, resumed["id"])]
    console = served.log.read_text()[console_before:]  # `grpo serve`'s output for the resumed run
    assert "resumed from checkpoint-1: step 1 of 12" in said and "resumed from checkpoint-1: step 1 of 12" in console
    # The progress line's ETA is for the steps left (the preset logs every 10th step), at the pace since the resume
    [progress] = [m for m in said if m.startswith("step 10/12 | ")]
    assert re.search(r" \| ETA \d+s \(2 steps left\)$", progress), progress
    assert "missing keys" not in console, console
    assert _changed(run_dir / "config.yaml") == {"grpo.max_steps": 12,
                                                  "grpo.reward_funcs": ["exact_match_gated"]}
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 12
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trained = [row["step"] for row in rows if "reward" in row["metrics"]]
    assert trained == sorted(set(trained)) and trained[0] == 1  # each step trained and logged once across the stop

    bad = served.server.post(f"deployments/{deployment_id}/create_flow_run", {"parameters": {
        "run_name": "ui-changed", "resume": True, "max_steps": 12, "reward_funcs": ["exact_match_gated"],
        "learning_rate": 3e-4}}).json()
    run = served.wait(bad["id"], timeout=600)
    assert run["state"]["type"] == "FAILED"
    assert run["state"]["message"].startswith("--resume: config differs from the one") and \
        "grpo.learning_rate: 0.0001 -> 0.0003" in run["state"]["message"], run["state"]
    logs = served.server.post("logs/filter", {"logs": {"flow_run_id": {"any_": [bad["id"]]}}}).json()
    assert not any("Traceback" in entry["message"] for entry in logs), [e["message"] for e in logs]


def test_a_crash_in_a_served_run_keeps_its_traceback(served):
    """A stop reported as Cancelled is not logged again with its traceback; an error is not a stop: a reward function
    that raises fails the run, and the run's own log keeps Prefect's ERROR with the traceback."""
    deployment_id = served.deployment()["id"]
    created = served.server.post(f"deployments/{deployment_id}/create_flow_run", {"parameters": {
        "run_name": "ui-crash", "max_steps": 2, "reward_funcs": ["exact_match_crashing"],
        "evaluation_settings": {"enabled": False}}}).json()
    run = served.wait(created["id"], timeout=600)
    assert run["state"]["type"] == "FAILED", (run["state"], served.log.read_text()[-4000:])
    own = [e for e in _logs_when_done(served, created["id"]) if e["flow_run_id"] == created["id"]]
    assert any(m.startswith("Engine execution exited with unexpected exception") and "Traceback" in m
               and "this reward function crashes on purpose" in m for m in _errors(own)), [e["message"] for e in own]


def test_an_environment_preset_from_the_form_trains_on_episodes_and_its_summary_shows_the_environment(served, page):
    """Preset → tiny-calculator, shortened in the form (training steps, batch size, the warm start's steps, evaluation
    prompts): the Environments and tools section offers the registered environments and tools as dropdowns, the run
    trains on episodes, and the pipeline run's summary shows the environment's figures before and after, tool on and
    off."""
    from playwright.sync_api import expect

    from grpo.config import flatten, load_config

    deployment_id = _run_page(page, served)
    known = _known(served, deployment_id)
    preset = form_property(page, "Preset")
    open_select(page, preset)
    page.get_by_role("option", name="tiny-calculator", exact=True).click()
    expect(preset.locator(".p-select-button__value")).to_have_text("tiny-calculator")
    form_property(page, "Training steps").locator("input").fill("4")
    form_property(page, "Batch size (completions per device per step)").locator("input").fill("64")
    form_property(page, "MLflow run name").locator("textarea").fill("ui-calculator")
    open_section(page, "Model")
    form_property(page, "Steps").locator("input").fill("100")  # the warm start's
    open_section(page, "Environments and tools")
    environment = form_property(page, "Name (Environments and tools)")
    assert open_select(page, environment) == [  # the built-ins: registered (`agent` runs environment.agent's agent)
        "agent", "calculator", "guess_digit", "openenv", "tool_use"]
    page.keyboard.press("Escape")
    assert "tiny-calculator: calculator" in environment.inner_text()  # the presets' values in its help
    assert open_select(page, form_property(page, "Tools")) == ["calculator"]
    page.keyboard.press("Escape")
    open_section(page, "Evaluation")
    form_property(page, "Num Prompts").locator("input").fill("40")
    form_property(page, "Environments and tools").scroll_into_view_if_needed()
    page.screenshot(path=str(SCREENSHOTS / "prefect-run-form-environment.png"))
    created = submit(page, served.server, deployment_id, known)
    park(page)
    run = served.wait(created["id"])
    assert run["state"]["type"] == "COMPLETED", (run["state"], served.log.read_text()[-4000:])

    run_dir = served.home / "runs" / "ui-calculator"
    calculator = flatten(load_config("tiny-calculator"))
    assert {k: v for k, v in _flat_config(run_dir / "config.yaml").items() if calculator[k] != v} == {
        "grpo.max_steps": 4, "grpo.per_device_train_batch_size": 64, "model.warm_start.steps": 100,
        "evaluation.num_prompts": 40}
    logged = [json.loads(line)["metrics"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert any(row.get("env/turns/mean", 0) >= 1 and "env/tools/calculator/calls" in row for row in logged), logged
    summary = json.loads((run_dir / "summary.json").read_text())
    for figure in ("tool_call_rate", "turns_mean", "tool_off_accuracy"):
        assert summary[f"eval_env_{figure}_before"] is not None and summary[f"eval_env_{figure}_after"] is not None
    [artifact] = served.server.post("artifacts/filter", {"artifacts": {
        "key": {"any_": ["grpo-run-summary"]}, "flow_run_id": {"any_": [created["id"]]}}}).json()
    assert "| environment: tool_off_accuracy |" in artifact["data"], artifact["data"]
    ui = served.server.url.removesuffix("/api")
    page.goto(f"{ui}/runs/flow-run/{created['id']}", wait_until="networkidle")
    page.get_by_text("Artifacts", exact=True).first.click()
    expect(page.get_by_text("grpo-run-summary").first).to_be_visible(timeout=120_000)
    page.screenshot(path=str(SCREENSHOTS / "prefect-flow-run-environment.png"))


def test_the_readme_api_parameters_run(served):
    """docs/guides/prefect-ui.md, "Start a run through the API": its example, as the docs show it."""
    deployment_id = served.deployment()["id"]
    params = {"preset": "tiny", "learning_rate": 2e-4, "max_steps": 30, "grpo_settings": {"beta": 0.04}}
    created = served.server.post(f"deployments/{deployment_id}/create_flow_run", {"parameters": params}).json()
    run = served.wait(created["id"])
    assert run["state"]["type"] == "COMPLETED", (run["state"], served.log.read_text()[-4000:])
    assert _changed(served.run_dir(run) / "config.yaml") == {"grpo.learning_rate": 2e-4, "grpo.max_steps": 30,
                                                             "grpo.beta": 0.04}
