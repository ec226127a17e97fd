"""The sweep, written once: an Optuna study over a search space, one pipeline run per trial, under one MLflow parent
run. Read it top to bottom.

``run_sweep(config, space, trials)``:

1. checks the sweep before anything runs or is created: the direction, the concurrency, the space against the config
   (:func:`grpo.pipeline.sweep_space.validate_space`: field paths, every grid combination, every distribution's
   bounds), the sweep's name and directory;
2. creates or continues the Optuna study ``study_name`` in ``storage`` (default ``sqlite:///<output_dir>/optuna.db``;
   a deployment's runs default to ``<config.name>-<deployment>``, so the nightly schedule adds to one study night
   after night; any other sweep defaults to a new study named as the sweep); its sampler (grid: the combinations the
   study has not run, enqueued; random: ``RandomSampler``, tpe: ``TPESampler``) and pruner (``MedianPruner``,
   ``HyperbandPruner``) come from the space. A grid point the study already has (a completed or pruned trial with the
   same params) is not run again; one line says how many there were ("grid: 3 of 3 points already in study X;
   nothing to run");
3. creates ``<output_dir>/<sweep_name>/`` and ONE MLflow parent run (tags ``grpo.run_type=sweep``, ``grpo.sweep``,
   ``grpo.sweep.study``; the space as param ``sweep.space`` and artifact ``sweep/space.json``); every invocation gets
   a new directory and parent run, never an earlier one's;
4. runs ``n_trials`` NEW trials (a grid: its missing points) with Optuna's ask/tell, at most ``max_concurrency`` at
   a time, each in a thread of this process (the next trial is asked for when a slot frees, so TPE sees every result
   told so far), each a pipeline run named ``<sweep_name>-t<NNN>`` (NNN: the trial's number in the study,
   continuing across invocations) in ``<output_dir>/<sweep_name>/``, whose MLflow run carries ``mlflow.parentRunId``
   = the parent run plus ``grpo.sweep.trial``. A :class:`TrialRunner` runs the trial's pipeline:
   :class:`InProcessTrials` in the trial's thread (prepared data, sampler plans and the warm-started tiny model built
   first, in the sweep's thread), or ``flows.sweep.DeploymentTrials`` as a flow run of a Prefect deployment. With a
   pruner, an in-process trial's training reports the pruner's metric (default ``reward``) at every logging step
   (:class:`grpo.training.pruning.ReportIntermediate`, a trainer callback in the trial's own
   :class:`~grpo.pipeline.run_context.RunContext`); when ``trial.should_prune()``, training stops at the end of that
   step, the pipeline finishes as usual (model, eval, summary), the trial is told PRUNED, and its MLflow run
   (FINISHED) is tagged ``grpo.sweep.pruned=true`` and ``grpo.sweep.pruned_at_step``. Trials of a deployment are
   sampled and told like in-process ones but NOT pruned: they train in the worker's process;
5. records a failed trial as failed (FAIL in the study; its MLflow run set to FAILED with tag ``grpo.sweep.error``;
   its row in the results has ``status: failed`` and the error) without stopping the others. Each trial's end is one
   line on the sweep's log (its params, state and value), marked :data:`PROGRESS` for a console that shows only
   those (``grpo sweep``);
6. picks the study's best trial (``Study.best_trial``: over every completed trial of every invocation, by ``metric``
   read from the trial's summary or else its MLflow metrics, in ``direction``; pruned trials never qualify) and
   registers its model as a version of ``registered_model_name`` (default ``<config.name>-grpo``; a new version
   unless that run has one), tagged with the metric, direction and value it was judged by. Every sweep of a config
   registers into that one model, so the alias ``best`` is judged across its versions: it moves only to a version
   that beats the one it names on the same metric and direction, else it stays and a line says why
   (:mod:`grpo.tracking.sweep_runs`); ``study-<study>`` names the study's own best;
7. publishes the results: ``results.json`` and ``sweep.json`` in the sweep directory, ``sweep/results.json`` (+ an
   MLflow table ``sweep/results_table.json``) and ``sweep/importances.json`` (Optuna's fANOVA parameter importances
   over the study) on the parent run, and the sweep's results page (a table of its trials) under the parent's
   ``dashboard/`` artifacts. The comparison dashboard is the app's (``grpo.app.sweep_dashboard``, after ``grpo
   sweep``; ``grpo dashboard --sweep``), the one layer that imports ``dashboards/``.

It raises :class:`SweepError` (after publishing the results) only when every trial of this invocation failed (an
invocation with nothing to run, a grid the study has already run, ends cleanly with the study's best).

Every path runs this function: ``grpo sweep`` and the Prefect UI run it in the flow ``grpo-sweep``
(``flows/sweep.py``: each trial a ``sweep-trial`` task whose pipeline is a subflow, or a deployment's flow run;
Prefect artifacts), code without Prefect with ``InProcessTrials()`` (the recipe with
:class:`grpo.pipeline.experiment.LocalStages`). The caller's :class:`~grpo.pipeline.run_context.RunContext`
(``context``) gives each trial its own context sharing the caller's list of started flow runs (``grpo sweep`` cancels
them when stopped). The MLflow side beyond the parent run, the trials' own runs and the model registry, comes in as
``trial_runs`` (:class:`TrialRuns`; the flow passes :class:`grpo.tracking.sweep_runs.MlflowTrialRuns`); without it
the trials' runs stay as their pipelines closed them and nothing is registered.

Own code, and why: the ask/tell loop that bounds concurrency with a thread pool, and the parent run's contents;
sampling, pruning decisions, the study's state and storage, the best trial and importances are Optuna's.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import contextvars
import html
import json
import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from grpo.config import ExperimentConfig, to_yaml
from grpo.errors import GRPOPlatformError, RunDirectoryError
from grpo.formatting import count, human_metric, human_number
from grpo.pipeline import stages
from grpo.pipeline.cache_dirs import plan_dir_for
from grpo.pipeline.run_context import RunContext
from grpo.pipeline.sweep_space import Space, validate_space
from grpo.runs import open_run_dir, validate_run_name
from grpo.tracking.metric_keys import read_run_metric
from grpo.tracking.model_logging import use_tracking_uri
from grpo.tracking.run_tracking import end_status
from grpo.tracking.sweep_runs import BEST_ALIAS, DIRECTION_TAG, METRIC_TAG, VALUE_TAG, ParentRun
from grpo.tracking.tracker import MlflowTracker, tracker_from_config
from grpo.training.graceful_stop import clear_stop_request, request_stop
from grpo.training.pruning import ReportIntermediate

DIRECTIONS = ("maximize", "minimize")
STATUSES = ("completed", "pruned", "failed")
PROGRESS = {"grpo_sweep_progress": True}
"""``extra`` of the sweep's log records a person follows it by (a grid's points already run, each trial's end): a
console can show these alone (``grpo sweep``: :func:`is_progress`), the sweep's full log keeps the rest."""


def is_progress(record: logging.LogRecord) -> bool:
    """Whether ``record`` is one of the sweep's :data:`PROGRESS` lines."""
    return bool(getattr(record, "grpo_sweep_progress", False))


class SweepError(RuntimeError):
    """Every trial of the sweep failed; ``result`` is what the sweep published before saying so."""

    def __init__(self, message: str, result: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.result = result


class StudyError(GRPOPlatformError, ValueError):
    """The stored Optuna study can not be continued by this sweep (another direction or metric)."""


# ---------------------------------------------------------------- records


@dataclass
class Sweep:
    """One invocation of the sweep: its name and directory, the study it adds to, its parent run when tracked."""

    name: str
    dir: Path
    space: Space
    study: Any  # optuna.Study
    study_name: str
    storage: str
    metric: str
    direction: str
    max_concurrency: int
    first_trial: int  # trials the study had before this invocation
    grid_todo: list[dict[str, Any]] | None = None  # a grid's points the study has no completed or pruned trial of
    tracker: MlflowTracker | None = None
    parent: ParentRun | None = None
    context: RunContext = field(default_factory=RunContext, repr=False)  # the caller's: its trials share its flow runs

    @property
    def pruner(self) -> str:
        return self.space.pruner_spec["type"] if self.space.pruner_spec else "none"

    @property
    def n_new(self) -> int:
        """The trials this invocation runs: the space's ``n_trials``, or a grid's missing points."""
        return self.space.n_trials if self.grid_todo is None else len(self.grid_todo)


@dataclass
class Trial:
    """One asked trial: what a :class:`TrialRunner` needs to run its pipeline, and the study's trial to tell."""

    number: int
    run_name: str
    run_dir: Path
    study_trial: Any = field(repr=False)  # optuna.Trial
    overrides: dict[str, Any] = field(default_factory=dict)
    config: ExperimentConfig | None = None  # None until its suggestion became a valid config
    tags: dict[str, str] = field(default_factory=dict)  # its MLflow run's: nesting under the parent, its number
    parent: ParentRun | None = None
    pruning: ReportIntermediate | None = field(default=None, repr=False)
    context: RunContext = field(default_factory=RunContext, repr=False)  # its own: the pruning hook, the flow runs


@dataclass(frozen=True)
class TrialResult:
    """How one trial ended: its row in the results."""

    trial: int
    run_name: str
    status: str  # one of STATUSES
    overrides: dict[str, Any]
    metric: str
    metric_value: float | None
    pruned_at_step: int | None
    study_state: str
    mlflow_run_id: str | None
    prefect_flow_run_id: str | None
    wall_seconds: float | None
    run_dir: str
    error: str | None

    def line(self) -> str:
        """The trial's one line for a person: its run, state, value and params (or error)."""
        detail = self.error if self.status == "failed" else ", ".join(
            f"{k}={human_number(v)}" for k, v in self.overrides.items())
        if self.status == "pruned":
            detail += f" (pruned at step {self.pruned_at_step})"
        return f"  {self.run_name:28s} {self.status:9s} {self.metric}={human_metric(self.metric_value)}  {detail}"

    def row(self) -> dict[str, Any]:
        """``results.json``'s and ``sweep.json``'s row: each override also as a column of its own, for the tables."""
        return {"trial": self.trial, "run_name": self.run_name, "status": self.status, **self.overrides,
                "overrides": self.overrides, "metric": self.metric, "metric_value": self.metric_value,
                "pruned_at_step": self.pruned_at_step, "study_state": self.study_state,
                "mlflow_run_id": self.mlflow_run_id, "prefect_flow_run_id": self.prefect_flow_run_id,
                "wall_seconds": self.wall_seconds, "run_dir": self.run_dir, "error": self.error}


# ---------------------------------------------------------------- what the caller brings


class TrialRunner(Protocol):
    """How a trial's pipeline runs."""

    name: str  # where trials run: "local" or a deployment's name (the parent run's param sweep.use_deployment)
    in_process: bool  # trials train in this process: their run directories are here, a pruning hook reaches them

    def prepare(self, config: ExperimentConfig) -> None:
        """Build what the trial with ``config`` reads, in the sweep's thread, before it starts."""

    def run(self, trial: Trial) -> dict[str, Any]:
        """Run the trial's pipeline (in a thread of the sweep); its summary (``summary.json``'s keys with
        ``mlflow_run_id``, and ``prefect_flow_run_id`` under Prefect). Raises when the trial failed."""


class TrialRuns(Protocol):
    """The MLflow side of the sweep beyond its parent run: the trials' own runs and the model registry."""

    def find(self, number: int, run_dir: Path | None) -> str | None:
        """Trial ``number``'s MLflow run id when its summary has none (it failed): from its run directory
        (``run_dir``, given for a trial run in this process), else by its sweep tags."""

    def mark_failed(self, run_id: str, error: str) -> None:
        """FAILED, with the error as tag ``grpo.sweep.error`` (a pipeline closes its run FINISHED even when a stage
        raised)."""

    def mark_pruned(self, run_id: str, step: int) -> None:
        """Tags ``grpo.sweep.pruned=true`` and ``grpo.sweep.pruned_at_step`` on the (FINISHED) run."""

    def register(self, run_id: str, model_name: str, tags: Mapping[str, str]) -> dict[str, Any]:
        """The model run ``run_id`` logged as a new version of ``model_name`` (with ``tags``) with alias
        :data:`BEST_ALIAS`, unless the alias already names a version of that run; ``name``, ``version``, ``alias``,
        ``source``, ``run_id``, ``unchanged``."""


class SweepReport(Protocol):
    """Where the sweep shows besides MLflow and its directory (a Prefect flow run's artifacts)."""

    def started(self, sweep: Sweep) -> None:
        """The sweep directory and, when tracked, the parent run (``sweep.parent``) exist; no trial has run."""

    def finished(self, result: dict[str, Any]) -> None:
        """The results are published (also when every trial failed, before :class:`SweepError`)."""


# ---------------------------------------------------------------- the sweep


def run_sweep(config: ExperimentConfig, space: Mapping[str, Any], trials: TrialRunner, *, name: str | None = None,
              study_name: str | None = None, storage: str | None = None, deployment: str | None = None,
              metric: str = "eval_accuracy_after", direction: str = "maximize", max_concurrency: int = 2,
              registered_model_name: str | None = None,
              trial_runs: Callable[[ParentRun], TrialRuns] | None = None, report: SweepReport | None = None,
              log: logging.Logger | logging.LoggerAdapter | None = None, tags: Mapping[str, Any] | None = None,
              result_extra: Mapping[str, Any] | None = None, context: RunContext | None = None) -> dict[str, Any]:
    """Run ``n_trials`` new trials of an Optuna study over ``space`` on top of ``config``; returns the result (also
    ``sweep.json``). ``deployment``: the Prefect deployment this sweep runs as (its runs continue one study); ``tags``
    go on the parent run, ``result_extra`` into the result; ``context``: the caller's (each trial gets its own, sharing
    its list of started flow runs)."""
    log = log or logging.getLogger(__name__)

    # 1. Everything that can be wrong with the request, before anything is created.
    checked, name, sweep_dir = _checked(config, space, name, direction, max_concurrency)

    # 2. The study (new or continued) and the sweep directory.
    sweep = _open(config, space, checked, name, sweep_dir, study_name or default_study_name(config, name, deployment),
                  storage or default_storage(config), metric, direction, max_concurrency, trials, log)
    sweep.context = context if context is not None else RunContext()
    clear_stop_request()  # an earlier sweep of this process (a test session) may have been interrupted

    # 3. The MLflow parent run the trials nest under.
    _start_parent_run(sweep, config, space, trials, tags or {})
    runs = trial_runs(sweep.parent) if trial_runs is not None and sweep.parent is not None else None
    status = "FAILED"
    try:
        if report is not None:
            report.started(sweep)

        # 4-5. Ask, run, tell: every trial of this invocation, failed ones included.
        results = _run_trials(sweep, trials, runs, log)

        # 6-7. The study's best trial, its model registered, the results published.
        result = _publish(sweep, config, results, runs, registered_model_name, log, result_extra or {})
        if report is not None:
            report.finished(result)
        if results and result["completed"] + result["pruned"] == 0:
            first = next((r.error for r in results if r.error), "unknown error")
            raise SweepError(f"sweep {name}: all {len(results)} trials failed; first error: {first}", result)
        status = "FINISHED"
        return result
    except BaseException as err:
        status = end_status(False, err, False)  # Ctrl-C, SIGTERM: KILLED, as a pipeline's run; else FAILED
        raise
    finally:
        if sweep.tracker is not None:
            sweep.tracker.close(status=status)


def _checked(config: ExperimentConfig, space: Mapping[str, Any], name: str | None, direction: str,
             max_concurrency: int) -> tuple[Space, str, Path]:
    """The space checked against the config (fields, grid points, bounds), the sweep's name and its new directory."""
    if direction not in DIRECTIONS:
        raise ValueError(f"direction: {direction!r} is not one of {', '.join(DIRECTIONS)}")
    if max_concurrency < 1:
        raise ValueError(f"max_concurrency: must be >= 1 (got {max_concurrency})")
    checked = validate_space(config, space)
    name = name or default_sweep_name(config)
    try:
        validate_run_name(name)
    except RunDirectoryError:
        raise RunDirectoryError(f"sweep_name {name!r}: use letters, digits, '.', '_' or '-' (max 128 characters, "
                                "no leading punctuation)") from None
    sweep_dir = Path(config.output_dir) / name
    if sweep_dir.exists():
        raise RunDirectoryError(f"sweep directory {sweep_dir} already exists; choose another sweep name")
    return checked, name, sweep_dir


def _open(config: ExperimentConfig, space: Mapping[str, Any], checked: Space, name: str, sweep_dir: Path,
          study_name: str, storage: str, metric: str, direction: str, max_concurrency: int, trials: TrialRunner,
          log) -> Sweep:
    """The study to add trials to, and the sweep directory with its space and base config."""
    study = open_study(study_name, storage, checked, metric, direction)
    sweep = Sweep(name=name, dir=sweep_dir, space=checked, study=study, study_name=study_name, storage=storage,
                  metric=metric, direction=direction, max_concurrency=max_concurrency,
                  first_trial=len(study.get_trials(deepcopy=False)))
    if checked.sampler_kind == "grid":
        points = checked.grid_points()
        sweep.grid_todo = _grid_todo(study, checked, points)
        if len(sweep.grid_todo) < len(points):
            todo = f"running the {count(len(sweep.grid_todo), 'missing point')}" if sweep.grid_todo else \
                "nothing to run"
            log.info(f"grid: {len(points) - len(sweep.grid_todo)} of {len(points)} points already in study "
                     f"{study_name}; {todo}", extra=PROGRESS)
    sweep_dir.mkdir(parents=True)
    (sweep_dir / "space.json").write_text(json.dumps(space, indent=2, default=str))
    (sweep_dir / "base_config.yaml").write_text(to_yaml(config))
    log.info(f"sweep {name}: {sweep.n_new} new trials of study {study_name} ({sweep.first_trial} before) over "
             f"{', '.join(checked.fields)}, {checked.sampler_kind} sampler, {sweep.pruner} pruner, max "
             f"{max_concurrency} at once{'' if trials.in_process else f', via deployment {trials.name} (not pruned)'}")
    return sweep


def _start_parent_run(sweep: Sweep, config: ExperimentConfig, space: Mapping[str, Any], trials: TrialRunner,
                      tags: Mapping[str, Any]) -> None:
    """ONE MLflow parent run per invocation (none with ``tracking.backend: none``): the space, the settings."""
    tracker = tracker_from_config(config, sweep.dir)
    if tracker is None:
        return
    run_id = tracker.start(
        sweep.name, config.tracking.experiment_name,
        tags={"grpo.run_type": "sweep", "grpo.sweep": sweep.name, "grpo.run_dir": str(sweep.dir),
              "grpo.sweep.study": sweep.study_name, **tags},
        params={"sweep.n_trials": sweep.n_new, "sweep.max_concurrency": sweep.max_concurrency,
                "sweep.metric": sweep.metric, "sweep.direction": sweep.direction,
                "sweep.fields": ",".join(sweep.space.fields), "sweep.space": space,
                "sweep.sampler": sweep.space.sampler_kind, "sweep.pruner": sweep.pruner,
                "sweep.study": sweep.study_name, "sweep.storage": shown_storage(sweep.storage),
                "sweep.use_deployment": trials.name})
    tracker.log_dict(space, "sweep/space.json")
    tracker.log_artifact(sweep.dir / "base_config.yaml", "sweep")
    sweep.tracker, sweep.parent = tracker, ParentRun(tracker.tracking_uri, tracker.experiment_id, run_id)


def _run_trials(sweep: Sweep, trials: TrialRunner, runs: TrialRuns | None, log) -> list[TrialResult]:
    """Ask for a trial whenever fewer than ``max_concurrency`` run, run it in a thread, tell the study as each ends.
    Interrupted (Ctrl-C, SIGTERM), running trials save a checkpoint at the end of their step and stop, and no new
    trial starts."""
    from optuna.trial import TrialState

    if sweep.grid_todo is not None:
        sweep.space.enqueue_grid(sweep.study, _not_waiting(sweep.study, sweep.space, sweep.grid_todo))
    results: list[TrialResult] = []
    running: dict[concurrent.futures.Future, Trial] = {}
    # Trials log models through MLflow's global tracking URI, which log_model switches per call; pinning it for the
    # whole fan-out makes the concurrent switch-and-restore calls agree.
    uri = use_tracking_uri(sweep.tracker.tracking_uri) if sweep.tracker is not None else contextlib.nullcontext()
    with uri, concurrent.futures.ThreadPoolExecutor(sweep.max_concurrency, thread_name_prefix="sweep-trial") as pool:
        asked = 0
        try:
            while asked < sweep.n_new or running:
                while asked < sweep.n_new and len(running) < sweep.max_concurrency:
                    asked += 1
                    trial = _ask(sweep)
                    try:
                        _configure(sweep, trial, trials)
                    except Exception as err:  # a suggestion no config takes fails this trial only
                        results.append(_tell(sweep, trial, "failed", {}, f"{type(err).__name__}: {err}", runs,
                                             trials, log))
                        continue
                    # each trial's thread gets a copy of this one's context (a Prefect flow run's, for its tasks)
                    context = contextvars.copy_context()
                    running[pool.submit(context.run, _run_trial, trial, trials, runs, log)] = trial
                if not running:
                    continue
                done, _ = concurrent.futures.wait(list(running), return_when=concurrent.futures.FIRST_COMPLETED)
                for future in done:
                    trial = running.pop(future)
                    try:
                        summary, error, status = future.result(), None, "completed"
                    except Exception as err:  # a failed trial never stops the sweep
                        summary, error, status = {}, f"{type(err).__name__}: {err}", "failed"
                    results.append(_tell(sweep, trial, status, summary, error, runs, trials, log))
        except BaseException:
            log.warning(f"sweep {sweep.name}: interrupted; running trials save a checkpoint at the end of their "
                        "step and stop, waiting trials do not start")
            request_stop()
            for trial in running.values():
                with contextlib.suppress(Exception):
                    sweep.study.tell(trial.study_trial, state=TrialState.FAIL)  # not left RUNNING in the stored study
            raise
    return sorted(results, key=lambda r: r.trial)


def _ask(sweep: Sweep) -> Trial:
    """The study's next trial, named by its number in the study (numbers continue across invocations)."""
    study_trial = sweep.study.ask()
    run_name = f"{sweep.name}-t{study_trial.number:03d}"
    return Trial(number=study_trial.number, run_name=run_name, run_dir=sweep.dir / run_name, study_trial=study_trial,
                 parent=sweep.parent)


def _configure(sweep: Sweep, trial: Trial, trials: TrialRunner) -> None:
    """The trial's suggested values as a config in the sweep directory, its inputs built, its context (with its
    pruning hook) and its MLflow run's tags."""
    trial.overrides = sweep.space.suggest(trial.study_trial)
    trial.overrides, cfg = sweep.space.config(trial.overrides, f"trial {trial.number}")
    trial.config = cfg.model_copy(update={"output_dir": str(sweep.dir)})
    trials.prepare(trial.config)
    if sweep.space.pruner_spec and trials.in_process:
        trial.pruning = _pruning_hook(trial.study_trial, sweep.space.pruner_spec, sweep.direction)
    trial.context = sweep.context.for_trial([trial.pruning] if trial.pruning is not None else [])
    trial.tags = {"grpo.run_type": "trial", "grpo.sweep": sweep.name, "grpo.sweep.trial": str(trial.number),
                  "grpo.sweep.study": sweep.study_name,
                  "grpo.sweep.overrides": json.dumps(trial.overrides, default=str)}
    if sweep.parent is not None:
        trial.tags["mlflow.parentRunId"] = sweep.parent.run_id


def _pruning_hook(study_trial, spec: dict[str, Any], study_direction: str) -> ReportIntermediate:
    """The trainer callback that reports ``spec['metric']`` to the trial and stops its training when pruned."""
    sign = 1.0 if spec["direction"] == study_direction else -1.0  # the pruner compares in the study's direction

    def report(step: int, value: float) -> bool:
        study_trial.report(sign * value, step)
        return study_trial.should_prune()

    return ReportIntermediate(spec["metric"], report)


def _run_trial(trial: Trial, trials: TrialRunner, runs: TrialRuns | None, log) -> dict[str, Any]:
    """One trial's pipeline, in its thread; a failure marks its MLflow run FAILED before the thread ends, so the
    trial's slot is only freed once it is recorded."""
    try:
        return trials.run(trial)
    except Exception as err:
        if runs is not None:
            try:
                run_id = runs.find(trial.number, trial.run_dir if trials.in_process else None)
                if run_id is not None:
                    runs.mark_failed(run_id, f"{type(err).__name__}: {err}")
            except Exception as mark_err:  # the trial's failure is what matters; it is in the results either way
                log.warning(f"trial {trial.number}: could not mark its MLflow run FAILED: {mark_err}")
        raise


def _tell(sweep: Sweep, trial: Trial, status: str, summary: dict[str, Any], error: str | None,
          runs: TrialRuns | None, trials: TrialRunner, log) -> TrialResult:
    """Close one trial: its state in the study, its MLflow run's tags, its row in the results."""
    from optuna.trial import TrialState

    run_id = summary.get("mlflow_run_id")
    if run_id is None and runs is not None:
        with contextlib.suppress(Exception):
            run_id = runs.find(trial.number, trial.run_dir if trials.in_process else None)
    client = sweep.tracker.client if sweep.tracker is not None else None
    value = _metric_value(summary, sweep.metric, client, run_id) if status == "completed" else None
    pruned_at = trial.pruning.stopped_at if trial.pruning is not None else None
    if status == "completed" and pruned_at is not None:
        status = "pruned"
        if runs is not None and run_id:
            with contextlib.suppress(Exception):
                runs.mark_pruned(run_id, pruned_at)
    for key, v in (("run_name", trial.run_name), ("sweep", sweep.name), ("mlflow_run_id", run_id),
                   ("overrides", trial.overrides), ("status", status)):
        with contextlib.suppress(Exception):
            trial.study_trial.set_user_attr(key, v)
    state = (TrialState.PRUNED if status == "pruned" else TrialState.COMPLETE
             if status == "completed" and value is not None else TrialState.FAIL)
    sweep.study.tell(trial.study_trial, value if state == TrialState.COMPLETE else None, state=state)
    if status == "completed" and value is None:
        log.warning(f"trial {trial.number} ({trial.run_name}) has no value for {sweep.metric!r}: failed in the study")
    result = TrialResult(trial=trial.number, run_name=trial.run_name, status=status, overrides=trial.overrides,
                         metric=sweep.metric, metric_value=value, pruned_at_step=pruned_at,
                         study_state=state.name.lower(), mlflow_run_id=run_id,
                         prefect_flow_run_id=summary.get("prefect_flow_run_id"),
                         wall_seconds=summary.get("wall_seconds"), run_dir=str(trial.run_dir), error=error)
    log.log(logging.WARNING if error else logging.INFO, result.line(), extra=PROGRESS)
    return result


def _publish(sweep: Sweep, config: ExperimentConfig, results: list[TrialResult], runs: TrialRuns | None,
             registered_model_name: str | None, log, result_extra: Mapping[str, Any]) -> dict[str, Any]:
    """The best trial registered, the study's importances, the results in the sweep directory and on the parent run;
    the result (also ``sweep.json``)."""
    rows = [r.row() for r in results]
    counts = {s: sum(r.status == s for r in results) for s in STATUSES}
    best = _best(sweep.study, sweep.space)
    registered = _register_best(sweep, config, best, runs, registered_model_name or f"{config.name}-grpo", log)
    importances = param_importances(sweep.study)
    study = {"name": sweep.study_name, "storage": shown_storage(sweep.storage), "sampler": sweep.space.sampler_kind,
             "pruner": sweep.pruner, "n_trials": len(sweep.study.get_trials(deepcopy=False)),
             "states": _trial_states(sweep.study), "first_trial": sweep.first_trial, "importances": importances}
    (sweep.dir / "results.json").write_text(json.dumps(rows, indent=2, default=str))
    if sweep.tracker is not None:
        sweep.tracker.log_dict(importances, "sweep/importances.json")
    dashboard = _results_page(sweep, config, rows, log)
    if sweep.tracker is not None:
        _log_results(sweep, rows, counts, study, best, registered)
    result = {"sweep_name": sweep.name, "sweep_dir": str(sweep.dir),
              "mlflow_run_id": sweep.parent.run_id if sweep.parent else None,
              "experiment_id": sweep.parent.experiment_id if sweep.parent else None,
              "metric": sweep.metric, "direction": sweep.direction, "fields": sweep.space.fields, "trials": rows,
              "best": best, "registered_model": registered, "dashboard": dashboard, "study": study, **counts,
              **result_extra}
    write_result(result)
    return result


def _register_best(sweep: Sweep, config: ExperimentConfig, best: dict[str, Any] | None, runs: TrialRuns | None,
                   model_name: str, log) -> dict[str, Any] | None:
    """The best trial's model in the registry (alias ``best``), when there is one to register; a failure to
    register is a warning, the sweep's results stand."""
    if best is None:
        log.warning(f"no completed trial of study {sweep.study_name} has a value for {sweep.metric!r}; "
                    "nothing registered")
        return None
    if sweep.tracker is None or not best["mlflow_run_id"]:
        return None
    if not config.tracking.log_model:
        log.info("tracking.log_model is false: no model to register")
        return None
    if runs is None:
        log.info("no MLflow registry given to the sweep: nothing registered")
        return None
    tags = {"grpo.sweep": best.get("sweep") or sweep.name, "grpo.sweep.parent_run_id": sweep.parent.run_id,
            "grpo.sweep.study": sweep.study_name, "grpo.sweep.trial": str(best["trial"]),
            METRIC_TAG: sweep.metric, DIRECTION_TAG: sweep.direction, VALUE_TAG: str(best["metric_value"])}
    try:
        registered = runs.register(best["mlflow_run_id"], model_name, tags)
    except Exception as err:
        log.warning(f"could not register the best trial's model: {type(err).__name__}: {err}")
        return None
    if registered.get("note"):
        log.info(f"{model_name} version {registered['version']}: {registered['note']}")
    return registered


def _log_results(sweep: Sweep, rows: list[dict], counts: dict[str, int], study: dict, best: dict | None,
                 registered: dict | None) -> None:
    """The results on the parent run: files, a table, each trial's value as a point, the totals, the best's tags."""
    tracker, metric = sweep.tracker, sweep.metric
    table = results_table(rows)
    tracker.log_dict(rows, "sweep/results.json")
    if table:
        tracker.log_table({k: [json.dumps(r.get(k), default=str) if isinstance(r.get(k), (dict, list)) else r.get(k)
                               for r in table] for k in table[0]}, "sweep/results_table.json")
    for r in rows:
        if r["metric_value"] is not None:
            tracker.log_metrics({f"trials/{metric}": r["metric_value"]}, step=r["trial"])
    tracker.log_metrics({"sweep/trials_completed": counts["completed"], "sweep/trials_pruned": counts["pruned"],
                         "sweep/trials_failed": counts["failed"], "sweep/study_trials": study["n_trials"],
                         **({f"sweep/best_{metric}": best["metric_value"]} if best else {})}, step=0)
    tags = {"grpo.sweep.best_trial": str(best["trial"]), "grpo.sweep.best_run_id": best["mlflow_run_id"]} \
        if best and best["mlflow_run_id"] else {}
    if registered:
        tags.update({"grpo.sweep.registered_model": registered["name"],
                     "grpo.sweep.registered_version": registered["version"]})
    if tags:
        tracker.set_tags(tags)


def results_table(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The results as a table: one row per trial, its overrides as columns (not also as one dict)."""
    return [{k: v for k, v in r.items() if k not in ("overrides", "metric")} for r in rows]


def write_result(result: dict[str, Any]) -> None:
    """``sweep.json`` in the sweep directory: the result as the sweep returned it (the app adds its dashboard)."""
    (Path(result["sweep_dir"]) / "sweep.json").write_text(json.dumps(result, indent=2, default=str))


# ---------------------------------------------------------------- the study


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


def shown_storage(storage: str) -> str:
    """The storage URL as it may be shown (in params, results and messages): without its password."""
    with contextlib.suppress(Exception):
        from sqlalchemy.engine import make_url

        return make_url(storage).render_as_string(hide_password=True)
    return storage


def open_study(study_name: str, storage: str, space: Space, metric: str, direction: str):
    """Create the study, or load it to continue (``load_if_exists``); its direction and metric must be this sweep's."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)  # not "A new study created"; the sweep says what it runs
    if storage.startswith("sqlite:///"):
        Path(storage[len("sqlite:///"):]).parent.mkdir(parents=True, exist_ok=True)
    study = optuna.create_study(study_name=study_name, storage=storage, sampler=space.sampler(),
                                pruner=space.pruner(), direction=direction, load_if_exists=True)
    stored = study.direction.name.lower()
    if stored != direction:
        raise StudyError(f"study {study_name!r} in {shown_storage(storage)} is to {stored} its metric, not to "
                         f"{direction}; choose another study name")
    if study.user_attrs.get("metric", metric) != metric:
        raise StudyError(f"study {study_name!r} in {shown_storage(storage)} ranks trials by "
                         f"{study.user_attrs['metric']!r}, not {metric!r}; choose another study name")
    study.set_user_attr("metric", metric)
    return study


def _grid_todo(study, space: Space, points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The grid ``points`` the study has no completed or pruned trial of (the same params, no others): running them
    again repeats a result the study has. A failed point runs again."""
    from optuna.trial import TrialState

    done = [space.decode(t.params) for t in study.get_trials(deepcopy=False,
                                                             states=(TrialState.COMPLETE, TrialState.PRUNED))]
    return [p for p in points if p not in done]


def _not_waiting(study, space: Space, points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ``points`` to enqueue: those the study does not hold as WAITING already (enqueued by an invocation stopped
    before it asked for them; the next asks take those first)."""
    from optuna.trial import TrialState

    waiting = [space.decode(t.system_attrs.get("fixed_params", {}))
               for t in study.get_trials(deepcopy=False, states=(TrialState.WAITING,))]
    out = []
    for point in points:
        if point in waiting:
            waiting.remove(point)
        else:
            out.append(point)
    return out


def _trial_states(study) -> dict[str, int]:
    counts: dict[str, int] = {}
    for t in study.get_trials(deepcopy=False):
        counts[t.state.name.lower()] = counts.get(t.state.name.lower(), 0) + 1
    return counts


def param_importances(study) -> dict[str, Any]:
    """Optuna's parameter importances (fANOVA, seeded) over the study's completed trials, or why there are none:
    they need two completed trials and two params to tell apart."""
    import optuna
    from optuna.trial import TrialState

    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    params = sorted({p for t in complete for p in t.params})
    out = {"study": study.study_name, "completed_trials": len(complete), "importances": None, "note": None}
    if len(complete) < 2 or len(params) < 2:
        out["note"] = ("importances need at least 2 completed trials and 2 params; the study has "
                       f"{count(len(complete), 'completed trial')} over {count(len(params), 'param')}")
        return out
    try:
        imp = optuna.importance.get_param_importances(
            study, evaluator=optuna.importance.FanovaImportanceEvaluator(seed=0))
        out["importances"] = {k: float(v) for k, v in imp.items()}
    except Exception as err:  # e.g. every completed trial has the same value, or no param common to them all
        out["note"] = f"importances not computed: {type(err).__name__}: {err}"
    return out


def _metric_value(summary: dict, metric: str, client, run_id: str | None) -> float | None:
    """The trial's ``metric``: from its summary, else from its MLflow run (either eval naming)."""
    value = summary.get(metric)
    if value is None and client is not None and run_id:
        with contextlib.suppress(Exception):
            value = read_run_metric(client, run_id, metric)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _best(study, space: Space) -> dict[str, Any] | None:
    """The study's best trial (``Study.best_trial``: over every completed trial of every invocation)."""
    try:
        t = study.best_trial
    except ValueError:  # no completed trial yet
        return None
    return {"trial": t.number, "run_name": t.user_attrs.get("run_name"), "sweep": t.user_attrs.get("sweep"),
            "metric_value": t.value, "mlflow_run_id": t.user_attrs.get("mlflow_run_id"),
            "overrides": t.user_attrs.get("overrides") or space.decode(t.params)}


# ---------------------------------------------------------------- the results page


def _results_page(sweep: Sweep, config: ExperimentConfig, rows: list[dict], log) -> dict[str, Any]:
    """The sweep's own page, a table of its trials (``kind: placeholder``), logged under the parent run's
    ``dashboard/`` artifacts; the app replaces it with the comparison dashboard. Never fails the sweep."""
    if sweep.parent is None:
        reason = "tracking.backend is none"
    else:
        reason = (f"the comparison: grpo dashboard --experiment {config.tracking.experiment_name} --sweep "
                  f"{sweep.parent.run_id}")
    path = sweep.dir / "dashboard.html"
    cols = ["trial", "run_name", "status", *sweep.space.fields, "metric_value", "mlflow_run_id", "error"]
    cells = "".join("<tr>" + "".join(f"<td>{html.escape(str(r.get(c, '')))}</td>" for c in cols) + "</tr>"
                    for r in rows)
    path.write_text(
        f"<!doctype html><meta charset=utf-8><title>Sweep {html.escape(sweep.name)}</title>"
        f"<h1>Sweep {html.escape(sweep.name)}</h1><p>Placeholder dashboard ({html.escape(reason)}). "
        f"Metric: {html.escape(sweep.metric)} ({sweep.direction}).</p>"
        f"<table border=1><tr>{''.join(f'<th>{html.escape(c)}</th>' for c in cols)}</tr>{cells}</table>\n")
    artifact = None
    if sweep.tracker is not None:
        try:
            if sweep.tracker.log_artifact(path, "dashboard"):
                artifact = f"dashboard/{path.name}"
        except Exception as err:
            log.warning(f"could not log the dashboard to MLflow: {type(err).__name__}: {err}")
    return {"path": str(path), "kind": "placeholder", "artifact": artifact}


# ---------------------------------------------------------------- trials in this process


class InputStages(NamedTuple):
    """How a trial's shared inputs are built: its prepared data, its sampler plan, its starting policy's source."""

    prep: Callable[[ExperimentConfig], dict[str, Any]]
    plan: Callable[[ExperimentConfig, str, str], dict[str, Any]]
    policy: Callable[[ExperimentConfig, str], str]


def _policy_source(config: ExperimentConfig, data_dir: str) -> str:
    return stages.policy_stage(config, Path(data_dir)).source


LOCAL_INPUTS = InputStages(prep=stages.cached_prep, plan=stages.cached_plan, policy=_policy_source)


def run_trial_pipeline(trial: Trial) -> dict[str, Any]:
    """The trial's pipeline as plain calls: the recipe with ``LocalStages`` and the trial's context into its run
    directory, its MLflow run tagged as the sweep's trial."""
    from grpo.pipeline.experiment import LocalStages
    from grpo.pipeline.recipe import run_recipe

    return run_recipe(trial.config, open_run_dir(trial.config, trial.run_name, False), LocalStages(),
                      context=trial.context, tags=trial.tags)


class InProcessTrials:
    """Trials in this process, each in its thread of the sweep, so a pruner's hook reaches its training.

    ``pipeline`` runs a trial (default :func:`run_trial_pipeline`; the Prefect flow passes its ``sweep-trial`` task
    with the pipeline as a subflow). :meth:`prepare` builds the prepared data, sampler plan and warm-started tiny
    model once per distinct key with ``inputs`` (default: the stages' cached functions; the flow passes its prep and
    plan subflows), in the sweep's own thread before the trial that needs them starts: running trials only read these
    caches (concurrent builders do not write them atomically). A key that failed fails every trial that needs it,
    without building it again."""

    name = "local"
    in_process = True

    def __init__(self, pipeline: Callable[[Trial], dict[str, Any]] = run_trial_pipeline,
                 inputs: InputStages = LOCAL_INPUTS) -> None:
        self.pipeline, self.inputs = pipeline, inputs
        self._built: dict[str, Any] = {}

    def _once(self, key: str, build: Callable[[], Any]) -> Any:
        if key not in self._built:
            try:
                self._built[key] = build()
            except Exception as err:
                self._built[key] = err
        if isinstance(self._built[key], Exception):
            raise self._built[key]
        return self._built[key]

    def prepare(self, config: ExperimentConfig) -> None:
        # keyed on the data config: the prep stage fingerprints the source itself (reading a file once, not per trial)
        prep = self._once(f"prep:{json.dumps(config.data.model_dump(mode='json'), sort_keys=True)}",
                          lambda: self.inputs.prep(config))
        self._once(f"plan:{plan_dir_for(config, prep['content_hash'])}",
                   lambda: self.inputs.plan(config, prep["data_dir"], prep["content_hash"]))
        if config.model.is_tiny:
            key = json.dumps([config.model.tiny.model_dump(), config.model.warm_start.model_dump(),
                              config.data.model_dump(mode="json"), config.grpo.seed], sort_keys=True)
            self._once(f"policy:{key}", lambda: self.inputs.policy(config, prep["data_dir"]))

    def run(self, trial: Trial) -> dict[str, Any]:
        return self.pipeline(trial)


__all__ = ["BEST_ALIAS", "DIRECTIONS", "PROGRESS", "InProcessTrials", "InputStages", "ParentRun", "StudyError", "Sweep",
           "SweepError", "SweepReport", "Trial", "TrialResult", "TrialRunner", "TrialRuns", "default_storage",
           "default_study_name", "default_sweep_name", "open_study", "param_importances", "results_table", "run_sweep",
           "run_trial_pipeline", "shown_storage", "write_result", "is_progress"]
