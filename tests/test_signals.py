"""Issue #12, items 5, 6 and 15: Ctrl-C and SIGTERM stop a run cleanly and leave no server behind; runs started from
the Prefect UI stay inside the allowed roots. Real processes, real signals, real Prefect and MLflow servers."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from grpo.config import load_config
from tests.conftest import MICRO
from tests.servers import BIN, PrefectServer

# ---------------------------------------------------------------- #12.15 path confinement of served runs


def test_paths_outside_the_allowed_roots_are_refused(tmp_path):
    from grpo.confine import PathNotAllowed, check_config_paths

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


@pytest.fixture(scope="module")
def prefect_server(tmp_path_factory):
    server = PrefectServer(tmp_path_factory.mktemp("prefect-home")).start()
    try:
        yield server
    finally:
        server.stop()


def _wait_final(s: PrefectServer, flow_run_id: str, timeout: float, log: Path) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        run = s.get(f"flow_runs/{flow_run_id}")
        if run["state"]["type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
            return run["state"]
        assert time.monotonic() < deadline, (run["state"], log.read_text()[-3000:])
        time.sleep(1)


@pytest.mark.slow
def test_served_runs_are_confined_to_the_allowed_roots(prefect_server, tmp_path):
    """#12.15: a run started from the Prefect UI with output_dir=/ or a data file outside the roots (or
    /etc/passwd) fails with a message naming the field and the roots; a run inside an --allow-path root runs.
    Before the fix the output_dir=/ run tried to create /micro-... and the outside data file was trained on."""
    s = prefect_server
    project, allowed = tmp_path / "project", tmp_path / "allowed"
    project.mkdir()
    allowed.mkdir()
    outside = tmp_path / "outside.jsonl"
    outside.write_text("".join(f'{{"prompt": "{i}+1=", "answer": "{i + 1}"}}\n' for i in range(200)))
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        proc = subprocess.Popen([str(BIN / "grpo"), "serve", "--name", "confined", "--allow-path", str(allowed)],
                                env=s.env(), cwd=project, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 180
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
            passwd = "data.source=/etc/passwd" in overrides  # the form sends any string
            cfg = load_config(MICRO, [*base, *(o for o in overrides if not passwd or "passwd" not in o)]
                              ).model_dump(mode="json", by_alias=True)
            if passwd:
                cfg["data"]["source"] = "/etc/passwd"
            for _ in range(30):  # a busy SQLite server answers 503 for a moment
                created = s.post(f"deployments/{deployment['id']}/create_flow_run", {"parameters": {"config": cfg}})
                if created.status_code != 503:
                    break
                time.sleep(2)
            assert created.status_code == 201, created.text
            return created.json()["id"]

        root_run = start("output_dir=/")
        outside_run = start(f"output_dir={allowed}/runs", f"data.source={outside}")
        passwd_run = start(f"output_dir={allowed}/runs", "data.source=/etc/passwd")
        ok_run = start(f"output_dir={allowed}/runs")
        roots = f"allowed roots ({project.resolve()}, {allowed.resolve()})"
        state = _wait_final(s, root_run, 300, log)
        assert state["type"] == "FAILED" and "output_dir '/' is outside the " + roots in state["message"], state
        state = _wait_final(s, outside_run, 300, log)
        assert state["type"] == "FAILED" and f"data.source '{outside}' is outside the " + roots in state["message"]
        state = _wait_final(s, passwd_run, 300, log)
        assert state["type"] == "FAILED" and "/etc/passwd" in state["message"], state
        state = _wait_final(s, ok_run, 400, log)
        assert state["type"] == "COMPLETED", (state, log.read_text()[-3000:])
        assert [p.name for p in (allowed / "runs").iterdir()]  # the allowed run wrote its run directory there
        assert not list(Path("/").glob("micro-*"))
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
