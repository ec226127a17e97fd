"""``grpo ui`` starts a real Prefect server and a real MLflow server on 127.0.0.1, and stops both on Ctrl-C."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.servers import free_port

pytestmark = pytest.mark.integration


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def test_grpo_ui_serves_both_and_stops_them(tmp_path):
    prefect_port, mlflow_port = free_port(), free_port()
    proc = subprocess.Popen([sys.executable, "-m", "grpo.app.cli", "ui", "--prefect-port", str(prefect_port),
                             "--mlflow-port", str(mlflow_port)], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 240
        line = ""
        while time.time() < deadline and "MLflow UI" not in line:
            line = proc.stdout.readline()
            assert line or proc.poll() is None, "grpo ui exited"
        assert f"http://127.0.0.1:{mlflow_port}" in line
        assert healthy(f"http://127.0.0.1:{prefect_port}/api/health")
        assert healthy(f"http://127.0.0.1:{mlflow_port}/health")
        assert (tmp_path / "mlflow.db").is_file()  # the project folder's local store
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    time.sleep(1)
    assert not healthy(f"http://127.0.0.1:{prefect_port}/api/health")
    assert not healthy(f"http://127.0.0.1:{mlflow_port}/health")
