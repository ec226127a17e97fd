"""Experiment tracking with MLflow: one run per pipeline run, metrics buffered on disk and sent in the background.

This module holds the MLflow semantics (runs, params, dedup on resume, key rules, model logging); the generic
disk spool and its sender thread are :mod:`grpo.tracking.spool`. How a metric travels (``MlflowTracker.log_metrics``):

1. The caller's thread appends one JSON line ``{"s": step, "t": timestamp_ms, "m": {key: value}}`` to
   ``<spool_dir>/metrics.jsonl`` and returns (microseconds; no network, never raises into training).
2. A background thread reads the spool from the *sent cursor* (a byte offset at a line boundary, persisted in
   ``<spool_dir>/state.json``) to the end, sends the points with MLflow's ``log_batch`` (at most 1000 metrics per
   call, MLflow's limit) every ``flush_interval`` seconds or as soon as ``batch_trigger`` points are waiting, and
   moves the cursor forward only after the server accepted the batch.
3. When the tracking server is unreachable the points stay in the spool and the thread retries with exponential
   backoff (capped at ``max_backoff`` seconds, retrying indefinitely); training does not wait for it.
4. A process that dies leaves the unsent tail in the spool; the next ``start`` with the same spool directory sends
   it first. A batch whose reply was lost is sent again with the same timestamps: MLflow's SQL store ignores an exact
   duplicate (key, step, timestamp, value), and the cursor makes sure nothing else is resent.

Resume: ``start(run_id=...)`` reopens the run, skips params already logged, and reads the steps every metric key
already has in MLflow; a point whose (key, step) is already in the run (or was already logged in this session) is
dropped, so a training resumed from an earlier checkpoint re-logging steps that were logged before its crash
produces neither duplicates nor gaps. Consequence: a stage that restarts its step count (warm start, then GRPO)
must log under its own key prefix (``MlflowCallback(tracker, prefix="warm_start/")``), or its points are dropped.

Without a configured URI, ``resolve_tracking_uri`` points MLflow at ``sqlite:///<project>/mlflow.db``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import numbers
import os
import re
import threading
import time
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from grpo.errors import GRPOPlatformError
from grpo.tracking.metric_keys import TRAIN_PREFIX
from grpo.tracking.spool import Spool, read_state

_log = logging.getLogger(__name__)

SPOOL_DIRNAME = "tracking_spool"
REJECTED_FILE = "rejected.jsonl"

# MLflow's limits (mlflow.utils.validation in 3.x); read from MLflow when available, these are the fallbacks.
MAX_METRICS_PER_BATCH = 1000
MAX_PARAMS_TAGS_PER_BATCH = 100
MAX_PARAM_VAL_LENGTH = 6000
MAX_TAG_VAL_LENGTH = 8000
MAX_ENTITY_KEY_LENGTH = 250
try:  # pragma: no branch - the constants exist in every MLflow this project supports
    from mlflow.utils import validation as _mlflow_validation

    MAX_METRICS_PER_BATCH = _mlflow_validation.MAX_METRICS_PER_BATCH
    MAX_PARAMS_TAGS_PER_BATCH = _mlflow_validation.MAX_PARAMS_TAGS_PER_BATCH
    MAX_PARAM_VAL_LENGTH = _mlflow_validation.MAX_PARAM_VAL_LENGTH
    MAX_TAG_VAL_LENGTH = _mlflow_validation.MAX_TAG_VAL_LENGTH
    MAX_ENTITY_KEY_LENGTH = _mlflow_validation.MAX_ENTITY_KEY_LENGTH
except (ImportError, AttributeError):  # pragma: no cover
    pass

_TRUNCATED = "...[truncated]"
_BAD_KEY_CHARS = re.compile(r"[^/\w.\- :]")


class TrackingError(GRPOPlatformError):
    """The tracking backend can not be used (unreachable at start, unknown run id, ...)."""


def resolve_tracking_uri(cfg_uri: str | None, project_dir: Path) -> str:
    """The config's URI, else ``MLFLOW_TRACKING_URI``, else a SQLite store ``<project_dir>/mlflow.db`` (absolute)."""
    if cfg_uri:
        return cfg_uri
    env = os.environ.get("MLFLOW_TRACKING_URI")
    if env:
        return env
    return f"sqlite:///{Path(project_dir).resolve() / 'mlflow.db'}"


def default_artifact_location(tracking_uri: str, experiment_name: str) -> str | None:
    """For a local SQLite store: ``<db folder>/mlartifacts/<experiment>`` (MLflow's own default is ``./mlruns`` under
    whatever the working directory is). Other stores decide themselves (a server uses its artifact root)."""
    if not tracking_uri.startswith("sqlite:///"):
        return None
    db = Path(tracking_uri[len("sqlite:///"):])
    safe = re.sub(r"[^\w.-]", "_", experiment_name).strip("._") or "default"
    return (db.parent / "mlartifacts" / safe).resolve().as_uri()


def sanitize_metric_key(key: str) -> str:
    """A name MLflow accepts: ``eval/pass@8`` -> ``eval/pass_at_8``; other invalid characters become ``_``."""
    out = _BAD_KEY_CHARS.sub("_", str(key).replace("@", "_at_"))
    parts = [p for p in out.split("/") if p not in ("", ".", "..")]
    out = "/".join(parts) or "_"
    return out[:MAX_ENTITY_KEY_LENGTH]


# What kind of experiment this is, as MLflow names it: model training ("custom_model_development", what MLflow's own
# training guides create), not a GenAI app. Set on new experiments and added to existing ones at a run's start. The
# MLflow UI (3.17.2) does not choose its view from it, though: see MLFLOW_UI_QUERY.
EXPERIMENT_TAGS = {"mlflow.experimentKind": "custom_model_development"}

# MLflow's UI (3.17.2) opens an experiment on the view of its "workflow type" switch (GenAI, the default, shows the
# traces Overview; machine learning shows the runs with their charts). The switch is the page URL's ``workflowType``
# parameter, else the browser's last choice (local storage), else GenAI; the experiment's mlflow.experimentKind tag
# is not read. So every MLflow link the platform prints carries the parameter (mlflow_ui_url).
MLFLOW_UI_QUERY = "workflowType=machine_learning"


def mlflow_ui_url(tracking_uri: str, experiment_id: str, run_id: str | None = None) -> str:
    """The MLflow UI page of an experiment (its runs view) or of one of its runs: on the tracking server, or on
    ``grpo ui``'s MLflow server (port 5000) for a local SQLite store."""
    base = tracking_uri.rstrip("/") if _is_http(tracking_uri) else "http://127.0.0.1:5000"
    page = f"/#/experiments/{experiment_id}" + (f"/runs/{run_id}" if run_id else "")
    return f"{base}{page}?{MLFLOW_UI_QUERY}"

_SECRET_KEY = re.compile(r"token|secret|passw|api_?key|credential|private_key", re.IGNORECASE)
REDACTED = "***"


def numeric_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The metrics MLflow can take, as floats: numbers and 0-d tensors / numpy scalars; booleans, other values and NaN
    are left out. The one place metric values are cleaned (every logging path goes through the tracker)."""
    clean: dict[str, float] = {}
    for key, value in metrics.items():
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            if not (hasattr(value, "item") and getattr(value, "ndim", 1) == 0):
                continue
            value = value.item()  # 0-d tensor / numpy scalar
        value = float(value)
        if not math.isnan(value):
            clean[key] = value
    return clean


def redact(key: str, value: Any) -> Any:
    """``value`` with secrets masked: a token/secret/password-like key's value, recursively inside mappings, so a
    ``grpo.extra.hub_token`` never reaches a tracking store in plain text."""
    if _SECRET_KEY.search(str(key).rsplit(".", 1)[-1]) and value not in (None, ""):
        return REDACTED
    if isinstance(value, Mapping):
        return {k: redact(str(k), v) for k, v in value.items()}
    return value


def param_value(value: Any) -> str:
    """MLflow param value: strings as is, scalars via ``str``, lists/dicts as compact JSON; cut at MLflow's limit."""
    if isinstance(value, str):
        text = value
    elif value is None or isinstance(value, (bool, int, float)):
        text = str(value)
    else:
        text = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    if len(text) > MAX_PARAM_VAL_LENGTH:
        text = text[: MAX_PARAM_VAL_LENGTH - len(_TRUNCATED)] + _TRUNCATED
    return text


def _tag_value(value: Any) -> str:
    text = value if isinstance(value, str) else param_value(value) if isinstance(value, (list, dict)) else str(value)
    if len(text) > MAX_TAG_VAL_LENGTH:
        text = text[: MAX_TAG_VAL_LENGTH - len(_TRUNCATED)] + _TRUNCATED
    return text


def _chunks(items: list, size: int) -> Iterator[list]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


def _is_http(uri: str) -> bool:
    return uri.startswith(("http://", "https://"))


def _parse_spool_line(row: dict) -> list:
    """A spool line ``{"s": step, "t": timestamp_ms, "m": {key: value}}`` as MLflow ``Metric`` entities."""
    from mlflow.entities import Metric

    return [Metric(k, float(v), int(row["t"]), int(row["s"])) for k, v in row["m"].items()]


def _is_permanent(err: BaseException) -> bool:
    """A 4xx answer other than 429: sending the same batch again can not succeed."""
    from mlflow.exceptions import MlflowException

    if not isinstance(err, MlflowException):
        return False
    try:
        status = err.get_http_status_code()
    except Exception:
        return False
    return 400 <= status < 500 and status != 429


class MlflowTracker:
    """One MLflow run: params/tags synchronously at ``start``, metrics through an on-disk spool and a sender thread.

    Args:
        tracking_uri: where MLflow lives (see :func:`resolve_tracking_uri`).
        spool_dir: directory for the metric spool and the sent cursor, e.g. ``runs/<name>/tracking_spool``.
        flush_interval: seconds between background sends.
        batch_trigger: send early once this many points are waiting.
        max_backoff: retry interval cap (seconds) while the server is unreachable.
        http_timeout: seconds per HTTP request of the sender (connect and read).
        log_system_metrics: sample CPU/memory/disk/network (and GPU when present) with MLflow's system metrics
            collectors and log them as ``system/...`` through the same spool.
        system_metrics_interval: seconds between samples (default: MLflow's, 10 s, or
            ``MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL``).
        strict: raise errors of the synchronous helpers (artifacts, tags) instead of logging a warning.
    """

    def __init__(
        self,
        tracking_uri: str,
        spool_dir: Path,
        *,
        flush_interval: float = 1.0,
        batch_trigger: int = 500,
        max_backoff: float = 30.0,
        http_timeout: float = 15.0,
        log_system_metrics: bool = False,
        system_metrics_interval: float | None = None,
        strict: bool = False,
    ) -> None:
        from mlflow import MlflowClient

        self.tracking_uri = tracking_uri
        self.spool_dir = Path(spool_dir)
        self.flush_interval = flush_interval
        self.batch_trigger = batch_trigger
        self.max_backoff = max_backoff
        self.http_timeout = http_timeout
        self.log_system_metrics = log_system_metrics
        self.system_metrics_interval = system_metrics_interval
        self.strict = strict
        self.client = MlflowClient(tracking_uri)

        self.run_id: str | None = None
        self.experiment_id: str | None = None
        self.dropped_duplicates = 0  # points skipped because (key, step) was already logged
        self.rejected = 0  # points the server refused permanently (written to rejected.jsonl)

        self._lock = threading.Lock()  # the dedup sets (the spool has its own lock)
        self._logged: dict[str, set[int]] = {}
        self._keys: dict[str, str] = {}
        self._sys_monitor = None
        self._sys_thread: threading.Thread | None = None
        self._sys_stop = threading.Event()
        self._spool = Spool(self.spool_dir, parse=_parse_spool_line, is_permanent=_is_permanent,
                            on_reject=self._reject, max_batch=MAX_METRICS_PER_BATCH, flush_interval=flush_interval,
                            batch_trigger=batch_trigger, max_backoff=max_backoff, name="mlflow-spool-sender")

    # ------------------------------------------------------------------ paths and persisted state

    @property
    def spool_file(self) -> Path:
        return self._spool.file

    @property
    def state_file(self) -> Path:
        return self._spool.state_file

    @property
    def last_error(self) -> str | None:
        return self._spool.last_error

    @staticmethod
    def saved_run_id(spool_dir: Path) -> str | None:
        """The MLflow run id a previous tracker recorded in ``spool_dir`` (to resume the same run)."""
        return read_state(spool_dir).get("run_id")

    # ------------------------------------------------------------------ start

    def _check_reachable(self) -> None:
        if not _is_http(self.tracking_uri):
            return
        import requests

        try:
            requests.get(self.tracking_uri.rstrip("/") + "/health", timeout=min(self.http_timeout, 10))
        except requests.RequestException as err:
            raise TrackingError(f"MLflow tracking server {self.tracking_uri} is unreachable: {err}") from None

    def start(
        self,
        run_name: str,
        experiment_name: str,
        tags: Mapping[str, Any] | None = None,
        params: Mapping[str, Any] | None = None,
        run_id: str | None = None,
    ) -> str:
        """Create a run (or reopen ``run_id``), log params and tags, start the sender; returns the run id.

        Unsent points left in the spool by an earlier tracker are sent first (to the run they belong to).
        """
        from mlflow.entities import Param, RunStatus, RunTag
        from mlflow.exceptions import MlflowException

        if self.run_id is not None:
            raise TrackingError("MlflowTracker.start called twice; create a new tracker per run")
        self._check_reachable()
        old_run = self._spool.read_state().get("run_id")
        if self._spool.recover() and old_run:
            self._drain_leftover(old_run)
        self._spool.compact()

        # Experiment and run.
        if run_id is None:
            exp = self.client.get_experiment_by_name(experiment_name)
            if exp is None:
                try:
                    self.experiment_id = self.client.create_experiment(
                        experiment_name, artifact_location=default_artifact_location(self.tracking_uri, experiment_name),
                        tags=EXPERIMENT_TAGS,
                    )
                except MlflowException:  # created concurrently
                    self.experiment_id = self.client.get_experiment_by_name(experiment_name).experiment_id
            else:
                if exp.lifecycle_stage == "deleted":
                    self.client.restore_experiment(exp.experiment_id)
                self.experiment_id = exp.experiment_id
                for key, value in EXPERIMENT_TAGS.items():  # experiments made before the tag, or by another tool
                    if exp.tags.get(key) != value:
                        self.client.set_experiment_tag(exp.experiment_id, key, value)
            run = self.client.create_run(
                self.experiment_id, run_name=run_name, tags={k: _tag_value(v) for k, v in (tags or {}).items()}
            )
            run_id = run.info.run_id
        else:
            try:
                run = self.client.get_run(run_id)
            except MlflowException as err:
                raise TrackingError(f"can not resume MLflow run {run_id}: {err.message}") from None
            if run.info.lifecycle_stage == "deleted":
                self.client.restore_run(run_id)
            if run.info.status != RunStatus.to_string(RunStatus.RUNNING):
                self.client.update_run(run_id, status="RUNNING")
            self.experiment_id = run.info.experiment_id
            if tags:
                self._log_batch_sync(run_id, tags=[RunTag(k, _tag_value(v)) for k, v in tags.items()])
        self.run_id = run_id
        self._spool.write_state(run_id=run_id, experiment_id=self.experiment_id, tracking_uri=self.tracking_uri,
                                offset=0)

        # Params: immutable in MLflow, so only the missing ones (a resumed run already has them).
        existing = run.data.params
        todo = []
        for key, value in (params or {}).items():
            text = param_value(redact(key, value))
            if key in existing:
                if existing[key] != text:
                    _log.warning("MLflow param %s is already %r in run %s; keeping it (new value %r)",
                                 key, existing[key], run_id, text)
                continue
            todo.append(Param(key, text))
        if todo:
            self._log_batch_sync(run_id, params=todo)

        # (key, step) points already in the run: never sent again.
        self._logged = {}
        for key in run.data.metrics:
            self._logged[key] = {m.step for m in self.client.get_metric_history(run_id, key)}

        self._spool.start(self._make_sender())
        if self.log_system_metrics:
            self._start_system_metrics()
        return run_id

    def _log_batch_sync(self, run_id: str, params: list | None = None, tags: list | None = None) -> None:
        for chunk in _chunks(params or [], MAX_PARAMS_TAGS_PER_BATCH):
            self.client.log_batch(run_id, params=chunk)
        for chunk in _chunks(tags or [], MAX_PARAMS_TAGS_PER_BATCH):
            self.client.log_batch(run_id, tags=chunk)

    def _drain_leftover(self, old_run: str) -> None:
        """Send what an earlier tracker left in the spool, before anything new is logged.

        MLflow accepts metrics for finished runs (only deleted runs refuse them), so the run's status is left alone.
        """
        from mlflow.exceptions import MlflowException

        try:
            self.client.get_run(old_run)
        except MlflowException:
            _log.warning("MLflow run %s of the unsent spool no longer exists; dropping its points", old_run)
            return
        self.run_id = old_run
        try:
            self._spool.send_pending(self._make_sender(), raise_transient=True)
        except Exception as err:
            raise TrackingError(f"could not send the unsent metrics in {self.spool_file}: {err}") from None
        finally:
            self.run_id = None

    # ------------------------------------------------------------------ logging

    def _key(self, key: str) -> str:
        out = self._keys.get(key)
        if out is None:
            out = sanitize_metric_key(key)
            if out != key:
                _log.info("MLflow metric %r is logged as %r (MLflow key rules)", key, out)
            self._keys[key] = out
        return out

    def log_metrics(self, metrics: Mapping[str, Any], step: int) -> None:
        """Queue metrics for ``step``; returns at once. Non-numbers and NaN are skipped; never raises."""
        try:
            self._log_metrics(metrics, int(step))
        except Exception as err:  # tracking must never stop training
            _log.warning("tracking: could not queue metrics at step %s: %s", step, err)

    def _log_metrics(self, metrics: Mapping[str, Any], step: int) -> None:
        if self.run_id is None or not self._spool.is_open:
            return
        clean = {self._key(key): value for key, value in numeric_metrics(metrics).items()}
        if not clean:
            return
        with self._lock:
            fresh = {}
            for key, value in clean.items():
                steps = self._logged.setdefault(key, set())
                if step in steps:
                    self.dropped_duplicates += 1
                    continue
                steps.add(step)
                fresh[key] = value
        if fresh:
            self._spool.append({"s": step, "t": int(time.time() * 1000), "m": fresh}, len(fresh))

    # ------------------------------------------------------------------ sending

    def _make_sender(self):
        """``send(metrics)``: one HTTP request without MLflow's own retries for REST stores, ``log_batch`` otherwise.

        MLflow's REST client retries a refused connection 7 times with exponential backoff (minutes); the sender
        has its own retry loop, so for an HTTP server it makes a single attempt per batch instead.
        """
        run_id = self.run_id
        try:
            from mlflow.protos.service_pb2 import LogBatch
            from mlflow.store.tracking.rest_store import RestStore
            from mlflow.utils.proto_json_utils import message_to_json
            from mlflow.utils.rest_utils import http_request, verify_rest_response

            store = self.client._tracking_client.store
            if isinstance(store, RestStore):
                endpoint = RestStore._METHOD_TO_INFO.get(LogBatch, ("/api/2.0/mlflow/runs/log-batch", "POST"))[0]

                def send(metrics: list) -> None:
                    body = json.loads(message_to_json(LogBatch(run_id=run_id, metrics=[m.to_proto() for m in metrics])))
                    response = http_request(
                        store.get_host_creds(), endpoint, "POST", max_retries=0, backoff_factor=0,
                        backoff_jitter=0, timeout=self.http_timeout, json=body,
                    )
                    verify_rest_response(response, endpoint)

                return send
        except (ImportError, AttributeError):  # pragma: no cover - MLflow internals moved; use the public API
            pass

        def send(metrics: list) -> None:
            self.client.log_batch(run_id, metrics=metrics)

        return send

    def _reject(self, batch: list, err: BaseException) -> None:
        self.rejected += len(batch)
        _log.warning("tracking: MLflow refused %d points (%s); kept in %s", len(batch), err,
                     self.spool_dir / REJECTED_FILE)
        with (self.spool_dir / REJECTED_FILE).open("a") as f:
            for m in batch:
                f.write(json.dumps({"key": m.key, "value": m.value, "step": m.step, "timestamp": m.timestamp,
                                    "error": str(err)[:500]}) + "\n")

    def pending(self) -> int:
        """Bytes of the spool not yet in MLflow."""
        return self._spool.pending()

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until everything logged so far is in MLflow (True) or ``timeout`` seconds pass (False)."""
        if self.run_id is None:
            return True
        return self._spool.flush(timeout)

    def close(self, status: str = "FINISHED", timeout: float = 30.0) -> bool:
        """Stop system metrics, send what can be sent within ``timeout``, stop the sender.

        The run is marked ``status`` only when the spool is empty; otherwise it stays RUNNING and the unsent points
        stay in the spool for the next ``start``. Returns whether everything was sent.
        """
        if self.run_id is None:
            return True
        self._stop_system_metrics()
        done = self.flush(timeout)
        self._spool.stop(join_timeout=max(self.http_timeout + 1, 1))
        done = done or self.pending() == 0
        if done:
            self._spool.compact()
            if status:
                try:
                    self.client.set_terminated(self.run_id, status=status)
                except Exception as err:
                    _log.warning("tracking: could not mark run %s %s: %s", self.run_id, status, err)
        else:
            _log.warning("tracking: %d bytes of metrics not sent; they stay in %s for the next start",
                         self.pending(), self.spool_file)
        self.run_id = None
        return done

    def __enter__(self) -> MlflowTracker:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(status="FAILED" if exc_type else "FINISHED")

    # ------------------------------------------------------------------ system metrics

    def _start_system_metrics(self) -> None:
        """MLflow's system metric collectors (CPU, memory, disk, network, GPU), logged through the spool.

        ``mlflow.system_metrics.SystemMetricsMonitor`` works for a client-created run (it takes ``run_id`` and
        ``tracking_uri``), but its loop calls ``get_run`` every sample and stops for good on the first failure and
        it sends without buffering; so only its collectors are used here and the samples go through the spool.
        """
        try:
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                monitor = SystemMetricsMonitor(self.run_id, tracking_uri=self.tracking_uri)
        except Exception as err:
            _log.warning("tracking: system metrics unavailable: %s", err)
            return
        interval = self.system_metrics_interval or monitor.sampling_interval
        samples = max(int(monitor.samples_before_logging), 1)
        steps = [max(s) for k, s in self._logged.items() if k.startswith("system/") and s]
        first_step = max(steps) + 1 if steps else 0
        self._sys_monitor = monitor
        self._sys_stop.clear()

        def loop() -> None:
            step = first_step
            while not self._sys_stop.is_set():
                try:
                    for _ in range(samples):
                        monitor.collect_metrics()
                        if self._sys_stop.wait(interval):
                            break
                    values = monitor.aggregate_metrics()
                    for m in monitor.monitors:
                        m.clear_metrics()
                except Exception as err:  # pragma: no cover
                    _log.warning("tracking: system metrics sampling failed: %s", err)
                    return
                if values:
                    self.log_metrics({f"system/{k}": v for k, v in values.items()}, step)
                    step += 1

        self._sys_thread = threading.Thread(target=loop, name="mlflow-system-metrics", daemon=True)
        self._sys_thread.start()

    def _stop_system_metrics(self) -> None:
        if self._sys_thread is not None:
            self._sys_stop.set()
            self._sys_thread.join(timeout=5)
            self._sys_thread = None

    # ------------------------------------------------------------------ synchronous helpers

    def _guard(self, what: str, fn, *args, **kwargs) -> bool:
        if self.run_id is None:
            raise TrackingError(f"{what}: the tracker is not started")
        try:
            fn(*args, **kwargs)
            return True
        except Exception as err:
            if self.strict:
                raise
            _log.warning("tracking: %s failed: %s", what, err)
            return False

    def set_tags(self, tags: Mapping[str, Any]) -> bool:
        from mlflow.entities import RunTag

        items = [RunTag(str(k), _tag_value(v)) for k, v in tags.items()]
        return self._guard("set_tags", lambda: self._log_batch_sync(self.run_id, tags=items))

    def log_params(self, params: Mapping[str, Any]) -> bool:
        """Log params not yet in the run (MLflow params can not change)."""
        from mlflow.entities import Param

        def do() -> None:
            existing = self.client.get_run(self.run_id).data.params
            todo = [Param(k, param_value(redact(k, v))) for k, v in params.items() if k not in existing]
            self._log_batch_sync(self.run_id, params=todo)

        return self._guard("log_params", do)

    def log_datasets(self, datasets: list[dict[str, Any]]) -> bool:
        """MLflow dataset inputs (the run page's "Datasets" column): each ``{"name", "digest", "source", "context",
        "profile"}``; the source is a local path, the profile a small dict (row counts)."""
        from mlflow.entities import Dataset, DatasetInput, InputTag

        inputs = [DatasetInput(Dataset(name=d["name"], digest=d["digest"][:36], source_type="local",
                                       source=json.dumps({"uri": str(d["source"])}),
                                       profile=json.dumps(d.get("profile") or {})),
                               tags=[InputTag("mlflow.data.context", d["context"])]) for d in datasets]
        return self._guard("log_inputs", self.client.log_inputs, self.run_id, inputs)

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> bool:
        """Upload a file, or a directory's contents, under ``artifact_path``."""
        path = Path(path)
        fn = self.client.log_artifacts if path.is_dir() else self.client.log_artifact
        return self._guard(f"log_artifact({path})", fn, self.run_id, str(path), artifact_path)

    def log_dict(self, data: Any, artifact_file: str) -> bool:
        """``data`` as a JSON (``.json``) or YAML (``.yaml``/``.yml``) artifact."""
        return self._guard(f"log_dict({artifact_file})", self.client.log_dict, self.run_id, data, artifact_file)

    def log_text(self, text: str, artifact_file: str) -> bool:
        return self._guard(f"log_text({artifact_file})", self.client.log_text, self.run_id, text, artifact_file)

    def log_table(self, data: Any, artifact_file: str) -> bool:
        """A pandas DataFrame or dict of columns as an MLflow table (``artifact_file`` must end in ``.json``)."""
        return self._guard(f"log_table({artifact_file})", self.client.log_table, self.run_id, data, artifact_file)


def tracker_from_config(cfg, run_dir: Path, project_dir: Path | None = None, **kwargs: Any) -> MlflowTracker | None:
    """The tracker an experiment config asks for (None for ``tracking.backend: none``), spooling under
    ``<run_dir>/tracking_spool``; create it on the main process only."""
    t = cfg.tracking
    if t.backend != "mlflow":
        return None
    uri = resolve_tracking_uri(t.tracking_uri, Path(project_dir) if project_dir else Path.cwd())
    return MlflowTracker(uri, Path(run_dir) / SPOOL_DIRNAME, log_system_metrics=t.log_system_metrics, **kwargs)


class MlflowCallback(TrainerCallback):
    """Forward every ``Trainer.log`` call to the tracker at ``state.global_step`` (main process only), under
    ``prefix`` (:data:`TRAIN_PREFIX` by default).

    Numbers only; NaN is skipped. Another ``prefix`` (e.g. ``"warm_start/"``) keeps stages that restart their step
    count apart.
    """

    def __init__(self, tracker: MlflowTracker, prefix: str = TRAIN_PREFIX) -> None:
        self.tracker = tracker
        self.prefix = prefix

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs or not state.is_world_process_zero:
            return
        self.tracker.log_metrics({f"{self.prefix}{k}": v for k, v in logs.items()}, step=state.global_step)


def log_metrics_file(tracker: MlflowTracker, path: str | Path, prefix: str = TRAIN_PREFIX) -> int:
    """Replay a ``metrics.jsonl`` written by :class:`grpo.training.train.MetricsRecorder` (``{"step", "metrics"}`` lines).

    Idempotent: points whose (key, step) the run already has are dropped, so replaying after a live
    :class:`MlflowCallback` or after a resume adds only what is missing. Returns the number of lines read.
    """
    path = Path(path)
    if not path.is_file():
        return 0
    rows = 0
    with path.open() as f:
        for line in f:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # a torn last line
            tracker.log_metrics({f"{prefix}{k}": v for k, v in row.get("metrics", {}).items()}, int(row["step"]))
            rows += 1
    return rows


@contextlib.contextmanager
def use_tracking_uri(uri: str) -> Iterator[None]:
    """Point MLflow's fluent API at ``uri`` for the block (flavour ``log_model`` only resolves the global URI)."""
    import mlflow
    from mlflow.tracking._tracking_service import utils as tracking_utils

    old_uri = tracking_utils._tracking_uri
    old_env = os.environ.get("MLFLOW_TRACKING_URI")
    mlflow.set_tracking_uri(uri)
    try:
        yield
    finally:
        mlflow.set_tracking_uri(old_uri)
        if old_env is None:
            os.environ.pop("MLFLOW_TRACKING_URI", None)
        else:
            os.environ["MLFLOW_TRACKING_URI"] = old_env


def _pip_requirements(extra: tuple[str, ...] = ()) -> list[str]:
    from importlib.metadata import PackageNotFoundError, version

    reqs = []
    for name in ("mlflow", "transformers", "torch", "tokenizers", "accelerate", *extra):
        try:
            reqs.append(f"{name}=={version(name)}")
        except PackageNotFoundError:
            pass
    return reqs


def log_model(
    tracker: MlflowTracker,
    model_dir: str | Path,
    tokenizer_dir: str | Path | None = None,
    name: str = "model",
    task: str = "text-generation",
    step: int = 0,
):
    """Log the trained model with MLflow's ``transformers`` flavour, linked to the tracker's run.

    MLflow 3 links a logged model to the run's metrics at ``step`` (the model's page lists them): pass the last
    training step, where the evaluation after training is logged (``eval/accuracy``), not step 0 where the one before
    training is. The metrics are flushed to MLflow first so they are there to link; the run's params are set on the
    model too (MLflow copies them only for a model it creates itself).

    Works offline: the model is loaded from an absolute local path (its ``name_or_path`` is then not a valid hub
    repo id, so the flavour's license lookup fails locally without a request), a local model card is passed so the
    flavour does not fetch one from the hub, and the pip requirements are given so MLflow does not load the model
    in a subprocess to infer them. Returns MLflow's ``ModelInfo`` (``model_uri`` is ``models:/<model_id>``; the
    model is also reachable as ``runs:/<run_id>/<name>``).
    """
    import mlflow
    import mlflow.transformers
    from huggingface_hub import ModelCard
    from mlflow.entities import LoggedModelStatus
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if tracker.run_id is None:
        raise TrackingError("log_model: the tracker is not started")
    model_dir = Path(model_dir).resolve()
    tokenizer_dir = Path(tokenizer_dir).resolve() if tokenizer_dir else model_dir
    from grpo.training.policy import MODEL_LOCK, is_adapter_dir, load_adapted

    with MODEL_LOCK:
        # A LoRA run's model/ is a peft adapter, logged as a peft model: MLflow stores the adapter and references the
        # base (a local folder by its path: MLflow's own copy of a local base, made when it is no hub id, comes out
        # with peft's layer names and loads as random weights), and load_model returns the PeftModel.
        adapter = is_adapter_dir(model_dir)
        model = load_adapted(model_dir) if adapter else AutoModelForCausalLM.from_pretrained(str(model_dir))
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    extra = {}
    if adapter and Path(model.peft_config["default"].base_model_name_or_path).is_dir():
        extra["base_model_path"] = model.peft_config["default"].base_model_name_or_path
    card = ModelCard(
        f"---\nlicense: other\ntags: [grpo]\n---\n# {name}\n\nGRPO-trained model from MLflow run {tracker.run_id}.\n"
    )
    client = tracker.client
    if not tracker.flush(timeout=60):
        _log.warning("tracking: metrics not yet in MLflow; the logged model %r is not linked to them", name)
    params = client.get_run(tracker.run_id).data.params
    logged = client.create_logged_model(
        experiment_id=tracker.experiment_id, name=name, source_run_id=tracker.run_id, model_type="transformers",
        params=params,
    )
    with use_tracking_uri(tracker.tracking_uri), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        info = mlflow.transformers.log_model(
            transformers_model={"model": model, "tokenizer": tokenizer},
            name=name,
            task=task,
            model_card=card,
            pip_requirements=_pip_requirements(("peft",) if adapter else ()),
            run_id=tracker.run_id,
            model_id=logged.model_id,
            step=step,
            **extra,
        )
    try:
        client.finalize_logged_model(logged.model_id, LoggedModelStatus.READY)
    except Exception as err:  # pragma: no cover - older servers
        _log.warning("tracking: could not mark logged model %s READY: %s", logged.model_id, err)
    return info
