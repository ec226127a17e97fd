"""The run lifecycle part of :class:`grpo.tracking.tracker.MlflowTracker`: create or reopen the MLflow run, send what
an earlier tracker left unsent, start and stop the background work, and end the run with its status.

Resume: ``start(run_id=...)`` reopens the run, skips params already logged, and reads the steps every metric key
already has in MLflow, so the batched logging drops a point whose (key, step) the run has (see
:mod:`grpo.tracking.batched_logging`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Self

from grpo.tracking.spool import read_state
from grpo.tracking.store import EXPERIMENT_TAGS, TrackingError, default_artifact_location, is_http
from grpo.tracking.values import param_value, redact, tag_value

_log = logging.getLogger(__name__)


class RunLifecycle:
    """Start, resume and close one MLflow run. A mixin of :class:`~grpo.tracking.tracker.MlflowTracker`: it uses the
    tracker's ``client``, ``tracking_uri``, ``http_timeout``, the batched logging's spool, dedup sets, sender and
    system metrics, and the synchronous logging's batch send (``_log_batch_sync``)."""

    run_id: str | None
    experiment_id: str | None

    @staticmethod
    def saved_run_id(spool_dir: Path) -> str | None:
        """The MLflow run id a previous tracker recorded in ``spool_dir`` (to resume the same run)."""
        return read_state(spool_dir).get("run_id")

    def _check_reachable(self) -> None:
        """A clear error at once when nothing listens at the tracking URI. A server that accepted the connection but
        does not answer ``/health`` in time is busy (one worker, its SQLite held, a starved CPU), not absent: the run
        goes on with a warning, and MLflow's client waits for the server as it does for every request
        (``MLFLOW_HTTP_REQUEST_TIMEOUT``, ``MLFLOW_HTTP_REQUEST_MAX_RETRIES``). Before, that wait failed the run as
        "unreachable" on a loaded machine."""
        if not is_http(self.tracking_uri):
            return
        import requests

        wait = min(self.http_timeout, 10)
        try:
            requests.get(self.tracking_uri.rstrip("/") + "/health", timeout=wait)
        except requests.ReadTimeout:
            _log.warning("MLflow tracking server %s is busy (no answer to /health in %g s); going on: MLflow's client "
                         "waits for it (MLFLOW_HTTP_REQUEST_TIMEOUT, MLFLOW_HTTP_REQUEST_MAX_RETRIES)",
                         self.tracking_uri, wait)
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
                        experiment_name,
                        artifact_location=default_artifact_location(self.tracking_uri, experiment_name),
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
                self.experiment_id, run_name=run_name, tags={k: tag_value(v) for k, v in (tags or {}).items()}
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
                self._log_batch_sync(run_id, tags=[RunTag(k, tag_value(v)) for k, v in tags.items()])
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

    def close(self, status: str = "FINISHED", timeout: float = 30.0) -> bool:
        """Stop system metrics, send what can be sent within ``timeout``, stop the sender.

        The run is marked ``status`` only when the spool is empty; otherwise it stays RUNNING and the unsent points
        stay in the spool for the next ``start``. Returns whether everything was sent.
        """
        if self.run_id is None:
            return True
        self._close_traces(min(timeout, 10.0))  # before the last flush: it logs the trace counts
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

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(status="FAILED" if exc_type else "FINISHED")
