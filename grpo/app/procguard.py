"""Child servers that die with their parent, and the CLI's Ctrl-C / SIGTERM handling (#12.5, #12.6).

* :func:`die_with_parent` is a ``preexec_fn``: the child gets a signal when the thread that started it (start it
  from the main thread) ends, so a killed parent (SIGKILL included) leaves no server behind (Linux
  ``prctl(PR_SET_PDEATHSIG)``).
* ``python -m grpo.app.procguard CMD ...`` runs CMD under a small guard that leads its process group: when the guard's
  parent (or the ``--owner-pid`` process) dies, or it gets SIGTERM/SIGINT/SIGHUP, it stops the whole group (CMD and
  whatever CMD spawned, e.g. ``mlflow server``'s uvicorn worker), which a parent-death signal on CMD alone would not
  reach.
* :func:`embedded_prefect_server` starts Prefect's ephemeral API server (what ``grpo run`` uses when no
  ``PREFECT_API_URL`` is set) in its own session, so a Ctrl-C to the terminal's process group no longer kills it
  under the running flow, and with a parent-death signal.
* :func:`install_signal_handlers`: the first SIGINT raises KeyboardInterrupt, the first SIGTERM raises
  :class:`Terminated` (both unwind the run: the MLflow run is closed KILLED, the flow run marked cancelled); a second
  SIGINT exits at once.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable

PR_SET_PDEATHSIG = 1


def _set_pdeathsig(sig: int) -> None:
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)


def die_with_parent(sig: int = signal.SIGTERM):
    """A ``preexec_fn`` for Popen: the child gets ``sig`` when its parent dies (also if it already has)."""
    parent = os.getpid()

    def preexec() -> None:
        _set_pdeathsig(sig)
        if os.getppid() != parent:  # the parent died between fork and prctl
            os._exit(1)

    return preexec


def guarded_command(cmd: list[str], owner_pid: int | None = None) -> list[str]:
    """``cmd`` run under the process-group guard (see the module docstring); Popen it with
    ``start_new_session=True, preexec_fn=die_with_parent()``. With ``owner_pid`` the group lives as long as that
    process instead of the parent (Popen it without ``die_with_parent``): a server one process starts for others,
    e.g. one test-suite server shared by every pytest-xdist worker, which ends with the controlling pytest."""
    return [sys.executable, "-m", "grpo.app.procguard", *(["--owner-pid", str(owner_pid)] if owner_pid else []), *cmd]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _guard(cmd: list[str]) -> int:
    """Run ``cmd`` in this (new) process group; end the group when its owner (this process's parent, or the
    ``--owner-pid`` process) dies or on a signal."""
    owner = None
    if cmd[:1] == ["--owner-pid"]:
        owner, cmd = int(cmd[1]), cmd[2:]
    parent = os.getppid()
    child = subprocess.Popen(cmd)
    stopping = []

    def stop(signum=None, frame=None) -> None:
        stopping.append(signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, stop)
    while child.poll() is None and not stopping and (_alive(owner) if owner else os.getppid() == parent):
        time.sleep(0.2)
    if child.poll() is not None:
        return child.returncode
    for sig, grace in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 0.0)):
        try:
            os.killpg(0, sig) if sig == signal.SIGKILL else _signal_group_but_me(sig)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + grace
        while child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
    return 128 + signal.SIGTERM


def _signal_group_but_me(sig: int) -> None:
    signal.signal(sig, signal.SIG_IGN)
    os.killpg(0, sig)


# ---------------------------------------------------------------- the embedded Prefect server


def embedded_prefect_server():
    """Start Prefect's ephemeral API server now (from the main thread), in its own session and with a parent-death
    signal; Prefect's clients then use it as they would their own. None when ``PREFECT_API_URL`` is set or ephemeral
    mode is off. RuntimeError (Prefect's message) when it does not start in time.

    Prefect's server package (FastAPI, SQLAlchemy, its background workers: about 2 s of CPU to import) is imported
    only when the server starts here; a run against a server (``PREFECT_API_URL``) never imports it."""
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_EPHEMERAL_ENABLED

    if PREFECT_API_URL.value() or not PREFECT_SERVER_EPHEMERAL_ENABLED.value():
        return None
    from prefect.server.api.server import SubprocessASGIServer

    class GuardedServer(SubprocessASGIServer):
        def _run_uvicorn_command(self) -> subprocess.Popen:
            real_popen = subprocess.Popen

            def popen(*args, **kwargs):
                return real_popen(*args, start_new_session=True, preexec_fn=die_with_parent(), **kwargs)

            subprocess.Popen = popen  # only for the call below, from the main thread
            try:
                return super()._run_uvicorn_command()
            finally:
                subprocess.Popen = real_popen

    server = GuardedServer()  # registered as Prefect's ephemeral instance: SubprocessASGIServer() returns it
    server.start()
    return server


# ---------------------------------------------------------------- signals in the CLI


class Terminated(BaseException):
    """SIGTERM asked this process to stop (a BaseException, like KeyboardInterrupt: the run ends KILLED)."""

    def __init__(self, signum: int = signal.SIGTERM) -> None:
        super().__init__(f"terminated by signal {signum}")
        self.signum = signum


_received: list[int] = []


def _on_signal(signum: int, frame) -> None:
    if _received:
        if signum == signal.SIGINT:  # a second Ctrl-C: stop at once (the server dies with us)
            os.write(2, b"interrupted again: exiting now\n")
            os._exit(130)
        return  # a repeated SIGTERM (Prefect re-sends the one it caught to this handler): already stopping
    _received.append(signum)
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise Terminated(signum)


def install_signal_handlers() -> None:
    _received.clear()
    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)


def exit_code(err: BaseException) -> int:
    """130 after SIGINT, 143 after SIGTERM (Prefect's TerminationSignal included)."""
    if _received:
        return 128 + _received[0]
    return 128 + int(getattr(err, "signum", getattr(err, "signal", signal.SIGINT if isinstance(
        err, KeyboardInterrupt) else signal.SIGTERM)))


def cancel_flow_runs(flow_run_ids: list[str], api_url: str | None, reason: str, timeout: float = 10.0) -> int:
    """Force each flow run (the CLI's, interrupted) to Cancelled on the Prefect API; how many were. Bounded: a
    server that does not answer costs ``timeout`` seconds per run, not Prefect's client retries."""
    import httpx

    from grpo.app.serve import api_auth_headers

    if api_url is None:
        from prefect.settings import PREFECT_API_URL

        api_url = PREFECT_API_URL.value()
    if not api_url:
        return 0
    done = 0
    with httpx.Client(timeout=timeout, headers=api_auth_headers()) as client:
        for flow_run_id in dict.fromkeys(flow_run_ids):
            try:
                response = client.post(f"{api_url.rstrip('/')}/flow_runs/{flow_run_id}/set_state",
                                       json={"state": {"type": "CANCELLED", "name": "Cancelled", "message": reason},
                                             "force": True})
                done += response.status_code in (200, 201)
            except httpx.HTTPError:
                continue
    return done


class CancelWatch:
    """Cancel from the Prefect UI for a run the CLI started. A served or worker-run flow run is cancelled by its
    runner (it sends SIGTERM); nothing supervises ``grpo run``'s own flow run, so a Cancel in the UI only marked it
    Cancelling while training went on. This thread polls the CLI's flow runs (``flow_run_ids``, filled as they start)
    and, when one is Cancelling or Cancelled, calls ``on_cancel`` with its id once; by default that sends this process
    SIGTERM: the run stops as it does on SIGTERM (checkpoint at the current step, MLflow run KILLED, flow runs
    Cancelled).

    Each poll is one ``POST /flow_runs/filter`` for all of the runs, on one HTTP client kept for the thread's life.
    A request per run on a new client each time (one per subflow, every 2 s, each building a TLS context even for
    plain http) cost a tiny-preset run about 3 s of CPU and the server a request per subflow per poll."""

    CANCELLED_TYPES = ("CANCELLING", "CANCELLED")

    def __init__(self, flow_run_ids: list[str], api_url: str | None, interval: float = 2.0,
                 on_cancel: Callable[[str], None] | None = None) -> None:
        import threading

        from grpo.app.serve import api_auth_headers

        self.flow_run_ids, self.api_url, self.interval = flow_run_ids, api_url, interval
        # read here, not on the thread: Prefect's settings context (where a caller's settings live) is the caller's
        self.headers = api_auth_headers()
        self.on_cancel = on_cancel or (lambda _flow_run_id: os.kill(os.getpid(), signal.SIGTERM))
        self.polls = 0  # polls with runs to watch
        self.requests = 0  # HTTP responses the watch received (one per poll)
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="grpo-cancel-watch", daemon=True)

    def __enter__(self) -> CancelWatch:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()

    def _cancelled(self, client, url: str) -> str | None:
        """The id of one watched flow run that is Cancelling or Cancelled, or None (also when the server does not
        answer: the next poll asks again)."""
        import httpx

        ids = list(dict.fromkeys(self.flow_run_ids))
        if not ids:
            return None
        self.polls += 1
        body = {"flow_runs": {"id": {"any_": ids}, "state": {"type": {"any_": list(self.CANCELLED_TYPES)}}},
                "limit": 1}
        try:
            response = client.post(f"{url.rstrip('/')}/flow_runs/filter", json=body, timeout=10)
            runs = response.json() if response.status_code == 200 else []
        except (httpx.HTTPError, ValueError):
            return None
        return runs[0]["id"] if runs and isinstance(runs, list) else None

    def _loop(self) -> None:
        import httpx

        url = self.api_url
        def counted(_response) -> None:
            self.requests += 1

        # the team's server (``grpo team up``) answers 401 to a request without its auth string: every poll read
        # "nothing cancelled" and a Cancel in the UI never reached the run
        with httpx.Client(event_hooks={"response": [counted]}, headers=self.headers) as client:
            while not self.done.wait(self.interval):
                if url is None:
                    from prefect.settings import PREFECT_API_URL

                    url = PREFECT_API_URL.value()
                    if not url:
                        continue
                flow_run_id = self._cancelled(client, url)
                if flow_run_id is not None and not self.done.is_set():
                    self.done.set()
                    self.on_cancel(flow_run_id)
                    return


if __name__ == "__main__":
    sys.exit(_guard(sys.argv[1:]))
