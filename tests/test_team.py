"""``grpo team up|status|down`` for real: Debian's PostgreSQL, the Prefect and MLflow servers on it with
authentication, a micro ``grpo run`` against them with the team's credentials, and one down/up cycle (data kept).

The team home is a folder under /tmp that others may enter (0711): as root, PostgreSQL runs as the ``postgres`` user,
who can not pass through pytest's own 0700 temp folder.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import psutil
import pytest
import requests

from grpo.app.ui import port_taken
from tests.conftest import MICRO, micro_overrides
from tests.servers import BIN, REPO, free_port

pytestmark = pytest.mark.integration


def grpo(*args: str, env: dict | None = None, cwd: Path = REPO, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "grpo"), *args], cwd=cwd, env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})},
                          capture_output=True, text=True, timeout=timeout)


def env_file(path: Path) -> dict[str, str]:
    """``export K=V`` lines of team.env as a dict (what ``source team.env`` exports)."""
    return dict(line.removeprefix("export ").split("=", 1) for line in path.read_text().splitlines() if line)


class Team:
    def __init__(self, home: Path) -> None:
        self.home = home
        self.ports = {"prefect": free_port(), "mlflow": free_port(), "pg": free_port()}

    def up(self) -> subprocess.CompletedProcess:
        result = grpo("team", "up", "--home", str(self.home), *(f"--{k}-port={v}" for k, v in self.ports.items()))
        assert result.returncode == 0, result.stdout + result.stderr
        return result

    def down(self) -> subprocess.CompletedProcess:
        return grpo("team", "down", "--home", str(self.home))

    @property
    def env(self) -> dict[str, str]:
        return env_file(self.home / "team.env")

    @property
    def passwords(self) -> list[str]:
        return list(json.loads((self.home / "secrets.json").read_text()).values())

    def prefect(self, method: str, path: str, auth: bool = True, **kw) -> requests.Response:
        credentials = tuple(self.env["PREFECT_API_AUTH_STRING"].split(":", 1)) if auth else None
        return requests.request(method, f"{self.env['PREFECT_API_URL']}/{path}", auth=credentials, timeout=120, **kw)

    def mlflow(self, path: str, auth: tuple[str, str] | None = None, **kw) -> requests.Response:
        return requests.get(f"{self.env['MLFLOW_TRACKING_URI']}/{path}", auth=auth, timeout=120, **kw)

    @property
    def worker(self) -> tuple[str, str]:
        return self.env["MLFLOW_TRACKING_USERNAME"], self.env["MLFLOW_TRACKING_PASSWORD"]


@pytest.fixture(scope="module")
def team():
    home = Path(tempfile.mkdtemp(prefix="grpo-team-", dir="/tmp"))
    home.chmod(0o711)
    started = Team(home / "team")
    try:
        started.first_up = started.up()
        yield started
    finally:
        started.down()
        shutil.rmtree(home, ignore_errors=True)


def test_team_up_wants_credentials_and_serves_a_grpo_run(team, tmp_path, monkeypatch):
    out = team.first_up.stdout
    assert f"source {team.home / 'team.env'}" in out and "deployments of infra/prefect.yaml: created" in out
    for path in ("secrets.json", "team.env", "admin.env", "mlflow/basic_auth.ini"):
        assert (team.home / path).stat().st_mode & 0o777 == 0o600, path

    # Prefect: health answers anyone (probes); the API only the auth string
    assert team.prefect("GET", "health", auth=False).status_code == 200
    assert team.prefect("POST", "flows/filter", auth=False, json={}).status_code == 401
    assert team.prefect("POST", "flows/filter", json={}).status_code == 200
    pools = {p["name"]: p for p in team.prefect("POST", "work_pools/filter", json={}).json()}
    assert set(pools) == {"cpu-pool", "gpu-pool"} and pools["gpu-pool"]["concurrency_limit"] == 1
    assert pools["cpu-pool"]["base_job_template"] == json.loads((REPO / "infra/work-pools/cpu-pool.json").read_text())
    deployments = {d["name"] for d in team.prefect("POST", "deployments/filter", json={}).json()}
    assert deployments == {"default", "gpu", "nightly"}

    # MLflow: 401 without credentials, the worker's work; the platform's app settings are kept behind the auth
    assert team.mlflow("api/2.0/mlflow/experiments/search?max_results=5").status_code == 401
    assert team.mlflow("").status_code == 401
    assert team.mlflow("api/2.0/mlflow/experiments/search?max_results=5", auth=team.worker).status_code == 200
    assert "mlflow.workflowType_v1" in team.mlflow("", auth=team.worker).text

    # a micro run with the team's credentials in the environment (as `source team.env`), tracked in MLflow
    result = grpo("run", "--config", str(MICRO), "--set", *micro_overrides(tmp_path / "runs"), "--set",
                  "tracking.backend=mlflow", "--set", "tracking.log_model=false", "--set",
                  "tracking.log_system_metrics=false", env=team.env, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    [summary] = (tmp_path / "runs").glob("*/summary.json")
    summary = json.loads(summary.read_text())
    for name, value in team.env.items():
        monkeypatch.setenv(name, value)
    from mlflow import MlflowClient

    client = MlflowClient()
    run = client.get_run(summary["mlflow_run_id"])
    assert run.info.status == "FINISHED"

    # no password anywhere: MLflow params, tags, artifacts; Prefect's flow-run parameters and logs; the run's log
    seen = [json.dumps(run.data.params), json.dumps(run.data.tags), result.stdout, result.stderr, team.first_up.stdout]
    artifacts = Path(client.download_artifacts(run.info.run_id, "", str(tmp_path / "artifacts")))
    seen += [p.read_text(errors="replace") for p in artifacts.rglob("*") if p.is_file()]
    seen += [p.read_text(errors="replace") for p in (tmp_path / "runs").rglob("*.log")]
    flow_runs = team.prefect("POST", "flow_runs/filter", json={}).json()
    assert summary["prefect_flow_run_id"] in {r["id"] for r in flow_runs}
    seen += [json.dumps(r["parameters"]) for r in flow_runs]
    seen += [json.dumps(team.prefect("POST", "logs/filter", json={"limit": 200, "offset": offset}).json())
             for offset in range(0, 2000, 200)]
    assert len(seen) > 20 and any("micro" in text for text in seen)
    for password in team.passwords:
        assert not [text[:300] for text in seen if password in text]


def test_cancel_reaches_the_team_server_with_its_auth_string(team):
    """An interrupted ``grpo run`` marks its flow runs Cancelled, and the cancel watch sees a Cancel from the UI, on
    the team's server too: both sent their requests without the auth string, read the 401 as "nothing cancelled"
    and "0 cancelled", and the run's flow run stayed Running in the UI."""
    import threading

    from prefect.settings import PREFECT_API_AUTH_STRING, temporary_settings

    from grpo.app.procguard import CancelWatch, cancel_flow_runs

    api = team.env["PREFECT_API_URL"]
    flow = team.prefect("POST", "flows/", json={"name": "team-cancel-probe"}).json()["id"]

    def flow_run() -> str:
        body = {"flow_id": flow, "state": {"type": "RUNNING", "name": "Running"}}
        return team.prefect("POST", "flow_runs/", json=body).json()["id"]

    interrupted, watched = flow_run(), flow_run()
    seen: list[str] = []
    reported = threading.Event()
    # the process's Prefect settings as `source team.env` gives them to a grpo run (Prefect reads its environment
    # once a process: this test's worker may have read it before)
    with temporary_settings({PREFECT_API_AUTH_STRING: team.env["PREFECT_API_AUTH_STRING"]}):
        assert cancel_flow_runs([interrupted], api, "stopped by SIGINT") == 1
        watch = CancelWatch([watched], api, interval=0.05, on_cancel=lambda run: (seen.append(run), reported.set()))
    assert team.prefect("GET", f"flow_runs/{interrupted}").json()["state"]["type"] == "CANCELLED"
    with watch:
        body = {"state": {"type": "CANCELLING", "name": "Cancelling"}}
        assert team.prefect("POST", f"flow_runs/{watched}/set_state", json=body).status_code in (200, 201)
        assert reported.wait(600), "the watch never saw the Cancelling run"  # a hang bound, not a speed requirement
    assert seen == [watched]


def test_team_status_down_stops_everything_and_up_keeps_the_data(team, monkeypatch):
    status = grpo("team", "status", "--home", str(team.home))
    assert status.returncode == 0
    for line in ("running  PostgreSQL  127.0.0.1:{pg}", "running  Prefect     http://127.0.0.1:{prefect}",
                 "running  MLflow      http://127.0.0.1:{mlflow}"):
        assert line.format(**team.ports) in status.stdout, status.stdout

    # a run logged with the worker's credentials, to find after the restart
    for name, value in team.env.items():
        monkeypatch.setenv(name, value)
    from mlflow import MlflowClient

    client = MlflowClient()
    experiment = client.create_experiment("team-survives")
    run_id = client.create_run(experiment).info.run_id
    client.log_param(run_id, "lr", "1e-4")

    again = grpo("team", "up", "--home", str(team.home), *(f"--{k}-port={v}" for k, v in team.ports.items()))
    assert again.returncode == 2 and again.stderr.startswith("error: ") and "already running" in again.stderr
    assert len(again.stderr.strip().splitlines()) == 1

    state = json.loads((team.home / "state.json").read_text())
    pg_pid = int((team.home / "postgres/data/postmaster.pid").read_text().split()[0])
    groups = {entry["pid"] for entry in state["servers"].values()}
    members = [p for p in psutil.process_iter() if p.pid == pg_pid or _pgid(p.pid) in groups]
    assert len(members) >= 3
    down = team.down()
    assert down.returncode == 0 and "stopped: prefect, mlflow, postgres" in down.stdout
    alive = [p for p in members if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, alive
    assert not any(port_taken(port) for port in team.ports.values())
    assert "nothing of the team setup" in grpo("team", "status", "--home", str(team.home)).stdout

    second = team.up()
    assert "deployments of infra/prefect.yaml: kept" in second.stdout and "a new cluster" not in second.stdout
    assert client.get_run(run_id).data.params == {"lr": "1e-4"}
    assert client.get_experiment_by_name("team-survives").experiment_id == experiment


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None
