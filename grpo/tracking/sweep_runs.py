"""A sweep's MLflow side beyond its parent run: its trials' own runs and the model registry.

The sweep (:func:`grpo.pipeline.sweep.run_sweep`) decides what happens to a trial's run and when;
:class:`MlflowTrialRuns` is how it happens in MLflow: find a trial's run (its spool's record, else its sweep tags), set
it FAILED or tag it pruned, read its ``summary.json`` artifact, register the best trial's model under an alias. It
knows a trial by its number and run directory only, so it stays below the pipeline (tests/test_layers.py).
"""

from __future__ import annotations

import contextlib
import json
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpo.tracking.model_logging import use_tracking_uri
from grpo.tracking.tracker import SPOOL_DIRNAME, MlflowTracker

BEST_ALIAS = "best"
"""The registered model's alias for the best trial of a sweep's study."""


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
        """A new version of ``model_name`` (with ``tags``) from the model that run ``run_id`` logged, with alias
        :data:`BEST_ALIAS`; when the alias already names a version of that run (the best trial of an earlier
        invocation), that version stays."""
        import mlflow

        client = self.client
        with contextlib.suppress(Exception):
            current = client.get_model_version_by_alias(model_name, BEST_ALIAS)
            if current.run_id == run_id:
                return {"name": model_name, "version": str(current.version), "alias": BEST_ALIAS,
                        "source": current.source, "run_id": run_id, "unchanged": True}
        models = [m for m in client.search_logged_models(experiment_ids=[self.parent.experiment_id],
                                                         filter_string=f"source_run_id = '{run_id}'")
                  if m.source_run_id == run_id]
        source = f"models:/{models[0].model_id}" if models else f"runs:/{run_id}/model"
        with use_tracking_uri(self.parent.tracking_uri):
            version = mlflow.register_model(source, model_name, tags=dict(tags))
        client.set_registered_model_alias(model_name, BEST_ALIAS, version.version)
        return {"name": model_name, "version": str(version.version), "alias": BEST_ALIAS, "source": source,
                "run_id": run_id, "unchanged": False}


__all__ = ["BEST_ALIAS", "MlflowTrialRuns", "ParentRun"]
