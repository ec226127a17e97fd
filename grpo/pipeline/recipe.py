"""The experiment, written once: prep → plan → policy → eval (before) → GRPO → eval (after), into one run directory
and one MLflow run. Read it top to bottom.

Every path runs this function with a different :class:`StageRunner`: ``grpo run`` and the Prefect UI run each stage
as a named Prefect subflow with its caching, retries and artifacts (``flows/pipeline.py``); ``torchrun`` /
``accelerate launch`` ranks, tests and benchmarks call the stages directly
(:class:`grpo.pipeline.experiment.LocalStages`). So the run directory, ``summary.json`` and the MLflow run are the same
on every path. The caller passes the run's live objects (extra trainer callbacks, the flow runs it started) in a
:class:`~grpo.pipeline.run_context.RunContext`; the recipe puts the MLflow tracker it starts there for the stages.

Under a multi-process launch every rank trains; rank 0 alone prepares data, plans, evaluates, tracks and writes the
summary, and gives the other ranks what they need (:func:`grpo.distributed.decide_on_main`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from grpo import distributed
from grpo.config import ExperimentConfig
from grpo.console import quiet_library_noise
from grpo.errors import DataError
from grpo.pipeline.run_context import RunContext
from grpo.pipeline.stages import plan_summary, policy_summary, prep_summary
from grpo.runs import RunDir
from grpo.tracking.run_tracking import (
    end_status,
    eval_metrics,
    log_numbers,
    log_plan,
    log_prep,
    log_run_artifacts,
    start_run_tracking,
)
from grpo.tracking.tracker import MlflowTracker

Log = Callable[[str], None]


class StageRunner(Protocol):
    """How the recipe's stages run: each returns a small JSON-able record (see :mod:`grpo.pipeline.stages`)."""

    def started(self, run: RunDir, tracker: MlflowTracker | None) -> None:
        """The run directory is open and its MLflow run started (rank 0)."""

    def prep(self, cfg: ExperimentConfig) -> dict[str, Any]:
        """Validated data: the prep stats with ``data_dir`` and ``content_hash``."""

    def plan(self, cfg: ExperimentConfig, data_dir: str, content_hash: str) -> dict[str, Any]:
        """The sampler plan's summary with ``plan_path``."""

    def policy(self, cfg: ExperimentConfig, data_dir: str, log: Log) -> dict[str, Any]:
        """The tiny model GRPO starts from, in its cache entry: built and warm-started when missing, its progress
        through ``log`` (:func:`grpo.pipeline.stages.cached_policy`)."""

    def evaluate(self, cfg: ExperimentConfig, model: str, data_dir: str, out_file: str, tag: str) -> dict[str, Any]:
        """Accuracy and pass@k of ``model`` (``"policy"`` or a trained model's directory), written to ``out_file``."""

    def train(self, cfg: ExperimentConfig, run: RunDir, data_dir: str, plan_path: str, resume: bool,
              context: RunContext, log: Log) -> dict[str, Any]:
        """GRPO training on every rank, with the context's trainer callbacks and its tracker's: ``steps``,
        ``seconds``, ``resumed_from``, ``metric_names``, ``reward_curve``, ``model_dir``, ``policy_source``."""

    def finished(self, summary: dict[str, Any]) -> None:
        """The run finished with ``summary`` (rank 0)."""


def run_recipe(cfg: ExperimentConfig, run: RunDir, stages: StageRunner, *, context: RunContext | None = None,
               resume: bool = False, log: Log = print, tags: Mapping[str, Any] | None = None,
               summary_extra: Mapping[str, Any] | None = None) -> dict[str, Any] | None:
    """Run every stage into ``run``; returns the summary (also ``summary.json``) on rank 0, None on the others.
    ``context``: the caller's (see :class:`~grpo.pipeline.run_context.RunContext`); its ``tracker`` is this run's
    while the recipe runs."""
    quiet_library_noise()
    context = context if context is not None else RunContext()
    started = time.perf_counter()
    main = distributed.is_main_process()
    if not main:
        log = lambda *_: None  # noqa: E731 - rank 0 speaks for the run
    tracker = None
    if main:
        tracker = start_run_tracking(cfg, run, tags={"grpo.world_size": str(distributed.launched_world_size()),
                                                     **(tags or {})})
        stages.started(run, tracker)
    context.tracker = tracker
    finished, error, was_finished = False, None, resume and run.summary_file.is_file()
    try:
        summary = _stages(cfg, run, stages, resume, log, context, started, summary_extra or {})
        finished = True
        return summary
    except BaseException as err:
        error = err
        raise
    finally:
        context.tracker = None
        if tracker is not None:
            tracker.close(status=end_status(finished, error, was_finished))


def _stages(cfg: ExperimentConfig, run: RunDir, stages: StageRunner, resume: bool, log: Log, context: RunContext,
            started: float, summary_extra: Mapping[str, Any]) -> dict[str, Any] | None:
    main = distributed.is_main_process()
    tracker = context.tracker

    # 1. Prep: validated Parquet splits and a quarantine, cached on the data config and source contents.
    prep = distributed.decide_on_main(lambda: _checked_prep(stages.prep(cfg), run, resume))
    data_dir = prep["data_dir"]
    log_prep(tracker, prep)
    log(prep_summary(prep))

    # 2. Plan: the prompt schedule for every optimizer step, cached on the data and the batch layout.
    plan = distributed.decide_on_main(lambda: stages.plan(cfg, data_dir, prep["content_hash"]))
    log_plan(tracker, plan)
    log(plan_summary(plan))
    if main:
        run.write_json("inputs.json", {"data_dir": data_dir, "data_content_hash": prep["content_hash"],
                                       "plan_path": plan["plan_path"]})

    # 3. Policy: the tiny model is built and warm-started once per model, data and environment, into the cache.
    if main and cfg.model.is_tiny:
        log(policy_summary(stages.policy(cfg, data_dir, log)))

    # 4. Evaluate the starting policy (kept from the first attempt when resuming).
    before = run.read_json("eval_before.json") if resume else None
    if main and before is None and cfg.evaluation.enabled and cfg.evaluation.before_training:
        before = stages.evaluate(cfg, "policy", data_dir, str(run.path / "eval_before.json"), "before")
    if before is not None:
        log_numbers(tracker, eval_metrics(before), step=0)
        log(f"eval before: accuracy {before['accuracy']:.3f}{_env_line(before)}")

    # 5. GRPO on every rank, resuming from the last checkpoint when there is one.
    trained = stages.train(cfg, run, data_dir, plan["plan_path"], resume, context, log)
    if not main:
        return None

    # 6. Evaluate the trained model, write the summary, attach the artifacts.
    after = None
    if cfg.evaluation.enabled:
        after = stages.evaluate(cfg, trained["model_dir"], data_dir, str(run.path / "eval_after.json"), "after")
        log_numbers(tracker, eval_metrics(after), step=trained["steps"])
        log(f"eval after: accuracy {after['accuracy']:.3f}{_env_line(after)}")
    summary = write_summary(cfg, run, trained, before, after, prep["content_hash"], time.perf_counter() - started,
                            mlflow_run_id=tracker.run_id if tracker is not None else None, **summary_extra)
    if tracker is not None:
        log_run_artifacts(tracker, cfg, run, data_dir, plan["plan_path"], step=trained["steps"])
    stages.finished(summary)
    return summary


def _checked_prep(prep: dict[str, Any], run: RunDir, resume: bool) -> dict[str, Any]:
    """A resumed run continues on the data it started with: refuse when the source's contents changed since."""
    recorded = run.inputs().get("data_content_hash") if resume else None
    if recorded and recorded != prep["content_hash"]:
        raise DataError(f"data.source {prep['source']}: its contents changed since run {run.path.name} started "
                        f"(content {recorded[:12]}, now {prep['content_hash'][:12]}); --resume continues on the same "
                        "data, start a new run instead")
    return prep


def write_summary(cfg: ExperimentConfig, run: RunDir, trained: Mapping[str, Any], before: dict | None,
                  after: dict | None, data_content_hash: str | None, wall_seconds: float, **extra) -> dict[str, Any]:
    """``summary.json``: the run's outcome in one flat record (the same keys on every path)."""
    k = cfg.evaluation.pass_k
    curve = trained["reward_curve"]
    summary = {
        "run_name": run.path.name,
        "run_dir": str(run.path),
        "steps": trained["steps"],
        "data_content_hash": data_content_hash,
        "wall_seconds": round(wall_seconds, 2),
        "train_seconds": round(trained["seconds"], 2),
        "policy_source": trained["policy_source"],
        "resumed_from": trained["resumed_from"],
        "eval_accuracy_before": before["accuracy"] if before else None,
        "eval_accuracy_after": after["accuracy"] if after else None,
        f"eval_pass@{k}_before": before.get(f"pass@{k}") if before else None,
        f"eval_pass@{k}_after": after.get(f"pass@{k}") if after else None,
        "reward_first": curve[0][1] if curve else None,
        "reward_last": curve[-1][1] if curve else None,
        "metrics": trained["metric_names"],
        **_env_figures(before, "before"),
        **_env_figures(after, "after"),
        **extra,
    }
    run.write_json("summary.json", summary)
    return summary


def _env_figures(record: dict | None, when: str) -> dict[str, float]:
    """An environment's evaluation figures as flat summary keys: ``eval_env_tool_call_rate_before``,
    ``eval_env_tool_off_accuracy_after``, ... (none without an environment)."""
    env = (record or {}).get("env", {})
    return {f"eval_env_{key.replace('/', '_')}_{when}": value for key, value in env.items()}


def _env_line(record: dict) -> str:
    """The environment's evaluation figures for the console line (empty without an environment)."""
    env = record.get("env", {})
    return "".join(f", {key} {value:.3f}" for key, value in env.items())
