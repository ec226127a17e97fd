"""``grpo ui`` starts a real Prefect server and a real MLflow server on 127.0.0.1, and stops both on Ctrl-C."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.servers import free_port, interrupt

pytestmark = pytest.mark.integration


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def test_grpo_ui_serves_both_grpo_serve_waits_out_its_busy_prefect_server_and_ctrl_c_stops_them(tmp_path):
    """The docs' steps: ``grpo ui``, then ``grpo serve`` against its Prefect server. The serve meets the server
    busy (forced: its process group stopped, so the kernel accepts the connection and nothing answers, as an event
    loop held by SQLite on a loaded machine does); it says so and registers its deployments once the server answers.
    Before, its 5-second health check failed the serve ("no Prefect server ... (timed out)", exit 2): clean-clone CI
    at e849605.

    The ports are not the defaults and the shell has exported PREFECT_API_URL for another server (#44.1): the banner
    names the exports terminal 2 needs with the ports chosen, and the Prefect UI calls its own server's API. Before,
    its /ui-settings named that other server (or port 4200 when none was exported), so the browser said "Can't
    connect to Server API" with an empty Deployments list, or listed another server's deployments. MLflow's server
    printed a StarletteDeprecationWarning twice (#44.6).

    Stopping ``grpo ui`` first leaves the serve without its server: it stops by itself with one line (exit 1).
    Before, it printed Prefect's connection tracebacks and did not exit on Ctrl-C for minutes."""
    prefect_port, mlflow_port = free_port(), free_port()
    elsewhere = f"http://127.0.0.1:{free_port()}/api"  # exported for another server, none listening
    proc = subprocess.Popen([sys.executable, "-m", "grpo.app.cli", "ui", "--prefect-port", str(prefect_port),
                             "--mlflow-port", str(mlflow_port)], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            env={**{k: v for k, v in os.environ.items() if k != "GRPO_CACHE_DIR"},  # the default
                                 "PREFECT_HOME": str(tmp_path / "prefect-home"),  # a fresh database
                                 "PREFECT_API_URL": elsewhere})
    try:
        deadline = time.time() + 600  # a hung server's bound
        lines = [""]
        while time.time() < deadline and not lines[-1].startswith("  export "):
            lines.append(proc.stdout.readline())
            assert lines[-1] or proc.poll() is None, "grpo ui exited"
        logs = proc.stdout.readline()
        # what grpo ui prints, whole: where to go, what to export, where the servers' own output went (Prefect's
        # ASCII banner, uvicorn's and MLflow's start-up lines filled the console before)
        assert len(lines) == 4 and lines[-2].startswith("In another shell"), lines
        assert logs.startswith("The servers' own logs: .cache/grpo/ui/prefect-server.log and "), logs
        assert "Uvicorn running" in (tmp_path / ".cache/grpo/ui/mlflow-server.log").read_text()
        banner, exports = lines[-3], lines[-1]
        assert f"http://127.0.0.1:{mlflow_port}" in banner and f"http://127.0.0.1:{prefect_port}" in banner
        assert exports.split() == ["export", f"PREFECT_API_URL=http://127.0.0.1:{prefect_port}/api",
                                   f"MLFLOW_TRACKING_URI=http://127.0.0.1:{mlflow_port}"], lines[-3:]
        assert "StarletteDeprecationWarning" not in "".join(lines), "".join(lines)
        ui = f"http://127.0.0.1:{prefect_port}"
        with urllib.request.urlopen(f"{ui}/ui-settings", timeout=30) as response:
            assert json.load(response)["api_url"] == f"{ui}/api"
        assert healthy(f"http://127.0.0.1:{prefect_port}/api/health")
        assert healthy(f"http://127.0.0.1:{mlflow_port}/health")
        assert (tmp_path / "mlflow.db").is_file()  # the project folder's local store
        _experiment_opens_on_its_runs(f"http://127.0.0.1:{mlflow_port}")
        serve, serve_log = _serve_waits_out_a_busy_server(proc, prefect_port, tmp_path)
        try:
            _deployments_list_its_own_server(ui)
        except BaseException:
            interrupt(serve, timeout=120)
            raise
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    # The serve outlives its server (the person stopped `grpo ui` first): it stops by itself in one line. Before, it
    # printed Prefect's connection tracebacks and a Ctrl-C then took minutes (every shutdown call retried).
    try:
        serve.wait(timeout=300)  # a hung serve's bound
    except subprocess.TimeoutExpired:
        interrupt(serve, timeout=120)
        raise AssertionError(f"grpo serve did not stop after its server: {serve_log.read_text()[-3000:]}") from None
    said = serve_log.read_text()
    assert serve.returncode == 1 and "Traceback" not in said, said[-3000:]
    assert said.splitlines()[-1].startswith(f"the Prefect server at http://127.0.0.1:{prefect_port}/api stopped "
                                            "(it refuses connections): serving stops"), said[-3000:]
    time.sleep(1)
    assert not healthy(f"http://127.0.0.1:{prefect_port}/api/health")
    assert not healthy(f"http://127.0.0.1:{mlflow_port}/health")


def _serve_waits_out_a_busy_server(ui: subprocess.Popen, prefect_port: int, tmp_path):
    """Returns the serve, still serving, and its log."""
    from pathlib import Path

    import psutil

    from tests.servers import BIN, PrefectServer, interrupt

    [prefect] = [p for p in psutil.Process(ui.pid).children()
                 if any(Path(c).name == "prefect" for c in p.cmdline()[:2])]  # `prefect server start`
    server = PrefectServer(tmp_path / "serve-home", prefect_port)
    server.home.mkdir()
    log = tmp_path / "serve.log"
    os.killpg(prefect.pid, signal.SIGSTOP)
    try:
        # with Prefect's client patience set to two 3-second tries, the serve gives up in one line, naming the wait
        impatient = server.run(str(BIN / "grpo"), "serve", cwd=tmp_path, timeout=600,
                               env=server.env(PREFECT_API_REQUEST_TIMEOUT="3", PREFECT_CLIENT_MAX_RETRIES="1"))
        *notes, error = impatient.stderr.strip().splitlines()
        assert impatient.returncode == 2 and impatient.stdout == "", (impatient.stdout, impatient.stderr)
        assert [n.split(" is busy")[0] for n in notes] == [f"note: the Prefect server at {server.url}"], notes
        assert error.startswith(f"error: the Prefect server at {server.url} accepts connections but did not answer "
                                "GET /health in 6 s"), error
        assert "PREFECT_API_REQUEST_TIMEOUT" in error and "Traceback" not in impatient.stderr
        with log.open("w") as out:
            serve = subprocess.Popen([str(BIN / "grpo"), "serve"], cwd=tmp_path, env=server.env(), stdout=out,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + 600  # a hung CLI's bound
            while "is busy" not in log.read_text():
                assert serve.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.2)
            assert serve.poll() is None, log.read_text()[-3000:]
            os.killpg(prefect.pid, signal.SIGCONT)
            deadline = time.monotonic() + 600  # a hung server's bound
            while True:  # the runner registers both deployments when it starts
                served = server.query("deployments/filter", {"deployments": {"name": {"any_": ["local"]}}})
                if len(served) == 2:
                    break
                assert serve.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.5)
            [note] = [line for line in log.read_text().splitlines() if "is busy" in line]
            assert note.startswith(f"note: the Prefect server at http://127.0.0.1:{prefect_port}/api is busy"), note
            assert "error:" not in log.read_text() and "Traceback" not in log.read_text(), log.read_text()[-3000:]
        except BaseException:
            interrupt(serve, timeout=120)
            raise
    finally:
        os.killpg(prefect.pid, signal.SIGCONT)
    return serve, log


def _deployments_list_its_own_server(ui: str) -> None:
    """The Prefect UI's Deployments page, in Chromium, lists what ``grpo serve`` registered with this server, and
    every API call the page makes goes to this server."""
    from playwright.sync_api import expect

    from tests.browser import SCREENSHOTS, chromium_page

    with chromium_page(1400, 900) as page:
        calls: list[str] = []
        page.on("request", lambda request: calls.append(request.url) if "/api/" in request.url else None)
        page.goto(f"{ui}/deployments", wait_until="load", timeout=60_000)
        try:
            expect(page.get_by_text("grpo-sweep").first).to_be_visible(timeout=120_000)
        finally:
            page.screenshot(path=str(SCREENSHOTS / "prefect-grpo-ui-other-ports.png"))
        assert "Can't connect" not in page.locator("body").inner_text()
    assert calls and all(url.startswith(f"{ui}/api/") for url in calls), sorted(set(calls))


def _experiment_opens_on_its_runs(uri: str) -> None:
    """#31: in a browser that never chose a view, an experiment reached from MLflow's own experiment list (a link
    without workflowType) opened on MLflow 3's GenAI overview; grpo ui's MLflow opens it on its runs."""
    import re

    from mlflow import MlflowClient

    from tests.browser import SCREENSHOTS, chromium_page

    client = MlflowClient(uri)
    experiment_id = client.create_experiment("grpo-ui-view")
    client.set_terminated(client.create_run(experiment_id, run_name="ui-view-run").info.run_id)
    with chromium_page() as page:  # a fresh profile: no view chosen before
        page.goto(f"{uri}/", wait_until="load", timeout=60_000)
        page.get_by_role("link", name="grpo-ui-view").first.click(timeout=60_000)
        page.wait_for_url(re.compile(rf".*/experiments/{experiment_id}/\w+.*"), timeout=60_000)
        url = page.url
        page.screenshot(path=str(SCREENSHOTS / "mlflow-grpo-ui-experiment.png"))
    assert f"/experiments/{experiment_id}/runs" in url and "/overview" not in url, url


def test_second_grpo_ui_says_the_ports_are_taken_and_sigterm_stops_both_servers(tmp_path):
    """A second ``grpo ui`` on the same ports says so in one line, naming the options that change them, and exits 2
    before starting anything; SIGTERM to the first stops both of its servers (they run in sessions of their own)."""
    import psutil

    prefect_port, mlflow_port = free_port(), free_port()
    cmd = [sys.executable, "-m", "grpo.app.cli", "ui", "--prefect-port", str(prefect_port),
           "--mlflow-port", str(mlflow_port)]
    first = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    servers: list = []
    try:
        line = ""
        while "MLflow UI" not in line:
            line = first.stdout.readline()
            assert line or first.poll() is None, "grpo ui exited"
        servers = psutil.Process(first.pid).children()
        assert len(servers) == 2 and all(s.is_running() for s in servers)

        second = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert second.returncode == 2, (second.stdout, second.stderr)
        assert second.stdout == ""
        [message] = second.stderr.strip().splitlines()
        assert message.startswith("error: ports ") and "already in use" in message, message
        assert (f"{prefect_port} (Prefect, --prefect-port)" in message
                and f"{mlflow_port} (MLflow, --mlflow-port)" in message)
        assert "--port " not in message  # not Prefect's own advice: grpo ui has no --port

        first.send_signal(signal.SIGTERM)
        first.wait(timeout=60)
    finally:
        if first.poll() is None:
            first.kill()
        gone, alive = psutil.wait_procs(servers, timeout=30)
        for server in alive:  # left behind by a failing grpo ui: not by the test (each leads its own group)
            os.killpg(server.pid, signal.SIGKILL)
    assert not alive, [p.pid for p in alive]
    assert not healthy(f"http://127.0.0.1:{prefect_port}/api/health")
    assert not healthy(f"http://127.0.0.1:{mlflow_port}/health")


# Library lines that a served sweep printed among grpo serve's own (#44.6): transformers' progress bars for the
# policy the sweep loads (or builds and saves) before its first trial, MLflow's registry notes on the best model and
# its note on GPU metrics; and on SIGTERM Prefect's runner's "coroutine 'Runner.astop' was never awaited".
SERVE_CHATTER = ("Loading weights", "Writing model shards", "Successfully registered model", "Created version",
                 "Skip logging GPU metrics", "RuntimeWarning", "never awaited")


def test_grpo_serve_runs_a_sweep_without_library_chatter_and_sigterm_stops_it_cleanly(prefect_server, mlflow_server,
                                                                                     tmp_path):
    """``grpo serve`` as terminal 2 runs it: a sweep started from its deployment (one micro trial of 2 steps) leaves
    only the platform's and Prefect's lines in its console. SIGTERM (``kill``, systemd, a container stop) during a
    served run's training stops serving as Ctrl-C does: the run saves a checkpoint at its step and ends Cancelled, the
    schedules are paused, exit 0, without Python's warning about Prefect's stop coroutine or a traceback. Before,
    Prefect's own handler printed both and exited at once, its run left Running with no process and no checkpoint."""
    from tests.conftest import MICRO
    from tests.servers import BIN, interrupt

    s = prefect_server
    config = tmp_path / "micro-tracked.yaml"  # tracked, so the best model is registered
    config.write_text(MICRO.read_text() + "tracking:\n  backend: mlflow\n")
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        proc = subprocess.Popen([str(BIN / "grpo"), "serve", "--config", str(config), "--name", "console"],
                                cwd=tmp_path, env=s.env(MLFLOW_TRACKING_URI=mlflow_server.uri), stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)

    def start(deployment: str, parameters: dict) -> dict:
        deadline = time.monotonic() + 600  # a hung server's bound
        while (response := s._request("GET", f"deployments/name/{deployment}")).status_code != 200:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        created = s.post(f"deployments/{response.json()['id']}/create_flow_run", {"parameters": parameters})
        assert created.status_code == 201, created.text
        return created.json()

    try:
        run = start("grpo-sweep/console", {"space": {"grid": {"grpo.learning_rate": [1e-4]}}, "max_steps": 2,
                                           "registered_model_name": f"serve-console-{tmp_path.name}"})
        deadline = time.monotonic() + 1200  # a hung run's bound
        while run["state_type"] not in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
            assert proc.poll() is None and time.monotonic() < deadline, (run["state"], log.read_text()[-3000:])
            time.sleep(2)
            run = s.get(f"flow_runs/{run['id']}")
        assert run["state_type"] == "COMPLETED", (run["state"], log.read_text()[-4000:])
        training = start("grpo-pipeline/console", {"max_steps": 400})
        deadline = time.monotonic() + 600  # a hung run's bound
        while "/400 | reward" not in log.read_text():  # its first logged step: it is training
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            interrupt(proc, timeout=90)
    text = log.read_text()
    assert proc.returncode == 0, text[-3000:]
    [sweep_json] = list(tmp_path.glob("runs/*/sweep.json"))
    assert json.loads(sweep_json.read_text())["registered_model"], text[-3000:]  # the registry was written to
    assert [c for c in SERVE_CHATTER if c in text] == [], text[-4000:]
    assert "Traceback" not in text, text[-4000:]
    assert s.get(f"flow_runs/{training['id']}")["state_type"] == "CANCELLED", text[-3000:]
    assert list(tmp_path.glob("runs/*/checkpoints/checkpoint-*")), text[-3000:]
    assert s.get("deployments/name/grpo-sweep/console")["paused"]  # serving stopped: its schedules paused
