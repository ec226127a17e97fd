"""``grpo team up|status|down``: the shared setup of ``infra/compose.yaml`` started natively, without Docker.

What runs, all from one folder (the team home: ``--home``, ``$GRPO_TEAM_HOME``, else ``./.grpo-team``):

* PostgreSQL (Debian's ``postgresql`` server programs) on 127.0.0.1 with password authentication, its data in
  ``postgres/data``; as root it runs as the ``postgres`` user, which PostgreSQL requires;
* the Prefect server on its own database, with Prefect's API auth string (``PREFECT_SERVER_API_AUTH_STRING``);
* the MLflow tracking server on its own database, behind MLflow's basic-auth (users ``admin`` and ``worker``, the
  auth store a third database), artifacts served through it (``--artifacts-destination``), with the platform's
  MLflow app settings (``--app-name grpo-auth``, grpo/app/mlflow_app.py);
* the work pools of ``infra/work-pools`` and, on the first ``up``, the deployments of ``infra/prefect.yaml``;
* the automation that ends a dead worker's flow runs Crashed (:func:`zombie_automation`).

The passwords are generated at the first ``up`` into ``secrets.json`` (0600) and reach the servers through their
environment and a 0600 auth config, never a command line (``ps`` shows command lines to every user). Clients and
workers ``source team.env`` (0600: the URLs and the ``worker`` credentials); ``admin.env`` holds MLflow's admin.
The servers are detached (their own sessions): ``up`` returns, ``state.json`` names their processes for ``status``
and ``down``; their output goes to ``logs/``. Data lives on across ``down`` and ``up``.
"""

from __future__ import annotations

import json
import os
import pwd
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from grpo.app.serve import basic_auth
from grpo.app.ui import MLFLOW_STARLETTE_WARNING, _tail, port_taken, prefect_server_env, wait_healthy
from grpo.errors import GRPOPlatformError

POOLS = {"cpu-pool": None, "gpu-pool": 1}  # infra/work-pools/NAME.json; the concurrency limit set at creation
MLFLOW_ADMIN, MLFLOW_WORKER = "admin", "worker"
PG_SUPERUSER = "postgres"
# A hung server's bound, not a speed limit: Prefect's migrations on a fresh database take minutes on a busy machine.
HEALTH_TIMEOUT = 600
SECRET_NAMES = ("postgres", "prefect_db", "mlflow_db", "prefect_api", "mlflow_admin", "mlflow_worker", "flask")


class TeamError(GRPOPlatformError):
    """The team setup can not start, or is already running: one line for the user."""


def default_home() -> Path:
    return Path(os.environ.get("GRPO_TEAM_HOME") or Path.cwd() / ".grpo-team")


@dataclass(frozen=True)
class Ports:
    prefect: int = 4200
    mlflow: int = 5000
    postgres: int = 5432


@dataclass(frozen=True)
class Team:
    """The team home's layout."""

    home: Path

    @property
    def secrets(self) -> Path:
        return self.home / "secrets.json"

    @property
    def state(self) -> Path:
        return self.home / "state.json"

    @property
    def team_env(self) -> Path:
        return self.home / "team.env"

    @property
    def admin_env(self) -> Path:
        return self.home / "admin.env"

    @property
    def logs(self) -> Path:
        return self.home / "logs"

    @property
    def pg_dir(self) -> Path:
        return self.home / "postgres"

    @property
    def pg_data(self) -> Path:
        return self.pg_dir / "data"

    @property
    def mlflow_dir(self) -> Path:
        return self.home / "mlflow"


# ---------------------------------------------------------------- files


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` readable by its owner only (0600 from the first byte: created that way, then
    renamed over the old file)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(text)
    os.replace(tmp, path)


def load_secrets(team: Team) -> dict[str, str]:
    """The team's passwords, generated once (the databases and users they created live on)."""
    if team.secrets.is_file():
        return json.loads(team.secrets.read_text())
    values = {name: secrets.token_urlsafe(24) for name in SECRET_NAMES}
    write_private(team.secrets, json.dumps(values, indent=1) + "\n")
    return values


def prefect_auth(secret: dict[str, str]) -> str:
    """The Prefect server's API auth string (``user:password``; Prefect's auth is one shared string)."""
    return f"grpo:{secret['prefect_api']}"


def client_env(urls: dict[str, str], secret: dict[str, str], user: str) -> dict[str, str]:
    """What a client (a person's shell, a worker, ``grpo run``) needs to reach the team's servers as ``user``."""
    return {"PREFECT_API_URL": f"{urls['prefect']}/api", "PREFECT_API_AUTH_STRING": prefect_auth(secret),
            "MLFLOW_TRACKING_URI": urls["mlflow"], "MLFLOW_TRACKING_USERNAME": user,
            "MLFLOW_TRACKING_PASSWORD": secret[f"mlflow_{user}"]}


def _env_file(values: dict[str, str]) -> str:
    return "".join(f"export {k}={v}\n" for k, v in values.items())  # the values are URLs and url-safe tokens


# ---------------------------------------------------------------- PostgreSQL


def pg_bin() -> Path:
    """The folder of PostgreSQL's server programs: Debian's newest ``/usr/lib/postgresql/N/bin``, else ``PATH``."""
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"),
                   key=lambda p: int(p.parts[-3]) if p.parts[-3].isdigit() else 0)  # /usr/lib/postgresql/N/bin/pg_ctl
    if found:
        return found[-1].parent
    on_path = shutil.which("pg_ctl")
    if on_path and shutil.which("initdb"):
        return Path(on_path).parent
    raise TeamError("PostgreSQL's server programs (initdb, pg_ctl) are not installed: install Debian's postgresql "
                    "package (apt-get install postgresql)")


def pg_account() -> pwd.struct_passwd | None:
    """Whom PostgreSQL runs as: this user, or ``postgres`` when this is root (PostgreSQL refuses to run as root)."""
    if os.geteuid() != 0:
        return None
    try:
        return pwd.getpwnam(PG_SUPERUSER)
    except KeyError:
        raise TeamError("running as root, and PostgreSQL will not: there is no 'postgres' user to run it as "
                        "(Debian's postgresql package creates it; or run grpo team up as another user)") from None


def _as_pg(account: pwd.struct_passwd | None, cmd: list[str], cwd: Path, **kw) -> subprocess.CompletedProcess:
    ids = {} if account is None else {"user": account.pw_uid, "group": account.pw_gid, "extra_groups": []}
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, **ids, **kw)


def _pg_failed(what: str, result: subprocess.CompletedProcess, log: Path | None = None) -> TeamError:
    said = " | ".join((result.stderr or result.stdout or "").strip().splitlines()[-3:])
    where = f"; its log {log} ends: {_tail(log)}" if log else ""
    return TeamError(f"PostgreSQL: {what} failed ({said}){where}")


def init_postgres(team: Team, bin_dir: Path, account: pwd.struct_passwd | None, secret: dict[str, str]) -> None:
    """A new cluster in the team home: password logins over TCP on 127.0.0.1 only (no Unix socket: its path would
    be too long under a deep home, and every login then goes through the password)."""
    team.pg_dir.mkdir(mode=0o700, exist_ok=True)
    if account is not None:
        os.chown(team.pg_dir, account.pw_uid, account.pw_gid)
        reach = _as_pg(account, ["test", "-w", str(team.pg_dir)], cwd=Path("/"))
        if reach.returncode != 0:
            raise TeamError(f"PostgreSQL runs as user {account.pw_name}, who can not reach {team.pg_dir}: choose a "
                            "--home whose parent folders others may enter (chmod o+x), e.g. under /srv or /var/lib")
    pwfile = team.pg_dir / "superuser-password"
    write_private(pwfile, secret["postgres"] + "\n")
    if account is not None:
        os.chown(pwfile, account.pw_uid, account.pw_gid)
    try:
        result = _as_pg(account, [str(bin_dir / "initdb"), "-D", str(team.pg_data), "-U", PG_SUPERUSER,
                                  "--auth=scram-sha-256", f"--pwfile={pwfile}", "-E", "UTF8", "--locale=C"],
                        cwd=team.pg_dir)
    finally:
        pwfile.unlink(missing_ok=True)
    if result.returncode != 0:
        shutil.rmtree(team.pg_data, ignore_errors=True)
        raise _pg_failed("initdb", result)
    with (team.pg_data / "postgresql.conf").open("a") as conf:
        conf.write("\n# grpo team up\nlisten_addresses = '127.0.0.1'\nunix_socket_directories = ''\n")


def start_postgres(team: Team, bin_dir: Path, account: pwd.struct_passwd | None, port: int) -> None:
    log = team.pg_dir / "postgres.log"
    result = _as_pg(account, [str(bin_dir / "pg_ctl"), "-D", str(team.pg_data), "-l", str(log), "-o", f"-p {port}",
                              "-w", "-t", str(HEALTH_TIMEOUT), "start"], cwd=team.pg_dir)
    if result.returncode != 0:
        raise _pg_failed("start", result, log)


def pg_running(team: Team, bin_dir: Path, account: pwd.struct_passwd | None) -> bool:
    if not (team.pg_data / "PG_VERSION").is_file():
        return False
    return _as_pg(account, [str(bin_dir / "pg_ctl"), "-D", str(team.pg_data), "status"], cwd=team.pg_dir
                  ).returncode == 0


def stop_postgres(team: Team, bin_dir: Path, account: pwd.struct_passwd | None) -> None:
    _as_pg(account, [str(bin_dir / "pg_ctl"), "-D", str(team.pg_data), "-m", "fast", "-w", "stop"], cwd=team.pg_dir)


def create_databases(bin_dir: Path, port: int, secret: dict[str, str]) -> None:
    """The roles and databases of a new cluster: ``prefect`` owns Prefect's, ``mlflow`` MLflow's store and its auth
    store. The SQL goes through psql's stdin (the passwords stay off command lines)."""
    sql = (f"CREATE ROLE prefect LOGIN PASSWORD '{secret['prefect_db']}';\n"
           "CREATE DATABASE prefect OWNER prefect;\n"
           f"CREATE ROLE mlflow LOGIN PASSWORD '{secret['mlflow_db']}';\n"
           "CREATE DATABASE mlflow OWNER mlflow;\n"
           "CREATE DATABASE mlflow_auth OWNER mlflow;\n")
    result = subprocess.run([str(bin_dir / "psql"), "-X", "-q", "-v", "ON_ERROR_STOP=1", "-h", "127.0.0.1", "-p",
                             str(port), "-U", PG_SUPERUSER, "-d", "postgres", "-f", "-"], input=sql, text=True,
                            capture_output=True, env={**os.environ, "PGPASSWORD": secret["postgres"]})
    if result.returncode != 0:
        raise _pg_failed("creating the databases", result)


# ---------------------------------------------------------------- the servers' processes


def _process(pid: int, created: float):
    """The running process ``pid`` if it is the one started then (not another that reused its id), else None."""
    import psutil

    try:
        proc = psutil.Process(pid)
        return proc if abs(proc.create_time() - created) < 1 and proc.status() != psutil.STATUS_ZOMBIE else None
    except psutil.Error:
        return None


def _detached(cmd: list[str], env: dict[str, str], log: Path, cwd: Path) -> dict:
    """Start ``cmd`` in its own session (it outlives ``grpo team up``; ``down`` stops its whole group)."""
    import psutil

    with log.open("a") as out:
        proc = subprocess.Popen(cmd, env=env, cwd=cwd, start_new_session=True, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT)
    return {"pid": proc.pid, "created": psutil.Process(proc.pid).create_time(), "log": str(log), "_popen": proc}


def _stop_group(entry: dict) -> None:
    """SIGTERM to the server's process group, SIGKILL to what is left of it after 20 s."""
    proc = _process(entry["pid"], entry["created"])
    if proc is None:
        return
    for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
        try:
            os.killpg(entry["pid"], sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            try:
                os.killpg(entry["pid"], 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)


def _request(method: str, url: str, credentials: str, body: dict | None = None) -> tuple[int, dict | list]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={**basic_auth(credentials), "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as response:
            return response.status, json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as err:
        return err.code, {}


def ensure_worker_user(mlflow_url: str, secret: dict[str, str]) -> None:
    """MLflow's ``worker`` user (runs and workers log as it), created by the admin once."""
    admin = f"{MLFLOW_ADMIN}:{secret['mlflow_admin']}"
    status, _ = _request("GET", f"{mlflow_url}/api/2.0/mlflow/users/get?username={MLFLOW_WORKER}", admin)
    if status == 200:
        return
    status, _ = _request("POST", f"{mlflow_url}/api/2.0/mlflow/users/create", admin,
                         {"username": MLFLOW_WORKER, "password": secret["mlflow_worker"]})
    if status != 200:
        raise TeamError(f"MLflow: creating the user {MLFLOW_WORKER!r} failed (HTTP {status})")


def ensure_pools(prefect_api: str, credentials: str, project: Path) -> bool:
    """The work pools of ``infra/work-pools`` with their base job templates (updated to the files on every ``up``);
    a new pool gets its concurrency limit (a later change in the UI is kept). True when a pool was new."""
    created = False
    for name, limit in POOLS.items():
        template = json.loads((project / "infra" / "work-pools" / f"{name}.json").read_text())
        status, _ = _request("POST", f"{prefect_api}/work_pools/", credentials,
                             {"name": name, "type": "process", "base_job_template": template,
                              "concurrency_limit": limit})
        if status == 409:
            status, _ = _request("PATCH", f"{prefect_api}/work_pools/{name}", credentials,
                                 {"base_job_template": template})
        else:
            created = True
        if status not in (200, 201, 204):
            raise TeamError(f"Prefect: creating the work pool {name!r} failed (HTTP {status})")
    return created


# A flow run whose heartbeats stop (its worker's machine died, the worker was SIGKILLed with its runs) ends Crashed:
# Prefect's server has no such check of its own, an automation does it (Prefect's "detect zombie flows" recipe). The
# work pools' templates set PREFECT_FLOWS_HEARTBEAT_FREQUENCY (30 s, Prefect's minimum) for every run a worker starts;
# three missed beats make a zombie.
ZOMBIE_AUTOMATION = "grpo: crash flow runs whose heartbeats stopped"
ZOMBIE_AFTER_SECONDS = 90
FINAL_EVENTS = ("Completed", "Failed", "Cancelled", "Crashed")


def zombie_automation() -> dict:
    """The automation that marks a flow run Crashed when no heartbeat (nor final state) follows its last heartbeat
    within :data:`ZOMBIE_AFTER_SECONDS`."""
    beat = "prefect.flow-run.heartbeat"
    return {"name": ZOMBIE_AUTOMATION, "enabled": True,
            "description": f"A flow run of a worker that died: no heartbeat for {ZOMBIE_AFTER_SECONDS} s",
            "trigger": {"type": "event", "posture": "Proactive", "after": [beat],
                        "expect": [beat, *(f"prefect.flow-run.{state}" for state in FINAL_EVENTS)],
                        "match": {"prefect.resource.id": ["prefect.flow-run.*"]},
                        "for_each": ["prefect.resource.id"], "threshold": 1, "within": ZOMBIE_AFTER_SECONDS},
            "actions": [{"type": "change-flow-run-state", "state": "CRASHED",
                         "message": f"no heartbeat for {ZOMBIE_AFTER_SECONDS} s: its worker or machine is gone"}]}


def ensure_zombie_automation(prefect_api: str, credentials: str) -> None:
    """Create :func:`zombie_automation` unless an automation of its name exists (a change in the UI is kept)."""
    status, found = _request("POST", f"{prefect_api}/automations/filter", credentials,
                             {"automations": {"name": {"any_": [ZOMBIE_AUTOMATION]}}})
    if status == 200 and found:
        return
    status, _ = _request("POST", f"{prefect_api}/automations/", credentials, zombie_automation())
    if status not in (200, 201):
        raise TeamError(f"Prefect: creating the automation {ZOMBIE_AUTOMATION!r} failed (HTTP {status})")


# ---------------------------------------------------------------- up / status / down


@dataclass(frozen=True)
class Started:
    urls: dict[str, str]
    pools: list[str]
    deployed: bool


def _shown_host(host: str) -> str:
    """The name clients use for a server bound to ``host`` (this machine's name for all addresses)."""
    return host if host not in ("0.0.0.0", "::") else os.uname().nodename


def _urls(host: str, ports: Ports) -> dict[str, str]:
    shown = _shown_host(host)
    return {"prefect": f"http://{shown}:{ports.prefect}", "mlflow": f"http://{shown}:{ports.mlflow}",
            "postgres": f"127.0.0.1:{ports.postgres}"}


def read_state(team: Team) -> dict | None:
    try:
        return json.loads(team.state.read_text())
    except (OSError, ValueError):
        return None


def running(team: Team) -> dict[str, bool]:
    """Which of the team's processes run now (by the state ``up`` wrote)."""
    state = read_state(team) or {}
    alive = {name: _process(entry["pid"], entry["created"]) is not None
             for name, entry in state.get("servers", {}).items()}
    if (team.pg_data / "postmaster.pid").is_file():
        alive["postgres"] = pg_running(team, pg_bin(), pg_account())
    return alive


def up(team: Team, project: Path, host: str = "127.0.0.1", ports: Ports = Ports(),
       artifacts_destination: str | None = None, echo: Callable[[str], None] = print) -> Started:
    """Start the team setup (see the module's docstring); :class:`TeamError` when it can not."""
    if not (project / "infra" / "prefect.yaml").is_file():
        raise TeamError(f"infra/prefect.yaml not found under {project}: run grpo team up from the repository root")
    bin_dir, account = pg_bin(), pg_account()
    if any(running(team).values()):
        raise TeamError(f"the team setup in {team.home} is already running (grpo team status; grpo team down)")
    taken = [f"{port} (--{what}-port)" for what, port in (("prefect", ports.prefect), ("mlflow", ports.mlflow),
                                                          ("pg", ports.postgres))
             if port_taken(port, host if what != "pg" else "127.0.0.1")]
    if taken:
        several = len(taken) > 1
        raise TeamError(f"port{'s' if several else ''} {' and '.join(taken)} already in use on {host}; pick "
                        + ("free ones with those options" if several else "a free one with that option"))
    team.home.mkdir(parents=True, exist_ok=True)
    team.home.chmod(0o711)  # others may pass through (PostgreSQL's user, to its data), not list or read
    team.logs.mkdir(exist_ok=True)
    team.mlflow_dir.mkdir(mode=0o700, exist_ok=True)
    secret = load_secrets(team)
    urls = _urls(host, ports)

    fresh = not (team.pg_data / "PG_VERSION").is_file()
    if fresh:
        echo(f"PostgreSQL: a new cluster in {team.pg_data}")
        init_postgres(team, bin_dir, account, secret)
    start_postgres(team, bin_dir, account, ports.postgres)
    state: dict = {"host": host, "ports": vars(ports), "urls": urls, "servers": {},
                   "artifacts_destination": artifacts_destination}
    try:
        if fresh:
            create_databases(bin_dir, ports.postgres, secret)
        _wait_servers(state, _start_servers(team, host, ports, artifacts_destination, secret, state))
        ensure_worker_user(urls["mlflow"], secret)
        new_pools = ensure_pools(f"{urls['prefect']}/api", prefect_auth(secret), project)
        ensure_zombie_automation(f"{urls['prefect']}/api", prefect_auth(secret))
        write_private(team.team_env, _env_file(client_env(urls, secret, MLFLOW_WORKER)))
        write_private(team.admin_env, _env_file(client_env(urls, secret, MLFLOW_ADMIN)))
        if new_pools:
            _deploy(team, project, client_env(urls, secret, MLFLOW_WORKER))
    except BaseException:
        down(team)
        raise
    return Started(urls, list(POOLS), new_pools)


def _wait_servers(state: dict, popen: dict[str, subprocess.Popen]) -> None:
    """Until the servers just started answer their health checks; :class:`TeamError` with the end of the log of one
    that exits or does not answer within :data:`HEALTH_TIMEOUT`."""
    host = "127.0.0.1" if state["host"] in ("0.0.0.0", "::") else state["host"]
    for name, proc in popen.items():
        path = {"prefect": "/api/health", "mlflow": "/health"}[name]
        try:
            wait_healthy(f"http://{host}:{state['ports'][name]}{path}", proc, HEALTH_TIMEOUT)
        except RuntimeError as err:
            log = Path(state["servers"][name]["log"])
            raise TeamError(f"{err}; its log {log} ends: {_tail(log)}") from None


def restart_server(team: Team, name: str) -> None:
    """Stop the running setup's server ``name`` (``prefect`` or ``mlflow``) and start it again as ``up`` did, on the
    same address and data, until it answers: what a server's upgrade or a changed setting takes while workers, runs
    and the other server go on."""
    state = read_state(team)
    if state is None or _process(**{k: state["servers"][name][k] for k in ("pid", "created")}) is None:
        raise TeamError(f"the {name} server of the team setup in {team.home} does not run (grpo team up)")
    _stop_group(state["servers"][name])
    popen = _start_servers(team, state["host"], Ports(**state["ports"]), state.get("artifacts_destination"),
                           load_secrets(team), state, only=(name,))
    _wait_servers(state, popen)


def _start_servers(team: Team, host: str, ports: Ports, artifacts_destination: str | None, secret: dict[str, str],
                   state: dict, only: tuple[str, ...] = ("prefect", "mlflow")) -> dict[str, subprocess.Popen]:
    """The Prefect and MLflow servers (those in ``only``), detached; ``state.json`` names them as soon as they
    exist."""
    bin_dir = Path(sys.executable).parent
    pg = f"127.0.0.1:{ports.postgres}"
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("PREFECT_", "MLFLOW_"))}  # a shell pointed at another server must not leak in
    base.update(PREFECT_SERVER_ANALYTICS_ENABLED="false", MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false")
    prefect_env = {**base, **prefect_server_env(ports.prefect, _shown_host(host)),
                   "PREFECT_HOME": str(team.home / "prefect"),
                   "PREFECT_API_DATABASE_CONNECTION_URL": f"postgresql+asyncpg://prefect:{secret['prefect_db']}@{pg}"
                                                         "/prefect",
                   "PREFECT_SERVER_API_AUTH_STRING": prefect_auth(secret),
                   "PREFECT_API_AUTH_STRING": prefect_auth(secret)}
    auth_ini = team.mlflow_dir / "basic_auth.ini"
    write_private(auth_ini, "[mlflow]\n"
                            "default_permission = EDIT\n"  # a team: everyone reads and logs to every experiment
                            f"database_uri = postgresql://mlflow:{secret['mlflow_db']}@{pg}/mlflow_auth\n"
                            f"admin_username = {MLFLOW_ADMIN}\n"
                            "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n")
    mlflow_env = {**base, "MLFLOW_BACKEND_STORE_URI": f"postgresql://mlflow:{secret['mlflow_db']}@{pg}/mlflow",
                  "MLFLOW_AUTH_CONFIG_PATH": str(auth_ini), "MLFLOW_AUTH_ADMIN_PASSWORD": secret["mlflow_admin"],
                  "MLFLOW_FLASK_SERVER_SECRET_KEY": secret["flask"],
                  "PYTHONWARNINGS": ",".join(filter(None, (base.get("PYTHONWARNINGS"), MLFLOW_STARLETTE_WARNING)))}
    destination = artifacts_destination or str(team.mlflow_dir / "artifacts")
    commands = {
        "prefect": ([str(bin_dir / "prefect"), "server", "start", "--host", host, "--port", str(ports.prefect)],
                    prefect_env),
        "mlflow": ([str(bin_dir / "mlflow"), "server", "--app-name", "grpo-auth", "--host", host, "--port",
                    str(ports.mlflow), "--workers", "1", "--artifacts-destination", destination], mlflow_env),
    }
    popen = {}
    for name, (cmd, env) in commands.items():
        if name not in only:
            continue
        entry = _detached(cmd, env, team.logs / f"{name}-server.log", team.home)
        popen[name] = entry.pop("_popen")
        state["servers"][name] = entry
        team.state.write_text(json.dumps(state, indent=1) + "\n")
    return popen


def _deploy(team: Team, project: Path, env: dict[str, str]) -> None:
    """``grpo deploy`` of infra/prefect.yaml from the repository root, as a client of the team's server."""
    log = team.logs / "deploy.log"
    with log.open("a") as out:
        result = subprocess.run([str(Path(sys.executable).parent / "grpo"), "deploy"], cwd=project,
                                env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT)
    if result.returncode != 0:
        raise TeamError(f"grpo deploy failed (exit {result.returncode}); its log {log} ends: {_tail(log)}")


def down(team: Team) -> list[str]:
    """Stop every process of the team setup; what was running."""
    state = read_state(team) or {}
    stopped = []
    for name, entry in state.get("servers", {}).items():
        if _process(entry["pid"], entry["created"]) is not None:
            stopped.append(name)
        _stop_group(entry)
    if (team.pg_data / "PG_VERSION").is_file():
        bin_dir, account = pg_bin(), pg_account()
        if pg_running(team, bin_dir, account):
            stop_postgres(team, bin_dir, account)
            stopped.append("postgres")
    team.state.unlink(missing_ok=True)
    return stopped


def status_lines(team: Team) -> list[str]:
    """What runs where, one line each."""
    state = read_state(team)
    alive = running(team)
    if state is None:
        return [f"nothing of the team setup in {team.home} runs (grpo team up starts it)"] + (
            ["PostgreSQL runs without the servers: grpo team down stops it"] if alive.get("postgres") else [])
    urls = state["urls"]
    where = {"postgres": f"PostgreSQL  {urls['postgres']}  (data {team.pg_data})",
             "prefect": f"Prefect     {urls['prefect']}  (API auth on; log {team.logs / 'prefect-server.log'})",
             "mlflow": f"MLflow      {urls['mlflow']}  (basic auth; log {team.logs / 'mlflow-server.log'})"}
    lines = [f"{'running' if alive.get(name) else 'STOPPED'}  {text}" for name, text in where.items()]
    return lines + [f"clients and workers: source {team.team_env}"]
