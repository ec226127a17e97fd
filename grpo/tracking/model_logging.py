"""Logging the trained model: MLflow's ``transformers`` flavour (a LoRA run's adapter as a peft model), linked to the
tracker's run and its metrics at the last training step."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from grpo.tracking.store import TrackingError

if TYPE_CHECKING:
    from grpo.tracking.tracker import MlflowTracker

_log = logging.getLogger(__name__)


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


def model_name(text: str) -> str:
    """``text`` as a logged model's name: MLflow refuses ``/ : . % " '`` in one (a run named ``qwen2.5-x`` gives
    ``qwen2-5-x``)."""
    return re.sub(r"[/:.%\"']", "-", text) or "model"


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
    name: str | None = None,
    task: str = "text-generation",
    step: int = 0,
):
    """Log the trained model with MLflow's ``transformers`` flavour, linked to the tracker's run.

    The model is named ``name``, by default the run's name (:func:`model_name`: MLflow's rules): the experiment's
    Models list tells the runs' models apart by it (every one was ``model``), and it is the ``<name>`` of
    ``runs:/<run_id>/<name>``.

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
    from transformers import AutoModelForCausalLM

    if tracker.run_id is None:
        raise TrackingError("log_model: the tracker is not started")
    client = tracker.client
    run = client.get_run(tracker.run_id)  # params are logged at start: no need to wait for the metrics
    name = model_name(name or run.info.run_name or "")
    model_dir = Path(model_dir).resolve()
    tokenizer_dir = Path(tokenizer_dir).resolve() if tokenizer_dir else model_dir
    from grpo.training.policy import MODEL_LOCK, is_adapter_dir, load_adapted
    from grpo.training.tiny_model import load_tokenizer_from

    with MODEL_LOCK:
        # A LoRA run's model/ is a peft adapter, logged as a peft model: MLflow stores the adapter and references the
        # base (a local folder by its path: MLflow's own copy of a local base, made when it is no hub id, comes out
        # with peft's layer names and loads as random weights), and load_model returns the PeftModel.
        adapter = is_adapter_dir(model_dir)
        model = load_adapted(model_dir) if adapter else AutoModelForCausalLM.from_pretrained(str(model_dir))
        tokenizer = load_tokenizer_from(tokenizer_dir)
    extra = {}
    if adapter and Path(model.peft_config["default"].base_model_name_or_path).is_dir():
        extra["base_model_path"] = model.peft_config["default"].base_model_name_or_path
    card = ModelCard(
        f"---\nlicense: other\ntags: [grpo]\n---\n# {name}\n\nGRPO-trained model from MLflow run {tracker.run_id}.\n"
    )
    if not tracker.flush(timeout=60):
        _log.warning("tracking: metrics not yet in MLflow; the logged model %r is not linked to them", name)
    logged = client.create_logged_model(
        experiment_id=tracker.experiment_id, name=name, source_run_id=tracker.run_id, model_type="transformers",
        params=run.data.params,
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

