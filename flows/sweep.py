"""The sweep flow: an Optuna study over a search space, one pipeline run per trial, under one MLflow parent run.

``grpo_sweep(space, preset | config, ...)`` (Prefect flow ``grpo-sweep``, also ``grpo sweep`` on the command line):

1. validates the space against the config (:func:`grpo.pipeline.sweep_space.validate_space`: field paths, every grid
   combination, every distribution's bounds) before anything runs or is created;
2. creates or continues the Optuna study ``study_name`` in ``storage`` (default ``sqlite:///<output_dir>/optuna.db``;
   a deployment's runs default to ``<config.name>-<deployment>``, so the nightly schedule adds to one study night
   after night; any other sweep defaults to a new study named as the sweep); its sampler (grid: every combination
   enqueued, random: ``RandomSampler``, tpe: ``TPESampler``) and pruner (``MedianPruner``, ``HyperbandPruner``)
   come from the space;
3. creates ``<output_dir>/<sweep_name>/`` and ONE MLflow parent run (tags ``grpo.run_type=sweep``, ``grpo.sweep``,
   ``grpo.sweep.study``; the space as param ``sweep.space`` and artifact ``sweep/space.json``); every invocation
   gets a new directory and parent run, never an earlier one's;
4. runs ``n_trials`` NEW trials with Optuna's ask/tell, at most ``max_concurrency`` at a time (the next trial is
   asked for when a slot frees, so TPE sees every result told so far), each a ``grpo-pipeline`` run named
   ``<sweep_name>-t<NNN>`` (NNN: the trial's number in the study, continuing across invocations) in
   ``<output_dir>/<sweep_name>/``, whose MLflow run carries ``mlflow.parentRunId`` = the parent run plus
   ``grpo.sweep.trial``:

   * locally (default): a ``sweep-trial`` task per trial on a ``ThreadPoolTaskRunner(max_workers=max_concurrency)``,
     each calling the pipeline as a subflow. Prepared data, sampler plans and the warm-started tiny model are built
     in the sweep's thread before a trial that needs them starts, so running trials only read those caches. With a
     pruner, the trial's training reports the pruner's metric (default ``reward``) at every logging step
     (``flows.stages.ReportIntermediate``, added to that run's trainer through the trial's
     :class:`~grpo.pipeline.run_context.RunContext`); when ``trial.should_prune()``, training stops at the end of
     that step, the pipeline finishes as usual (model, eval, summary), the trial is told PRUNED, and its MLflow run
     (FINISHED) is tagged ``grpo.sweep.pruned=true`` and ``grpo.sweep.pruned_at_step``;
   * ``use_deployment="grpo-pipeline/<deployment>"``: each trial is a flow run of that deployment created with
     ``prefect.deployments.run_deployment`` (linked to the trial task as a subflow, idempotency key
     ``<sweep flow run id>-<trial>``), executed by whatever worker serves the deployment's work pool, and polled
     until it ends (``trial_timeout`` seconds at most, default unlimited; a run still going then is cancelled
     and the trial fails). The deployment must be of a ``grpo-pipeline`` that accepts ``tracking_tags``, its
     workers must reach the same MLflow server, and a trial's summary is read from the run's ``summary.json`` MLflow
     artifact. Such trials are sampled and told like local ones but NOT pruned: they train in the worker's process,
     and the pipeline deployment takes no pruning hook;
5. records a failed trial as failed (FAIL in the study; its MLflow run set to FAILED with tag ``grpo.sweep.error``;
   its row in the results has ``status: failed`` and the error) without stopping the others;
6. publishes the results: a Prefect table artifact ``sweep-results`` and markdown ``sweep-summary`` (completed,
   pruned, failed; the study's totals), ``sweep/results.json`` (+ an MLflow table ``sweep/results_table.json``) and
   ``sweep/importances.json`` (Optuna's fANOVA parameter importances over the study) on the parent run, the
   comparison dashboard (``dashboards.comparison``, with the importances) under the parent's ``dashboard/``
   artifacts, and registers the model of the study's best trial (``Study.best_trial``: over every completed trial
   of every invocation, by ``metric`` read from the trial's summary or else its MLflow metrics, in ``direction``;
   pruned trials never qualify) as a new version of ``registered_model_name`` (default ``<config.name>-grpo``) with
   alias ``best``, unless the alias already names a version of that run.

It raises :class:`SweepError` (after publishing the results) only when every trial of this invocation failed.

Own code, and why: the Prefect/MLflow side (trial tasks or deployment runs, nesting, tags, artifacts, registry,
dashboard) and the ask/tell loop that bounds concurrency with Prefect's task runner; sampling, pruning decisions,
the study's state and storage, the best trial and importances are Optuna's.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import math
import threading
import time
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_link_artifact, create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.task_runners import ThreadPoolTaskRunner

from flows.pipeline import _flow_run_info, grpo_pipeline, mlflow_run_url
from flows.run_form import UNSET, PresetChoice, WholeConfig, given
from flows.sweep_form import (ConcurrencyField, DirectionField, MetricField, RegisteredModelField, SpaceField,
                              StorageField, StudyNameField, SweepNameField, TrialStepsField, TrialTimeoutField,
                              UseDeploymentField)
from grpo.config import ExperimentConfig, resolve_config, to_yaml
from grpo.errors import GRPOPlatformError, RunDirectoryError
from grpo.tracking.metric_keys import read_run_metric
from grpo.tracking.run_tracking import end_status
from grpo.pipeline.run_context import RunContext
from grpo.pipeline.sweep_space import Space, validate_space
from grpo.tracking.model_logging import use_tracking_uri
from grpo.tracking.tracker import SPOOL_DIRNAME, MlflowTracker, tracker_from_config
from grpo.runs import validate_run_name
from grpo.training.graceful_stop import clear_stop_request, request_stop

BEST_ALIAS = "best"
DIRECTIONS = ("maximize", "minimize")
_DEPLOYMENT_LOCK = threading.Lock()  # run_deployment's subflow task keys come from an unlocked per-flow counter


class SweepError(RuntimeError):
    """Every trial of the sweep failed."""


# ---------------------------------------------------------------- one trial


def _child_run_id(client, experiment_id: str | None, parent_id: str, index: int, run_dir: Path | None) -> str | None:
    """The trial's MLflow run: recorded in its run directory's spool (local) or found by its sweep tags."""
    if run_dir is not None:
        run_id = MlflowTracker.saved_run_id(run_dir / SPOOL_DIRNAME)
        if run_id:
            return run_id
    if experiment_id is None:
        return None
    runs = client.search_runs(
        [experiment_id], max_results=1,
        filter_string=f"tags.`mlflow.parentRunId` = '{parent_id}' and tags.`grpo.sweep.trial` = '{index}'",
    )
    return runs[0].info.run_id if runs else None


def _mark_child_failed(tracking: dict, index: int, run_dir: Path | None, error: str) -> str | None:
    """Set the trial's MLflow run to FAILED (the pipeline closes its run as FINISHED even when a stage raised)."""
    if not tracking:
        return None
    from mlflow import MlflowClient

    try:
        client = MlflowClient(tracking["uri"])
        run_id = _child_run_id(client, tracking["experiment_id"], tracking["parent_run_id"], index, run_dir)
        if run_id is None:
            return None
        run = client.get_run(run_id)
        client.set_tag(run_id, "grpo.sweep.error", error[:4000])
        client.set_terminated(run_id, status="FAILED", end_time=run.info.end_time)  # keep the real end time
        return run_id
    except Exception as err:  # the trial's failure is what matters; it is in the results either way
        get_run_logger().warning(f"trial {index}: could not mark its MLflow run FAILED: {err}")
        return None


def _summary_from_mlflow(tracking: dict, index: int) -> dict:
    from mlflow import MlflowClient

    client = MlflowClient(tracking["uri"])
    run_id = _child_run_id(client, tracking["experiment_id"], tracking["parent_run_id"], index, None)
    if run_id is None:
        raise RuntimeError(f"trial {index}: no MLflow run tagged with this sweep's trial {index}")
    try:
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            summary = json.loads(Path(client.download_artifacts(run_id, "summary.json", tmp)).read_text())
    except Exception:
        summary = {}
    return {"mlflow_run_id": run_id, **summary}


def _run_deployment(name: str, config: ExperimentConfig, run_name: str, tracking_tags: dict, index: int,
                    tracking: dict, timeout: float | None) -> dict:
    from prefect.client.orchestration import get_client
    from prefect.context import FlowRunContext
    from prefect.deployments import run_deployment

    ctx = FlowRunContext.get()  # the sweep's (a task's thread carries a copy of the flow run context)
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


@task(name="sweep-trial", cache_policy=NO_CACHE, retries=0)
def run_trial(config: ExperimentConfig, run_name: str, index: int, tracking_tags: dict, tracking: dict,
              use_deployment: str | None = None, trial_timeout: float | None = None,
              context: RunContext | None = None) -> dict:
    """One trial: the pipeline as a subflow of this task (or a deployment's flow run); a failure marks its MLflow
    run FAILED before the task fails, so the trial's slot is only freed once it is recorded. ``context``: the
    trial's (its pruning hook, the sweep's list of flow runs), handed to the local pipeline by its run directory."""
    run_dir = Path(config.output_dir) / run_name
    try:
        if use_deployment:
            return _run_deployment(use_deployment, config, run_name, tracking_tags, index, tracking, trial_timeout)
        with (context or RunContext()).registered(run_dir):  # the pipeline's parameters stay JSON
            return grpo_pipeline.with_options(flow_run_name=run_name)(config=config, run_name=run_name,
                                                                      tracking_tags=tracking_tags)
    except Exception as err:
        _mark_child_failed(tracking, index, None if use_deployment else run_dir, f"{type(err).__name__}: {err}")
        raise


# ---------------------------------------------------------------- shared inputs


@task(name="warm-start-policy", cache_policy=NO_CACHE)
def warm_policy(config: ExperimentConfig, data_dir: str) -> str:
    """Build (or reuse) the cached warm-started tiny model, once for all trials that share it."""
    import grpo.pipeline.stages

    return grpo.pipeline.stages.policy_stage(config, Path(data_dir), log=get_run_logger().info).source


class SharedInputs:
    """Prep, plan and tiny-model warm start once per distinct key, built in the sweep's own thread before the trial
    that needs them starts: running trials only read these caches (concurrent builders do not write them
    atomically). A key that failed fails every trial that needs it, without building it again."""

    def __init__(self) -> None:
        self.done: dict[str, Any] = {}

    def _once(self, key: str, fn):
        if key not in self.done:
            try:
                self.done[key] = fn()
            except Exception as err:
                self.done[key] = err
        if isinstance(self.done[key], Exception):
            raise self.done[key]
        return self.done[key]

    def prepare(self, cfg: ExperimentConfig) -> None:
        from flows.stages import plan_flow, prep_flow
        from grpo.pipeline.cache_dirs import plan_dir_for

        # keyed on the data config: prep_flow fingerprints the source itself (reading a file once, not per trial)
        prep = self._once(f"prep:{json.dumps(cfg.data.model_dump(mode='json'), sort_keys=True)}", lambda: prep_flow(cfg))
        self._once(f"plan:{plan_dir_for(cfg, prep['content_hash'])}",
                   lambda: plan_flow(cfg, prep["data_dir"], prep["content_hash"]))
        if cfg.model.is_tiny:
            key = json.dumps([cfg.model.tiny.model_dump(), cfg.model.warm_start.model_dump(),
                              cfg.data.model_dump(mode="json"), cfg.grpo.seed], sort_keys=True)
            self._once(f"policy:{key}", lambda: warm_policy(cfg, prep["data_dir"]))


# ---------------------------------------------------------------- the study


class StudyError(GRPOPlatformError, ValueError):
    """The stored Optuna study can not be continued by this sweep (another direction or metric)."""


def default_storage(config: ExperimentConfig) -> str:
    """``sqlite:///<output_dir>/optuna.db``: next to the sweeps of that output directory, one file for its studies."""
    return f"sqlite:///{Path(config.output_dir).resolve() / 'optuna.db'}"


def default_sweep_name(config: ExperimentConfig) -> str:
    """``<config name>-sweep-<local time>``: the sweep's name (and directory) when none is given."""
    return f"{config.name}-sweep-{time.strftime('%Y%m%d-%H%M%S')}"


def default_study_name(config: ExperimentConfig, sweep_name: str, deployment: str | None) -> str:
    """A deployment's runs (the nightly schedule) continue one study, ``<config.name>-<deployment name>``; any other
    sweep starts its own study, named as the sweep."""
    return f"{config.name}-{deployment}" if deployment else sweep_name


def _shown_storage(storage: str) -> str:
    with contextlib.suppress(Exception):
        from sqlalchemy.engine import make_url

        return make_url(storage).render_as_string(hide_password=True)
    return storage


def open_study(study_name: str, storage: str, space: Space, metric: str, direction: str):
    """Create the study, or load it to continue (``load_if_exists``); its direction and metric must be this sweep's."""
    import optuna

    if storage.startswith("sqlite:///"):
        Path(storage[len("sqlite:///"):]).parent.mkdir(parents=True, exist_ok=True)
    study = optuna.create_study(study_name=study_name, storage=storage, sampler=space.sampler(),
                                pruner=space.pruner(), direction=direction, load_if_exists=True)
    stored = study.direction.name.lower()
    if stored != direction:
        raise StudyError(f"study {study_name!r} in {_shown_storage(storage)} is to {stored} its metric, not to "
                         f"{direction}; choose another study name")
    if study.user_attrs.get("metric", metric) != metric:
        raise StudyError(f"study {study_name!r} in {_shown_storage(storage)} ranks trials by "
                         f"{study.user_attrs['metric']!r}, not {metric!r}; choose another study name")
    study.set_user_attr("metric", metric)
    return study


def _pruning_hook(trial, spec: dict, study_direction: str):
    """The trainer callback that reports ``spec['metric']`` to the trial and stops its training when pruned."""
    from flows.stages import ReportIntermediate

    sign = 1.0 if spec["direction"] == study_direction else -1.0  # the pruner compares in the study's direction

    def report(step: int, value: float) -> bool:
        trial.report(sign * value, step)
        return trial.should_prune()

    return ReportIntermediate(spec["metric"], report)


def _trial_states(study) -> dict[str, int]:
    counts: dict[str, int] = {}
    for t in study.get_trials(deepcopy=False):
        counts[t.state.name.lower()] = counts.get(t.state.name.lower(), 0) + 1
    return counts


def param_importances(study) -> dict:
    """Optuna's parameter importances (fANOVA, seeded) over the study's completed trials, or why there are none:
    they need two completed trials and two params to tell apart."""
    import optuna
    from optuna.trial import TrialState

    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    params = sorted({p for t in complete for p in t.params})
    out = {"study": study.study_name, "completed_trials": len(complete), "importances": None, "note": None}
    if len(complete) < 2 or len(params) < 2:
        out["note"] = (f"importances need at least 2 completed trials and 2 params; the study has {len(complete)} "
                       f"completed trial{'s' if len(complete) != 1 else ''} over {len(params)} "
                       f"param{'s' if len(params) != 1 else ''}")
        return out
    try:
        imp = optuna.importance.get_param_importances(
            study, evaluator=optuna.importance.FanovaImportanceEvaluator(seed=0))
        out["importances"] = {k: float(v) for k, v in imp.items()}
    except Exception as err:  # e.g. every completed trial has the same value, or no param common to them all
        out["note"] = f"importances not computed: {type(err).__name__}: {err}"
    return out


# ---------------------------------------------------------------- results


def _metric_value(summary: dict, metric: str, client, run_id: str | None) -> float | None:
    value = summary.get(metric)
    if value is None and client is not None and run_id:
        with contextlib.suppress(Exception):
            value = read_run_metric(client, run_id, metric)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _best(study, space: Space) -> dict | None:
    """The study's best trial (``Study.best_trial``: over every completed trial of every invocation)."""
    try:
        t = study.best_trial
    except ValueError:  # no completed trial yet
        return None
    return {"trial": t.number, "run_name": t.user_attrs.get("run_name"), "sweep": t.user_attrs.get("sweep"),
            "metric_value": t.value, "mlflow_run_id": t.user_attrs.get("mlflow_run_id"),
            "overrides": t.user_attrs.get("overrides") or space.decode(t.params)}


def _register_best(tracker: MlflowTracker, best: dict, model_name: str, sweep: dict) -> dict:
    """A new version of ``model_name`` from the best trial's logged model, with alias ``best``; when the alias already
    names a version of that run (the best trial of an earlier invocation), that version stays."""
    import mlflow

    client, run_id = tracker.client, best["mlflow_run_id"]
    with contextlib.suppress(Exception):
        current = client.get_model_version_by_alias(model_name, BEST_ALIAS)
        if current.run_id == run_id:
            return {"name": model_name, "version": str(current.version), "alias": BEST_ALIAS,
                    "source": current.source, "run_id": run_id, "unchanged": True}
    models = [m for m in client.search_logged_models(experiment_ids=[tracker.experiment_id],
                                                     filter_string=f"source_run_id = '{run_id}'")
              if m.source_run_id == run_id]
    source = f"models:/{models[0].model_id}" if models else f"runs:/{run_id}/model"
    tags = {"grpo.sweep": best.get("sweep") or sweep["name"], "grpo.sweep.parent_run_id": sweep["parent_run_id"],
            "grpo.sweep.study": sweep["study"], "grpo.sweep.trial": str(best["trial"]),
            "grpo.sweep.metric": sweep["metric"], "grpo.sweep.metric_value": str(best["metric_value"])}
    with use_tracking_uri(tracker.tracking_uri):
        version = mlflow.register_model(source, model_name, tags=tags)
    client.set_registered_model_alias(model_name, BEST_ALIAS, version.version)
    return {"name": model_name, "version": str(version.version), "alias": BEST_ALIAS, "source": source,
            "run_id": run_id, "unchanged": False}


def _placeholder_dashboard(out: Path, sweep: dict, records: list[dict], reason: str) -> Path:
    import html

    cols = ["trial", "run_name", "status", *sweep["fields"], "metric_value", "mlflow_run_id", "error"]
    rows = "".join("<tr>" + "".join(f"<td>{html.escape(str(r.get(c, '')))}</td>" for c in cols) + "</tr>"
                   for r in records)
    out.write_text(
        f"<!doctype html><meta charset=utf-8><title>Sweep {html.escape(sweep['name'])}</title>"
        f"<h1>Sweep {html.escape(sweep['name'])}</h1><p>Placeholder dashboard ({html.escape(reason)}). "
        f"Metric: {html.escape(sweep['metric'])} ({sweep['direction']}).</p>"
        f"<table border=1><tr>{''.join(f'<th>{html.escape(c)}</th>' for c in cols)}</tr>{rows}</table>\n")
    return out


def _dashboard(tracker: MlflowTracker | None, experiment: str, sweep: dict, records: list[dict],
               sweep_dir: Path, importances: dict | None) -> dict:
    """The comparison dashboard (``dashboards.comparison``, with the study's importances), or a placeholder results
    page when that module is missing or fails; logged under the parent run's ``dashboard/`` artifacts. Never fails
    the sweep."""
    logger = get_run_logger()
    out, kind, log_dashboard = sweep_dir / "dashboard.html", "comparison", None
    try:
        from dashboards.comparison import build_dashboard, log_dashboard
    except ImportError as err:
        path, kind = _placeholder_dashboard(out, sweep, records, f"dashboards.comparison unavailable: {err}"), "placeholder"
    else:
        try:
            if tracker is None:
                raise RuntimeError("tracking.backend is none")
            path = Path(build_dashboard(tracker.tracking_uri, experiment, sweep_run_id=sweep["parent_run_id"], out=out,
                                        importances=importances))
        except Exception as err:
            logger.warning(f"comparison dashboard failed ({type(err).__name__}: {err}); writing a placeholder")
            path, kind = _placeholder_dashboard(out, sweep, records, f"build_dashboard failed: {err}"), "placeholder"
    artifact = None
    if tracker is not None:
        try:
            if log_dashboard is not None:
                artifact = log_dashboard(tracker, None, path)
            elif tracker.log_artifact(path, "dashboard"):
                artifact = f"dashboard/{path.name}"
        except Exception as err:
            logger.warning(f"could not log the dashboard to MLflow: {type(err).__name__}: {err}")
    return {"path": str(path), "kind": kind, "artifact": artifact}


def _counts(records: list[dict]) -> dict[str, int]:
    return {s: sum(r["status"] == s for r in records) for s in ("completed", "pruned", "failed")}


def _results_markdown(sweep: dict, records: list[dict], best: dict | None, registered: dict | None,
                      study: dict) -> str:
    n = _counts(records)
    lines = [f"## Sweep `{sweep['name']}`", "",
             f"- trials: {len(records)} ({n['completed']} completed, {n['pruned']} pruned, {n['failed']} failed)",
             f"- study: `{study['name']}` ({study['sampler']} sampler, {study['pruner']} pruner), "
             f"{study['n_trials']} trials in all ({', '.join(f'{v} {k}' for k, v in study['states'].items())})",
             f"- metric: `{sweep['metric']}` ({sweep['direction']})"]
    if best is not None:
        lines.append(f"- best of the study: trial {best['trial']} `{best['run_name']}` = **{best['metric_value']:.4g}** "
                     f"({', '.join(f'{k}={v}' for k, v in best['overrides'].items())})")
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
    sweep_name, study_name, storage = given(sweep_name), given(study_name), given(storage)
    registered_model_name, use_deployment, trial_timeout = (given(registered_model_name), given(use_deployment),
                                                            given(trial_timeout))
    max_steps = given(max_steps)
    logger = get_run_logger()
    from grpo.pipeline.confine import check_config_paths

    # every trial starts from the preset or this config, trained for max_steps when given (a space that varies
    # grpo.max_steps still sets each trial's own)
    config = resolve_config(given(config), given(preset), [f"grpo.max_steps={max_steps}"] if max_steps else None)
    check_config_paths(config)  # a served sweep (grpo serve) stays inside the allowed roots (#12.15)
    if direction not in DIRECTIONS:
        raise ValueError(f"direction: {direction!r} is not one of {', '.join(DIRECTIONS)}")
    if max_concurrency < 1:
        raise ValueError(f"max_concurrency: must be >= 1 (got {max_concurrency})")
    sp = validate_space(config, space)  # fields, grid points and bounds checked before anything is created
    name = sweep_name or default_sweep_name(config)
    try:
        validate_run_name(name)
    except RunDirectoryError:
        raise RunDirectoryError(f"sweep_name {name!r}: use letters, digits, '.', '_' or '-' (max 128 characters, "
                                "no leading punctuation)") from None
    sweep_dir = Path(config.output_dir) / name
    if sweep_dir.exists():
        raise RunDirectoryError(f"sweep directory {sweep_dir} already exists; choose another sweep name")
    from prefect.runtime import deployment as runtime_deployment

    study_name = study_name or default_study_name(config, name, runtime_deployment.name)
    storage = storage or default_storage(config)
    study = open_study(study_name, storage, sp, metric, direction)
    first_number = len(study.get_trials(deepcopy=False))
    pruner = sp.pruner_spec["type"] if sp.pruner_spec else "none"
    fields = sp.fields
    sweep_dir.mkdir(parents=True)
    (sweep_dir / "space.json").write_text(json.dumps(space, indent=2, default=str))
    (sweep_dir / "base_config.yaml").write_text(to_yaml(config))
    logger.info(f"sweep {name}: {sp.n_trials} new trials of study {study_name} ({first_number} before) over "
                f"{', '.join(fields)}, {sp.sampler_kind} sampler, {pruner} pruner, max {max_concurrency} at once"
                f"{f', via deployment {use_deployment} (not pruned)' if use_deployment else ''}")

    clear_stop_request()  # an earlier sweep of this process (a test session) may have been interrupted
    flow_run_id, _, _ = _flow_run_info()
    context = RunContext.for_run_dir(sweep_dir)  # the caller's (grpo sweep), else this sweep's own
    if flow_run_id is not None:
        context.flow_runs.append(flow_run_id)  # `grpo sweep` cancels it, with its trials', on Ctrl-C / SIGTERM
    tracker = tracker_from_config(config, sweep_dir)
    parent_id, tracking = None, {}
    if tracker is not None:
        parent_id = tracker.start(
            name, config.tracking.experiment_name,
            tags={"grpo.run_type": "sweep", "grpo.sweep": name, "grpo.run_dir": str(sweep_dir),
                  "grpo.sweep.study": study_name, **({"prefect.flow_run_id": flow_run_id} if flow_run_id else {})},
            params={"sweep.n_trials": sp.n_trials, "sweep.max_concurrency": max_concurrency, "sweep.metric": metric,
                    "sweep.direction": direction, "sweep.fields": ",".join(fields), "sweep.space": space,
                    "sweep.sampler": sp.sampler_kind, "sweep.pruner": pruner, "sweep.study": study_name,
                    "sweep.storage": _shown_storage(storage), "sweep.use_deployment": use_deployment or "local"})
        tracker.log_dict(space, "sweep/space.json")
        tracker.log_artifact(sweep_dir / "base_config.yaml", "sweep")
        tracking = {"uri": tracker.tracking_uri, "experiment_id": tracker.experiment_id, "parent_run_id": parent_id}
        create_link_artifact(key="mlflow-sweep-run", link=mlflow_run_url(tracker.tracking_uri, tracker.experiment_id,
                                                                          parent_id),
                             link_text=f"MLflow sweep run {parent_id}", description="The sweep's parent run in MLflow")
    sweep = {"name": name, "parent_run_id": parent_id, "metric": metric, "direction": direction, "fields": fields,
             "study": study_name}

    from optuna.trial import TrialState

    client = tracker.client if tracker is not None else None
    records: list[dict] = []
    running: dict[Any, dict] = {}  # concurrent future -> the trial's record in the making

    def record(t: dict, status: str, summary: dict, error: str | None) -> None:
        """Close one trial: its state in the study, its MLflow run's tags, its row in the results."""
        trial, index, run_dir = t["trial"], t["trial"].number, Path(config.output_dir) / name / t["run_name"]
        run_id = summary.get("mlflow_run_id")
        if run_id is None and client is not None:
            with contextlib.suppress(Exception):
                run_id = _child_run_id(client, tracker.experiment_id, parent_id, index,
                                       None if use_deployment else run_dir)
        value = _metric_value(summary, metric, client, run_id) if status == "completed" else None
        pruned_at = t["hook"].stopped_at if t.get("hook") is not None else None
        if status == "completed" and pruned_at is not None:
            status = "pruned"
            if client is not None and run_id:
                with contextlib.suppress(Exception):
                    client.set_tag(run_id, "grpo.sweep.pruned", "true")
                    client.set_tag(run_id, "grpo.sweep.pruned_at_step", str(pruned_at))
        for key, v in (("run_name", t["run_name"]), ("sweep", name), ("mlflow_run_id", run_id),
                       ("overrides", t["values"]), ("status", status)):
            with contextlib.suppress(Exception):
                trial.set_user_attr(key, v)
        state = (TrialState.PRUNED if status == "pruned" else TrialState.COMPLETE
                 if status == "completed" and value is not None else TrialState.FAIL)
        study.tell(trial, value if state == TrialState.COMPLETE else None, state=state)
        if status == "completed" and value is None:
            logger.warning(f"trial {index} ({t['run_name']}) has no value for {metric!r}: failed in the study")
        if error:
            logger.warning(f"trial {index} ({t['run_name']}) failed: {error}")
        records.append({"trial": index, "run_name": t["run_name"], "status": status, **t["values"],
                        "overrides": t["values"], "metric": metric, "metric_value": value, "pruned_at_step": pruned_at,
                        "study_state": state.name.lower(), "mlflow_run_id": run_id,
                        "prefect_flow_run_id": summary.get("prefect_flow_run_id"),
                        "wall_seconds": summary.get("wall_seconds"), "run_dir": str(run_dir), "error": error})

    status = "FAILED"
    try:
        if sp.sampler_kind == "grid":
            sp.enqueue_grid(study)
        shared = SharedInputs()
        # Trials log models through MLflow's global tracking URI, which log_model switches per call; pinning it for
        # the whole fan-out makes the concurrent switch-and-restore calls agree.
        uri_ctx = use_tracking_uri(tracker.tracking_uri) if tracker is not None else contextlib.nullcontext()
        with uri_ctx, ThreadPoolTaskRunner(max_workers=max_concurrency) as runner:
            launched = 0
            try:
                while launched < sp.n_trials or running:
                    # ask for the next trial as soon as a slot is free: TPE sees every result told so far
                    while launched < sp.n_trials and len(running) < max_concurrency:
                        launched += 1
                        trial = study.ask()
                        t = {"trial": trial, "run_name": f"{name}-t{trial.number:03d}", "values": {}, "hook": None}
                        try:
                            t["values"] = sp.suggest(trial)
                            t["values"], cfg = sp.config(t["values"], f"trial {trial.number}")
                            cfg = cfg.model_copy(update={"output_dir": str(sweep_dir)})
                            if not use_deployment:
                                shared.prepare(cfg)
                        except Exception as err:
                            record(t, "failed", {}, f"{type(err).__name__}: {err}")
                            continue
                        if sp.pruner_spec and not use_deployment:
                            t["hook"] = _pruning_hook(trial, sp.pruner_spec, direction)
                        tags = {"grpo.run_type": "trial", "grpo.sweep": name, "grpo.sweep.trial": str(trial.number),
                                "grpo.sweep.study": study_name,
                                "grpo.sweep.overrides": json.dumps(t["values"], default=str)}
                        if parent_id:
                            tags["mlflow.parentRunId"] = parent_id
                        future = runner.submit(
                            run_trial.with_options(task_run_name=t["run_name"]),
                            parameters={"config": cfg, "run_name": t["run_name"], "index": trial.number,
                                        "tracking_tags": tags, "tracking": tracking, "use_deployment": use_deployment,
                                        "trial_timeout": trial_timeout,
                                        "context": context.for_trial([t["hook"]] if t["hook"] else [])})
                        running[future.wrapped_future] = {**t, "future": future}
                    if not running:
                        continue
                    done, _ = concurrent.futures.wait(list(running), return_when=concurrent.futures.FIRST_COMPLETED)
                    for wrapped in done:
                        t = running.pop(wrapped)
                        try:
                            summary, error, state = t["future"].result(), None, "completed"
                        except Exception as err:  # a failed trial never stops the sweep
                            summary, error, state = {}, f"{type(err).__name__}: {err}", "failed"
                        record(t, state, summary, error)
            except BaseException:  # Ctrl-C / SIGTERM: running trials checkpoint and stop at their step end
                logger.warning(f"sweep {name}: interrupted; running trials save a checkpoint at the end of their "
                               "step and stop, waiting trials do not start")
                request_stop()
                for t in running.values():
                    with contextlib.suppress(Exception):
                        study.tell(t["trial"], state=TrialState.FAIL)  # not left RUNNING in the stored study
                raise

        records.sort(key=lambda r: r["trial"])
        n = _counts(records)
        best = _best(study, sp)
        registered = None
        if best is not None and tracker is not None and best["mlflow_run_id"]:
            if config.tracking.log_model:
                try:
                    registered = _register_best(tracker, best, registered_model_name or f"{config.name}-grpo", sweep)
                except Exception as err:
                    logger.warning(f"could not register the best trial's model: {type(err).__name__}: {err}")
            else:
                logger.info("tracking.log_model is false: no model to register")
        elif best is None:
            logger.warning(f"no completed trial of study {study_name} has a value for {metric!r}; nothing registered")

        importances = param_importances(study)
        study_info = {"name": study_name, "storage": _shown_storage(storage), "sampler": sp.sampler_kind,
                      "pruner": pruner, "n_trials": len(study.get_trials(deepcopy=False)),
                      "states": _trial_states(study), "first_trial": first_number, "importances": importances}
        table = [{k: v for k, v in r.items() if k not in ("overrides", "metric")} for r in records]
        (sweep_dir / "results.json").write_text(json.dumps(records, indent=2, default=str))
        create_table_artifact(key="sweep-results", table=json.loads(json.dumps(table, default=str)),
                              description=f"Sweep {name}: one row per trial ({metric}, {direction})")
        if tracker is not None:
            tracker.log_dict(importances, "sweep/importances.json")
        dashboard = _dashboard(tracker, config.tracking.experiment_name, sweep, records, sweep_dir, importances)
        if tracker is not None:
            tracker.log_dict(records, "sweep/results.json")
            if table:
                tracker.log_table({k: [json.dumps(r.get(k), default=str) if isinstance(r.get(k), (dict, list))
                                       else r.get(k) for r in table] for k in table[0]}, "sweep/results_table.json")
            for r in records:
                if r["metric_value"] is not None:
                    tracker.log_metrics({f"trials/{metric}": r["metric_value"]}, step=r["trial"])
            tracker.log_metrics({"sweep/trials_completed": n["completed"], "sweep/trials_pruned": n["pruned"],
                                 "sweep/trials_failed": n["failed"], "sweep/study_trials": study_info["n_trials"],
                                 **({f"sweep/best_{metric}": best["metric_value"]} if best else {})}, step=0)
            tags = {"grpo.sweep.best_trial": str(best["trial"]), "grpo.sweep.best_run_id": best["mlflow_run_id"]} \
                if best and best["mlflow_run_id"] else {}
            if registered:
                tags.update({"grpo.sweep.registered_model": registered["name"],
                             "grpo.sweep.registered_version": registered["version"]})
            if tags:
                tracker.set_tags(tags)
        create_markdown_artifact(key="sweep-summary",
                                 markdown=_results_markdown(sweep, records, best, registered, study_info),
                                 description=f"Sweep {name}")
        result = {"sweep_name": name, "sweep_dir": str(sweep_dir), "mlflow_run_id": parent_id,
                  "experiment_id": tracker.experiment_id if tracker is not None else None,
                  "metric": metric, "direction": direction, "fields": fields, "trials": records, "best": best,
                  "registered_model": registered, "dashboard": dashboard, "study": study_info, **n,
                  "prefect_flow_run_id": flow_run_id}
        (sweep_dir / "sweep.json").write_text(json.dumps(result, indent=2, default=str))
        if n["completed"] + n["pruned"] == 0:
            first = next((r["error"] for r in records if r["error"]), "unknown error")
            raise SweepError(f"sweep {name}: all {len(records)} trials failed; first error: {first}")
        status = "FINISHED"
        return result
    except BaseException as err:
        status = end_status(False, err, False)  # Ctrl-C, SIGTERM: KILLED, as a pipeline's run; else FAILED
        raise
    finally:
        if tracker is not None:
            tracker.close(status=status)


__all__ = ["grpo_sweep", "run_trial", "SweepError", "StudyError", "BEST_ALIAS", "default_sweep_name",
           "default_study_name", "default_storage", "param_importances"]
