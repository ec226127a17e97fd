"""The batched logging part of :class:`grpo.tracking.tracker.MlflowTracker`: metrics (and MLflow's system metrics)
through the on-disk spool (:mod:`grpo.tracking.spool`) and its sender thread, each (key, step) logged once.

How a metric travels (``log_metrics``):

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

System metrics (``system/...``, sampled every few seconds from the start) wait in memory until the run logs a metric of
its own (the evaluation before training, or the first training step), and follow it into the spool with their own
times and steps: MLflow keeps a run's metric keys in the order they first arrived, and its Compare page opens the
parallel coordinates plot on the first key the compared runs share, which was ``system/cpu_utilization_percentage``
instead of ``eval/accuracy``. A run that ends before a metric of its own sends them at close.

A point whose (key, step) is already in the run (or was already logged in this session) is dropped, so a training
resumed from an earlier checkpoint re-logging steps that were logged before its crash produces neither duplicates nor
gaps. Consequence: a stage that restarts its step count (warm start, then GRPO) must log under its own key prefix
(``MlflowCallback(tracker, prefix="warm_start/")``), or its points are dropped.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import threading
import time
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from grpo.tracking.spool import Spool
from grpo.tracking.values import MAX_METRICS_PER_BATCH, numeric_metrics, sanitize_metric_key

_log = logging.getLogger(__name__)

REJECTED_FILE = "rejected.jsonl"
SYSTEM_PREFIX = "system/"


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


@contextlib.contextmanager
def _collection_paused() -> Iterator[None]:
    """No automatic garbage collection while a batch goes through an in-process SQL store (SQLite by default).

    MLflow's SQLAlchemy store builds several ORM objects per point and holds them until the commit: that many live
    allocations trigger the collector, whose passes scan the whole training process's heap (model, tokenizer, data,
    libraries) for the store's short-lived objects, which reference counting frees anyway once the session closes.
    Measured on a 750-point batch with torch, transformers and TRL loaded: 7.3 ms of the sender's CPU per logged step
    with collection, 1.4 ms without. The switch is process-wide: a pause enables collection again only when it found
    it enabled, so a process that turned it off keeps it off (and with two trackers' senders in one process it is back
    on once the first pause that found it on ends)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


class BatchedLogging:
    """Metrics through the spool and its sender. A mixin of :class:`~grpo.tracking.tracker.MlflowTracker`: the
    tracker's ``__init__`` calls :meth:`_init_batched_logging`; the run lifecycle starts the sender
    (:meth:`_make_sender`) and the system metrics, and stops them."""

    run_id: str | None
    spool_dir: Path

    def _init_batched_logging(self, flush_interval: float, batch_trigger: int, max_backoff: float,
                              log_system_metrics: bool, system_metrics_interval: float | None) -> None:
        self.flush_interval = flush_interval
        self.batch_trigger = batch_trigger
        self.max_backoff = max_backoff
        self.log_system_metrics = log_system_metrics
        self.system_metrics_interval = system_metrics_interval
        self.dropped_duplicates = 0  # points skipped because (key, step) was already logged
        self.rejected = 0  # points the server refused permanently (written to rejected.jsonl)

        self._lock = threading.Lock()  # the dedup sets and the held system lines (the spool has its own lock)
        self._logged: dict[str, set[int]] = {}
        self._held: list[tuple[dict, int]] = []  # system-metric lines before the run's own first metric
        self._own_run: str | None = None  # the run known to have a metric of its own
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
            if not fresh:
                return
            line = {"s": step, "t": int(time.time() * 1000), "m": fresh}
            if not self._has_own_metric():
                self._held.append((line, len(fresh)))
                return
            self._spool.append(line, len(fresh))
            self._release_held()

    def _has_own_metric(self) -> bool:
        """Whether the run has a metric other than a system metric (logged now or before a resume); under the lock."""
        if self._own_run != self.run_id and any(not k.startswith(SYSTEM_PREFIX) for k in self._logged):
            self._own_run = self.run_id
        return self._own_run == self.run_id

    def _release_held(self) -> None:
        """The held system-metric lines into the spool, in order; under the lock."""
        held, self._held = self._held, []
        for line, points in held:
            self._spool.append(line, points)

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
            with _collection_paused():
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
        steps = [max(s) for k, s in self._logged.items() if k.startswith(SYSTEM_PREFIX) and s]
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
                    self.log_metrics({f"{SYSTEM_PREFIX}{k}": v for k, v in values.items()}, step)
                    step += 1

        self._sys_thread = threading.Thread(target=loop, name="mlflow-system-metrics", daemon=True)
        self._sys_thread.start()

    def _stop_system_metrics(self) -> None:
        """Stop sampling; held samples (the run logged nothing of its own) go to the spool for the last flush."""
        if self._sys_thread is not None:
            self._sys_stop.set()
            self._sys_thread.join(timeout=5)
            self._sys_thread = None
        with self._lock:
            if self._spool.is_open:
                self._release_held()
            self._held = []
