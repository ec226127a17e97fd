"""``grpo ui``: a Prefect server and an MLflow server on 127.0.0.1 over the same local stores the runs use.

Runs made before (ephemeral Prefect API, local SQLite MLflow store) show up, because both servers read the same
databases: Prefect's in ``$PREFECT_HOME`` and MLflow's ``mlflow.db`` in the project folder.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from grpo.tracking.store import resolve_tracking_uri


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float) -> None:
    """Poll ``url`` until it answers 200; RuntimeError if ``proc`` exits first or ``timeout`` passes."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: server exited with code {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url}: not healthy after {timeout:.0f}s")


def port_taken(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a server could not listen on ``host:port`` now (another ``grpo ui``, another program). Checked the way
    the servers bind (address reuse on), so a port a stopped server left in TIME_WAIT counts as free."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def taken_ports_message(prefect_port: int, mlflow_port: int) -> str | None:
    """One line naming the ports in use and the ``grpo ui`` options that change them; None when both are free.
    Asked before starting anything: a server started on a taken port prints its own advice (Prefect's names a
    ``--port`` flag ``grpo ui`` does not have) and exits."""
    taken = [f"{port} ({what}, --{what.lower()}-port)" for port, what in ((prefect_port, "Prefect"),
                                                                          (mlflow_port, "MLflow")) if port_taken(port)]
    if not taken:
        return None
    ports = f"port{'s' if len(taken) > 1 else ''} {' and '.join(taken)}"
    return f"{ports} already in use on 127.0.0.1 (another grpo ui?); pick free ones, e.g. " \
           "grpo ui --prefect-port 4201 --mlflow-port 5001"


# MLflow's FastAPI app imports starlette.middleware.wsgi, which Starlette has deprecated: its server printed a
# StarletteDeprecationWarning twice (two of its processes import the app) that tells a grpo user nothing they can act
# on. Only that warning, from that import, is ignored (PYTHONWARNINGS: action:message-prefix:category:module).
MLFLOW_STARLETTE_WARNING = "ignore:starlette.middleware.wsgi is deprecated:UserWarning:mlflow.server.fastapi_app"


def prefect_server_env(port: int, host: str = "127.0.0.1") -> dict[str, str]:
    """The settings that make a ``prefect server start --port PORT`` its own. Its UI asks ``/ui-settings`` which API
    to call, and Prefect answers ``PREFECT_API_URL`` (environment or profile), else ``PREFECT_SERVER_API_PORT``
    (4200), not the ``--port`` it listens on: on another port the UI said "Can't connect to Server API" or showed
    another server's flows. ``PREFECT_API_URL`` is set too, over one the shell exported for another server: the
    links the server writes to its own UI (automations' notifications, ``PREFECT_UI_URL``) derive from it."""
    url = f"http://{host}:{port}/api"
    return {"PREFECT_API_URL": url, "PREFECT_SERVER_UI_API_URL": url}


def server_logs() -> dict[str, Path]:
    """Where ``grpo ui`` writes each server's own output (under the cache root: nobody's run output)."""
    from grpo.paths import cache_root

    folder = cache_root() / "ui"
    return {"prefect": folder / "prefect-server.log", "mlflow": folder / "mlflow-server.log"}


def _tail(path: Path, lines: int = 5) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return ""


def start_servers(project_dir: Path, prefect_port: int, mlflow_port: int) -> list[subprocess.Popen]:
    """Start both servers bound to 127.0.0.1 and wait until they answer; returns the processes. Both are stopped when
    either fails to come up or the wait is interrupted (Ctrl-C, SIGTERM).

    Their own output (Prefect's ASCII banner, uvicorn's request lines, MLflow's store and middleware notes) goes to
    :func:`server_logs`, not the console: ``grpo ui`` prints where to go and what to export; a server that fails to
    come up is named with the end of its log."""
    bin_dir = Path(sys.executable).parent
    uri = resolve_tracking_uri(None, project_dir)
    if not uri.startswith("sqlite:///"):
        uri = f"sqlite:///{project_dir.resolve() / 'mlflow.db'}"
    artifacts = Path(uri[len("sqlite:///"):]).parent / "mlartifacts"
    env = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    logs = server_logs()
    logs["prefect"].parent.mkdir(parents=True, exist_ok=True)
    with logs["prefect"].open("w") as out:
        prefect = subprocess.Popen(
            [str(bin_dir / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(prefect_port)],
            env={**env, **prefect_server_env(prefect_port)}, start_new_session=True, stdout=out,
            stderr=subprocess.STDOUT,
        )
    with logs["mlflow"].open("w") as out:
        mlflow = subprocess.Popen(
        [str(bin_dir / "mlflow"), "server", "--app-name", "grpo", "--host", "127.0.0.1", "--port", str(mlflow_port),
         "--workers", "1",
         "--backend-store-uri", uri, "--default-artifact-root", str(artifacts)],
            env={**env,
                 "PYTHONWARNINGS": ",".join(filter(None, (env.get("PYTHONWARNINGS"), MLFLOW_STARLETTE_WARNING)))},
            start_new_session=True, stdout=out, stderr=subprocess.STDOUT,
        )
    procs = [prefect, mlflow]
    try:
        # a hung server's bound, not a speed limit: Prefect's migrations take half a minute on a busy 2-core machine
        for name, url, proc in (("prefect", f"http://127.0.0.1:{prefect_port}/api/health", prefect),
                                ("mlflow", f"http://127.0.0.1:{mlflow_port}/health", mlflow)):
            try:
                wait_healthy(url, proc, 600)
            except RuntimeError as err:
                raise RuntimeError(f"{err}; its log {logs[name]} ends: {_tail(logs[name])}") from None
    except BaseException:
        stop_servers(procs)
        raise
    return procs


def stop_servers(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
