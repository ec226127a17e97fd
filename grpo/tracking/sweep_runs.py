"""A sweep's MLflow side beyond its parent run: its trials' own runs and the model registry.

The sweep (:func:`grpo.pipeline.sweep.run_sweep`) decides what happens to a trial's run and when;
:class:`MlflowTrialRuns` is how it happens in MLflow: find a trial's run (its spool's record, else its sweep tags), set
it FAILED or tag it pruned, read its ``summary.json`` artifact, register the best trial's model and move the aliases.
It knows a trial by its number and run directory only, so it stays below the pipeline (tests/test_layers.py).

What ``best`` means: every sweep of a config registers into one model (``<config name>-grpo``), whatever its study,
so the alias is judged across the model's versions, not within one study. Each version carries the metric, direction
and value it was judged by (:data:`METRIC_TAG`, :data:`DIRECTION_TAG`, :data:`VALUE_TAG`); ``best`` moves to a new
version only when that version beats the one it names on the same metric in the same direction (a tie keeps it).
A version judged otherwise (another metric or direction, or none recorded) is not comparable: the alias stays, and
the registration says so in one line. So ``best`` never names a model worse than one it named before. Each study's
own best is the alias ``study-<study name>`` (:func:`study_alias`), which follows Optuna's best trial of that study.
"""

from __future__ import annotations

import contextlib
import json
import re
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpo.formatting import human_metric
from grpo.tracking.model_logging import use_tracking_uri
from grpo.tracking.tracker import SPOOL_DIRNAME, MlflowTracker

BEST_ALIAS = "best"
"""The registered model's alias for its best version, across every sweep that registered into it."""
METRIC_TAG, DIRECTION_TAG, VALUE_TAG = "grpo.sweep.metric", "grpo.sweep.direction", "grpo.sweep.metric_value"
"""The model version's tags saying what it was judged by: the sweep's metric, its direction, the trial's value."""


@dataclass(frozen=True)
class ParentRun:
    """The sweep's MLflow parent run: where its trials' runs nest and are found."""

    tracking_uri: str
    experiment_id: str | None
    run_id: str


class MlflowTrialRuns:
    """The trials of the parent run ``parent`` in MLflow (:class:`grpo.pipeline.sweep.TrialRuns`)."""

    def __init__(self, parent: ParentRun) -> None:
        from mlflow import MlflowClient

        self.parent, self.client = parent, MlflowClient(parent.tracking_uri)

    def find(self, number: int, run_dir: Path | None) -> str | None:
        """The id the trial's tracker recorded in its run directory's spool (``run_dir``: a trial run in this
        process), else the run tagged as trial ``number``."""
        if run_dir is not None:
            run_id = MlflowTracker.saved_run_id(run_dir / SPOOL_DIRNAME)
            if run_id:
                return run_id
        return self.tagged(number)

    def tagged(self, number: int) -> str | None:
        """The run nested under the parent with ``grpo.sweep.trial`` = ``number``."""
        if self.parent.experiment_id is None:
            return None
        runs = self.client.search_runs(
            [self.parent.experiment_id], max_results=1,
            filter_string=f"tags.`mlflow.parentRunId` = '{self.parent.run_id}' and "
                          f"tags.`grpo.sweep.trial` = '{number}'")
        return runs[0].info.run_id if runs else None

    def summary(self, number: int) -> dict[str, Any]:
        """Trial ``number``'s ``summary.json`` artifact with its ``mlflow_run_id`` (only the id when the artifact
        cannot be read): the summary of a trial that ran in another process (a deployment's worker)."""
        run_id = self.tagged(number)
        if run_id is None:
            raise RuntimeError(f"trial {number}: no MLflow run tagged with this sweep's trial {number}")
        try:
            with tempfile.TemporaryDirectory() as tmp:
                summary = json.loads(Path(self.client.download_artifacts(run_id, "summary.json", tmp)).read_text())
        except Exception:
            summary = {}
        return {"mlflow_run_id": run_id, **summary}

    def mark_failed(self, run_id: str, error: str) -> None:
        """FAILED, with the error as tag ``grpo.sweep.error``."""
        run = self.client.get_run(run_id)
        self.client.set_tag(run_id, "grpo.sweep.error", error[:4000])
        self.client.set_terminated(run_id, status="FAILED", end_time=run.info.end_time)  # keep the real end time

    def mark_pruned(self, run_id: str, step: int) -> None:
        """Tags ``grpo.sweep.pruned=true`` and ``grpo.sweep.pruned_at_step``."""
        self.client.set_tag(run_id, "grpo.sweep.pruned", "true")
        self.client.set_tag(run_id, "grpo.sweep.pruned_at_step", str(step))

    def register(self, run_id: str, model_name: str, tags: Mapping[str, str]) -> dict[str, Any]:
        """The model run ``run_id`` logged, as a version of ``model_name`` with ``tags`` (which name the metric,
        direction and value it is judged by: :data:`METRIC_TAG`, :data:`DIRECTION_TAG`, :data:`VALUE_TAG`; its
        study as ``grpo.sweep.study``): the version of that run already registered (the study's best of an earlier
        invocation), else a new one. :data:`BEST_ALIAS` moves to it only when it beats the version the alias names
        (see the module docstring); ``study-<study>`` always does. Returns ``name``, ``version``, ``alias`` (the
        best alias when it names this version, else None), ``best_version`` (the version the alias names),
        ``note`` (why the alias stays elsewhere, one line), ``study_alias``, ``source``, ``run_id`` and
        ``unchanged`` (no new version)."""
        client = self.client
        holder = None
        with contextlib.suppress(Exception):  # no such model yet, or no alias
            holder = client.get_model_version_by_alias(model_name, BEST_ALIAS)
        version = next((v for v in client.search_model_versions(f"run_id = '{run_id}'") if v.name == model_name),
                       None)
        unchanged = version is not None
        if version is None:
            version = self._new_version(run_id, model_name, tags)
        note = None if holder is None else _alias_stays(holder, str(version.version), tags)
        if note is None:
            client.set_registered_model_alias(model_name, BEST_ALIAS, version.version)
        study = study_alias(tags.get("grpo.sweep.study", ""))
        if study:
            client.set_registered_model_alias(model_name, study, version.version)
        return {"name": model_name, "version": str(version.version), "alias": None if note else BEST_ALIAS,
                "best_version": str(version.version) if note is None else str(holder.version), "note": note,
                "study_alias": study, "source": version.source, "run_id": run_id, "unchanged": unchanged}

    def _new_version(self, run_id: str, model_name: str, tags: Mapping[str, str]):
        """A new version from the logged model of run ``run_id`` (its run artifact when none is found), without
        MLflow's lines on stderr ("Successfully registered model", "Created version", its wait for the version)."""
        import mlflow
        from mlflow.utils.logging_utils import MLFLOW_LOGGING_STREAM

        models = [m for m in self.client.search_logged_models(experiment_ids=[self.parent.experiment_id],
                                                              filter_string=f"source_run_id = '{run_id}'")
                  if m.source_run_id == run_id]
        source = f"models:/{models[0].model_id}" if models else f"runs:/{run_id}/model"
        was = MLFLOW_LOGGING_STREAM.enabled
        MLFLOW_LOGGING_STREAM.enabled = False  # all MLflow prints and logs go there (a failure raises)
        try:
            with use_tracking_uri(self.parent.tracking_uri):
                return mlflow.register_model(source, model_name, tags=dict(tags))
        finally:
            MLFLOW_LOGGING_STREAM.enabled = was


def _alias_stays(holder, version: str, tags: Mapping[str, str]) -> str | None:
    """Why :data:`BEST_ALIAS` stays on ``holder`` (the version it names) rather than move to ``version`` judged by
    ``tags``, in one line; None when it moves: ``version`` is better on the same metric in the same direction."""
    if str(holder.version) == version:
        return None
    judged = (tags.get(METRIC_TAG), tags.get(DIRECTION_TAG))
    held = (holder.tags.get(METRIC_TAG), holder.tags.get(DIRECTION_TAG))
    try:
        value, held_value = float(tags[VALUE_TAG]), float(holder.tags[VALUE_TAG])
    except (KeyError, TypeError, ValueError):
        value = held_value = None
    stays = f"alias {BEST_ALIAS} stays on version {holder.version}"
    if held != judged or held_value is None or value is None:
        missing = [k for k, v in (("metric", held[0]), ("direction", held[1]), ("value", held_value)) if v is None]
        by = f"records no {' or '.join(missing)}" if missing else f"was judged by {held[0]} ({held[1]})"
        return (f"{stays}: it {by}, version {version} by {judged[0]} ({judged[1]}); set the alias in MLflow if "
                f"version {version} should have it")
    if value > held_value if judged[1] == "maximize" else value < held_value:
        return None
    return (f"{stays}: its {judged[0]} {human_metric(held_value)} is not beaten by version {version}'s "
            f"{human_metric(value)} ({judged[1]})")


def study_alias(study: str) -> str | None:
    """``study-<study>``: the alias of a study's best version (MLflow aliases take letters, digits, ``_`` and ``-``:
    other characters become ``_``); None without a study name."""
    return f"study-{re.sub(r'[^A-Za-z0-9_-]', '_', study)}"[:255] if study else None


__all__ = ["BEST_ALIAS", "DIRECTION_TAG", "METRIC_TAG", "MlflowTrialRuns", "ParentRun", "VALUE_TAG", "study_alias"]
