"""The whole experiment as one recipe, read top to bottom: prep → policy → plan → eval → GRPO → eval.

This is the in-process recipe (also what every rank runs under ``torchrun``); the Prefect pipeline in
``flows/pipeline.py`` runs the same stages from :mod:`grpo.stages` as subflows.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from collections.abc import Callable

from grpo import distributed
from grpo.console import quiet_library_noise
from grpo.config import ExperimentConfig
from grpo.prep import load_prepared
from grpo.run_tracking import end_status, eval_metrics, log_numbers, log_run_artifacts, log_prep, plan_metrics, start_run_tracking
from grpo.runs import RunDir
from grpo.stages import eval_stage, plan_stage, policy_stage, prep_stage, prep_summary, trained_policy
from grpo.tracking import MlflowCallback
from grpo.train import TrainResult, train_grpo


def run_experiment(
    cfg: ExperimentConfig, run: RunDir, resume: bool = False, log: Callable[[str], None] = print, callbacks=()
) -> dict | None:
    """Run every stage into ``run`` and return the summary (also written to ``summary.json``).

    Under a multi-process launch every rank trains; rank 0 alone prepares data, builds the cached policy, plans,
    evaluates and writes the summary (other ranks return None).
    """
    quiet_library_noise()
    started = time.perf_counter()
    main = distributed.is_main_process()
    if not main:
        log = lambda *_: None  # noqa: E731 - rank 0 speaks for the run
    # Rank 0 tracks the run in MLflow, as the Prefect pipeline does (same names; see grpo/run_tracking.py).
    tracker = start_run_tracking(cfg, run, tags={"grpo.world_size": str(distributed.launched_world_size())}) if main else None
    finished, error, was_finished = False, None, resume and run.summary_file.is_file()
    try:
        summary = _stages(cfg, run, resume, log, main, tracker, callbacks, started)
        finished = True
        return summary
    except BaseException as err:
        error = err
        raise
    finally:
        if tracker is not None:
            tracker.close(status=end_status(finished, error, was_finished))


def _stages(cfg, run, resume, log, main, tracker, callbacks, started) -> dict | None:
    data_dir = run.path / "data"
    if main and not (resume and (data_dir / "stats.json").is_file()):
        stats = prep_stage(cfg, data_dir)
        log_prep(tracker, stats)
        log(prep_summary(stats))
    distributed.barrier()

    if main:
        policy = policy_stage(cfg, data_dir, log=log)
    distributed.barrier()  # rank 0 built and cached the policy; the others load it from the cache
    if not main:
        policy = policy_stage(cfg, data_dir, log=log)

    plan_path = run.path / "plan" / "plan.parquet"
    if main and not plan_path.is_file():
        plan = plan_stage(cfg, data_dir, plan_path.parent, policy.tokenizer)
        log_numbers(tracker, plan_metrics(plan))
        log(f"plan: {plan['generation_rounds']} generation rounds, {plan['prompts_per_round']} prompts each")
        run.write_json("inputs.json", {"data_dir": str(data_dir), "data_content_hash": plan.get("dataset_sha256"),
                                       "plan_path": str(plan_path)})
    distributed.barrier()

    before = run.read_json("eval_before.json") if resume else None
    if main and before is None and cfg.evaluation.enabled and cfg.evaluation.before_training:
        before = eval_stage(cfg, policy, data_dir, run.path / "eval_before.json")
    if before is not None:
        log_numbers(tracker, eval_metrics(before, "before"), step=0)
        log(f"eval before: accuracy {before['accuracy']:.3f}")

    callbacks = [*callbacks, *([MlflowCallback(tracker)] if tracker is not None else [])]
    result = train_grpo(cfg, policy, load_prepared(data_dir)["train"], run, resume, plan_path=plan_path,
                        callbacks=callbacks, echo=log)
    if not main:
        return None

    after = None
    if cfg.evaluation.enabled:
        after = eval_stage(cfg, trained_policy(run.model_dir), data_dir, run.path / "eval_after.json")
        log_numbers(tracker, eval_metrics(after, "after"), step=result.steps)
        log(f"eval after: accuracy {after['accuracy']:.3f}")
    summary = write_summary(cfg, run, result, before, after, policy.source, time.perf_counter() - started,
                            mlflow_run_id=tracker.run_id if tracker is not None else None)
    if tracker is not None:
        log_run_artifacts(tracker, cfg, run, data_dir, plan_path)
    return summary


def write_summary(cfg: ExperimentConfig, run: RunDir, result: TrainResult, before: dict | None, after: dict | None,
                  policy_source: str, wall_seconds: float, **extra) -> dict:
    k = cfg.evaluation.pass_k
    summary = {
        "run_name": run.path.name,
        "run_dir": str(run.path),
        "steps": result.steps,
        "data_content_hash": _data_content_hash(run),
        "wall_seconds": round(wall_seconds, 2),
        "train_seconds": round(result.seconds, 2),
        "policy_source": policy_source,
        "resumed_from": result.resumed_from,
        "eval_accuracy_before": before["accuracy"] if before else None,
        "eval_accuracy_after": after["accuracy"] if after else None,
        f"eval_pass@{k}_before": before.get(f"pass@{k}") if before else None,
        f"eval_pass@{k}_after": after.get(f"pass@{k}") if after else None,
        "reward_first": result.reward_curve[0][1] if result.reward_curve else None,
        "reward_last": result.reward_curve[-1][1] if result.reward_curve else None,
        "metrics": result.metric_names,
        **extra,
    }
    run.write_json("summary.json", summary)
    return summary


def _data_content_hash(run: RunDir) -> str | None:
    """The content hash of the prepared data this run trained on: ``inputs.json`` names the data directory (the
    run's own ``data/`` in-process, the shared prep cache under Prefect) and its ``stats.json`` holds the hash."""
    data_dir = run.inputs().get("data_dir")
    stats = Path(data_dir) / "stats.json" if data_dir else None
    return json.loads(stats.read_text()).get("content_hash") if stats is not None and stats.is_file() else None
