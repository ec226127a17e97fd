"""Where MLflow lives: the tracking URI a run uses, an experiment's artifact location, the kind of experiment, the
MLflow UI's links; and the error when the tracking backend can not be used."""

from __future__ import annotations

import os
import re
from pathlib import Path

from grpo.errors import GRPOPlatformError


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
    base = tracking_uri.rstrip("/") if is_http(tracking_uri) else "http://127.0.0.1:5000"
    page = f"/#/experiments/{experiment_id}" + (f"/runs/{run_id}" if run_id else "")
    return f"{base}{page}?{MLFLOW_UI_QUERY}"


def is_http(uri: str) -> bool:
    """A tracking server reached over HTTP (not a local store such as SQLite)."""
    return uri.startswith(("http://", "https://"))
