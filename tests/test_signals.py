"""Issue #12, items 5, 6 and 15: Ctrl-C and SIGTERM stop a run cleanly and leave no server behind; runs started from
the Prefect UI stay inside the allowed roots. Real processes, real signals, real Prefect and MLflow servers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from grpo.config import load_config
from tests.conftest import MICRO
from tests.servers import BIN, PrefectServer, interrupt

pytestmark = pytest.mark.integration  # trains a model, starts servers or processes: not in `make test-fast`

# ---------------------------------------------------------------- #12.15 path confinement of served runs


def test_paths_outside_the_allowed_roots_are_refused(tmp_path):
    from grpo.pipeline.confine import PathNotAllowed, check_config_paths

    allowed = tmp_path / "allowed"
    (allowed / "data").mkdir(parents=True)
    (allowed / "data" / "d.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    (tmp_path / "outside.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    (allowed / "escape.jsonl").symlink_to(tmp_path / "outside.jsonl")
    roots = [allowed.resolve()]
    ok = load_config(MICRO, [f"output_dir={allowed}/runs", f"data.source={allowed}/data/d.jsonl"])
    check_config_paths(ok, roots)
    check_config_paths(load_config(MICRO, ["output_dir=/"]), None)  # not a served run: no confinement
    for override, field in [("output_dir=/", "output_dir '/'"), (f"output_dir={allowed}/../x", "output_dir"),
                            (f"data.source={tmp_path}/outside.jsonl", "data.source"),
                            (f"data.source={allowed}/escape.jsonl", "data.source")]:
        with pytest.raises(PathNotAllowed) as err:
            check_config_paths(load_config(MICRO, [f"output_dir={allowed}/runs", override]), roots)
        assert str(err.value).startswith(field) and f"allowed roots ({allowed.resolve()})" in str(err.value)
    # The form sends any string: /etc/passwd as a data source fails the flow's parameter validation, naming it.
    from pydantic import ValidationError

    from grpo.config import ExperimentConfig

    sent = ok.model_dump(mode="json", by_alias=True)
    sent["data"]["source"] = "/etc/passwd"
    with pytest.raises(ValidationError) as err:
        ExperimentConfig.model_validate(sent)
    assert "'/etc/passwd' is not a valid source" in str(err.value)


def _wait_final(s: PrefectServer, flow_run_id: str, timeout: float, log: Path) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        run = s.get(f"flow_runs/{flow_run_id}")
        if run["state"]["type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
            return run["state"]
        assert time.monotonic() < deadline, (run["state"], log.read_text()[-3000:])
        time.sleep(1)


def test_served_runs_are_confined_to_the_allowed_roots(prefect_server, tmp_path):
    """#12.15: a run started from the Prefect UI with output_dir=/ fails with a message naming the field and the
    roots; a run inside an --allow-path root runs. Before the fix the output_dir=/ run tried to create /micro-....
    Every field and path kind (data files outside, symlinks, '..') is checked at unit level above; this checks that
    the served flow applies the check."""
    s = prefect_server
    project, allowed = tmp_path / "project", tmp_path / "allowed"
    project.mkdir()
    allowed.mkdir()
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        proc = subprocess.Popen([str(BIN / "grpo"), "serve", "--name", "confined", "--allow-path", str(allowed),
                                 "--limit", "2"],
                                env=s.env(), cwd=project, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 600  # a hung server's bound: the shared one has stalled for minutes
        while True:
            served = s.post("deployments/filter", {"deployments": {"name": {"any_": ["confined"]}}}).json()
            if any(d["name"] == "confined" for d in served):
                break
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        deployment = s.get("deployments/name/grpo-pipeline/confined")
        base = ["tracking.backend=none", "grpo.max_steps=2", "grpo.logging_steps=1", "grpo.save_steps=100",
                "model.warm_start.steps=5", "evaluation.enabled=false"]

        def start(*overrides: str) -> str:
            cfg = load_config(MICRO, [*base, *overrides]).model_dump(mode="json", by_alias=True)
            created = s.post(f"deployments/{deployment['id']}/create_flow_run",
                             {"parameters": {"config": cfg, "preset": None}})
            assert created.status_code == 201, created.text  # (a busy server's 503s are retried by s.post)
            return created.json()["id"]

        root_run = start("output_dir=/")
        ok_run = start(f"output_dir={allowed}/runs")
        roots = f"allowed roots ({project.resolve()}, {allowed.resolve()})"
        state = _wait_final(s, root_run, 300, log)
        assert state["type"] == "FAILED" and "output_dir '/' is outside the " + roots in state["message"], state
        state = _wait_final(s, ok_run, 400, log)
        assert state["type"] == "COMPLETED", (state, log.read_text()[-3000:])
        assert [p.name for p in (allowed / "runs").iterdir()]  # the allowed run wrote its run directory there
        assert not list(Path("/").glob("micro-*"))
    finally:
        interrupt(proc, timeout=60)


# ---------------------------------------------------------------- #12.5 Ctrl-C, #12.6 SIGTERM


def _start_run(tmp_path: Path, mlflow_uri: str, name: str, prefect_api: str | None = None
               ) -> tuple[subprocess.Popen, Path]:
    """`grpo run` (micro sized, many steps) as the leader of its own process group, on the embedded Prefect server
    (own PREFECT_HOME, so its database can be read afterwards) or the one at ``prefect_api``, tracked on the
    session's MLflow server."""
    import sys

    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update(PREFECT_HOME=str(tmp_path / "prefect-home"), PYTHONUNBUFFERED="1",
               PREFECT_SERVER_ANALYTICS_ENABLED="false", **({"PREFECT_API_URL": prefect_api} if prefect_api else {}))
    # save_steps beyond the run: the only checkpoint is the one the interrupt saves
    sets = [f"output_dir={tmp_path}", "grpo.max_steps=400", "grpo.logging_steps=1", "grpo.save_steps=1000",
            "tracking.backend=mlflow", f"tracking.tracking_uri={mlflow_uri}", "tracking.experiment_name=signals",
            "tracking.log_system_metrics=false", "evaluation.before_training=false", "model.warm_start.steps=10"]
    args = [sys.executable, "-m", "grpo.app.cli", "run", "--config", str(MICRO), "--run-name", name]
    for s in sets:
        args += ["--set", s]
    log = (tmp_path / f"{name}.out").open("w")
    proc = subprocess.Popen(args, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    return proc, tmp_path / f"{name}.out"


def _wait_first_step(proc: subprocess.Popen, run_dir: Path, out: Path, timeout: float = 400) -> None:
    """Wait until ``run_dir`` has a logged step; kill the run and fail if it ends or the time runs out first."""
    deadline = time.monotonic() + timeout
    while not ((run_dir / "metrics.jsonl").is_file() and (run_dir / "metrics.jsonl").read_text().strip()):
        if proc.poll() is not None or time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(f"no training step (exit {proc.poll()}):\n{out.read_text()[-3000:]}")
        time.sleep(0.5)


def _wait_exit(proc: subprocess.Popen, out: Path, timeout: float, after: str) -> None:
    """Wait for the run to exit; kill its group and fail if it is still running ``timeout`` s ``after`` a signal."""
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"still running {timeout} s after {after}:\n{out.read_text()[-3000:]}")


def _wait_training(proc: subprocess.Popen, run_dir: Path, out: Path, timeout: float = 400) -> list:
    """Wait for a logged step, then return every process of the run: its tree (the embedded server included)."""
    import psutil

    _wait_first_step(proc, run_dir, out, timeout)
    main = psutil.Process(proc.pid)
    tree = [main, *main.children(recursive=True)]
    assert any("uvicorn" in " ".join(p.cmdline()) for p in tree[1:]), [p.cmdline() for p in tree]
    return tree


def _alive(procs: list, grace: float = 15) -> list:
    import psutil

    deadline = time.monotonic() + grace
    while True:
        alive = []
        for p in procs:
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p)
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


def _pipeline_state(prefect_home: Path) -> str:
    import sqlite3

    with sqlite3.connect(prefect_home / "prefect.db") as db:
        rows = db.execute("SELECT flow_run.state_type FROM flow_run JOIN flow ON flow.id = flow_run.flow_id "
                          "WHERE flow.name = 'grpo-pipeline'").fetchall()
    assert len(rows) == 1, rows
    return rows[0][0]


def _mlflow_status(uri: str, run_dir: Path) -> str:
    import json

    from mlflow import MlflowClient

    run_id = json.loads((run_dir / "tracking_spool" / "state.json").read_text())["run_id"]
    return MlflowClient(uri).get_run(run_id).info.status


def _assert_checkpointed_where_it_stopped(run_dir: Path, out: Path,
                                         said: str = "saving a checkpoint at the end of this step, then stopping"
                                         ) -> None:
    """#12.5: the interrupt finished the step it arrived in, logged it and saved a checkpoint there."""
    from grpo.runs import RunDir

    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    latest = RunDir(run_dir).latest_checkpoint()
    assert latest is not None and latest.name == f"checkpoint-{max(steps)}", (latest, steps, out.read_text()[-2000:])
    assert said in out.read_text()


def test_ctrl_c_stops_the_run_and_marks_it_cancelled(tmp_path, mlflow_server):
    """#12.5: Ctrl-C (SIGINT to the terminal's process group) mid-training. Before the fix the embedded Prefect
    server died of the same SIGINT, the CLI retried its dead API and was still alive 120 s later, and the flow run
    and MLflow run stayed RUNNING."""
    proc, out = _start_run(tmp_path, mlflow_server.uri, "ctrl-c")
    tree = _wait_training(proc, tmp_path / "ctrl-c", out)
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        for p in _alive(tree, 0):
            p.kill()
        pytest.fail(f"still running 60 s after Ctrl-C:\n{out.read_text()[-3000:]}")
    assert proc.returncode == 130, out.read_text()[-3000:]
    assert _alive(tree) == []
    assert "flow run(s) cancelled" in out.read_text()
    assert _pipeline_state(tmp_path / "prefect-home") == "CANCELLED"
    assert _mlflow_status(mlflow_server.uri, tmp_path / "ctrl-c") == "KILLED"
    _assert_checkpointed_where_it_stopped(tmp_path / "ctrl-c", out)


def test_sigterm_to_the_cli_leaves_no_server_behind(tmp_path, mlflow_server):
    """#12.6: SIGTERM to the CLI's process alone. Before the fix the CLI died and its embedded Prefect server
    (uvicorn) kept running as an orphan."""
    proc, out = _start_run(tmp_path, mlflow_server.uri, "term")
    tree = _wait_training(proc, tmp_path / "term", out)
    os.kill(proc.pid, signal.SIGTERM)
    _wait_exit(proc, out, 60, "SIGTERM")
    left = [" ".join(p.cmdline()[:4]) for p in _alive(tree)]
    for p in _alive(tree, grace=0):
        p.kill()
    assert left == [], left
    assert proc.returncode == 143, out.read_text()[-3000:]
    assert _pipeline_state(tmp_path / "prefect-home") == "CANCELLED"
    assert _mlflow_status(mlflow_server.uri, tmp_path / "term") == "KILLED"
    _assert_checkpointed_where_it_stopped(tmp_path / "term", out)


def test_cancel_in_the_prefect_ui_stops_a_run_started_from_the_cli(tmp_path, mlflow_server, prefect_server):
    """#31: Cancel on a `grpo run` flow run in the UI only marked it Cancelling while training went on (no runner
    supervises the CLI's own flow run). Now the CLI stops as on SIGTERM: checkpoint at the current step, MLflow run
    KILLED, flow run Cancelled, exit 143. The run has 400 steps; the cancel is sent at its first logged one."""
    s = prefect_server
    proc, out = _start_run(tmp_path, mlflow_server.uri, "ui-cancel", prefect_api=s.url)
    _wait_first_step(proc, tmp_path / "ui-cancel", out)
    runs = s.post("flow_runs/filter", {"flows": {"name": {"any_": ["grpo-pipeline"]}},
                                       "flow_runs": {"state": {"type": {"any_": ["RUNNING"]}}}}).json()
    [run] = [r for r in runs if r["parameters"].get("run_name") == "ui-cancel"]
    s.post(f"flow_runs/{run['id']}/set_state", {"state": {"type": "CANCELLING", "name": "Cancelling"}})  # the UI's
    _wait_exit(proc, out, 180, "the cancel")
    assert proc.returncode == 143, out.read_text()[-3000:]
    assert s.get(f"flow_runs/{run['id']}")["state"]["type"] == "CANCELLED"
    assert _mlflow_status(mlflow_server.uri, tmp_path / "ui-cancel") == "KILLED"
    _assert_checkpointed_where_it_stopped(tmp_path / "ui-cancel", out)


def test_cancel_watch_finds_the_cancelled_run_among_many_with_one_request_per_poll(prefect_server):
    """The watch behind the test above, against the session's server: it finds the one Cancelling flow run among
    finished and running ones, including a run added to its list after it started (the CLI's subflows), reports it
    once, and asks the server once per poll however many runs it watches."""
    import threading

    from grpo.app.procguard import CancelWatch

    s = prefect_server
    flow = s.post("flows/", {"name": "cancel-watch-probe"}).json()["id"]

    def flow_run(state: str) -> str:
        return s.post("flow_runs/", {"flow_id": flow, "state": {"type": state, "name": state.title()}}).json()["id"]

    ids = [flow_run("COMPLETED"), flow_run("RUNNING"), flow_run("RUNNING")]
    seen: list[str] = []
    reported = threading.Event()
    watch = CancelWatch(ids, s.url, interval=0.05, on_cancel=lambda run: (seen.append(run), reported.set()))
    with watch:
        deadline = time.monotonic() + 600  # bounds on a hung server, not speed requirements
        while watch.polls < 3 and time.monotonic() < deadline:  # three polls with nothing cancelled
            time.sleep(0.05)
        assert watch.polls >= 3 and seen == []
        late = flow_run("RUNNING")
        ids.append(late)
        s.post(f"flow_runs/{late}/set_state", {"state": {"type": "CANCELLING", "name": "Cancelling"}})
        s.post(f"flow_runs/{ids[1]}/set_state", {"state": {"type": "COMPLETED", "name": "Completed"}})
        assert reported.wait(600), "the Cancelling run was never reported"
        polls = watch.polls
        watch.thread.join(120)
    assert seen == [late]  # once, and the thread ended
    assert not watch.thread.is_alive() and watch.polls == polls
    assert 0 < watch.requests <= watch.polls  # one request per poll for the four runs, not one per run


SERVER_OWNER = """
import sys, time
from pathlib import Path
from tests.servers import MlflowServer

server = MlflowServer(Path(sys.argv[1])).start()
print(server.proc.pid, flush=True)
time.sleep(600)
"""


def test_a_killed_test_process_takes_its_servers_with_it(tmp_path):
    """#12.6: an MLflow server of a (session) fixture outlived the SIGKILLed pytest that started it."""
    import sys

    import psutil

    owner = subprocess.Popen([sys.executable, "-c", SERVER_OWNER, str(tmp_path / "mlflow")],
                             cwd=Path(__file__).parent.parent,
                             stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        line = owner.stdout.readline()
        assert line.strip().isdigit(), owner.wait(timeout=60)
        leader = psutil.Process(int(line))
        servers = [leader, *leader.children(recursive=True)]
        assert any("mlflow" in " ".join(p.cmdline()) for p in servers), [p.cmdline() for p in servers]
        owner.kill()  # SIGKILL: no atexit, no fixture teardown
        owner.wait(timeout=30)
        left = [p.pid for p in _alive(servers, grace=30)]
        for p in _alive(servers, grace=0):
            p.kill()
        assert left == [], "server processes outlived their killed owner"  # before: mlflow server still running
    finally:
        if owner.poll() is None:
            owner.kill()


def test_ctrl_c_stops_a_sweep_its_running_trial_checkpoints_and_all_runs_end_cancelled(tmp_path, prefect_server,
                                                                                       mlflow_server):
    """#12.5 for `grpo sweep`: Ctrl-C while the first of two trials trains. The trial (a thread) checkpoints at its
    step end and stops, the second never starts, the sweep's own flow run and the trial's end CANCELLED, the parent
    and trial MLflow runs KILLED, exit 130. Before, the sweep's flow run was left RUNNING and its parent run FAILED."""
    import sys

    from mlflow import MlflowClient

    (tmp_path / "space.yaml").write_text("grid:\n  grpo.learning_rate: [1.0e-4, 3.0e-4]\n")
    sets = [f"output_dir={tmp_path / 'runs'}", "grpo.max_steps=400", "grpo.logging_steps=1", "grpo.save_steps=1000",
            "tracking.backend=mlflow", f"tracking.tracking_uri={mlflow_server.uri}",
            "tracking.experiment_name=signals-sweep", "tracking.log_system_metrics=false",
            "evaluation.before_training=false", "model.warm_start.steps=10"]
    out = tmp_path / "sweep.out"
    with out.open("w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "grpo.app.cli", "sweep", "--config", str(MICRO), "--space",
                                 str(tmp_path / "space.yaml"), "--name", "stopped", "--max-concurrency", "1",
                                 *(a for s in sets for a in ("--set", s))],
                                cwd=tmp_path, env=prefect_server.env(), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    trial = tmp_path / "runs" / "stopped" / "stopped-t000"
    _wait_first_step(proc, trial, out)
    os.killpg(proc.pid, signal.SIGINT)
    _wait_exit(proc, out, 90, "Ctrl-C")
    assert proc.returncode == 130, out.read_text()[-3000:]
    _assert_checkpointed_where_it_stopped(trial, out, said="running trials save a checkpoint")
    assert not (tmp_path / "runs" / "stopped" / "stopped-t001").exists()  # the waiting trial never started

    def states(flow: str, **params: str) -> list[str]:
        runs = prefect_server.post("flow_runs/filter", {"flows": {"name": {"any_": [flow]}}}).json()
        return [r["state"]["type"] for r in runs if all(r["parameters"].get(k) == v for k, v in params.items())]

    assert states("grpo-sweep", sweep_name="stopped") == ["CANCELLED"]
    assert states("grpo-pipeline", run_name="stopped-t000") == ["CANCELLED"]
    client = MlflowClient(mlflow_server.uri)
    experiment = client.get_experiment_by_name("signals-sweep").experiment_id
    statuses = {r.data.tags.get("grpo.run_type"): r.info.status for r in client.search_runs([experiment])}
    assert statuses == {"sweep": "KILLED", "trial": "KILLED"}, statuses

    # #28: the stored study marks the interrupted trial FAIL (none left RUNNING), and a rerun continues that study
    import optuna

    storage = f"sqlite:///{tmp_path / 'runs' / 'optuna.db'}"
    # the running trial FAIL; the grid's point that never started stays enqueued (WAITING), nothing is left RUNNING
    assert [t.state.name for t in optuna.load_study(study_name="stopped", storage=storage).trials] == ["FAIL",
                                                                                                  "WAITING"]
    short = [s for s in sets if not s.startswith("grpo.max_steps")] + ["grpo.max_steps=2"]
    rerun = subprocess.run([sys.executable, "-m", "grpo.app.cli", "sweep", "--config", str(MICRO), "--space",
                            str(tmp_path / "space.yaml"), "--name", "stopped-again", "--study", "stopped",
                            "--max-concurrency", "1", *(a for s in short for a in ("--set", s))],
                           cwd=tmp_path, env=prefect_server.env(), capture_output=True, text=True, timeout=900)
    assert rerun.returncode == 0, (rerun.stdout[-3000:], rerun.stderr[-3000:])
    again = json.loads((tmp_path / "runs" / "stopped-again" / "sweep.json").read_text())
    assert [(t["trial"], t["status"]) for t in again["trials"]] == [(1, "completed"), (2, "completed")]
    trials = optuna.load_study(study_name="stopped", storage=storage).trials
    assert trials[0].state.name == "FAIL" and [t.state.name for t in trials[1:3]] == ["COMPLETE", "COMPLETE"]
    assert "RUNNING" not in {t.state.name for t in trials}
