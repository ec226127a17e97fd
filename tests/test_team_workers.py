"""Workers on several machines against ``grpo team up`` (#45 section 2), and a worker lost mid-trial (section 3).

Each "machine" is a ``prefect worker start --pool cpu-pool`` process with a working directory, a ``HOME``, a
``PREFECT_HOME`` and a ``GRPO_CACHE_DIR`` of its own; it shares nothing with the others but the servers' URLs and
credentials (team.env). The sweep (``grpo sweep --deployment grpo-pipeline/default``) runs from a third folder,
the person's laptop: its trials are flow runs of the deployment, taken by the workers.

States are forced, not waited for: each worker's reward module (``GRPO_REWARD_MODULES``, its own file) holds the
trial at its first reward call until the test opens that machine's gate, so a worker serving one run at a time
(``--limit 1``) can not take the second trial, and the other worker must.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.conftest import MICRO, micro_overrides
from tests.servers import BIN
from tests.test_team import team  # noqa: F401  (the module's own `grpo team up`, shared by its tests)

pytestmark = pytest.mark.integration

# The worker's own reward: it records the run it scored under the machine's HOME (the proof of which worker ran
# which trial) and holds the first call until the machine's gate file exists. The laptop has the same file, so the
# sweep's config validates the reward's name there.
GATED_REWARD = """
import os, time
from pathlib import Path
from grpo.rewards import register_reward

CALLS = []


@register_reward("machine_mark")
def machine_mark(completions, **kwargs):
    CALLS.append(1)
    marks = Path(os.environ["HOME"]) / "marks"
    marks.mkdir(exist_ok=True)
    (marks / str(os.getpid())).write_text(os.environ.get("PREFECT__FLOW_RUN_ID", ""))
    gates = {1: "gate"}  # and a second hold at call N (GRPO_TEST_HOLD_AT), opened by the file gate-N
    if os.environ.get("GRPO_TEST_HOLD_AT"):
        gates[int(os.environ["GRPO_TEST_HOLD_AT"])] = "gate-" + os.environ["GRPO_TEST_HOLD_AT"]
    gate = Path(os.environ["GRPO_TEST_GATE"]).with_name(gates[len(CALLS)]) if len(CALLS) in gates else None
    deadline = time.monotonic() + 900  # a bound on a test that never opens the gate
    while gate and not gate.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    return [0.0 for _ in completions]
"""

# A trial: a few steps of the micro experiment, a small evaluation after it (the sweep's metric), its model logged.
TRIAL_SETS = ["tracking.backend=mlflow", "tracking.log_system_metrics=false", "grpo.max_steps=2",
              "grpo.logging_steps=1", "grpo.save_steps=100", "model.warm_start.steps=10",
              "evaluation.before_training=false", "evaluation.num_prompts=8", "evaluation.pass_k=0",
              "grpo.reward_funcs=[exact_match,machine_mark]"]
HANG_BOUND = 900  # seconds: a bound on a hung server or worker, not a speed requirement
# A dead worker's flow run ends Crashed 90 s after its last heartbeat (30 s apart): the team's automation.
CRASH_BOUND = 300


def isolated_env(team_env: dict[str, str], home: Path, cache: Path, reward: Path) -> dict[str, str]:
    """A machine's environment: none of this process's Prefect, MLflow or platform settings, only team.env's, its
    own HOME, PREFECT_HOME and cache, and its reward module."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_", "GRPO_"))}
    return {**clean, **team_env, "HOME": str(home), "PREFECT_HOME": str(home / ".prefect"),
            "GRPO_CACHE_DIR": str(cache), "GRPO_REWARD_MODULES": str(reward), "HF_HUB_OFFLINE": "1"}


class Machine:
    """A worker's machine: its own folders, its reward module, its ``prefect worker`` process."""

    def __init__(self, root: Path, name: str, team_env: dict[str, str]) -> None:
        self.name, self.root = name, root / name
        self.home, self.work, self.cache = self.root / "home", self.root / "work", self.root / "cache"
        for folder in (self.home, self.work, self.cache):
            folder.mkdir(parents=True, exist_ok=True)
        (self.root / "reward.py").write_text(GATED_REWARD)
        self.gate = self.root / "gate"
        self.env = {**isolated_env(team_env, self.home, self.cache, self.root / "reward.py"),
                    "GRPO_TEST_GATE": str(self.gate)}
        self.proc: subprocess.Popen | None = None

    def start(self, gate_open: bool = False, limit: int | None = 1, pool: str = "cpu-pool") -> Machine:
        if gate_open:
            self.gate.touch()
        else:
            self.gate.unlink(missing_ok=True)
        limited = ["--limit", str(limit)] if limit is not None else []
        with (self.root / "worker.log").open("a") as log:
            self.proc = subprocess.Popen([str(BIN / "prefect"), "worker", "start", "--pool", pool, *limited,
                                          "--name", self.name], cwd=self.work, env=self.env,
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        return self

    def kill(self) -> None:
        """The machine is gone: SIGKILL to the worker and its flow runs (each in a session of its own)."""
        if self.proc is not None and self.proc.poll() is None:
            worker = psutil.Process(self.proc.pid)
            for proc in [worker, *worker.children(recursive=True)]:
                with contextlib.suppress(psutil.NoSuchProcess):
                    proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        """The end of the test: SIGTERM to the worker; SIGKILL to it and any flow run of it left after 30 s."""
        if self.proc is not None and self.proc.poll() is None:
            runs = psutil.Process(self.proc.pid).children(recursive=True)
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()
            for proc in runs:
                with contextlib.suppress(psutil.NoSuchProcess):
                    proc.kill()

    def flow_runs(self) -> set[str]:
        """The flow runs whose reward ran on this machine."""
        marks = self.home / "marks"
        return {p.read_text() for p in marks.iterdir()} if marks.is_dir() else set()

    def log(self) -> str:
        return (self.root / "worker.log").read_text(errors="replace")[-3000:]


@pytest.fixture
def machines(team, tmp_path):  # noqa: F811
    started = [Machine(tmp_path, name, team.env) for name in ("machine-a", "machine-b")]
    try:
        yield started
    finally:
        for machine in started:
            machine.stop()


def flow_runs_named(setup, prefix: str) -> dict[str, dict]:
    runs = setup.prefect("POST", "flow_runs/filter", json={"flow_runs": {"name": {"like_": prefix}}, "limit": 50})
    return {r["name"]: r for r in runs.json() if r["name"].startswith(prefix)}


def wait_until(check, what: str, logs, bound: float = HANG_BOUND) -> None:
    deadline = time.monotonic() + bound
    while not check():
        assert time.monotonic() < deadline, f"{what} not reached: {logs()}"
        time.sleep(1)


@contextlib.contextmanager
def running_sweep(setup, laptop: Path, name: str, grid: list[float],
                  max_concurrency: int = 2) -> Iterator[subprocess.Popen]:
    """``grpo sweep --deployment grpo-pipeline/default`` from the laptop (team.env and its own reward module),
    SIGKILLed with its process group if it is still running when the block ends."""
    laptop.mkdir(parents=True, exist_ok=True)
    (laptop / "reward.py").write_text(GATED_REWARD)
    (laptop / "space.yaml").write_text(f"sampler: grid\nparams:\n  grpo.learning_rate: {grid}\n")
    sets = [*micro_overrides(laptop / "runs"), *TRIAL_SETS, f"tracking.experiment_name={name}"]
    env = isolated_env(setup.env, laptop, laptop / "cache", laptop / "reward.py")
    out = (laptop / "sweep.log").open("w")
    command = [str(BIN / "grpo"), "sweep", "--config", str(MICRO), "--space", str(laptop / "space.yaml"), "--name",
               name, "--deployment", "grpo-pipeline/default", "--max-concurrency", str(max_concurrency)]
    sweep = subprocess.Popen([*command, *(a for s in sets for a in ("--set", s))], cwd=laptop, env=env, stdout=out,
                             stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield sweep
    finally:
        if sweep.poll() is None:
            os.killpg(sweep.pid, signal.SIGKILL)


def test_a_sweep_runs_its_trials_on_two_workers_at_once(team, machines, tmp_path, monkeypatch):  # noqa: F811
    laptop = tmp_path / "laptop"
    with running_sweep(team, laptop, "two", [1.0e-4, 3.0e-4]) as sweep:
        for machine in machines:
            machine.start()

        def logs() -> str:
            return "\n".join([(laptop / "sweep.log").read_text()[-3000:], *(m.log() for m in machines)])

        # each worker holds its trial at the gate: both trials run at once, one on each machine
        wait_until(lambda: all(m.flow_runs() for m in machines), "a trial on each machine", logs)
        for machine in machines:
            machine.gate.touch()
        assert sweep.wait(timeout=HANG_BOUND) == 0, logs()
    out = (laptop / "sweep.log").read_text()

    trials = flow_runs_named(team, "two-t")
    assert sorted(trials) == ["two-t000", "two-t001"], out
    assert {r["state_type"] for r in trials.values()} == {"COMPLETED"}, out
    assert all(r["deployment_id"] for r in trials.values())  # deployment runs, not the sweep's subflows
    ran = [m.flow_runs() for m in machines]
    assert ran[0] and ran[1] and not ran[0] & ran[1] and ran[0] | ran[1] == {r["id"] for r in trials.values()}, ran

    for name, value in team.env.items():
        monkeypatch.setenv(name, value)
    from mlflow import MlflowClient

    client = MlflowClient()
    result = json.loads((laptop / "runs" / "two" / "sweep.json").read_text())
    assert [t["status"] for t in result["trials"]] == ["completed", "completed"], result["trials"]
    parent = client.get_run(result["mlflow_run_id"])
    children = client.search_runs([parent.info.experiment_id],
                                  filter_string=f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    assert sorted(c.info.run_name for c in children) == ["two-t000", "two-t001"]
    for child in children:  # each trial's metrics, artifacts and model reached MLflow through the server
        assert child.info.status == "FINISHED" and "eval/accuracy" in child.data.metrics, child.data.metrics
        assert client.get_metric_history(child.info.run_id, "train/reward"), child.info.run_name
        assert "summary.json" in {a.path for a in client.list_artifacts(child.info.run_id)}
        models = client.search_logged_models(experiment_ids=[parent.info.experiment_id],
                                             filter_string=f"source_run_id = '{child.info.run_id}'")
        assert models, child.info.run_name
    registered = result["registered_model"]
    version = client.get_model_version_by_alias(registered["name"], "best")
    assert version.run_id == {c.info.run_name: c.info.run_id for c in children}[result["best"]["run_name"]]

    # the comparison dashboard: built by `grpo sweep` from MLflow, on disk and on the parent run, every trial in it
    assert result["dashboard"]["kind"] == "comparison", result["dashboard"]
    page = Path(result["dashboard"]["path"]).read_text()
    assert "two-t000" in page and "two-t001" in page
    assert result["dashboard"]["artifact"] in {a.path for a in client.list_artifacts(parent.info.run_id, "dashboard")}
    assert "Traceback" not in out, out[-3000:]


def test_a_worker_killed_mid_trial_crashes_its_run_and_the_sweep_goes_on(team, machines, tmp_path):  # noqa: F811
    """The machine of a running trial dies (SIGKILL to its worker and the flow run): the flow run ends Crashed
    (the team's automation, its heartbeats stopped), the trial FAIL in the study, the sweep runs its next trial on
    the restarted worker and completes."""
    import optuna

    machine = machines[0]
    laptop = tmp_path / "laptop"
    with running_sweep(team, laptop, "lost", [1.0e-4, 3.0e-4], max_concurrency=1) as sweep:
        machine.start()

        def logs() -> str:
            return "\n".join([(laptop / "sweep.log").read_text()[-3000:], machine.log()])

        wait_until(machine.flow_runs, "the first trial training on the machine", logs)
        [first] = machine.flow_runs()
        assert team.prefect("GET", f"flow_runs/{first}").json()["state_type"] == "RUNNING"
        killed = time.monotonic()
        machine.kill()
        wait_until(lambda: team.prefect("GET", f"flow_runs/{first}").json()["state_type"] == "CRASHED",
                   "the killed trial's flow run Crashed", logs, CRASH_BOUND)
        crashed_after = time.monotonic() - killed
        wait_until(lambda: "lost-t001" in flow_runs_named(team, "lost-t"), "the next trial submitted", logs)
        machine.start(gate_open=True)  # the machine is back: its worker takes the next trial
        assert sweep.wait(timeout=HANG_BOUND) == 0, logs()
    out = (laptop / "sweep.log").read_text()

    trials = flow_runs_named(team, "lost-t")
    assert {n: r["state_type"] for n, r in trials.items()} == {"lost-t000": "CRASHED", "lost-t001": "COMPLETED"}, out
    assert trials["lost-t000"]["id"] == first and trials["lost-t001"]["id"] in machine.flow_runs()
    assert crashed_after > 30, crashed_after  # the automation's doing (90 s after the last heartbeat), not the sweep's
    result = json.loads((laptop / "runs" / "lost" / "sweep.json").read_text())
    assert [t["status"] for t in result["trials"]] == ["failed", "completed"], result["trials"]
    assert "Crashed" in result["trials"][0]["error"], result["trials"][0]
    study = optuna.load_study(study_name=result["study"]["name"], storage=result["study"]["storage"])
    assert [t.state.name for t in study.trials] == ["FAIL", "COMPLETE"]
    assert "  lost-t000" in out and "failed" in out


def test_eight_pipeline_runs_submitted_at_once_all_complete(team, machines, tmp_path):  # noqa: F811
    """8 flow runs of grpo-pipeline/default created through the API at the same moment (8 threads past one barrier),
    run by one worker 8 at once against PostgreSQL-backed servers: every create answered 201, every run COMPLETED,
    and no 503 nor "database is locked" in the servers' or the worker's output."""
    from concurrent.futures import ThreadPoolExecutor
    from threading import Barrier

    from grpo.config import load_config

    cfg = load_config(MICRO, [f"output_dir={tmp_path / 'runs'}", "tracking.backend=mlflow",
                              "tracking.experiment_name=burst", "tracking.log_model=false",
                              "tracking.log_system_metrics=false", "evaluation.enabled=false", "grpo.max_steps=2",
                              "grpo.logging_steps=1", "grpo.save_steps=100", "model.warm_start.steps=10"])
    deployment = team.prefect("GET", "deployments/name/grpo-pipeline/default").json()
    barrier = Barrier(8)

    def submit(i: int):
        body = {"parameters": {"config": cfg.model_dump(mode="json", by_alias=True), "preset": None,
                               "run_name": f"burst-{i}"}, "name": f"burst-{i}"}
        barrier.wait(timeout=60)
        return team.prefect("POST", f"deployments/{deployment['id']}/create_flow_run", json=body)

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(submit, range(8)))
    assert [a.status_code for a in answers] == [201] * 8, [a.text[:200] for a in answers]
    ids = {a.json()["id"] for a in answers}
    machine = machines[0].start(gate_open=True, limit=8)

    def states() -> dict[str, str]:
        found = team.prefect("POST", "flow_runs/filter", json={"flow_runs": {"id": {"any_": sorted(ids)}}}).json()
        return {r["name"]: r["state_type"] for r in found}

    wait_until(lambda: set(states().values()) <= {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"},
               "8 runs ended", lambda: f"{states()} {machine.log()}")
    assert states() == {f"burst-{i}": "COMPLETED" for i in range(8)}, machine.log()
    for log in (team.home / "logs" / "prefect-server.log", team.home / "logs" / "mlflow-server.log",
                machine.root / "worker.log"):
        text = log.read_text(errors="replace")
        assert "database is locked" not in text and " 503 " not in text and "503 Service" not in text, log
    summaries = [json.loads((tmp_path / "runs" / f"burst-{i}" / "summary.json").read_text()) for i in range(8)]
    assert {s["prefect_flow_run_id"] for s in summaries} == ids and {s["steps"] for s in summaries} == {2}


# A worker's own environment (GRPO_ENV_MODULES): it records, under the machine's HOME, what the flow run's process sees.
ECHO_ENV = """
import json, os
from pathlib import Path
from grpo.environments import StepResult, register_environment

@register_environment("team_echo")
class Echo:
    stop_strings = ("]",)

    def reset(self, **row):
        seen = {"cuda": os.environ.get("CUDA_VISIBLE_DEVICES"), "cwd": os.getcwd(), "pid": os.getpid()}
        (Path(os.environ["HOME"]) / "env-seen.json").write_text(json.dumps(seen))
        return None

    def step(self, action):
        return StepResult("ok|", True, 1.0)
"""


def test_the_gpu_pool_runs_a_pipeline_with_the_workers_own_environment(team, tmp_path):  # noqa: F811
    """A gpu-pool worker (its template, CUDA hidden as on a machine without one) in a folder of its own, the
    checkout named by its $GRPO_HOME (the gpu deployment's pull step): a flow run of grpo-pipeline/gpu created
    through the API trains with an environment only the worker's GRPO_ENV_MODULES file registers."""
    from grpo.config import load_config
    from tests.servers import REPO

    machine = Machine(tmp_path, "gpu-box", team.env)
    (machine.root / "envs.py").write_text(ECHO_ENV)
    machine.env.update(GRPO_ENV_MODULES=str(machine.root / "envs.py"), GRPO_HOME=str(REPO), CUDA_VISIBLE_DEVICES="")
    cfg = load_config(MICRO, [f"output_dir={tmp_path / 'runs'}", "tracking.backend=mlflow",
                              "tracking.experiment_name=gpu-pool", "tracking.log_model=false",
                              "tracking.log_system_metrics=false", "evaluation.enabled=false", "grpo.max_steps=2",
                              "grpo.logging_steps=1", "grpo.save_steps=100", "model.warm_start.steps=10"])
    config = cfg.model_dump(mode="json", by_alias=True)
    config["environment"]["name"] = "team_echo"  # known to the worker's process only
    deployment = team.prefect("GET", "deployments/name/grpo-pipeline/gpu").json()
    created = team.prefect("POST", f"deployments/{deployment['id']}/create_flow_run",
                           json={"parameters": {"config": config, "preset": None, "run_name": "on-gpu-pool"}})
    assert created.status_code == 201, created.text
    flow_run_id = created.json()["id"]
    try:
        machine.start(gate_open=True, limit=None, pool="gpu-pool")  # its run does not use the gated reward
        assert final_state(team, flow_run_id, machine.log) == "COMPLETED", machine.log()
    finally:
        machine.stop()
    seen = json.loads((machine.home / "env-seen.json").read_text())
    assert seen["cuda"] == "" and seen["cwd"] == str(REPO), seen
    summary = json.loads((tmp_path / "runs" / "on-gpu-pool" / "summary.json").read_text())
    assert summary["prefect_flow_run_id"] == flow_run_id and summary["steps"] == 2


def submit_pipeline(setup, output_dir: Path, run_name: str, *sets: str) -> str:
    """A flow run of grpo-pipeline/default with a micro config created through the API (as the UI's Run does),
    scored by the worker's gated reward."""
    from grpo.config import load_config

    cfg = load_config(MICRO, [f"output_dir={output_dir}", "tracking.backend=mlflow", "tracking.log_model=false",
                              "tracking.log_system_metrics=false", "evaluation.enabled=false", "grpo.logging_steps=1",
                              "grpo.save_steps=100", "model.warm_start.steps=10", *sets])
    config = cfg.model_dump(mode="json", by_alias=True)
    config["grpo"]["reward_funcs"] = ["exact_match", "machine_mark"]  # the worker's own reward: its gate, its mark
    deployment = setup.prefect("GET", "deployments/name/grpo-pipeline/default").json()
    created = setup.prefect("POST", f"deployments/{deployment['id']}/create_flow_run", json={"parameters": {
        "config": config, "preset": None, "run_name": run_name}})
    assert created.status_code == 201, created.text
    return created.json()["id"]


def final_state(setup, flow_run_id: str, logs) -> str:
    ended = ("COMPLETED", "FAILED", "CRASHED", "CANCELLED")

    def state() -> str | None:
        answer = setup.prefect("GET", f"flow_runs/{flow_run_id}")
        return answer.json()["state_type"] if answer.status_code == 200 else None

    wait_until(lambda: state() in ended, "the flow run's end", logs)
    return state()


def test_a_run_goes_on_through_a_prefect_server_restart(team, machines, tmp_path):  # noqa: F811
    """The Prefect server restarted while a flow run trains (held at its first reward until the new server answers):
    the run finishes, and the new server has its final state, COMPLETED."""
    from grpo.app.team import Team as Layout
    from grpo.app.team import read_state, restart_server

    machine = machines[0].start()
    flow_run_id = submit_pipeline(team, tmp_path / "runs", "through-restart", "grpo.max_steps=2")
    wait_until(machine.flow_runs, "the run training", machine.log)
    layout = Layout(team.home)
    before = read_state(layout)["servers"]["prefect"]["pid"]
    restart_server(layout, "prefect")
    assert read_state(layout)["servers"]["prefect"]["pid"] != before
    machine.gate.touch()
    assert final_state(team, flow_run_id, machine.log) == "COMPLETED", machine.log()
    summary = json.loads((tmp_path / "runs" / "through-restart" / "summary.json").read_text())
    assert summary["prefect_flow_run_id"] == flow_run_id and summary["steps"] == 2


def test_points_logged_while_postgresql_is_down_all_reach_mlflow(team, machines, tmp_path, monkeypatch):  # noqa: F811
    """PostgreSQL (under both servers) stopped while a run trains: steps 1-3 log their points while it is down (the
    reward holds step 1 until it is stopped, step 4 until it is back); they wait in the run's spool and all reach
    MLflow afterwards (the run's metric history equals the spool's metrics.jsonl); the flow run ends COMPLETED."""
    from grpo.app.team import Team as Layout
    from grpo.app.team import pg_account, pg_bin, read_state, start_postgres, stop_postgres

    steps = 4
    machine = machines[0]
    machine.env["GRPO_TEST_HOLD_AT"] = str(steps)
    machine.start()
    flow_run_id = submit_pipeline(team, tmp_path / "runs", "through-pg", f"grpo.max_steps={steps}")
    wait_until(machine.flow_runs, "the run training", machine.log)
    layout = Layout(team.home)
    spool = tmp_path / "runs" / "through-pg" / "tracking_spool" / "metrics.jsonl"

    def logged_steps() -> set[int]:
        lines = spool.read_text().splitlines() if spool.is_file() else []
        return {json.loads(line)["s"] for line in lines if line.strip()}

    stop_postgres(layout, pg_bin(), pg_account())
    try:
        machine.gate.touch()
        wait_until(lambda: steps - 1 in logged_steps(), "steps 1-3 logged while the databases are down", machine.log)
        outage = [line for line in spool.read_text().splitlines() if line.strip()]
    finally:
        start_postgres(layout, pg_bin(), pg_account(), read_state(layout)["ports"]["postgres"])
    (machine.root / f"gate-{steps}").touch()
    assert final_state(team, flow_run_id, machine.log) == "COMPLETED", machine.log()

    for name, value in team.env.items():
        monkeypatch.setenv(name, value)
    from mlflow import MlflowClient

    from grpo.tracking.metric_keys import train_key

    run_dir = tmp_path / "runs" / "through-pg"
    summary = json.loads((run_dir / "summary.json").read_text())
    client = MlflowClient()
    assert client.get_run(summary["mlflow_run_id"]).info.status == "FINISHED"
    waiting = [json.loads(line) for line in outage]  # the points the spool held while the databases were down
    assert {row["s"] for row in waiting} >= set(range(1, steps)), waiting
    recorded: dict[str, set] = {}  # the run's own record of every logged step (grpo.training's metrics.jsonl)
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        for name, value in row["metrics"].items():
            if isinstance(value, (int, float)) and value == value:
                recorded.setdefault(train_key(name), set()).add((row["step"], float(value)))
    assert len(recorded) > 10 and {s for points in recorded.values() for s, _ in points} == set(range(1, steps + 1))
    history = {key: {(m.step, m.value) for m in client.get_metric_history(summary["mlflow_run_id"], key)}
               for key in recorded}
    assert history == recorded
    for row in waiting:
        for key, value in row["m"].items():
            assert (row["s"], float(value)) in history.get(key, set()), (key, row["s"])
