"""Real servers for tests, as subprocesses on 127.0.0.1: an MLflow tracking server and a Prefect server with its own
PREFECT_HOME, and the session fixtures sharing them.

``tests/conftest.py`` registers this module as a plugin, so every test module shares one server of each kind per
session; under pytest-xdist every worker shares the same one (the first worker to need it starts it, the others attach
through a file in the session's common temp folder). A server ends with the session's controlling pytest process,
also when that is killed (grpo.app.procguard). A test that needs an outage starts a server of its own.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests
from filelock import FileLock

from grpo.app.procguard import die_with_parent, guarded_command
from grpo.app.ui import wait_healthy

REPO = Path(__file__).resolve().parent.parent


def popen_guarded(cmd: list[str], owner_pid: int | None = None, **kw) -> subprocess.Popen:
    """``cmd`` under grpo.app.procguard, leading its own process group: the group ends with this process (even when
    it is SIGKILLed), or with ``owner_pid`` when given (a server one worker starts for the whole session)."""
    return subprocess.Popen(guarded_command(cmd, owner_pid), start_new_session=True,
                            preexec_fn=None if owner_pid else die_with_parent(), **kw)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def interrupt(proc: subprocess.Popen, timeout: float) -> None:
    """Ctrl-C (SIGINT) to ``proc`` (a ``grpo serve``, leading its own session) and wait for it; SIGKILL to its group
    if it has not ended in ``timeout`` seconds."""
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


class MlflowServer:
    """``mlflow server`` with a SQLite backend store and proxied artifacts (``--artifacts-destination``)."""

    def __init__(self, root: Path, port: int | None = None) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None
        self.log_path = self.root / "server.log"

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 90.0, owner_pid: int | None = None) -> MlflowServer:
        cmd = [
            sys.executable, "-m", "mlflow", "server",
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "--workers", "1",
            "--backend-store-uri", f"sqlite:///{self.root / 'mlflow.db'}",
            "--artifacts-destination", str(self.root / "artifacts"),
        ]
        env = dict(os.environ)
        env.pop("MLFLOW_TRACKING_URI", None)
        env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] = "false"  # no job-runner process: starts several seconds faster
        log = self.log_path.open("ab")
        # Own process group: stop() ends the CLI and the uvicorn worker it spawns, nothing else.
        # The guard ends the group when this process dies, even by SIGKILL (a killed pytest leaves no server).
        self.proc = popen_guarded(cmd, owner_pid, stdout=log, stderr=subprocess.STDOUT, env=env)
        log.close()
        try:
            wait_healthy(f"{self.uri}/health", self.proc, timeout)
        except RuntimeError as err:
            self.stop()
            raise RuntimeError(f"mlflow server: {err}\n{self.log_tail()}") from None
        return self

    def stop(self, kill: bool = False) -> None:
        """SIGKILL (an outage) or SIGTERM (a clean stop) to the server's process group; waits until the port is free."""
        if self.proc is None:
            return
        sig = signal.SIGKILL if kill else signal.SIGTERM
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=5)
        # uvicorn may outlive the CLI for a moment after SIGTERM; wait until nothing answers on the port.
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            try:
                requests.get(f"{self.uri}/health", timeout=0.5)
            except requests.RequestException:
                break
            time.sleep(0.1)
        self.proc = None

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except FileNotFoundError:
            return ""


def _xdist_common_dir(tmp_path_factory) -> Path | None:
    """The temp folder every pytest-xdist worker of this session shares (the controller's basetemp), else None."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return None
    return tmp_path_factory.getbasetemp().parent


def _session_server(tmp_path_factory, kind: str, server_class):
    """Yield the session's server of ``kind`` (a class built from its folder and port): started here without xdist
    (stopped at the end), or under xdist the one server all workers share. The first worker starts it owned by the
    controlling pytest process (the workers' parent), so it outlives the worker that started it and ends with the
    session; the others build a handle from its folder and port (a handle's ``stop`` does nothing)."""
    common = _xdist_common_dir(tmp_path_factory)
    if common is None:
        server = server_class(tmp_path_factory.mktemp(kind)).start()
        try:
            yield server
        finally:
            server.stop()
        return
    info = common / f"{kind}.json"
    with FileLock(str(common / f"{kind}.lock")):
        if info.is_file():
            shared = json.loads(info.read_text())
            server = server_class(Path(shared["folder"]), shared["port"])
        else:
            folder = common / kind
            folder.mkdir()
            server = server_class(folder).start(owner_pid=os.getppid())
            info.write_text(json.dumps({"folder": str(folder), "port": server.port}))
    yield server


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    """One MLflow server for the whole session (startup takes seconds); yields the running :class:`MlflowServer`.
    Shared: tests never stop it (an outage test starts its own)."""
    yield from _session_server(tmp_path_factory, "mlflow-server", MlflowServer)


BIN = Path(sys.executable).parent


class PrefectServer:
    """``prefect server start`` with its own PREFECT_HOME; ``env()`` points child processes (CLI, workers) at it."""

    # The shared server's SQLite answers 503 while another writer holds it, and Prefect's clients retry a 503 with
    # doubling waits: 5 retries (its default) wait about a minute, which five test workers on 2 cores outlasted once
    # (`grpo serve` failed to register a deployment), and an in-process sweep's flow run met 503s for 2.5 minutes
    # under the suite's load; 8 wait about eight minutes. Child processes get it through env(), flows called in the
    # test process through the prefect_in_process fixture.
    CLIENT_MAX_RETRIES = 8

    def __init__(self, home: Path, port: int | None = None) -> None:
        self.home, self.port = home, port or free_port()
        self.url = f"http://127.0.0.1:{self.port}/api"
        self.log = home / "server.log"
        self.proc: subprocess.Popen | None = None
        self._clients = threading.local()

    def env(self, **extra: str) -> dict[str, str]:
        return {**os.environ, "PREFECT_HOME": str(self.home), "PREFECT_API_URL": self.url,
                "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PYTHONUNBUFFERED": "1",
                "PREFECT_CLIENT_MAX_RETRIES": str(self.CLIENT_MAX_RETRIES), **extra}

    def start(self, timeout: float = 120, owner_pid: int | None = None) -> PrefectServer:
        with self.log.open("ab") as log:
            self.proc = popen_guarded([str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port",
                                       str(self.port)], owner_pid, env=self.env(), stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_healthy(f"{self.url}/health", self.proc, timeout)
        except RuntimeError as err:
            self.stop()
            raise RuntimeError(f"prefect server: {err}\n{self.log.read_text()[-3000:]}") from None
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)

    def _request(self, method: str, path: str, **kw):
        """One API call; a 503 (the shared SQLite-backed server busy for a moment under the suite's load) is retried
        for up to ten minutes (a hung server's bound: the shared one has stalled for minutes), and so is a read that
        timed out or whose connection was reset (a loaded machine) when the call only reads (GET, a ``/filter``
        query: asking again creates nothing); anything else is returned or raised as it is."""
        import httpx

        # One client per thread, kept: a new one per call builds a TLS context (about 25 ms of CPU), and tests poll.
        client = getattr(self._clients, "client", None)
        if client is None:
            # A hung server's bound, not 30 s: the shared server's SQLite has been held by one writer for longer
            # ("database is locked" in its log) while a test's POST waited, and a POST that timed out cannot be sent
            # again (it may have created the flow run). Prefect's own client waits 60 s per try, with retries.
            # Idle connections are dropped after 2 s, before the server's keep-alive timeout (uvicorn: 5 s) closes
            # them: a request sent on a connection the server is closing at that moment fails with a reset.
            client = self._clients.client = httpx.Client(timeout=httpx.Timeout(600.0, connect=30.0),
                                                         limits=httpx.Limits(keepalive_expiry=2.0))
        deadline = time.monotonic() + 600
        reads = method == "GET" or path.endswith("/filter")
        while True:
            try:
                response = client.request(method, f"{self.url}/{path}", **kw)
            except httpx.TransportError:  # a timeout, or a connection the busy server reset
                if not reads or time.monotonic() > deadline:
                    raise
                time.sleep(1)
                continue
            if response.status_code != 503 or time.monotonic() > deadline:
                return response
            time.sleep(1)

    def get(self, path: str):
        response = self._request("GET", path)
        response.raise_for_status()
        return response.json()

    def post(self, path: str, body: dict):
        return self._request("POST", path, json=body)

    def query(self, path: str, body: dict) -> list[dict]:
        """A ``/filter`` query's results (an error status raises)."""
        response = self.post(path, body)
        response.raise_for_status()
        return response.json()

    def run(self, *cmd: str, timeout: float = 240, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(list(cmd), env=kw.pop("env", None) or self.env(), cwd=kw.pop("cwd", REPO),
                              capture_output=True, text=True, timeout=timeout, **kw)


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory):
    """One ``prefect server start`` per test session, shared by every xdist worker: its start-up (database
    migrations) costs a busy 2-core machine half a minute, so modules and CLI runs share it instead of each starting
    their own (a CLI run given ``prefect_server.env()`` uses it rather than an embedded server). Tests scope what they
    read from it by their own ids and names, never by counting everything on the server."""
    yield from _session_server(tmp_path_factory, "prefect-home", PrefectServer)


@pytest.fixture(scope="module")
def prefect_in_process(prefect_server):
    """Flows called in the test process run against the session's Prefect server (instead of a
    ``prefect_test_harness`` server per module)."""
    import prefect.context
    from prefect.settings import PREFECT_API_URL, PREFECT_CLIENT_MAX_RETRIES, temporary_settings

    with temporary_settings({PREFECT_API_URL: prefect_server.url,
                             PREFECT_CLIENT_MAX_RETRIES: prefect_server.CLIENT_MAX_RETRIES}):
        with prefect.context._temporary_global_settings_context(prefect.context.get_settings_context()):
            yield prefect_server
