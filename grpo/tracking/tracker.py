"""Experiment tracking with MLflow: one run per pipeline run, metrics buffered on disk and sent in the background.

:class:`MlflowTracker` is one MLflow run, composed of three parts, each in its own module:

* the run lifecycle (:mod:`grpo.tracking.run_lifecycle`): create or reopen the run (resume: params not logged again,
  the steps MLflow already has read back), send what an earlier tracker left unsent, close with a status;
* batched logging (:mod:`grpo.tracking.batched_logging`): metrics through the on-disk spool and its sender thread
  (:mod:`grpo.tracking.spool`), each (key, step) once, and MLflow's system metrics the same way; how a metric
  travels is told there;
* synchronous logging (:mod:`grpo.tracking.sync_logging`): tags, params, dataset inputs, artifacts and tables.

The trained model is logged by :func:`grpo.tracking.model_logging.log_model`; what MLflow accepts (limits, keys,
param values, redaction) is :mod:`grpo.tracking.values`, where it lives (URIs, UI links) :mod:`grpo.tracking.store`.
This module adds the tracker a config asks for and the trainer callback that feeds it.

Without a configured URI, ``resolve_tracking_uri`` points MLflow at ``sqlite:///<project>/mlflow.db``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from grpo.tracking.batched_logging import BatchedLogging
from grpo.tracking.metric_keys import TRAIN_PREFIX, train_key
from grpo.tracking.run_lifecycle import RunLifecycle
from grpo.tracking.store import resolve_tracking_uri
from grpo.tracking.sync_logging import SyncLogging
from grpo.tracking.traces import TraceLogging

SPOOL_DIRNAME = "tracking_spool"
FLUSH_INTERVAL = 5.0
"""Seconds between the sender's batches. A batch's cost in the training process is mostly per batch, not per point
(an in-process SQLite store: a session, the run's check and two commits, ~5 ms of CPU whatever its size), so one every
5 s instead of every second makes tracking's cost follow what is logged: with 0.3-second steps of 25 metrics the
sender takes 1.6 ms of CPU per step instead of 3.2 ms, with steps of a second or more ~1.5 ms instead of ~6 ms. A point
reaches MLflow at most this late (``batch_trigger`` points send sooner); ``flush`` and ``close`` send at once."""


class MlflowTracker(TraceLogging, RunLifecycle, BatchedLogging, SyncLogging):
    """One MLflow run: params/tags synchronously at ``start``, metrics through an on-disk spool and a sender thread.

    Args:
        tracking_uri: where MLflow lives (see :func:`resolve_tracking_uri`).
        spool_dir: directory for the metric spool and the sent cursor, e.g. ``runs/<name>/tracking_spool``.
        flush_interval: seconds between background sends (:data:`FLUSH_INTERVAL`).
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
        flush_interval: float = FLUSH_INTERVAL,
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
        self.http_timeout = http_timeout
        self.strict = strict
        self.client = MlflowClient(tracking_uri)
        self.run_id: str | None = None
        self.experiment_id: str | None = None
        self._init_batched_logging(flush_interval, batch_trigger, max_backoff, log_system_metrics,
                                   system_metrics_interval)


def tracker_from_config(cfg, run_dir: Path, project_dir: Path | None = None, **kwargs: Any) -> MlflowTracker | None:
    """The tracker an experiment config asks for (None for ``tracking.backend: none``), spooling under
    ``<run_dir>/tracking_spool``; create it on the main process only."""
    t = cfg.tracking
    if t.backend != "mlflow":
        return None
    uri = resolve_tracking_uri(t.tracking_uri, Path(project_dir) if project_dir else Path.cwd())
    return MlflowTracker(uri, Path(run_dir) / SPOOL_DIRNAME, log_system_metrics=t.log_system_metrics, **kwargs)


def _keyed(metrics: dict[str, Any], prefix: str) -> dict[str, Any]:
    """The trainer's metrics under ``prefix``: :func:`~grpo.tracking.metric_keys.train_key`'s names for ``train/``."""
    if prefix == TRAIN_PREFIX:
        return {train_key(k): v for k, v in metrics.items()}
    return {f"{prefix}{k}": v for k, v in metrics.items()}


class MlflowCallback(TrainerCallback):
    """Forward every ``Trainer.log`` call to the tracker at ``state.global_step`` (main process only), under
    ``prefix`` (:data:`TRAIN_PREFIX` by default, named by :func:`~grpo.tracking.metric_keys.train_key`).

    Numbers only; NaN is skipped. Another ``prefix`` (e.g. ``"warm_start/"``) keeps stages that restart their step
    count apart.
    """

    def __init__(self, tracker: MlflowTracker, prefix: str = TRAIN_PREFIX) -> None:
        self.tracker = tracker
        self.prefix = prefix

    def on_episodes(self, args, state, control, episodes=None, **kwargs):
        """Episode records from the trainer (main process): written as MLflow traces on the tracker's own thread."""
        if episodes:
            self.tracker.log_episode_traces(episodes)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs or not state.is_world_process_zero:
            return
        self.tracker.log_metrics(_keyed(logs, self.prefix), step=state.global_step)


def log_metrics_file(tracker: MlflowTracker, path: str | Path, prefix: str = TRAIN_PREFIX) -> int:
    """Replay a ``metrics.jsonl`` written by :class:`grpo.training.train.MetricsRecorder` (``{"step", "metrics"}``
    lines).

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
            tracker.log_metrics(_keyed(row.get("metrics", {}), prefix), int(row["step"]))
            rows += 1
    return rows

