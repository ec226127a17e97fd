"""What one experiment run records in MLflow, stage by stage: shared by the Prefect pipeline (``flows/pipeline.py``)
and the multi-process recipe (``grpo/pipeline/experiment.py`` under torchrun / accelerate launch), so both log the same
names: every trainer metric under ``train/`` (through :class:`grpo.tracking.tracker.MlflowCallback`, named by
:func:`grpo.tracking.metric_keys.train_key`), ``eval/accuracy`` and ``eval/pass_at_<k>`` at step 0 (before training)
and at the last step (after), the prep and plan figures as params (``prep.rows_valid``, ``plan.generation_rounds``,
...), and the run's artifacts and model.

Metrics are what changes over steps: MLflow draws one chart per metric key, so a one-off figure logged as a metric
is a single-bar chart that pushes the training curves down the run page and opens the Compare view on a constant."""

from __future__ import annotations

from collections.abc import Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

import yaml

from grpo.config import ExperimentConfig, flatten
from grpo.formatting import human_number
from grpo.runs import RunDir
from grpo.tracking.metric_keys import EVAL_ACCURACY, EVAL_PREFIX
from grpo.tracking.model_logging import log_model
from grpo.tracking.tracker import MlflowTracker, tracker_from_config
from grpo.tracking.values import redact

# The packages a result depends on, recorded as ``grpo.version.<name>`` run tags (absent ones are left out).
KEY_PACKAGES = ("grpo-platform", "torch", "transformers", "trl", "accelerate", "peft", "datasets", "vllm", "mlflow",
                "prefect")


def package_versions() -> dict[str, str]:
    """Installed versions of :data:`KEY_PACKAGES`, so a run names the environment its result came from."""
    versions = {}
    for name in KEY_PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return versions


def start_run_tracking(cfg: ExperimentConfig, run: RunDir, tags: Mapping[str, Any] | None = None
                       ) -> MlflowTracker | None:
    """Start (or, after a resume, reopen) the run's MLflow run; None when ``tracking.backend`` is ``none``."""
    tracker = tracker_from_config(cfg, run.path)
    if tracker is None:
        return None
    all_tags = {"grpo.run_dir": str(run.path), **{f"grpo.version.{k}": v for k, v in package_versions().items()},
                **(tags or {})}
    tracker.start(run.path.name, cfg.tracking.experiment_name, tags={k: v for k, v in all_tags.items() if v},
                  params=flatten(cfg), run_id=MlflowTracker.saved_run_id(tracker.spool_dir))
    return tracker


def end_status(finished: bool, error: BaseException | None, was_finished: bool) -> str:
    """The MLflow status a pipeline attempt leaves: FINISHED when it finished; KILLED when a signal (Ctrl-C,
    SIGTERM) stopped it; FAILED otherwise, except that a resume of a run that had already finished (its
    ``summary.json`` existed before the attempt) leaves it FINISHED: a failed retry does not undo a finished run."""
    if finished:
        return "FINISHED"
    if error is not None and not isinstance(error, Exception):  # KeyboardInterrupt, SystemExit, TerminationSignal
        return "KILLED"
    return "FINISHED" if was_finished else "FAILED"


def log_numbers(tracker: MlflowTracker | None, metrics: Mapping[str, Any], step: int = 0) -> None:
    if tracker is not None:
        tracker.log_metrics(metrics, step=step)  # the tracker keeps the numbers (grpo.tracking.values.numeric_metrics)


def prep_params(stats: Mapping[str, Any]) -> dict[str, Any]:
    """The prep stage's figures as params: row counts and prompt length statistics."""
    return {"prep.rows_in": stats["rows_in"], "prep.rows_valid": stats["rows_valid"],
            "prep.rows_quarantined": stats["rows_quarantined"],
            **{f"prep.prompt_chars_{k}": human_number(v) for k, v in (stats.get("prompt_chars") or {}).items()}}


def log_prep(tracker: MlflowTracker | None, stats: Mapping[str, Any]) -> None:
    """The prep stage in MLflow: its figures as params (:func:`prep_params`) and each split as a dataset input (name,
    content hash, where it was written, rows valid and quarantined), so the run page's Datasets column says what it
    trained on."""
    if tracker is None:
        return
    tracker.log_params(prep_params(stats))
    data_dir = Path(stats["data_dir"])
    tracker.log_datasets([
        {"name": f"{stats['source']}:{split}", "digest": stats["content_hash"], "source": data_dir / f"{split}.parquet",
         "context": "training" if split == "train" else "evaluation",
         "profile": {"num_rows": counts["rows_valid"], "rows_quarantined": counts["rows_quarantined"],
                     "quarantine": str(data_dir / "quarantine.jsonl")}}
        for split, counts in stats["splits"].items()])


def plan_params(plan: Mapping[str, Any]) -> dict[str, Any]:
    """The sampler plan's figures as params: generation rounds, epochs and the predicted token imbalance."""
    imbalance = (plan.get("predicted_imbalance") or {}).get("plan_order") or {}
    return {"plan.generation_rounds": plan["generation_rounds"], "plan.epochs": plan["epochs"],
            **{f"plan.imbalance_{k}": human_number(v) for k, v in imbalance.items() if isinstance(v, (int, float))}}


def log_plan(tracker: MlflowTracker | None, plan: Mapping[str, Any]) -> None:
    if tracker is not None:
        tracker.log_params(plan_params(plan))


def eval_metrics(record: Mapping[str, Any]) -> dict[str, float]:
    """An evaluation record as metrics: ``eval/accuracy``, ``eval/pass_at_<k>`` and an environment's figures
    ``eval/env/<name>`` (``eval/env/tool_call_rate``, ``eval/env/tool_off/accuracy``). The same names before and
    after training (logged at step 0 and at the last step), so each reads as one line over the run."""
    out = {EVAL_ACCURACY: record["accuracy"]}
    for key, value in record.items():
        if key.startswith("pass@") and value is not None:
            out[f"{EVAL_PREFIX}{key.replace('@', '_at_')}"] = value
    out.update({f"{EVAL_PREFIX}env/{key}": value for key, value in record.get("env", {}).items()})
    return out


def log_run_artifacts(tracker: MlflowTracker, cfg: ExperimentConfig, run: RunDir, data_dir: str | Path,
                      plan_path: str | Path, step: int) -> None:
    """Resolved config, dataset stats and quarantine, plan summary, eval sample tables, summary, and the model
    (logged at the last training ``step``, so it carries the evaluation after training and the run's params)."""
    redacted = run.path / "tracking_spool" / "config.yaml"  # the resolved config, secrets masked (see redact)
    redacted.parent.mkdir(parents=True, exist_ok=True)
    redacted.write_text(yaml.safe_dump(redact("", cfg.model_dump(mode="json", by_alias=True)), sort_keys=False))
    tracker.log_artifact(redacted)
    tracker.log_artifact(Path(data_dir) / "stats.json", "data")
    tracker.log_artifact(Path(data_dir) / "quarantine.jsonl", "data")
    tracker.log_artifact(Path(plan_path).with_name("plan.json"), "plan")
    for tag in ("before", "after"):
        record = run.read_json(f"eval_{tag}.json")
        if record:
            tracker.log_table({k: [s[k] for s in record["samples"]] for k in record["samples"][0]},
                              f"eval/samples_{tag}.json")
    tracker.log_artifact(run.summary_file)
    if cfg.tracking.log_model:
        # named after the run (with model.lora: the adapter, a peft model), the merged one "<run name>-merged"
        log_model(tracker, run.model_dir, run.model_dir, step=step)
        if cfg.model.lora.enabled and cfg.model.lora.save_merged and run.merged_model_dir.is_dir():
            log_model(tracker, run.merged_model_dir, run.merged_model_dir, name=f"{run.path.name}-merged", step=step)
