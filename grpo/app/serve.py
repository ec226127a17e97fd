"""``grpo serve`` and ``grpo deploy``: the platform's flows on a running Prefect server.

``grpo serve`` is the one-command local setup: it registers the pipeline flow (and the sweep flow) as deployments
of the Prefect server at ``PREFECT_API_URL`` and runs their flow runs on this machine (subprocesses of this one)
until Ctrl-C or SIGTERM, with no work pool or worker (Prefect's runner, as ``prefect.serve``). The run form in the
Prefect UI starts from the ``tiny`` preset (or ``--config FILE|PRESET``); ``--schedule CRON`` makes the sweep (or the
pipeline) recur.

``grpo deploy`` is ``prefect deploy`` over ``infra/prefect.yaml`` (deployments to work pools, run by workers), with
the checks done first so a missing server, work pool or flow file is one line, and with a fix for Prefect 3.8.8's
``prefect deploy`` against this project's FastAPI (see :func:`_patch_worker_lookup`).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any, Callable

import yaml

from grpo.errors import GRPOPlatformError

SWEEP_MODULE = "flows.sweep"

# Defaults of the sweep's run form (the same as the `nightly` deployment in infra/prefect.yaml): three learning rates,
# each trial 50 steps (the tiny preset gains most of its accuracy in its first 50), so the form's defaults finish in
# minutes on 2 cores.
SWEEP_PARAMETERS: dict[str, Any] = {
    "space": {"sampler": "grid", "params": {"grpo.learning_rate": [5.0e-5, 1.0e-4, 2.0e-4]}},
    "max_steps": 50,
    "max_concurrency": 1,
    "metric": "eval_accuracy_after",
    "direction": "maximize",
}


class ServeError(GRPOPlatformError):
    """No Prefect server to serve or deploy to, or a bad option (schedule, config, work pool)."""


# ---------------------------------------------------------------- the server


def api_url() -> str:
    """``PREFECT_API_URL`` (environment or Prefect profile), or :class:`ServeError` when none is set."""
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    if not url:
        raise ServeError(
            "PREFECT_API_URL is not set: start a server (`grpo ui`, or `prefect server start`) and "
            "export PREFECT_API_URL=http://127.0.0.1:4200/api"
        )
    return url.rstrip("/")


def server_patience() -> tuple[float, float]:
    """How long a Prefect server that accepts connections may take to answer, as Prefect's own client waits for one
    request: (seconds per try, ``PREFECT_API_REQUEST_TIMEOUT``; seconds in all, ``1 + PREFECT_CLIENT_MAX_RETRIES``
    tries: 6 minutes by default). Everything ``grpo serve`` does after its check goes through that client, so the
    check is no less patient than the serving it guards."""
    from prefect.settings import PREFECT_API_REQUEST_TIMEOUT, PREFECT_CLIENT_MAX_RETRIES

    per_try = float(PREFECT_API_REQUEST_TIMEOUT.value())
    return per_try, per_try * (1 + int(PREFECT_CLIENT_MAX_RETRIES.value()))


def basic_auth(credentials: str) -> dict[str, str]:
    """The ``Authorization`` header for ``user:password`` (HTTP basic auth, as Prefect's client sends
    ``PREFECT_API_AUTH_STRING`` and MLflow's sends ``MLFLOW_TRACKING_USERNAME``/``PASSWORD``)."""
    import base64

    return {"Authorization": f"Basic {base64.b64encode(credentials.encode()).decode()}"}


def api_auth_headers() -> dict[str, str]:
    """The headers every request of ours to the Prefect API carries: basic auth with ``PREFECT_API_AUTH_STRING``
    when it is set (``grpo team up``'s server answers 401 without), none otherwise."""
    from prefect.settings import PREFECT_API_AUTH_STRING

    credentials = PREFECT_API_AUTH_STRING.value()
    return basic_auth(credentials) if credentials else {}


def server_get(path: str, url: str | None = None, on_wait: Callable[[str], None] | None = None,
               first_wait: float = 5.0, patience: float | None = None):
    """``GET {url}/{path}`` on the Prefect API, patient with a busy server and quick with an absent one.

    Nothing listening (connection refused, unknown host) is :class:`ServeError` at once. A server that accepted the
    connection but has not answered in ``first_wait`` seconds is busy (its event loop held by SQLite or a starved
    CPU: a loaded 2-core machine held the shared test server's for longer than 5 s): ``on_wait`` gets one line
    saying so, and the request is asked again until ``patience`` seconds (:func:`server_patience`) have passed. A
    503 (its SQLite held by another writer) is waited out the same way."""
    import time

    import httpx

    url = url or api_url()
    per_try, default_patience = server_patience()
    patience = default_patience if patience is None else patience
    deadline = time.monotonic() + patience
    wait, said = first_wait, False
    while True:
        left = deadline - time.monotonic()
        try:
            # the connect stays short: a listening server completes it in the kernel, even while its process is busy
            response = httpx.get(f"{url}/{path}", headers=api_auth_headers(),
                                 timeout=httpx.Timeout(max(min(wait, left), 0.1), connect=5.0))
        except (httpx.ConnectError, httpx.UnsupportedProtocol, httpx.InvalidURL) as err:
            reason = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise ServeError(f"no Prefect server at {url} ({reason}); start one with `grpo ui` or "
                             "`prefect server start`, or fix PREFECT_API_URL") from None
        except httpx.TransportError as err:  # a timeout, or a connection the busy server dropped
            if time.monotonic() >= deadline:
                raise ServeError(f"the Prefect server at {url} accepts connections but did not answer "
                                 f"GET /{path} in {patience:.0f} s ({type(err).__name__}); is it hung? "
                                 "(PREFECT_API_REQUEST_TIMEOUT and PREFECT_CLIENT_MAX_RETRIES set the wait)") from None
            response = None
        if response is not None and response.status_code == 401:  # an authenticated server (`grpo team up`)
            raise ServeError(f"the Prefect server at {url} wants credentials (HTTP 401): set PREFECT_API_AUTH_STRING "
                             "(a team setup's are in its team.env: `source .grpo-team/team.env`)")
        if response is not None and (response.status_code != 503 or time.monotonic() >= deadline):
            return response
        if not said and on_wait is not None:
            bound = f"{patience / 60:.0f} min" if patience >= 120 else f"{patience:.0f} s"
            on_wait(f"the Prefect server at {url} is busy (no answer to GET /{path} in {first_wait:g} s); "
                    f"waiting for it, up to {bound} (Ctrl-C stops)")
        said = True
        if response is not None:
            time.sleep(1)
        wait = per_try  # later tries wait as long as one of Prefect's client's


def check_server(on_wait: Callable[[str], None] | None = None, patience: float | None = None) -> str:
    """The API URL of a Prefect server that answers its health check (waiting for a busy one, see
    :func:`server_get`); :class:`ServeError` otherwise."""
    url = api_url()
    response = server_get("health", url, on_wait=on_wait, patience=patience)
    if response.status_code != 200:
        raise ServeError(f"the Prefect server at {url} is not healthy (HTTP {response.status_code} from /health)")
    return url


# ---------------------------------------------------------------- grpo serve


def check_cron(cron: str, timezone: str | None = None) -> None:
    """Validate ``--schedule`` / ``--timezone`` as Prefect's ``CronSchedule`` (croniter) does; :class:`ServeError`
    naming the option and its value otherwise. Needs no server: ``grpo serve`` calls it before connecting."""
    from prefect.client.schemas.schedules import CronSchedule
    from pydantic import ValidationError

    try:
        CronSchedule(cron=cron, timezone=timezone or "UTC")
    except ValidationError as err:
        first = err.errors()[0]
        option, value = ("--timezone", timezone) if first["loc"][:1] == ("timezone",) else ("--schedule", cron)
        raise ServeError(f"{option} {value!r}: {first['msg'].removeprefix('Value error, ')}") from None


def config_parameter(config_path: Path | str | None) -> dict:
    """The experiment config (a file or a preset name) as a flow parameter (JSON, YAML names): the run form's
    starting values."""
    from grpo.config import DEFAULT_PRESET, load_config

    return load_config(config_path or DEFAULT_PRESET).model_dump(mode="json", by_alias=True)


def starting_point(config_path: Path | str | None) -> dict:
    """Where a run form starts: the preset (``--config NAME`` or the default) or, for a config file, the file's config
    as the form's "Whole config", one line of JSON (Prefect's json kind) rather than a 150-line editor."""
    from grpo.config import DEFAULT_PRESET, presets

    if config_path is None or (str(config_path) in presets() and not Path(config_path).is_file()):
        return {"preset": str(config_path or DEFAULT_PRESET)}
    return {"config": {"__prefect_kind": "json", "value": json.dumps(config_parameter(config_path))}}


def pipeline_parameters(config_path: Path | str | None) -> dict:
    """The pipeline deployment's parameters: the starting point, each config section collapsed."""
    from flows.run_form import collapsed_sections

    return {**starting_point(config_path), "resume": False, **collapsed_sections()}


def sweep_available() -> bool:
    return importlib.util.find_spec(SWEEP_MODULE) is not None


def build_deployments(
    name: str = "local",
    config_path: Path | None = None,
    schedule: str | None = None,
    schedule_flow: str | None = None,
    timezone: str | None = None,
) -> list:
    """The runner deployments ``grpo serve`` serves: ``grpo-pipeline/<name>`` and, when flows/sweep.py exists,
    ``grpo-sweep/<name>``; ``schedule`` (cron) goes to ``schedule_flow`` (default: the sweep if there is one)."""
    config_parameter(config_path)  # a config that does not load is refused before anything is served
    source = config_path or "the tiny preset"
    target = schedule_flow or ("sweep" if sweep_available() else "pipeline")
    if target == "sweep" and not sweep_available():
        raise ServeError(f"--schedule-flow sweep: the module {SWEEP_MODULE} is not installed")
    if schedule is not None:
        check_cron(schedule, timezone)

    def schedule_for(flow_kind: str) -> dict:
        if schedule is None or target != flow_kind:
            return {}
        return {"cron": schedule, **({"timezone": timezone} if timezone else {})}

    from prefect.types.entrypoint import EntrypointType

    from flows.pipeline import grpo_pipeline

    # flows is an installed package: entrypoints by module path run the same code whatever the working directory.
    module = {"entrypoint_type": EntrypointType.MODULE_PATH}
    deployments = [grpo_pipeline.to_deployment(
        name=name, parameters=pipeline_parameters(config_path), tags=["grpo", "served"], **module,
        description=f"GRPO pipeline served by `grpo serve`; the form starts from {source}.",
        **schedule_for("pipeline"))]
    if sweep_available():
        from flows.sweep import grpo_sweep

        deployments.append(grpo_sweep.to_deployment(
            name=name, parameters={**starting_point(config_path), **SWEEP_PARAMETERS}, tags=["grpo", "served", "sweep"],
            **module,
            description="GRPO sweep served by `grpo serve`: one pipeline run per trial of `space`.",
            **schedule_for("sweep")))
    return deployments


# A kind Prefect's server does not know: hydration replaces it with its value, unhydrated (see keep_json_kinds).
_PASS_THROUGH_KIND = "grpo-keep"


def keep_json_kinds(deployments: list) -> None:
    """Keep a re-served deployment's collapsed form. Prefect's server stores a created deployment's parameters as
    given, but hydrates an UPDATED one's: each ``{"__prefect_kind": "json", "value": "{}"}`` becomes ``{}``, and from
    the second ``grpo serve`` on every config section opened into its fields (a 14,500 px form). For a deployment
    that exists already, each json-kind value is wrapped in a kind the server does not know, which hydration
    replaces with the json-kind value itself; a run created from the deployment hydrates that as usual."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        for d in deployments:
            try:
                client.read_deployment_by_name(f"{d.flow_name}/{d.name}")
            except ObjectNotFound:
                continue
            d.parameters = {k: {"__prefect_kind": _PASS_THROUGH_KIND, "value": v}
                            if isinstance(v, dict) and v.get("__prefect_kind") == "json" else v
                            for k, v in d.parameters.items()}


def serve(deployments: list, limit: int | None = 1, echo=print) -> None:
    """Serve until Ctrl-C or SIGTERM (what ``prefect.serve`` does, with the runner of :func:`_runner`); the
    deployments' schedules are paused when serving stops."""
    import asyncio
    import signal

    from prefect.exceptions import TerminationSignal

    keep_json_kinds(deployments)
    quiet_server_gone_noise()
    for d in deployments:
        when = f", schedule {d.schedules[0].schedule.cron}" if d.schedules else ""
        echo(f"serving {d.flow_name}/{d.name}{when}")
    on_sigterm = signal.getsignal(signal.SIGTERM)
    url = api_url()
    try:
        runner = _runner(limit, url, echo)
        for d in deployments:
            runner.add_deployment(d)  # registers it with the server
        asyncio.run(_serve_until_interrupted(runner, url, echo))  # installs the runner's SIGTERM handler
    except (KeyboardInterrupt, TerminationSignal, asyncio.CancelledError):
        pass
    finally:
        signal.signal(signal.SIGTERM, on_sigterm)  # the runner's handler needs its loop, which has ended
        pause_served(deployments, url)


class _ServerGoneNoise(logging.Filter):
    """While its server is down, Prefect's runner logs the cancellation observer's connection failures with their
    ~40-line tracebacks (one line says it), and asyncio then logs a Prefect bug (the observer's done-callback calls
    anyio outside an event loop: ``NoEventLoopError``) with another. Kept: the observer's one-line messages."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == "asyncio":
            return "FlowRunCancellingObserver" not in str(record.msg % record.args if record.args else record.msg)
        record.exc_info = record.exc_text = None
        return True


class _AtCapacityOnce(logging.Filter):
    """Prefect's runner says "N scheduled runs skipped (at capacity)" at every poll (about every 10 s) while a run
    waits for a free slot (``--limit``): said again only when N changes, or after :attr:`REPEAT_SECONDS`."""

    REPEAT_SECONDS = 300.0

    def __init__(self) -> None:
        super().__init__()
        self.last: tuple[object, float] | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg != "%d scheduled runs skipped (at capacity)":
            return True
        count, now = record.args[0] if record.args else None, time.monotonic()
        if self.last is not None and self.last[0] == count and now - self.last[1] < self.REPEAT_SECONDS:
            return False
        self.last = (count, now)
        return True


def quiet_server_gone_noise() -> None:
    """Install :class:`_ServerGoneNoise` and :class:`_AtCapacityOnce` (idempotent)."""
    for name in ("prefect.FlowRunCancellingObserver", "asyncio"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _ServerGoneNoise) for f in logger.filters):
            logger.addFilter(_ServerGoneNoise())
    runner = logging.getLogger("prefect.runner")
    if not any(isinstance(f, _AtCapacityOnce) for f in runner.filters):
        runner.addFilter(_AtCapacityOnce())


SERVER_CHECK_SECONDS = 2.0
SERVER_CHECKS_REFUSED = 3
"""``grpo serve`` stops once its Prefect server has refused connections this many checks in a row (a server that is
merely busy still accepts them: the kernel completes the connect): Prefect's runner would otherwise print its
services' connection tracebacks, give up cancelling runs, and retry every call for about a minute."""


def server_listens(url: str, timeout: float = 2.0) -> bool:
    """Whether anything accepts a TCP connection at the API URL's host and port (no request: a stopped server
    refuses at once, where Prefect's client, having connected once, retries a refused connection with exponential
    back-off for about a minute per request)."""
    import socket
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        with socket.create_connection((parts.hostname or "127.0.0.1", port), timeout=timeout):
            return True
    except OSError:
        return False


def _gone(url: str) -> str:
    return (f"the Prefect server at {url} is gone: serving stops now, its schedules not paused (pause them in the "
            "Prefect UI once it is back)")


def _stop_now(why: str, code: int, echo) -> None:
    """End ``grpo serve`` at once: its flow runs (subprocesses) are interrupted as Ctrl-C interrupts them (they
    checkpoint), and the process exits without the runner's shutdown, whose calls to a gone server would each be
    retried for about a minute (Ctrl-C on a ``grpo serve`` whose server had stopped took minutes, twice pressed)."""
    import os
    import signal

    import psutil

    echo(why)
    for child in psutil.Process().children():
        try:
            child.send_signal(signal.SIGINT)
        except psutil.Error:
            pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


async def _serve_until_interrupted(runner, url: str, echo) -> None:
    """``runner.start()`` with Ctrl-C handled as asyncio.run handles it (the first cancels the runner, which pauses
    the schedules and stops its runs), except that a Ctrl-C while the Prefect server does not listen, or a second
    Ctrl-C, stops serving at once (:func:`_stop_now`)."""
    import asyncio
    import signal

    loop = asyncio.get_running_loop()
    main = asyncio.current_task()
    presses = 0

    def on_sigint() -> None:
        nonlocal presses
        presses += 1
        if presses > 1:
            _stop_now("second Ctrl-C: serving stops now; if the schedules still run, pause them in the Prefect UI",
                      130, echo)
        if not server_listens(url):
            _stop_now(_gone(url), 130, echo)
        echo("stopping: pausing the schedules and stopping the runs in progress (Ctrl-C again stops at once)")
        main.cancel()

    async def watch_server() -> None:
        refused = 0
        while True:
            await asyncio.sleep(SERVER_CHECK_SECONDS)
            listens = await asyncio.to_thread(server_listens, url)
            refused = 0 if listens else refused + 1
            if refused >= SERVER_CHECKS_REFUSED:
                _stop_now(f"the Prefect server at {url} stopped (it refuses connections): serving stops; start it "
                          "again, then `grpo serve` (pause the schedules in the Prefect UI if they should not run)",
                          1, echo)

    loop.add_signal_handler(signal.SIGINT, on_sigint)
    watcher = asyncio.create_task(watch_server())
    try:
        await runner.start()
    finally:
        watcher.cancel()
        loop.remove_signal_handler(signal.SIGINT)


def _runner(limit: int | None, url: str | None = None, echo=print):
    """Prefect's ``Runner`` (paused schedules on shutdown, at most ``limit`` runs at once) whose SIGTERM handler stops
    it. Prefect's handler calls ``self.stop()`` from inside the running event loop, where ``async_dispatch`` hands
    back the ``astop()`` coroutine instead of running it: "coroutine 'Runner.astop' was never awaited" on the
    console, and the runner's stop (cancelling the flow runs in progress) skipped before its ``sys.exit(0)``. A
    SIGTERM while the Prefect server does not listen stops serving at once (:func:`_stop_now`)."""
    import asyncio
    import signal

    from prefect.exceptions import TerminationSignal
    from prefect.runner import Runner

    class StoppingRunner(Runner):
        def handle_sigterm(self, *args: Any, **kwargs: Any) -> None:
            if not self.started:  # still starting, or a second SIGTERM while stopping: unwind now, as Ctrl-C does
                raise TerminationSignal(signal.SIGTERM)
            if url is not None and not server_listens(url):
                _stop_now(_gone(url), 143, echo)
            self._logger.info("SIGTERM received, initiating graceful shutdown...")
            # threadsafe: it also wakes the loop, which a plain create_task from a signal handler leaves asleep in
            # its selector until something else wakes it (as asyncio.run's own SIGINT handler knows)
            self._stopping = asyncio.run_coroutine_threadsafe(self.astop(), asyncio.get_running_loop())

    return StoppingRunner(pause_on_shutdown=True, limit=limit)


def pause_served(deployments: list, url: str | None = None) -> None:
    """Pause the served deployments' schedules. Prefect's runner pauses them only once it has started; a Ctrl-C
    between registering the deployments and that point left a schedule firing runs that no process serves."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    url = url or api_url()
    if not server_listens(url):  # each call to a gone server is retried for about a minute
        print(f"warning: the Prefect server at {url} is gone: the served schedules are not paused; "
              "pause them in the Prefect UI once it is back", file=sys.stderr)
        return
    try:
        with get_client(sync_client=True) as client:
            for d in deployments:
                try:
                    deployment = client.read_deployment_by_name(f"{d.flow_name}/{d.name}")
                except ObjectNotFound:  # interrupted before it was registered
                    continue
                if not deployment.paused:
                    client.pause_deployment(deployment.id)
    except Exception as err:  # the server is gone too: say so in one line, Ctrl-C must not end in a traceback
        print(f"warning: could not pause the served schedules ({type(err).__name__}: {err}); "
              "pause them in the Prefect UI", file=sys.stderr)


# ---------------------------------------------------------------- grpo deploy


def _patch_worker_lookup() -> None:
    """Prefect 3.8.8's ``prefect deploy`` lists the pool's online workers after creating each deployment and sends
    ``"offset": null, "limit": null``; FastAPI 0.154 (what this project's pin resolves to) no longer turns an explicit
    null into the parameter's default and answers 422, so the CLI dies after the first deployment. Send the
    server's defaults instead."""
    from prefect.client.orchestration._work_pools.client import WorkPoolAsyncClient

    original = WorkPoolAsyncClient.read_workers_for_work_pool
    if getattr(original, "_grpo_patched", False):
        return

    async def read_workers_for_work_pool(self, work_pool_name, worker_filter=None, offset=None, limit=None):
        from prefect.settings import PREFECT_API_DEFAULT_LIMIT

        return await original(self, work_pool_name, worker_filter=worker_filter, offset=offset or 0,
                              limit=limit if limit is not None else PREFECT_API_DEFAULT_LIMIT.value())

    read_workers_for_work_pool._grpo_patched = True
    WorkPoolAsyncClient.read_workers_for_work_pool = read_workers_for_work_pool


def deployment_entries(prefect_file: Path) -> list[dict]:
    try:
        data = yaml.safe_load(prefect_file.read_text())
    except FileNotFoundError:
        raise ServeError(f"{prefect_file}: file not found") from None
    except yaml.YAMLError as err:
        raise ServeError(f"{prefect_file}: YAML syntax error: {str(err).splitlines()[0]}") from None
    entries = (data or {}).get("deployments") or []
    if not entries:
        raise ServeError(f"{prefect_file}: no deployments")
    return entries


def check_deploy(prefect_file: Path, names: list[str] | None = None, check_pools: bool = True,
                 on_wait: Callable[[str], None] | None = None) -> list[str]:
    """Check what ``prefect deploy`` needs before it runs: a server, every named deployment's entrypoint file and
    work pool. Returns the deployment names to deploy (all of them by default)."""
    url = check_server(on_wait)
    entries = deployment_entries(prefect_file)
    by_name = {e.get("name"): e for e in entries}
    wanted = names or list(by_name)
    for name in wanted:
        entry = by_name.get(name.split("/")[-1])
        if entry is None:
            raise ServeError(f"{prefect_file}: no deployment named {name!r}; there are {', '.join(by_name)}")
        path = Path(str(entry.get("entrypoint", "")).split(":")[0])
        if not (Path.cwd() / path).is_file():
            raise ServeError(f"deployment {name!r}: entrypoint {path} not found under {Path.cwd()} (deploy from the "
                             "repository root)")
        pool = (entry.get("work_pool") or {}).get("name")
        if check_pools and pool and server_get(f"work_pools/{pool}", url, on_wait).status_code == 404:
            template = Path("infra") / "work-pools" / f"{pool}.json"  # deploys run from the repository root
            hint = f" --base-job-template {template}" if (Path.cwd() / template).is_file() else ""
            raise ServeError(f"deployment {name!r}: work pool {pool!r} does not exist; create it first: "
                             f"prefect work-pool create {pool} --type process{hint}")
    return wanted


def prefect_deploy(prefect_file: Path, names: list[str] | None = None, extra: list[str] | None = None,
                   on_wait: Callable[[str], None] | None = None) -> int:
    """``prefect --no-prompt deploy --prefect-file FILE --name ... [extra]`` in this process; its exit code.
    ``on_wait`` gets a line when the server is busy (see :func:`server_get`)."""
    from prefect.cli import app

    extra = list(extra or [])
    # with --pool the deployments go to another pool than the file names; `prefect deploy` checks that one
    wanted = check_deploy(prefect_file, names, check_pools=not {"--pool", "-p"} & set(extra), on_wait=on_wait)
    _patch_worker_lookup()
    argv = ["prefect", "--no-prompt", "deploy", "--prefect-file", str(prefect_file)]
    for name in wanted:
        argv += ["--name", name]
    argv += extra
    saved = sys.argv
    sys.argv = argv
    try:
        app()
    except SystemExit as done:
        return done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    finally:
        sys.argv = saved
    return 0

