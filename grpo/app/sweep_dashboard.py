"""A finished sweep's comparison dashboard, built by the app.

The sweep (:mod:`grpo.pipeline.sweep`, under the ``grpo-sweep`` flow) ends with its own results page, a table of its
trials, as the parent run's ``dashboard/dashboard.html``: ``flows/`` never import ``dashboards/``. Whoever calls the
sweep from the app (``grpo sweep``) replaces that page with :mod:`dashboards.comparison`'s, with the study's parameter
importances, on disk, on the parent run and in ``sweep.json``. A sweep run by a deployment (``grpo serve``, a
worker) keeps its results page; ``grpo dashboard --experiment E --sweep PARENT_RUN_ID`` builds the comparison then.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from grpo.config import ExperimentConfig


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)


def add_comparison_dashboard(config: ExperimentConfig, result: dict[str, Any],
                             warn: Callable[[str], None] = _warn) -> dict[str, Any]:
    """Build the comparison dashboard of the sweep ``result`` (as :func:`grpo.pipeline.sweep.run_sweep` returned it,
    with ``config``'s tracking), log it over the results page and update ``result`` and ``sweep.json``; returns
    ``result["dashboard"]``. An untracked sweep, or a dashboard that can not be built or logged, keeps the results
    page: ``warn`` says why, the sweep's results stand."""
    parent = result.get("mlflow_run_id")
    if not parent:
        return result["dashboard"]
    from mlflow import MlflowClient

    from dashboards.comparison import build_dashboard, log_dashboard
    from grpo.pipeline.sweep import write_result
    from grpo.tracking.store import resolve_tracking_uri

    uri = resolve_tracking_uri(config.tracking.tracking_uri, Path.cwd())
    out = Path(result["sweep_dir"]) / "dashboard.html"
    try:
        path = Path(build_dashboard(uri, config.tracking.experiment_name, sweep_run_id=parent, out=out,
                                    importances=result["study"]["importances"]))
    except Exception as err:
        warn(f"comparison dashboard failed ({type(err).__name__}: {err}); the sweep's results page stays")
        return result["dashboard"]
    artifact = None
    try:
        artifact = log_dashboard(MlflowClient(uri), parent, path)
    except Exception as err:
        warn(f"could not log the dashboard to MLflow: {type(err).__name__}: {err}")
    result["dashboard"] = {"path": str(path), "kind": "comparison", "artifact": artifact}
    write_result(result)
    return result["dashboard"]
