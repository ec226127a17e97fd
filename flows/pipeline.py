"""The pipeline flow: prep → plan → eval (before) → train → eval (after), one Prefect flow run and one MLflow run.

The flow's parameter is the experiment config itself, so the Prefect UI renders it as a form. A retry of the flow
run (or ``grpo run --resume``) continues the same run directory from its last checkpoint and logs into the same
MLflow run.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Literal

from prefect import flow, get_run_logger
from prefect.artifacts import create_link_artifact, create_markdown_artifact
from prefect.context import get_run_context

import grpo.stages
from flows.stages import PrefectProgress, eval_flow, plan_flow, prep_flow, summarize_for_ui
from grpo.console import quiet_library_noise
from grpo.confine import check_config_paths
from grpo.config import ExperimentConfig, load_config, presets, resolve_config
from grpo.experiment import write_summary
from grpo.prep import load_prepared
from grpo.runs import RunDir, open_run_dir
from grpo.run_tracking import end_status, eval_metrics, log_numbers, log_run_artifacts, log_prep, plan_metrics, start_run_tracking
from grpo.tracking import MlflowCallback, MlflowTracker
from grpo.train import train_grpo

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "tiny.yaml"
FLOW_RUNS_STARTED: list[str] = []  # this process's pipeline flow runs: the CLI cancels them on Ctrl-C / SIGTERM
_TRACKERS: dict[str, MlflowTracker] = {}  # run dir -> tracker, shared by the subflows of one pipeline run


def default_config() -> ExperimentConfig:
    return load_config(DEFAULT_CONFIG) if DEFAULT_CONFIG.is_file() else ExperimentConfig()


# The presets in configs/ as a closed choice, so the Prefect form shows a dropdown.
_PRESETS = tuple(presets())
Preset = Literal[_PRESETS] if _PRESETS else str  # type: ignore[valid-type]


@flow(name="grpo-train", flow_run_name="train")
def train_flow(config: ExperimentConfig, run_dir: str, data_dir: str, plan_path: str, resume: bool = False) -> dict:
    """GRPO training into ``run_dir``; resumes from the last checkpoint when one exists (no blind retries)."""
    run = RunDir(Path(run_dir))
    resume = resume or run.latest_checkpoint() is not None
    policy = grpo.stages.policy_stage(config, Path(data_dir), log=get_run_logger().info)
    callbacks = [PrefectProgress()]
    tracker = _TRACKERS.get(str(run.path))
    if tracker is not None:
        callbacks.append(MlflowCallback(tracker))
    result = train_grpo(config, policy, load_prepared(Path(data_dir))["train"], run, resume,
                        plan_path=Path(plan_path), callbacks=callbacks, echo=get_run_logger().info)
    return {"steps": result.steps, "seconds": result.seconds, "resumed_from": result.resumed_from,
            "metric_names": result.metric_names, "reward_curve": result.reward_curve,
            "model_dir": str(run.model_dir), "policy_source": policy.source}


def _flow_run_info() -> tuple[str | None, str | None, int]:
    try:
        ctx = get_run_context()
        fr = ctx.flow_run
        return str(fr.id), fr.name, int(fr.run_count or 1)
    except Exception:  # called outside a flow run
        return None, None, 1


def _ui_url(flow_run_id: str | None) -> str | None:
    from prefect.settings import PREFECT_UI_URL

    base = PREFECT_UI_URL.value()
    return f"{base.rstrip('/')}/runs/flow-run/{flow_run_id}" if base and flow_run_id else None


@flow(name="grpo-pipeline")  # no log_prints: stages log explicitly, library prints stay out of the run log
def grpo_pipeline(
    preset: Preset | None = None, config: ExperimentConfig = default_config(), overrides: list[str] | None = None,
    run_name: str | None = None, resume: bool = False, tracking_tags: dict | None = None,
) -> dict:
    """Prepare data, plan, evaluate, train with GRPO and evaluate again, tracked in MLflow.

    Args:
        preset: Start from this configs/ preset instead of the config form below.
        config: The experiment (defaults from configs/tiny.yaml). Ignored when a preset is chosen.
        overrides: key=value settings applied last, e.g. grpo.learning_rate=2e-4 (the CLI's --set).
        run_name: Run directory and MLflow run name; a new name is generated when empty. Never overwritten.
        resume: Continue an existing run directory from its last checkpoint, into the same MLflow run.
        tracking_tags: Extra MLflow run tags (a sweep sets mlflow.parentRunId to nest its trials).
    """
    quiet_library_noise()
    config = resolve_config(config, preset, overrides)
    check_config_paths(config)  # a served run (grpo serve) stays inside the allowed roots (#12.15)
    started = time.perf_counter()
    logger = get_run_logger()
    flow_run_id, flow_run_name, attempt = _flow_run_info()
    if flow_run_id is not None:
        FLOW_RUNS_STARTED.append(flow_run_id)
    name = run_name or f"{config.name}-{flow_run_name or time.strftime('%Y%m%d-%H%M%S')}"
    run_path = Path(config.output_dir) / name
    resume = resume or (attempt > 1 and run_path.exists())  # a retried flow run continues its run directory
    run = open_run_dir(config, name, resume)
    logger.info(f"run directory {run.path} (resume={resume})")

    tracker = start_run_tracking(config, run, tags={
        "prefect.flow_run_id": flow_run_id, "prefect.flow_run_name": flow_run_name,
        "prefect.deployment": _deployment_name(), "prefect.ui_url": _ui_url(flow_run_id), **(tracking_tags or {})})
    mlflow_run_id = tracker.run_id if tracker is not None else None
    finished, error, was_finished = False, None, resume and run.summary_file.is_file()
    if tracker is not None:
        _TRACKERS[str(run.path)] = tracker
        create_link_artifact(key="mlflow-run", link=mlflow_run_url(tracker.tracking_uri, tracker.experiment_id,
                                                                   mlflow_run_id),
                             link_text=f"MLflow run {mlflow_run_id}", description="This run in MLflow")
    try:
        prep = prep_flow(config)
        data_dir = prep["data_dir"]
        log_prep(tracker, prep)
        plan = plan_flow(config, data_dir, prep["content_hash"])
        run.write_json("inputs.json", {"data_dir": data_dir, "data_content_hash": prep["content_hash"],
                                       "plan_path": plan["plan_path"]})
        log_numbers(tracker, plan_metrics(plan))

        before = run.read_json("eval_before.json") if resume else None
        if before is None and config.evaluation.enabled and config.evaluation.before_training:
            before = eval_flow(config, "policy", data_dir, str(run.path / "eval_before.json"), "before")
        if before is not None:
            log_numbers(tracker, eval_metrics(before, "before"), step=0)

        trained = train_flow(config, str(run.path), data_dir, plan["plan_path"], resume)

        after = None
        if config.evaluation.enabled:
            after = eval_flow(config, trained["model_dir"], data_dir, str(run.path / "eval_after.json"), "after")
            log_numbers(tracker, eval_metrics(after, "after"), step=trained["steps"])

        result = _TrainResultView(trained)
        summary = write_summary(config, run, result, before, after, trained["policy_source"],
                                time.perf_counter() - started, mlflow_run_id=mlflow_run_id,
                                prefect_flow_run_id=flow_run_id)
        if tracker is not None:
            log_run_artifacts(tracker, config, run, data_dir, plan["plan_path"])
        create_markdown_artifact(key="grpo-run-summary", markdown=summarize_for_ui(summary), description="GRPO run")
        finished = True
        return summary
    except BaseException as err:
        error = err
        raise
    finally:
        if tracker is not None:
            _TRACKERS.pop(str(run.path), None)
            tracker.close(status=end_status(finished, error, was_finished))


def mlflow_run_url(tracking_uri: str, experiment_id: str | None, run_id: str) -> str:
    """The run's page: on the tracking server, or on ``grpo ui``'s MLflow server for the local SQLite store."""
    base = tracking_uri.rstrip("/") if tracking_uri.startswith("http") else "http://127.0.0.1:5000"
    return f"{base}/#/experiments/{experiment_id}/runs/{run_id}"


class _TrainResultView:
    def __init__(self, d: dict) -> None:
        self.steps, self.seconds, self.resumed_from = d["steps"], d["seconds"], d["resumed_from"]
        self.metric_names, self.reward_curve = d["metric_names"], d["reward_curve"]


def _deployment_name() -> str | None:
    try:
        from prefect.runtime import deployment

        return deployment.name
    except Exception:
        return None
