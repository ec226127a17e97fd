"""The pipeline flow: the recipe (:mod:`grpo.pipeline.recipe`: prep → plan → policy → eval (before) → train → eval
(after)) with each stage a named Prefect subflow; one Prefect flow run and one MLflow run.

The flow's parameters are the Prefect UI's run form (:mod:`flows.run_form`): a preset, the fields people change most,
one collapsed group per config section. A retry of the flow run (or ``grpo run --resume``) continues the same run
directory from its last checkpoint and logs into the same MLflow run.

Importing this module imports Prefect, the config and the form, not the training stack or MLflow (the recipe, the
stages and the progress callback are imported by a run): ``grpo serve`` and ``grpo deploy`` import it to build their
deployments.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING

from prefect import flow, get_run_logger
from prefect.artifacts import create_link_artifact, create_markdown_artifact, create_table_artifact
from prefect.context import get_run_context
from prefect.states import Cancelled, Failed

from flows.run_form import (
    UNSET,
    AsyncSettings,
    BatchSizeField,
    DataSettings,
    EnvironmentSettings,
    EvaluationSettings,
    ExperimentSettings,
    GRPOSettings,
    LearningRateField,
    LossTypeField,
    MaxStepsField,
    ModelSettings,
    NumGenerationsField,
    Overrides,
    PresetChoice,
    Resume,
    RewardFuncsField,
    RunName,
    SamplingSettings,
    SeedField,
    TrackingSettings,
    TrackingTags,
    WholeConfig,
    form_settings,
    given,
)
from flows.stages import (
    dataset_summary,
    dataset_table,
    eval_flow,
    plan_flow,
    plan_markdown,
    policy_flow,
    prep_flow,
    summarize_for_ui,
)
from grpo.config import ExperimentConfig, resolve_config
from grpo.console import mark_reported, quiet_library_noise
from grpo.errors import GRPOPlatformError
from grpo.pipeline.confine import check_config_paths
from grpo.pipeline.run_context import RunContext
from grpo.runs import RunDir, open_run_dir
from grpo.tracking.store import mlflow_ui_url

if TYPE_CHECKING:
    from grpo.tracking.tracker import MlflowTracker


@flow(name="grpo-train", flow_run_name="train")
def train_flow(config: ExperimentConfig, run_dir: str, data_dir: str, plan_path: str, resume: bool = False) -> dict:
    """GRPO training into ``run_dir``; resumes from the last checkpoint when one exists (no blind retries).

    Stopped by a signal (Cancel in the Prefect UI: the runner's SIGTERM; Ctrl-C), training saves a checkpoint at the
    end of its step (grpo.training.graceful_stop); this subflow then ends Cancelled, not Crashed, and its log says
    which step was saved and how to resume. The signal's exception still reaches the pipeline, which unwinds as
    before (MLflow run KILLED, the flow run Cancelled)."""
    from prefect.runtime import flow_run

    import grpo.pipeline.stages
    from flows.progress import PrefectProgress

    run = RunDir(Path(run_dir))
    context = RunContext.for_run_dir(run.path)  # the pipeline's (PrefectStages.train): parameters stay JSON
    parent = flow_run.parent_flow_run_id
    callbacks = [PrefectProgress(run.read_json("eval_before.json"), str(parent) if parent else None),
                 *context.tracking_callbacks(), *context.callbacks]
    logger = get_run_logger()
    try:
        return grpo.pipeline.stages.train_stage(config, run, data_dir, plan_path, resume, callbacks=callbacks,
                                                log=logger.info)
    except BaseException as err:
        return _cancelled(err, run, logger.warning)  # the pipeline's call re-raises err


def _stop_signal(err: BaseException) -> str | None:
    """The signal behind ``err`` (Ctrl-C, SIGTERM as Prefect's TerminationSignal or the CLI's own), None for an
    error."""
    if isinstance(err, KeyboardInterrupt):
        return "SIGINT"
    if isinstance(err, (Exception, SystemExit, GeneratorExit)):
        return None
    signum = getattr(err, "signum", None) or getattr(err, "signal", None)
    return signal.Signals(signum).name if signum else None


def _cancelled(err: BaseException, run: RunDir, say=None):
    """The Cancelled state a flow returns when a signal stopped it (``say`` logs the message first); re-raises
    ``err`` when it is an error, or Ctrl-C: asyncio turns a KeyboardInterrupt re-raised from a state into
    CancelledError, so Ctrl-C unwinds as it is (the CLI marks its flow runs Cancelled).

    The state's message says the step saved and how to continue, so Prefect's engine does not log the signal again
    as an ERROR with its traceback when it leaves a served run (:func:`grpo.console.mark_reported`); the signal
    still unwinds the caller (the pipeline, the CLI: exit 143)."""
    signal_name = _stop_signal(err)
    if signal_name is None:
        raise err
    message = stopped_message(run, signal_name)
    if say is not None:
        say(message)
    if isinstance(err, KeyboardInterrupt):
        raise err
    return Cancelled(message=message, data=mark_reported(err))


def stopped_message(run: RunDir, signal_name: str) -> str:
    """What a stopped training tells the person who stopped it: the step saved and how to continue."""
    checkpoint = run.latest_checkpoint()
    saved = (f"checkpoint at step {checkpoint.name.rsplit('-', 1)[-1]} saved in {checkpoint}" if checkpoint
             else "no checkpoint was saved (stopped before its first step ended)")
    return (f"training stopped by {signal_name}: {saved}. To continue: run the deployment again with MLflow run "
            f"name {run.path.name!r} and Resume on, or `grpo run --config {run.path / 'config.yaml'} --run-name "
            f"{run.path.name} --resume`")


class PrefectStages:
    """The recipe's stages as named Prefect subflows (``prep``, ``plan``, ``policy``, ``eval-before``, ``train``,
    ``eval-after``) with their caching, retries and artifacts; links the MLflow run and the summary in the UI."""

    def started(self, run: RunDir, tracker: MlflowTracker | None) -> None:
        if tracker is not None:
            create_link_artifact(key="mlflow-run", link=mlflow_run_url(tracker.tracking_uri, tracker.experiment_id,
                                                                       tracker.run_id),
                                 link_text=f"MLflow run {tracker.run_id}", description="This run in MLflow")

    def prep(self, cfg: ExperimentConfig) -> dict:
        stats = prep_flow(cfg)
        # repeated on the pipeline's own flow run, so its Artifacts tab shows the data without opening the subflow
        create_table_artifact(key="run-dataset", table=dataset_table(stats), description=dataset_summary(cfg, stats))
        return stats

    def plan(self, cfg: ExperimentConfig, data_dir: str, content_hash: str) -> dict:
        plan = plan_flow(cfg, data_dir, content_hash)
        create_markdown_artifact(key="run-plan", markdown=plan_markdown(plan), description="Sampler plan")
        return plan

    def policy(self, cfg: ExperimentConfig, data_dir: str, log) -> dict:
        return policy_flow(cfg, data_dir)

    def evaluate(self, cfg: ExperimentConfig, model: str, data_dir: str, out_file: str, tag: str) -> dict:
        return eval_flow(cfg, model, data_dir, out_file, tag)

    def train(self, cfg: ExperimentConfig, run: RunDir, data_dir: str, plan_path: str, resume: bool,
              context: RunContext, log) -> dict:
        with context.registered(run.path):  # the subflow's parameters must stay JSON: it finds the context by run dir
            return train_flow(cfg, str(run.path), data_dir, plan_path, resume)

    def finished(self, summary: dict) -> None:
        create_markdown_artifact(key="grpo-run-summary", markdown=summarize_for_ui(summary), description="GRPO run")


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
    preset: PresetChoice = UNSET,
    learning_rate: LearningRateField = UNSET,
    max_steps: MaxStepsField = UNSET,
    batch_size: BatchSizeField = UNSET,
    num_generations: NumGenerationsField = UNSET,
    reward_funcs: RewardFuncsField = UNSET,
    loss_type: LossTypeField = UNSET,
    seed: SeedField = UNSET,
    run_name: RunName = UNSET,
    resume: Resume = False,
    data_settings: DataSettings = UNSET,
    model_settings: ModelSettings = UNSET,
    grpo_settings: GRPOSettings = UNSET,
    sampling_settings: SamplingSettings = UNSET,
    async_settings: AsyncSettings = UNSET,
    environment_settings: EnvironmentSettings = UNSET,
    evaluation_settings: EvaluationSettings = UNSET,
    tracking_settings: TrackingSettings = UNSET,
    experiment_settings: ExperimentSettings = UNSET,
    overrides: Overrides = UNSET,
    config: WholeConfig = UNSET,
    tracking_tags: TrackingTags = UNSET,
) -> dict:
    """Prepare data, plan, evaluate, train with GRPO and evaluate again, tracked in MLflow.

    The run form's fields (titles and help in :mod:`flows.run_form`) change the preset (or ``config``) field by
    field; an empty field keeps its value. From code, pass a whole ``config`` (the CLI and sweeps do); a caller in
    this process with live objects for the run (trainer callbacks, its list of started flow runs) registers a
    :class:`~grpo.pipeline.run_context.RunContext` under the run directory around the call.
    """
    quiet_library_noise()
    settings = form_settings(
        {"learning_rate": learning_rate, "max_steps": max_steps, "batch_size": batch_size,
         "num_generations": num_generations, "reward_funcs": reward_funcs, "loss_type": loss_type, "seed": seed},
        {"data_settings": data_settings, "model_settings": model_settings, "grpo_settings": grpo_settings,
         "sampling_settings": sampling_settings, "async_settings": async_settings,
         "environment_settings": environment_settings, "evaluation_settings": evaluation_settings,
         "tracking_settings": tracking_settings,
         "experiment_settings": experiment_settings})
    logger = get_run_logger()
    flow_run_id, flow_run_name, attempt = _flow_run_info()
    try:
        config = resolve_config(given(config), given(preset), given(overrides), settings)
        check_config_paths(config)  # a served run (grpo serve) stays inside the allowed roots (#12.15)
        name = given(run_name) or f"{config.name}-{flow_run_name or time.strftime('%Y%m%d-%H%M%S')}"
        run_path = Path(config.output_dir) / name
        resume = resume or (attempt > 1 and run_path.exists())  # a retried flow run continues its run directory
        run = open_run_dir(config, name, resume)
    except GRPOPlatformError as err:
        # a form's mistake (a bad value, a changed config on resume, a taken run name) is one line in the UI, not a
        # traceback; a caller in Python gets the error itself (the CLI prints it as its one-line error)
        logger.error(f"error: {err}")
        return Failed(message=str(err), data=err)
    context = RunContext.for_run_dir(run.path)  # the caller's (grpo run, a sweep's trial), else this run's own
    if flow_run_id is not None:
        context.flow_runs.append(flow_run_id)  # grpo run / grpo sweep cancel it on Ctrl-C / SIGTERM
    logger.info(f"run directory {run.path} (resume={resume})")

    from grpo.pipeline.recipe import run_recipe  # the training stack: imported by a run, not by `grpo serve`

    tags = {"prefect.flow_run_id": flow_run_id, "prefect.flow_run_name": flow_run_name,
            "prefect.deployment": _deployment_name(), "prefect.ui_url": _ui_url(flow_run_id),
            **(given(tracking_tags) or {})}
    try:
        return run_recipe(config, run, PrefectStages(), context=context, resume=resume, log=logger.info, tags=tags,
                          summary_extra={"prefect_flow_run_id": flow_run_id})
    except BaseException as err:
        # Cancel in the UI (the runner's SIGTERM): the run ends Cancelled, not Crashed; a caller in Python (the CLI)
        # gets the signal's exception itself and exits 143
        return _cancelled(err, run)


def mlflow_run_url(tracking_uri: str, experiment_id: str | None, run_id: str) -> str:
    """The run's page: on the tracking server, or on ``grpo ui``'s MLflow server for the local SQLite store."""
    return mlflow_ui_url(tracking_uri, experiment_id, run_id)


def _deployment_name() -> str | None:
    try:
        from prefect.runtime import deployment

        return deployment.name
    except Exception:
        return None
