"""One Prefect flow per pipeline stage, each a short recipe over :mod:`grpo.pipeline.stages`.

Prep and plan are cached across runs on their inputs and the code that computes them (a changed training field
reuses them); prep and eval retry on transient failure; training never retries blindly: a new attempt resumes
from the last checkpoint. Every stage leaves artifacts in Prefect: a markdown summary, tables, training progress
(:mod:`flows.progress`).

The stages' own code (:mod:`grpo.pipeline.stages`: the training stack) is imported when a stage runs, not with this
module: ``grpo serve`` and ``grpo deploy`` import the flows to build their deployments and forms, and a served
deployment's flow run imports what it runs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from grpo.config import ExperimentConfig
from grpo.errors import GRPOPlatformError
from grpo.pipeline.cache_dirs import PLAN_CODE, PREP_CODE, plan_dir_for, prep_dir_for, stage_key
from grpo.runs import RunDir


def _cached_dir_key(kind: str, modules: tuple):
    """Cache key = the stage's own inputs (not the whole config) + the source code that computes it."""

    def key_fn(context, parameters) -> str:
        payload = {k: v for k, v in parameters.items() if k != "config"}
        return stage_key(kind, json.loads(json.dumps(payload, default=str)), modules)

    return key_fn


def _complete(out_dir: Path, marker: str) -> bool:
    return (out_dir / marker).is_file()


def transient(task, task_run, state) -> bool:
    """Retry condition: only faults that may pass (I/O, a flaky hub); never an input error (:class:`DataError`,
    :class:`ConfigError`), which would fail the same way again after the delay."""
    return not isinstance(state.data, GRPOPlatformError)


@task(name="prepare-dataset", cache_key_fn=_cached_dir_key("prep", PREP_CODE), persist_result=True, retries=2,
      retry_delay_seconds=5, retry_condition_fn=transient)
def prepare_task(data_config: dict, out_dir: str, config: ExperimentConfig) -> dict:
    import grpo.pipeline.stages

    return grpo.pipeline.stages.cached_prep(config, Path(out_dir))  # out_dir: prep_flow already hashed the source


@flow(name="grpo-prep", flow_run_name="prep")
def prep_flow(config: ExperimentConfig) -> dict:
    """Validate and prepare the dataset (cached on the data config, source contents and prep code; the prep task
    retries transient faults only)."""
    out_dir = prep_dir_for(config)
    # a cached result points at a directory; if that was deleted, recompute instead of returning a dangling path
    task_ = prepare_task.with_options(refresh_cache=not _complete(out_dir, "stats.json"))
    stats = task_(config.data.model_dump(mode="json"), str(out_dir), config)
    create_markdown_artifact(key="dataset-prep", markdown=f"## Dataset prep\n\n{dataset_summary(config, stats)}",
                             description="Dataset prep summary")
    create_table_artifact(key="dataset-stats", table=dataset_table(stats),
                          description="Rows per split and quarantine rules")
    return stats


def dataset_summary(config: ExperimentConfig, stats: dict) -> str:
    """The prep summary in markdown (the prep subflow's artifact, and the pipeline flow run's dataset table's
    description)."""
    quarantine = (f" (reasons in `{Path(stats['data_dir']) / 'quarantine.jsonl'}`)"
                  if stats.get("rows_quarantined") else "")
    return (f"Source `{config.data.source}` → `{stats['data_dir']}`\n\n"
            f"- rows in: **{stats['rows_in']}**, valid: **{stats['rows_valid']}**, "
            f"quarantined: **{stats['rows_quarantined']}**{quarantine}\n- content hash: `{stats['content_hash']}`\n")


def dataset_table(stats: dict) -> list[dict]:
    """Rows per split, then one row per quarantine rule with the rows it rejected."""
    return ([{"split": s, **v} for s, v in stats["splits"].items()]
            + [{"split": f"rule: {r}", "rows_quarantined": n} for r, n in stats.get("rules", {}).items()])


@task(name="write-plan", cache_key_fn=_cached_dir_key("plan", PLAN_CODE), persist_result=True)
def plan_task(plan_key: str, data_dir: str, out_dir: str, config: ExperimentConfig, data_hash: str) -> dict:
    import grpo.pipeline.stages

    return grpo.pipeline.stages.cached_plan(config, data_dir, data_hash, Path(out_dir))


@flow(name="grpo-plan", flow_run_name="plan")
def plan_flow(config: ExperimentConfig, data_dir: str, data_hash: str) -> dict:
    """Write the sampler plan (cached on data, sampling/batch fields and plan code)."""
    out_dir = plan_dir_for(config, data_hash)
    task_ = plan_task.with_options(refresh_cache=not _complete(out_dir, "plan.json"))
    plan = task_(out_dir.name, data_dir, str(out_dir), config, data_hash)
    imbalance = plan.get("predicted_imbalance", {})
    create_table_artifact(
        key="plan-balance",
        table=[{"order": k, **{kk: vv for kk, vv in v.items() if not isinstance(vv, (dict, list))}}
               for k, v in imbalance.items() if isinstance(v, dict)] or [{"order": "n/a"}],
        description="Predicted per-rank token imbalance (max/mean)",
    )
    create_markdown_artifact(key="sampler-plan", markdown=plan_markdown(plan), description="Sampler plan summary")
    return plan


def plan_markdown(plan: dict) -> str:
    """The plan summary (on the plan subflow, and repeated on the pipeline's own flow run)."""
    return (f"## Sampler plan\n\n`{plan['plan_path']}`\n\n- optimizer steps: {plan['optimizer_steps']}\n"
            f"- generation rounds: {plan['generation_rounds']} × {plan['prompts_per_round']} prompts\n"
            f"- epochs: {plan['epochs']}\n")


@flow(name="grpo-policy", flow_run_name="policy")
def policy_flow(config: ExperimentConfig, data_dir: str) -> dict:
    """The tiny model GRPO starts from, built and warm-started into the cache when missing (once per model, data and
    environment): its progress in the log and in a progress artifact here and on the pipeline's run."""
    from prefect.runtime import flow_run

    import grpo.pipeline.stages
    from flows.progress import RunProgress

    parent = flow_run.parent_flow_run_id
    report = RunProgress("warm-start-progress", str(parent) if parent else None)
    return grpo.pipeline.stages.cached_policy(config, data_dir, log=get_run_logger().info, report=report)


@flow(name="grpo-eval", flow_run_name="eval-{tag}", retries=2, retry_delay_seconds=5)
def eval_flow(config: ExperimentConfig, model_source: str, data_dir: str, out_file: str, tag: str) -> dict:
    """Greedy accuracy and pass@k of a model on the held-out split."""
    import grpo.pipeline.stages

    record = grpo.pipeline.stages.evaluate_model(config, model_source, data_dir, out_file)
    k = config.evaluation.pass_k
    create_table_artifact(key=f"eval-samples-{tag}", table=record["samples"],
                          description=f"Sample completions ({tag} training)")
    create_markdown_artifact(
        key=f"eval-{tag}",
        markdown=f"## Evaluation ({tag} training)\n\n- accuracy: **{record['accuracy']:.3f}**\n"
                 + (f"- pass@{k}: **{record[f'pass@{k}']:.3f}**\n" if record.get(f"pass@{k}") is not None else "")
                 + "".join(f"- environment {name}: **{value:.3f}**\n" for name, value in record.get("env", {}).items()),
    )
    return record


def summarize_for_ui(summary: dict[str, Any]) -> str:
    """The pipeline flow run's summary artifact: the outcome first (eval accuracy, pass@k, an environment's figures
    and reward, before and after), then where it came from (steps, data, times, MLflow run)."""
    def num(v: Any, digits: int = 3) -> str:
        return "—" if v is None else f"{v:.{digits}f}" if isinstance(v, float) else str(v)

    def change(before: Any, after: Any) -> str:
        delta = (f" ({after - before:+.3f})"
                 if isinstance(before, (int, float)) and isinstance(after, (int, float)) else "")
        return f"{num(before)} → **{num(after)}**{delta}"

    rows = [("eval accuracy", change(summary.get("eval_accuracy_before"), summary.get("eval_accuracy_after")))]
    for key in sorted(summary):
        if key.startswith("eval_pass@") and key.endswith("_before"):
            k = key.removeprefix("eval_").removesuffix("_before")
            if summary.get(key) is not None or summary.get(f"eval_{k}_after") is not None:
                rows.append((k, change(summary.get(key), summary.get(f"eval_{k}_after"))))
    for key in sorted(summary):  # the environment's figures (#30): success per variant, turns, tool calls
        if key.startswith("eval_env_") and key.endswith("_before"):
            name = key.removeprefix("eval_env_").removesuffix("_before")
            rows.append((f"environment: {name}", change(summary.get(key), summary.get(f"eval_env_{name}_after"))))
    rows += [("reward (first → last logged step)", change(summary.get("reward_first"), summary.get("reward_last"))),
             ("optimizer steps", num(summary.get("steps"))
              + (f" (resumed from `{Path(summary['resumed_from']).name}`)" if summary.get("resumed_from") else "")),
             ("training / whole run",
              f"{num(summary.get('train_seconds'), 1)} s / {num(summary.get('wall_seconds'), 1)} s"),
             ("data content hash", f"`{str(summary.get('data_content_hash') or '—')[:12]}`"),
             ("run directory", f"`{summary.get('run_dir', '—')}`"),
             ("MLflow run", f"`{summary.get('mlflow_run_id') or '— (tracking off)'}`")]
    table = "\n".join(f"| {name} | {value} |" for name, value in rows)
    return f"## GRPO run `{summary.get('run_name', '')}`\n\n| measure | value |\n| --- | --- |\n{table}\n"


__all__ = ["prep_flow", "plan_flow", "policy_flow", "eval_flow", "RunDir", "dataset_summary", "dataset_table",
           "plan_markdown", "summarize_for_ui"]
