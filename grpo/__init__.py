"""GRPO experiment platform: the library (see docs/design.md, "Where things live")."""

import os

# MLflow's telemetry client writes a session id into os.environ from a background thread; a concurrent reader of
# os.environ (requests' proxy lookup in another thread: sweep trials, the tracking sender) then fails with
# "KeyError: '_MLFLOW_TELEMETRY_SESSION_ID'" and an MLflow call dies mid-run. Off unless the user turned it on.
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
