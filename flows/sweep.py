"""The sweep flow: one pipeline run per trial of a search space, under one MLflow parent run.

``grpo_sweep(space, preset | config, ...)`` (Prefect flow ``grpo-sweep``, also ``grpo sweep`` on the command line):

1. expands and validates every trial (:func:`grpo.pipeline.sweep_space.expand_space`) before anything runs or is created;
2. creates ``<output_dir>/<sweep_name>/`` and ONE MLflow parent run (tags ``grpo.run_type=sweep``, ``grpo.sweep``;
   the space as param ``sweep.space`` and artifact ``sweep/space.json``);
3. runs the trials, at most ``max_concurrency`` at a time, each a ``grpo-pipeline`` run named
   ``<sweep_name>-t<NNN>`` whose run directory is ``<output_dir>/<sweep_name>/<sweep_name>-t<NNN>`` and whose MLflow
   run carries ``mlflow.parentRunId`` = the parent run (so MLflow nests it) plus ``grpo.sweep.trial``:

   * locally (default): a ``sweep-trial`` task per trial on a ``ThreadPoolTaskRunner(max_workers=max_concurrency)``,
     each calling the pipeline as a subflow (Prefect 3 links a subflow called from a task to that task). Prepared
     data, sampler plans and the warm-started tiny model are built once per distinct key before the fan-out, so
     concurrent trials only read the shared caches (they are not written atomically by concurrent builders);
   * ``use_deployment="grpo-pipeline/<deployment>"``: each trial is a flow run of that deployment created with
     ``prefect.deployments.run_deployment`` (linked to the trial task as a subflow, idempotency key
     ``<sweep flow run id>-<trial>``), executed by whatever worker serves the deployment's work pool, and polled
     until it ends (``trial_timeout`` seconds at most, default unlimited; a run still going then is cancelled
     and the trial fails). The deployment must be of a
     ``grpo-pipeline`` that accepts ``tracking_tags``, its workers must reach the same MLflow server, and a trial's
     summary is read from the run's ``summary.json`` MLflow artifact (the worker's result storage is not assumed);
4. records a failed trial as failed (its MLflow run is set to FAILED with tag ``grpo.sweep.error``; its row in the
   results has ``status: failed`` and the error) without stopping the others;
5. publishes the results: a Prefect table artifact ``sweep-results``, ``sweep/results.json`` (+ an MLflow table
   ``sweep/results_table.json``) on the parent run, the comparison dashboard (``dashboards.comparison``) under the
   parent's ``dashboard/`` artifacts, and registers the best trial's model (by ``metric``, read from the trial's
   summary or else from the trial's MLflow metrics, and ``direction``) as a new version of
   ``registered_model_name`` (default ``<config.name>-grpo``) with alias ``best``.

It raises :class:`SweepError` (after publishing the results) only when every trial failed.
"""

from __future__ import annotations

import contextlib
import json
import math
import threading
import time
from pathlib import Path
from typing import Any, Literal

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_link_artifact, create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.task_runners import ThreadPoolTaskRunner

from flows.pipeline import FLOW_RUNS_STARTED, Preset, _flow_run_info, default_config, grpo_pipeline, mlflow_run_url
from grpo.config import ExperimentConfig, resolve_config, to_yaml
from grpo.errors import RunDirectoryError
from grpo.pipeline.run_tracking import end_status
from grpo.pipeline.sweep_space import expand_space
from grpo.pipeline.tracking import SPOOL_DIRNAME, MlflowTracker, tracker_from_config, use_tracking_uri
from grpo.runs import validate_run_name
from grpo.training.graceful_stop import clear_stop_request, request_stop

BEST_ALIAS = "best"
DIRECTIONS = ("maximize", "minimize")
Direction = Literal["maximize", "minimize"]
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
              use_deployment: str | None = None, trial_timeout: float | None = None) -> dict:
    """One trial: the pipeline as a subflow of this task (or a deployment's flow run); a failure marks its MLflow
    run FAILED before the task fails, so the trial's slot is only freed once it is recorded."""
    run_dir = Path(config.output_dir) / run_name
    try:
        if use_deployment:
            return _run_deployment(use_deployment, config, run_name, tracking_tags, index, tracking, trial_timeout)
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


def _prepare_shared_inputs(configs: list[ExperimentConfig]) -> dict[int, str]:
    """Prep, plan and tiny-model warm start once per distinct key (sequentially); returns {trial: error} for trials
    whose shared inputs could not be built (they are recorded as failed without running)."""
    from flows.stages import plan_flow, prep_flow
    from grpo.pipeline.cache_dirs import plan_dir_for

    done: dict[str, Any] = {}
    errors: dict[int, str] = {}

    def once(key: str, fn):
        if key not in done:
            try:
                done[key] = fn()
            except Exception as err:
                done[key] = err
        if isinstance(done[key], Exception):
            raise done[key]
        return done[key]

    for i, cfg in enumerate(configs):
        try:
            # keyed on the data config: prep_flow fingerprints the source itself (reading a file once, not per trial)
            prep = once(f"prep:{json.dumps(cfg.data.model_dump(mode='json'), sort_keys=True)}", lambda: prep_flow(cfg))
            once(f"plan:{plan_dir_for(cfg, prep['content_hash'])}",
                 lambda: plan_flow(cfg, prep["data_dir"], prep["content_hash"]))
            if cfg.model.is_tiny:
                key = json.dumps([cfg.model.tiny.model_dump(), cfg.model.warm_start.model_dump(),
                                  cfg.data.model_dump(mode="json"), cfg.grpo.seed], sort_keys=True)
                once(f"policy:{key}", lambda: warm_policy(cfg, prep["data_dir"]))
        except Exception as err:
            errors[i] = f"shared inputs: {type(err).__name__}: {err}"
    return errors


# ---------------------------------------------------------------- results


def _metric_value(summary: dict, metric: str, client, run_id: str | None) -> float | None:
    value = summary.get(metric)
    if value is None and client is not None and run_id:
        with contextlib.suppress(Exception):
            value = client.get_run(run_id).data.metrics.get(metric)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _best(records: list[dict], direction: str) -> dict | None:
    scored = [r for r in records if r["status"] == "completed" and r["metric_value"] is not None]
    if not scored:
        return None
    pick = max if direction == "maximize" else min
    return pick(scored, key=lambda r: r["metric_value"])  # ties: the earliest trial


def _register_best(tracker: MlflowTracker, best: dict, model_name: str, sweep: dict) -> dict:
    """A new version of ``model_name`` from the best trial's logged model, with alias ``best``."""
    import mlflow

    client, run_id = tracker.client, best["mlflow_run_id"]
    models = [m for m in client.search_logged_models(experiment_ids=[tracker.experiment_id],
                                                     filter_string=f"source_run_id = '{run_id}'")
              if m.source_run_id == run_id]
    source = f"models:/{models[0].model_id}" if models else f"runs:/{run_id}/model"
    tags = {"grpo.sweep": sweep["name"], "grpo.sweep.parent_run_id": sweep["parent_run_id"],
            "grpo.sweep.trial": str(best["trial"]), "grpo.sweep.metric": sweep["metric"],
            "grpo.sweep.metric_value": str(best["metric_value"])}
    with use_tracking_uri(tracker.tracking_uri):
        version = mlflow.register_model(source, model_name, tags=tags)
    client.set_registered_model_alias(model_name, BEST_ALIAS, version.version)
    return {"name": model_name, "version": str(version.version), "alias": BEST_ALIAS, "source": source,
            "run_id": run_id}


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
               sweep_dir: Path) -> dict:
    """The comparison dashboard (``dashboards.comparison``), or a placeholder results page when that module is
    missing or fails; logged under the parent run's ``dashboard/`` artifacts. Never fails the sweep."""
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
            path = Path(build_dashboard(tracker.tracking_uri, experiment, sweep_run_id=sweep["parent_run_id"], out=out))
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


def _results_markdown(sweep: dict, records: list[dict], best: dict | None, registered: dict | None) -> str:
    lines = [f"## Sweep `{sweep['name']}`", "", f"- trials: {len(records)} "
             f"({sum(r['status'] == 'completed' for r in records)} completed, "
             f"{sum(r['status'] == 'failed' for r in records)} failed)",
             f"- metric: `{sweep['metric']}` ({sweep['direction']})"]
    if best is not None:
        lines.append(f"- best: trial {best['trial']} `{best['run_name']}` = **{best['metric_value']:.4g}** "
                     f"({', '.join(f'{k}={v}' for k, v in best['overrides'].items())})")
    if registered is not None:
        lines.append(f"- registered: `{registered['name']}` version {registered['version']} "
                     f"(alias `{registered['alias']}`)")
    return "\n".join(lines)


# ---------------------------------------------------------------- the flow


@flow(name="grpo-sweep")
def grpo_sweep(
    space: dict,
    preset: Preset | None = None,
    config: ExperimentConfig = default_config(),
    max_concurrency: int = 2,
    metric: str = "eval_accuracy_after",
    direction: Direction = "maximize",
    sweep_name: str | None = None,
    use_deployment: str | None = None,
    registered_model_name: str | None = None,
    trial_timeout: float | None = None,
) -> dict:
    """Run one GRPO pipeline per trial of ``space`` (grid and/or random over dotted config fields) on top of
    ``config``, at most ``max_concurrency`` at once, nested under one MLflow parent run; register the best model.

    Args:
        space: Search space over dotted config fields: {"grid": {"grpo.learning_rate": [1e-4, 2e-4]}} and/or
            {"random": {"n_trials": 4, "seed": 0, "params": {"grpo.beta": {"uniform": [0, 0.1]}}}}.
        preset: Start every trial from this preset (grpo/presets/) instead of the config form below.
        config: The base experiment every trial starts from (defaults from the tiny preset). Leave it unchanged
            when a preset is chosen.
        max_concurrency: Trials running at once.
        metric: Summary metric that picks the best trial (eval_accuracy_after, reward_last, ...).
        direction: Whether the best trial has the largest or the smallest metric.
        sweep_name: Sweep directory and MLflow parent run name; generated when empty. Never overwritten.
        use_deployment: Run each trial as a run of this pipeline deployment (e.g. grpo-pipeline/gpu) on its work
            pool instead of as a local subflow.
        registered_model_name: MLflow registered model for the best trial (default: <config.name>-grpo), alias "best".
        trial_timeout: Seconds a deployment trial may take before it counts as failed.
    """
    logger = get_run_logger()
    from grpo.pipeline.confine import check_config_paths

    config = resolve_config(config, preset)
    check_config_paths(config)  # a served sweep (grpo serve) stays inside the allowed roots (#12.15)
    if direction not in DIRECTIONS:
        raise ValueError(f"direction: {direction!r} is not one of {', '.join(DIRECTIONS)}")
    if max_concurrency < 1:
        raise ValueError(f"max_concurrency: must be >= 1 (got {max_concurrency})")
    trials = expand_space(config, space)  # every trial validated before anything is created
    name = sweep_name or f"{config.name}-sweep-{time.strftime('%Y%m%d-%H%M%S')}"
    try:
        validate_run_name(name)
    except RunDirectoryError:
        raise RunDirectoryError(f"sweep_name {name!r}: use letters, digits, '.', '_' or '-' (max 128 characters, "
                                "no leading punctuation)") from None
    sweep_dir = Path(config.output_dir) / name
    if sweep_dir.exists():
        raise RunDirectoryError(f"sweep directory {sweep_dir} already exists; choose another sweep name")
    fields = list(dict.fromkeys(f for values, _ in trials for f in values))
    run_names = [f"{name}-t{i:03d}" for i in range(len(trials))]
    configs = [cfg.model_copy(update={"output_dir": str(sweep_dir)}) for _, cfg in trials]
    sweep_dir.mkdir(parents=True)
    (sweep_dir / "space.json").write_text(json.dumps(space, indent=2, default=str))
    (sweep_dir / "base_config.yaml").write_text(to_yaml(config))
    logger.info(f"sweep {name}: {len(trials)} trials over {', '.join(fields) or '(no fields)'}, "
                f"max {max_concurrency} at once{f', via deployment {use_deployment}' if use_deployment else ''}")

    clear_stop_request()  # an earlier sweep of this process (a test session) may have been interrupted
    flow_run_id, _, _ = _flow_run_info()
    if flow_run_id is not None:
        FLOW_RUNS_STARTED.append(flow_run_id)  # `grpo sweep` cancels it, with its trials', on Ctrl-C / SIGTERM
    tracker = tracker_from_config(config, sweep_dir)
    parent_id, tracking = None, {}
    if tracker is not None:
        parent_id = tracker.start(
            name, config.tracking.experiment_name,
            tags={"grpo.run_type": "sweep", "grpo.sweep": name, "grpo.run_dir": str(sweep_dir),
                  **({"prefect.flow_run_id": flow_run_id} if flow_run_id else {})},
            params={"sweep.n_trials": len(trials), "sweep.max_concurrency": max_concurrency, "sweep.metric": metric,
                    "sweep.direction": direction, "sweep.fields": ",".join(fields), "sweep.space": space,
                    "sweep.use_deployment": use_deployment or "local"})
        tracker.log_dict(space, "sweep/space.json")
        tracker.log_artifact(sweep_dir / "base_config.yaml", "sweep")
        tracking = {"uri": tracker.tracking_uri, "experiment_id": tracker.experiment_id, "parent_run_id": parent_id}
        create_link_artifact(key="mlflow-sweep-run", link=mlflow_run_url(tracker.tracking_uri, tracker.experiment_id,
                                                                          parent_id),
                             link_text=f"MLflow sweep run {parent_id}", description="The sweep's parent run in MLflow")
    sweep = {"name": name, "parent_run_id": parent_id, "metric": metric, "direction": direction, "fields": fields}

    status = "FAILED"
    try:
        # Trials log models through MLflow's global tracking URI, which log_model switches per call; pinning it for
        # the whole fan-out makes the concurrent switch-and-restore calls agree.
        uri_ctx = use_tracking_uri(tracker.tracking_uri) if tracker is not None else contextlib.nullcontext()
        with uri_ctx:
            skipped = {} if use_deployment else _prepare_shared_inputs(configs)
            futures = {}
            with ThreadPoolTaskRunner(max_workers=max_concurrency) as runner:
                for i, cfg in enumerate(configs):
                    if i in skipped:
                        continue
                    tags = {"grpo.run_type": "trial", "grpo.sweep": name, "grpo.sweep.trial": str(i),
                            "grpo.sweep.overrides": json.dumps(trials[i][0], default=str)}
                    if parent_id:
                        tags["mlflow.parentRunId"] = parent_id
                    futures[i] = runner.submit(
                        run_trial.with_options(task_run_name=run_names[i]),
                        parameters={"config": cfg, "run_name": run_names[i], "index": i, "tracking_tags": tags,
                                    "tracking": tracking, "use_deployment": use_deployment,
                                    "trial_timeout": trial_timeout})
                outcomes = {}
                try:
                    for i, fut in futures.items():
                        try:
                            outcomes[i] = ("completed", fut.result(), None)
                        except Exception as err:  # a failed trial never stops the sweep
                            outcomes[i] = ("failed", {}, f"{type(err).__name__}: {err}")
                except BaseException:  # Ctrl-C / SIGTERM: running trials checkpoint and stop at their step end
                    logger.warning(f"sweep {name}: interrupted; running trials save a checkpoint at the end of their "
                                   "step and stop, waiting trials do not start")
                    request_stop()
                    raise

        records = []
        client = tracker.client if tracker is not None else None
        for i, (values, cfg) in enumerate(trials):
            state, summary, error = outcomes.get(i, ("failed", {}, skipped.get(i)))
            run_id = summary.get("mlflow_run_id")
            if run_id is None and client is not None:
                with contextlib.suppress(Exception):
                    run_id = _child_run_id(client, tracker.experiment_id, parent_id, i,
                                           None if use_deployment else Path(configs[i].output_dir) / run_names[i])
            value = _metric_value(summary, metric, client, run_id) if state == "completed" else None
            records.append({"trial": i, "run_name": run_names[i], "status": state, **values, "overrides": values,
                            "metric": metric, "metric_value": value, "mlflow_run_id": run_id,
                            "prefect_flow_run_id": summary.get("prefect_flow_run_id"),
                            "wall_seconds": summary.get("wall_seconds"),
                            "run_dir": str(Path(configs[i].output_dir) / run_names[i]), "error": error})
            if error:
                logger.warning(f"trial {i} ({run_names[i]}) failed: {error}")
        best = _best(records, direction)
        completed = sum(r["status"] == "completed" for r in records)

        registered = None
        if best is not None and tracker is not None:
            if config.tracking.log_model:
                try:
                    registered = _register_best(tracker, best, registered_model_name or f"{config.name}-grpo", sweep)
                except Exception as err:
                    logger.warning(f"could not register the best trial's model: {type(err).__name__}: {err}")
            else:
                logger.info("tracking.log_model is false: no model to register")
        elif best is None:
            logger.warning(f"no completed trial has a value for {metric!r}; nothing registered")

        table = [{k: v for k, v in r.items() if k not in ("overrides", "metric")} for r in records]
        (sweep_dir / "results.json").write_text(json.dumps(records, indent=2, default=str))
        create_table_artifact(key="sweep-results", table=json.loads(json.dumps(table, default=str)),
                              description=f"Sweep {name}: one row per trial ({metric}, {direction})")
        dashboard = _dashboard(tracker, config.tracking.experiment_name, sweep, records, sweep_dir)
        if tracker is not None:
            tracker.log_dict(records, "sweep/results.json")
            tracker.log_table({k: [json.dumps(r.get(k), default=str) if isinstance(r.get(k), (dict, list))
                                   else r.get(k) for r in table] for k in table[0]}, "sweep/results_table.json")
            for r in records:
                if r["metric_value"] is not None:
                    tracker.log_metrics({f"trials/{metric}": r["metric_value"]}, step=r["trial"])
            tracker.log_metrics({"sweep/trials_completed": completed,
                                 "sweep/trials_failed": len(records) - completed,
                                 **({f"sweep/best_{metric}": best["metric_value"]} if best else {})}, step=0)
            tags = {"grpo.sweep.best_trial": str(best["trial"]), "grpo.sweep.best_run_id": best["mlflow_run_id"]} \
                if best else {}
            if registered:
                tags.update({"grpo.sweep.registered_model": registered["name"],
                             "grpo.sweep.registered_version": registered["version"]})
            if tags:
                tracker.set_tags(tags)
        create_markdown_artifact(key="sweep-summary", markdown=_results_markdown(sweep, records, best, registered),
                                 description=f"Sweep {name}")
        result = {"sweep_name": name, "sweep_dir": str(sweep_dir), "mlflow_run_id": parent_id,
                  "experiment_id": tracker.experiment_id if tracker is not None else None,
                  "metric": metric, "direction": direction, "fields": fields, "trials": records, "best": best,
                  "registered_model": registered, "dashboard": dashboard, "completed": completed,
                  "failed": len(records) - completed, "prefect_flow_run_id": flow_run_id}
        (sweep_dir / "sweep.json").write_text(json.dumps(result, indent=2, default=str))
        if completed == 0:
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


__all__ = ["grpo_sweep", "run_trial", "SweepError", "BEST_ALIAS"]
