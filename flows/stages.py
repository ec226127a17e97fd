"""One Prefect flow per pipeline stage, each a short recipe over :mod:`grpo.pipeline.stages`.

Prep and plan are cached across runs on their inputs and the code that computes them (a changed training field
reuses them); prep and eval retry on transient failure; training never retries blindly: a new attempt resumes
from the last checkpoint. Every stage leaves artifacts in Prefect: a markdown summary, tables, training progress.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from prefect import flow, task
from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from transformers import TrainerCallback

import grpo.pipeline.stages
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
    return grpo.pipeline.stages.cached_prep(config, Path(out_dir))  # out_dir: prep_flow already hashed the source


@flow(name="grpo-prep", flow_run_name="prep")
def prep_flow(config: ExperimentConfig) -> dict:
    """Validate and prepare the dataset (cached on the data config, source contents and prep code; the prep task
    retries transient faults only)."""
    out_dir = prep_dir_for(config)
    # a cached result points at a directory; if that was deleted, recompute instead of returning a dangling path
    task_ = prepare_task.with_options(refresh_cache=not _complete(out_dir, "stats.json"))
    stats = task_(config.data.model_dump(mode="json"), str(out_dir), config)
    create_markdown_artifact(
        key="dataset-prep",
        markdown=(f"## Dataset prep\n\nSource `{config.data.source}` → `{out_dir}`\n\n"
                  f"- rows in: **{stats['rows_in']}**, valid: **{stats['rows_valid']}**, "
                  f"quarantined: **{stats['rows_quarantined']}**\n- content hash: `{stats['content_hash']}`\n"),
        description="Dataset prep summary",
    )
    create_table_artifact(
        key="dataset-stats",
        table=[{"split": s, **v} for s, v in stats["splits"].items()]
        + [{"split": f"rule: {r}", "rows_quarantined": n} for r, n in stats.get("rules", {}).items()],
        description="Rows per split and quarantine rules",
    )
    return stats


@task(name="write-plan", cache_key_fn=_cached_dir_key("plan", PLAN_CODE), persist_result=True)
def plan_task(plan_key: str, data_dir: str, out_dir: str, config: ExperimentConfig, data_hash: str) -> dict:
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
    create_markdown_artifact(
        key="sampler-plan",
        markdown=(f"## Sampler plan\n\n`{plan['plan_path']}`\n\n- optimizer steps: {plan['optimizer_steps']}\n"
                  f"- generation rounds: {plan['generation_rounds']} × {plan['prompts_per_round']} prompts\n"
                  f"- epochs: {plan['epochs']}\n"),
        description="Sampler plan summary",
    )
    return plan


class PrefectProgress(TrainerCallback):
    """Keeps a Prefect progress artifact at the fraction of optimizer steps done."""

    def __init__(self) -> None:
        self.artifact_id = None

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            self.artifact_id = create_progress_artifact(progress=0.0, key="training-progress",
                                                        description="GRPO optimizer steps done (%)")

    def on_step_end(self, args, state, control, **kwargs):
        if self.artifact_id is not None and state.max_steps:
            update_progress_artifact(self.artifact_id, progress=100.0 * state.global_step / state.max_steps)


@flow(name="grpo-eval", flow_run_name="eval-{tag}", retries=2, retry_delay_seconds=5)
def eval_flow(config: ExperimentConfig, model_source: str, data_dir: str, out_file: str, tag: str) -> dict:
    """Greedy accuracy and pass@k of a model on the held-out split."""
    record = grpo.pipeline.stages.evaluate_model(config, model_source, data_dir, out_file)
    k = config.evaluation.pass_k
    create_table_artifact(key=f"eval-samples-{tag}", table=record["samples"],
                          description=f"Sample completions ({tag} training)")
    create_markdown_artifact(
        key=f"eval-{tag}",
        markdown=f"## Evaluation ({tag} training)\n\n- accuracy: **{record['accuracy']:.3f}**\n"
                 + (f"- pass@{k}: **{record[f'pass@{k}']:.3f}**\n" if record.get(f"pass@{k}") is not None else ""),
    )
    return record


def summarize_for_ui(summary: dict[str, Any]) -> str:
    lines = ["## GRPO run", ""]
    for key in ("run_name", "steps", "eval_accuracy_before", "eval_accuracy_after", "wall_seconds",
                "mlflow_run_id", "prefect_flow_run_id"):
        if summary.get(key) is not None:
            lines.append(f"- {key}: `{summary[key]}`")
    return "\n".join(lines)


__all__ = ["prep_flow", "plan_flow", "eval_flow", "PrefectProgress", "RunDir", "summarize_for_ui"]
