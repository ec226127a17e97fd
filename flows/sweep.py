"""The sweep flow ``grpo-sweep``: the sweep (:func:`grpo.pipeline.sweep.run_sweep`: an Optuna study over a search
space, one pipeline run per trial, under one MLflow parent run) as one Prefect flow run; ``grpo sweep`` runs it too.

What Prefect adds, and only that:

- the run form (:mod:`flows.sweep_form`): a preset or a whole config, training steps per trial, the search space;
- each trial a ``sweep-trial`` task run of this flow run (at most ``max_concurrency`` at once). Locally (default,
  :class:`grpo.pipeline.sweep.InProcessTrials`) its pipeline is a ``grpo-pipeline`` subflow in the trial's thread,
  and the ``grpo-prep`` and ``grpo-plan`` subflows and the ``warm-start-policy`` task build the inputs trials share
  first. With ``use_deployment="grpo-pipeline/<deployment>"`` (:class:`DeploymentTrials`) it is a flow run of that
  deployment, executed by whatever worker serves the deployment's work pool;
- the artifacts: a link to the parent MLflow run while the sweep runs, then the table ``sweep-results`` and the
  markdown ``sweep-summary`` (completed, pruned, failed; the study's totals);
- the flow run: its id on the parent run and in the result, and in ``FLOW_RUNS_STARTED`` (``grpo sweep`` cancels it,
  with its trials', on Ctrl-C / SIGTERM); a deployment's runs continue the study ``<config name>-<deployment name>``.

:class:`MlflowTrialRuns` is the sweep's MLflow side beyond its parent run (its trials' runs, the model registry): it
belongs with the tracking modules, and sits here, on the sweep's caller side, until they offer it.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_link_artifact, create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE

from flows.pipeline import FLOW_RUNS_STARTED, _flow_run_info, grpo_pipeline, mlflow_run_url
from flows.run_form import UNSET, PresetChoice, WholeConfig, given
from flows.stages import plan_flow, prep_flow
from flows.sweep_form import (ConcurrencyField, DirectionField, MetricField, RegisteredModelField, SpaceField,
                              StorageField, StudyNameField, SweepNameField, TrialStepsField, TrialTimeoutField,
                              UseDeploymentField)
from grpo.config import ExperimentConfig, resolve_config
from grpo.pipeline.confine import check_config_paths
from grpo.pipeline.sweep import (BEST_ALIAS, InProcessTrials, InputStages, ParentRun, Sweep, Trial, results_table,
                                 run_sweep)
from grpo.pipeline.tracking import SPOOL_DIRNAME, MlflowTracker, use_tracking_uri

_DEPLOYMENT_LOCK = threading.Lock()  # run_deployment's subflow task keys come from an unlocked per-flow counter


# ---------------------------------------------------------------- one trial


@task(name="sweep-trial", cache_policy=NO_CACHE, retries=0)
def run_trial(config: ExperimentConfig, run_name: str, index: int, tracking_tags: dict, tracking: dict,
              use_deployment: str | None = None, trial_timeout: float | None = None) -> dict:
    """One trial: the pipeline as a subflow of this task, or a flow run of ``use_deployment`` linked to it."""
    if use_deployment:
        return _run_deployment(use_deployment, config, run_name, tracking_tags, index, tracking, trial_timeout)
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
        tracking=_tracking(trial))


@task(name="warm-start-policy", cache_policy=NO_CACHE)
def warm_policy(config: ExperimentConfig, data_dir: str) -> str:
    """Build (or reuse) the cached warm-started tiny model, once for all trials that share it."""
    import grpo.pipeline.stages

    return grpo.pipeline.stages.policy_stage(config, Path(data_dir), log=get_run_logger().info).source


PREFECT_INPUTS = InputStages(prep=prep_flow, plan=plan_flow, policy=warm_policy)


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
    runs = MlflowTrialRuns(ParentRun(tracking["uri"], tracking["experiment_id"], tracking["parent_run_id"]))
    run_id = runs.tagged(index)
    if run_id is None:
        raise RuntimeError(f"trial {index}: no MLflow run tagged with this sweep's trial {index}")
    try:
        with tempfile.TemporaryDirectory() as tmp:
            summary = json.loads(Path(runs.client.download_artifacts(run_id, "summary.json", tmp)).read_text())
    except Exception:
        summary = {}
    return {"mlflow_run_id": run_id, **summary}


# ---------------------------------------------------------------- MLflow: the trials' runs and the registry


class MlflowTrialRuns:
    """:class:`grpo.pipeline.sweep.TrialRuns` on MLflow, for the trials of the parent run ``parent``: find a trial's
    run, set it FAILED or tag it pruned, register the best trial's model."""

    def __init__(self, parent: ParentRun) -> None:
        from mlflow import MlflowClient

        self.parent, self.client = parent, MlflowClient(parent.tracking_uri)

    def find(self, trial: Trial, local: bool) -> str | None:
        """The id a local trial's tracker recorded in its run directory's spool, else the run tagged as the trial."""
        if local:
            run_id = MlflowTracker.saved_run_id(trial.run_dir / SPOOL_DIRNAME)
            if run_id:
                return run_id
        return self.tagged(trial.number)

    def tagged(self, number: int) -> str | None:
        """The run nested under the parent with ``grpo.sweep.trial`` = ``number``."""
        if self.parent.experiment_id is None:
            return None
        runs = self.client.search_runs(
            [self.parent.experiment_id], max_results=1,
            filter_string=f"tags.`mlflow.parentRunId` = '{self.parent.run_id}' and "
                          f"tags.`grpo.sweep.trial` = '{number}'")
        return runs[0].info.run_id if runs else None

    def mark_failed(self, run_id: str, error: str) -> None:
        run = self.client.get_run(run_id)
        self.client.set_tag(run_id, "grpo.sweep.error", error[:4000])
        self.client.set_terminated(run_id, status="FAILED", end_time=run.info.end_time)  # keep the real end time

    def mark_pruned(self, run_id: str, step: int) -> None:
        self.client.set_tag(run_id, "grpo.sweep.pruned", "true")
        self.client.set_tag(run_id, "grpo.sweep.pruned_at_step", str(step))

    def register(self, best: dict[str, Any], model_name: str, sweep: Sweep) -> dict[str, Any]:
        """A new version of ``model_name`` from the best trial's logged model, with alias ``best``; when the alias
        already names a version of that run (the best trial of an earlier invocation), that version stays."""
        import mlflow

        client, run_id = self.client, best["mlflow_run_id"]
        with contextlib.suppress(Exception):
            current = client.get_model_version_by_alias(model_name, BEST_ALIAS)
            if current.run_id == run_id:
                return {"name": model_name, "version": str(current.version), "alias": BEST_ALIAS,
                        "source": current.source, "run_id": run_id, "unchanged": True}
        models = [m for m in client.search_logged_models(experiment_ids=[self.parent.experiment_id],
                                                         filter_string=f"source_run_id = '{run_id}'")
                  if m.source_run_id == run_id]
        source = f"models:/{models[0].model_id}" if models else f"runs:/{run_id}/model"
        tags = {"grpo.sweep": best.get("sweep") or sweep.name, "grpo.sweep.parent_run_id": self.parent.run_id,
                "grpo.sweep.study": sweep.study_name, "grpo.sweep.trial": str(best["trial"]),
                "grpo.sweep.metric": sweep.metric, "grpo.sweep.metric_value": str(best["metric_value"])}
        with use_tracking_uri(self.parent.tracking_uri):
            version = mlflow.register_model(source, model_name, tags=tags)
        client.set_registered_model_alias(model_name, BEST_ALIAS, version.version)
        return {"name": model_name, "version": str(version.version), "alias": BEST_ALIAS, "source": source,
                "run_id": run_id, "unchanged": False}


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
        lines.append(f"- best of the study: trial {best['trial']} `{best['run_name']}` = "
                     f"**{best['metric_value']:.4g}** ({', '.join(f'{k}={v}' for k, v in best['overrides'].items())})")
    if registered is not None:
        lines.append(f"- registered: `{registered['name']}` version {registered['version']} "
                     f"(alias `{registered['alias']}`{', unchanged' if registered.get('unchanged') else ''})")
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

    max_steps, deployment = given(max_steps), given(use_deployment)
    # every trial starts from the preset or this config, trained for max_steps when given (a space that varies
    # grpo.max_steps still sets each trial's own)
    config = resolve_config(given(config), given(preset), [f"grpo.max_steps={max_steps}"] if max_steps else None)
    check_config_paths(config)  # a served sweep (grpo serve) stays inside the allowed roots (#12.15)
    flow_run_id, _, _ = _flow_run_info()
    if flow_run_id is not None:
        FLOW_RUNS_STARTED.append(flow_run_id)  # `grpo sweep` cancels it, with its trials', on Ctrl-C / SIGTERM
    trials = (DeploymentTrials(deployment, given(trial_timeout)) if deployment
              else InProcessTrials(_pipeline_subflow, PREFECT_INPUTS))
    return run_sweep(config, space, trials, name=given(sweep_name), study_name=given(study_name),
                     storage=given(storage), deployment=runtime_deployment.name, metric=metric, direction=direction,
                     max_concurrency=max_concurrency, registered_model_name=given(registered_model_name),
                     trial_runs=MlflowTrialRuns, report=PrefectArtifacts(), log=get_run_logger(),
                     tags={"prefect.flow_run_id": flow_run_id} if flow_run_id else None,
                     result_extra={"prefect_flow_run_id": flow_run_id})


__all__ = ["DeploymentTrials", "MlflowTrialRuns", "PrefectArtifacts", "grpo_sweep", "run_trial"]
