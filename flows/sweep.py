"""The sweep flow ``grpo-sweep``: the sweep (:func:`grpo.pipeline.sweep.run_sweep`: an Optuna study over a search
space, one pipeline run per trial, under one MLflow parent run) as one Prefect flow run; ``grpo sweep`` runs it too.

What Prefect adds, and only that:

- the run form (:mod:`flows.sweep_form`): a preset or a whole config, training steps per trial, the search space;
- each trial a ``sweep-trial`` task run of this flow run (at most ``max_concurrency`` at once). Locally (default,
  :class:`grpo.pipeline.sweep.InProcessTrials`) its pipeline is a ``grpo-pipeline`` subflow in the trial's thread,
  handed the trial's :class:`~grpo.pipeline.run_context.RunContext` (its pruning hook, the sweep's list of flow
  runs) by its run directory, and the ``grpo-prep`` and ``grpo-plan`` subflows and the ``warm-start-policy`` task
  build the inputs trials share first. With ``use_deployment="grpo-pipeline/<deployment>"``
  (:class:`DeploymentTrials`) it is a flow run of that deployment, executed by whatever worker serves the
  deployment's work pool;
- the artifacts: a link to the parent MLflow run while the sweep runs, then the table ``sweep-results`` and the
  markdown ``sweep-summary`` (completed, pruned, failed; the study's totals);
- the flow run: its id on the parent run and in the result, and in its run context's list of flow runs (the
  context ``grpo sweep`` registered under the sweep's directory: it cancels them, with its trials', on Ctrl-C /
  SIGTERM); a deployment's runs continue the study ``<config name>-<deployment name>``.

The sweep's MLflow side beyond its parent run (its trials' runs, the model registry) is
:class:`grpo.tracking.sweep_runs.MlflowTrialRuns`; this flow passes it to the sweep.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_link_artifact, create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE

from flows.pipeline import _flow_run_info, _ui_url, grpo_pipeline, mlflow_run_url
from flows.run_form import UNSET, PresetChoice, WholeConfig, given
from flows.stages import plan_flow, prep_flow
from flows.sweep_form import (
    ConcurrencyField,
    DirectionField,
    MetricField,
    RegisteredModelField,
    SpaceField,
    StorageField,
    StudyNameField,
    SweepNameField,
    TrialStepsField,
    TrialTimeoutField,
    UseDeploymentField,
)
from grpo.config import ExperimentConfig, resolve_config
from grpo.formatting import human_metric, human_number
from grpo.pipeline.confine import check_config_paths
from grpo.pipeline.run_context import RunContext

if TYPE_CHECKING:  # the sweep and its MLflow side are imported when a sweep runs, not by `grpo serve`
    from grpo.pipeline.sweep import InputStages, Sweep, Trial

_DEPLOYMENT_LOCK = threading.Lock()  # run_deployment's subflow task keys come from an unlocked per-flow counter


# ---------------------------------------------------------------- one trial


@task(name="sweep-trial", cache_policy=NO_CACHE, retries=0)
def run_trial(config: ExperimentConfig, run_name: str, index: int, tracking_tags: dict, tracking: dict,
              use_deployment: str | None = None, trial_timeout: float | None = None,
              context: RunContext | None = None) -> dict:
    """One trial: the pipeline as a subflow of this task, or a flow run of ``use_deployment`` linked to it.
    ``context``: the trial's (its pruning hook, the sweep's list of flow runs), handed to the local pipeline by its
    run directory."""
    if use_deployment:
        return _run_deployment(use_deployment, config, run_name, tracking_tags, index, tracking, trial_timeout)
    run_dir = Path(config.output_dir) / run_name
    with (context or RunContext()).registered(run_dir):  # the pipeline's parameters stay JSON: it looks the context up
        return grpo_pipeline.with_options(flow_run_name=run_name)(config=config, run_name=run_name,
                                                                  tracking_tags=tracking_tags)


def _tracking(trial: Trial) -> dict:
    """The parent run, as the trial task's (JSON) parameter."""
    p = trial.parent
    return {"uri": p.tracking_uri, "experiment_id": p.experiment_id, "parent_run_id": p.run_id} if p else {}


def _pipeline_subflow(trial: Trial) -> dict:
    """A local trial: its ``sweep-trial`` task, the pipeline a subflow of it."""
    return run_trial.with_options(task_run_name=trial.run_name)(
        config=trial.config, run_name=trial.run_name, index=trial.number, tracking_tags=trial.tags,
        tracking=_tracking(trial), context=trial.context)


@task(name="warm-start-policy", cache_policy=NO_CACHE)
def warm_policy(config: ExperimentConfig, data_dir: str) -> str:
    """Build (or reuse) the cached warm-started tiny model, once for all trials that share it."""
    import grpo.pipeline.stages

    return grpo.pipeline.stages.policy_stage(config, Path(data_dir), log=get_run_logger().info).source


def prefect_inputs() -> InputStages:
    """The inputs trials share, built as Prefect subflows (``grpo-prep``, ``grpo-plan``) and a task."""
    from grpo.pipeline.sweep import InputStages

    return InputStages(prep=prep_flow, plan=plan_flow, policy=warm_policy)


class DeploymentTrials:
    """Trials as flow runs of the deployment ``name`` (``grpo-pipeline/<deployment>``), created with
    ``prefect.deployments.run_deployment`` (linked to the trial's ``sweep-trial`` task as a subflow, idempotency key
    ``<sweep flow run id>-trial-<N>``), executed by whatever worker serves the deployment's work pool, and polled
    until they end (``timeout`` seconds at most, default unlimited; a run still going then is cancelled and the trial
    fails). The deployment must be of a ``grpo-pipeline`` that accepts ``tracking_tags``, its workers must reach the
    same MLflow server, and a trial's summary is its flow run's result or else its MLflow run's ``summary.json``
    artifact. Not pruned: trials train in the worker's process, and the pipeline deployment takes no pruning hook."""

    in_process = False

    def __init__(self, name: str, timeout: float | None = None) -> None:
        self.name, self.timeout = name, timeout

    def prepare(self, config: ExperimentConfig) -> None:
        """Nothing: the worker's pipeline builds its own inputs."""

    def run(self, trial: Trial) -> dict:
        return run_trial.with_options(task_run_name=trial.run_name)(
            config=trial.config, run_name=trial.run_name, index=trial.number, tracking_tags=trial.tags,
            tracking=_tracking(trial), use_deployment=self.name, trial_timeout=self.timeout)


def _run_deployment(name: str, config: ExperimentConfig, run_name: str, tracking_tags: dict, index: int,
                    tracking: dict, timeout: float | None) -> dict:
    from prefect.client.orchestration import get_client
    from prefect.context import FlowRunContext
    from prefect.deployments import run_deployment

    ctx = FlowRunContext.get()  # the sweep's (a trial's thread carries a copy of the flow run context)
    flow_run_id = ctx.flow_run.id if ctx is not None and ctx.flow_run is not None else None
    with _DEPLOYMENT_LOCK:  # create only; waiting happens outside the lock
        # preset/overrides None: the trial's config exactly, not the deployment's preset (infra/prefect.yaml)
        fr = run_deployment(name, parameters={"config": config.model_dump(mode="json", by_alias=True),
                                              "preset": None, "overrides": None,
                                              "run_name": run_name, "tracking_tags": tracking_tags},
                            flow_run_name=run_name, timeout=0,
                            idempotency_key=f"{flow_run_id}-trial-{index}" if flow_run_id else None)
    deadline = None if timeout is None else time.monotonic() + timeout
    with get_client(sync_client=True) as client:
        while not (fr.state and fr.state.is_final()):
            if deadline is not None and time.monotonic() > deadline:
                from prefect.states import Cancelled

                with contextlib.suppress(Exception):  # so that no worker starts it after the sweep gave up on it
                    client.set_flow_run_state(fr.id, Cancelled(message=f"sweep trial timeout ({timeout}s)"), force=True)
                raise TimeoutError(f"deployment flow run {fr.name} still {fr.state.name if fr.state else '?'} "
                                   f"after {timeout:.0f}s")
            time.sleep(5 if deadline is None else min(5.0, max(0.2, deadline - time.monotonic())))
            fr = client.read_flow_run(fr.id)
    if not fr.state.is_completed():
        raise RuntimeError(f"deployment flow run {fr.name} ({fr.id}) ended {fr.state.name}: {fr.state.message or ''}")
    summary = None
    with contextlib.suppress(Exception):  # needs result persistence on the worker and access to its storage
        summary = fr.state.result(raise_on_failure=False)
    if not isinstance(summary, dict):
        summary = _summary_from_mlflow(tracking, index) if tracking else {}
    return {**summary, "prefect_flow_run_id": str(fr.id)}


def _summary_from_mlflow(tracking: dict, index: int) -> dict:
    from grpo.tracking.sweep_runs import MlflowTrialRuns, ParentRun

    parent = ParentRun(tracking["uri"], tracking["experiment_id"], tracking["parent_run_id"])
    return MlflowTrialRuns(parent).summary(index)


# ---------------------------------------------------------------- the flow run's artifacts


class PrefectArtifacts:
    """The sweep in the Prefect UI: the link to its parent MLflow run while it runs, its results at the end."""

    def started(self, sweep: Sweep) -> None:
        if sweep.parent is not None:
            p = sweep.parent
            create_link_artifact(key="mlflow-sweep-run", link=mlflow_run_url(p.tracking_uri, p.experiment_id, p.run_id),
                                 link_text=f"MLflow sweep run {p.run_id}",
                                 description="The sweep's parent run in MLflow")

    def finished(self, result: dict[str, Any]) -> None:
        from grpo.pipeline.sweep import results_table

        name = result["sweep_name"]
        create_table_artifact(key="sweep-results", table=json.loads(json.dumps(results_table(result["trials"]),
                                                                               default=str)),
                              description=f"Sweep {name}: one row per trial ({result['metric']}, "
                                          f"{result['direction']})")
        create_markdown_artifact(key="sweep-summary", markdown=results_markdown(result), description=f"Sweep {name}")


def results_markdown(result: dict[str, Any]) -> str:
    """The ``sweep-summary`` artifact: the trials' outcomes, the study's totals, the best trial and its model."""
    study, best, registered = result["study"], result["best"], result["registered_model"]
    lines = [f"## Sweep `{result['sweep_name']}`", "",
             f"- trials: {len(result['trials'])} ({result['completed']} completed, {result['pruned']} pruned, "
             f"{result['failed']} failed)",
             f"- study: `{study['name']}` ({study['sampler']} sampler, {study['pruner']} pruner), "
             f"{study['n_trials']} trials in all ({', '.join(f'{v} {k}' for k, v in study['states'].items())})",
             f"- metric: `{result['metric']}` ({result['direction']})"]
    if best is not None:
        params = ", ".join(f"{k}={human_number(v)}" for k, v in best["overrides"].items())
        lines.append(f"- best of the study: trial {best['trial']} `{best['run_name']}` = "
                     f"**{human_metric(best['metric_value'])}** ({params})")
    if registered is not None:
        alias = f"alias `{registered['alias']}`" if registered.get("alias") else registered.get("note")
        lines.append(f"- registered: `{registered['name']}` version {registered['version']} "
                     f"({alias}{', unchanged' if registered.get('unchanged') else ''})")
    imp = study.get("importances") or {}
    if imp.get("importances"):
        lines.append("- importances: " + ", ".join(f"`{k}` {v:.2f}" for k, v in imp["importances"].items()))
    return "\n".join(lines)


# ---------------------------------------------------------------- the flow


@flow(name="grpo-sweep")
def grpo_sweep(
    space: SpaceField,
    preset: PresetChoice = UNSET,
    max_steps: TrialStepsField = UNSET,
    max_concurrency: ConcurrencyField = 2,
    metric: MetricField = "eval_accuracy_after",
    direction: DirectionField = "maximize",
    sweep_name: SweepNameField = UNSET,
    study_name: StudyNameField = UNSET,
    storage: StorageField = UNSET,
    registered_model_name: RegisteredModelField = UNSET,
    use_deployment: UseDeploymentField = UNSET,
    trial_timeout: TrialTimeoutField = UNSET,
    config: WholeConfig = UNSET,
) -> dict:
    """Run ``n_trials`` new trials of an Optuna study over ``space`` on top of ``config``, at most ``max_concurrency``
    at once, nested under one MLflow parent run; prune bad trials; register the study's best model.

    The parameters' titles and help, as the Prefect UI's run form shows them, are in :mod:`flows.sweep_form`; an
    empty (UNSET) field means its default there.
    """
    from prefect.runtime import deployment as runtime_deployment

    from grpo.console import quiet_library_noise
    from grpo.pipeline.sweep import PROGRESS, InProcessTrials, default_sweep_name, run_sweep
    from grpo.tracking.sweep_runs import MlflowTrialRuns

    quiet_library_noise()  # as the pipeline flow: a served sweep's process loads the model before any trial does
    max_steps, deployment = given(max_steps), given(use_deployment)
    # every trial starts from the preset or this config, trained for max_steps when given (a space that varies
    # grpo.max_steps still sets each trial's own)
    config = resolve_config(given(config), given(preset), [f"grpo.max_steps={max_steps}"] if max_steps else None)
    check_config_paths(config)  # a served sweep (grpo serve) stays inside the allowed roots (#12.15)
    name = given(sweep_name) or default_sweep_name(config)
    context = RunContext.for_run_dir(Path(config.output_dir) / name)  # the caller's (grpo sweep), else its own
    flow_run_id, _, _ = _flow_run_info()
    if flow_run_id is not None:
        context.flow_runs.append(flow_run_id)  # `grpo sweep` cancels it, with its trials', on Ctrl-C / SIGTERM
    if _ui_url(flow_run_id):  # for a console showing only the sweep's lines (Prefect's "View at" is not one)
        get_run_logger().info(f"prefect flow run: {_ui_url(flow_run_id)}", extra={**PROGRESS, "send_to_api": False})
    trials = (DeploymentTrials(deployment, given(trial_timeout)) if deployment
              else InProcessTrials(_pipeline_subflow, prefect_inputs()))
    return run_sweep(config, space, trials, name=name, study_name=given(study_name),
                     storage=given(storage), deployment=runtime_deployment.name, metric=metric, direction=direction,
                     max_concurrency=max_concurrency, registered_model_name=given(registered_model_name),
                     trial_runs=MlflowTrialRuns, report=PrefectArtifacts(), log=get_run_logger(),
                     tags={"prefect.flow_run_id": flow_run_id} if flow_run_id else None,
                     result_extra={"prefect_flow_run_id": flow_run_id}, context=context)


__all__ = ["DeploymentTrials", "PrefectArtifacts", "grpo_sweep", "run_trial"]
