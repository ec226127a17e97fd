"""The synchronous logging part of :class:`grpo.tracking.tracker.MlflowTracker`: tags, params, dataset inputs,
artifacts and tables, each sent when it is called (they are few and not on the training path). A failure is a
warning and ``False``, or raises with ``strict``."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from grpo.tracking.store import TrackingError
from grpo.tracking.values import MAX_PARAMS_TAGS_PER_BATCH, in_chunks, param_value, redact, tag_value

_log = logging.getLogger(__name__)


class SyncLogging:
    """A mixin of :class:`~grpo.tracking.tracker.MlflowTracker`; uses its ``client``, ``run_id`` and ``strict``."""

    run_id: str | None
    strict: bool

    def _log_batch_sync(self, run_id: str, params: list | None = None, tags: list | None = None) -> None:
        """Params and tags in batches of MLflow's limit (also the run lifecycle's, at ``start``)."""
        for chunk in in_chunks(params or [], MAX_PARAMS_TAGS_PER_BATCH):
            self.client.log_batch(run_id, params=chunk)
        for chunk in in_chunks(tags or [], MAX_PARAMS_TAGS_PER_BATCH):
            self.client.log_batch(run_id, tags=chunk)

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

        items = [RunTag(str(k), tag_value(v)) for k, v in tags.items()]
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

