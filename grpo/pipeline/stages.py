"""The pipeline's stages as plain functions that pass paths: prep → plan → policy → eval → train → eval.

The recipe (:mod:`grpo.pipeline.recipe`) sequences them; :class:`grpo.pipeline.experiment.LocalStages` calls them
directly and the Prefect flows in ``flows/`` call the same functions as subflows. Each stage reads what the previous one
wrote (Parquet data, a plan file, a model directory) and returns a small JSON-able summary, so nothing large travels
between stages. Prepared data and plans are cached in content-addressed directories (:mod:`grpo.pipeline.cache_dirs`),
the warm-started tiny model in its cache entry (:mod:`grpo.training.policy`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from grpo import distributed
from grpo.algo.plan import prompt_token_lengths
from grpo.config import ExperimentConfig
from grpo.environments import routable_environments
from grpo.environments.chat import config_chat_tools
from grpo.formatting import count
from grpo.paths import locked
from grpo.pipeline.cache_dirs import plan_dir_for, prep_dir_for
from grpo.pipeline.plans import build_plan
from grpo.pipeline.prep import load_prepared, prepare_dataset
from grpo.rewards import get_reward
from grpo.runs import RunDir
from grpo.training.evaluation import EvalResult, evaluate_environment, evaluate_policy
from grpo.training.pace import duration
from grpo.training.policy import Policy, build_tiny_policy, load_policy, plan_tokenizer, trained_policy
from grpo.training.prompts import prompt_texts
from grpo.training.train import train_grpo
from grpo.training.warm_start import Report


def prep_stage(cfg: ExperimentConfig, out_dir: Path) -> dict[str, Any]:
    """Validate the data source into train/eval Parquet plus a quarantine of every rejected row (with its rule)."""
    d = cfg.data
    result = prepare_dataset(d, out_dir, max_prompt_chars=d.max_prompt_chars, max_answer_chars=d.max_answer_chars,
                             duplicates=d.duplicates, min_rows=d.min_rows,
                             environments=routable_environments(cfg.environment))
    return {**result.stats, "data_dir": str(out_dir)}


def cached_prep(cfg: ExperimentConfig, out_dir: Path | None = None) -> dict[str, Any]:
    """The prep stage into its content-addressed directory, or the stats of the complete output already there.
    ``out_dir``: that directory when the caller has it already (:func:`prep_dir_for` hashes the source file)."""
    out_dir = Path(out_dir) if out_dir is not None else prep_dir_for(cfg)
    with locked(out_dir):
        stats = out_dir / "stats.json"
        if stats.is_file():
            return {**json.loads(stats.read_text()), "data_dir": str(out_dir)}
        return prep_stage(cfg, out_dir)


def prep_summary(stats: dict[str, Any]) -> str:
    """The prep stage's console line, the same on every path: rows valid, source, content, and where the
    quarantined rows' reasons are when there are any."""
    line = (f"data: {stats['rows_valid']} of {stats['rows_in']} rows valid from {stats['source']} "
            f"(content {stats['content_hash'][:12]})")
    if stats["rows_quarantined"]:
        line += f", {stats['rows_quarantined']} quarantined (reasons in {Path(stats['data_dir']) / 'quarantine.jsonl'})"
    return line


def policy_stage(cfg: ExperimentConfig, data_dir: Path, log=print) -> Policy:
    """The policy GRPO starts from: the cached tiny model (built and warm-started once) or a hub/local model."""
    return load_policy(cfg, load_prepared(data_dir), log=log)


def cached_policy(cfg: ExperimentConfig, data_dir: str | Path, log=print, report: Report | None = None
                  ) -> dict[str, Any]:
    """The ``policy`` stage: the tiny model GRPO starts from, built and warm-started into its cache entry when
    missing (once per model, data and environment), its progress through ``log`` and ``report``; the stages after
    it load the entry. See :func:`grpo.training.policy.build_tiny_policy` for the record."""
    return build_tiny_policy(cfg, load_prepared(Path(data_dir)), log=log, report=report)


def policy_summary(record: dict[str, Any]) -> str:
    """The policy stage's console line: where the tiny model is, and how it got there."""
    if record["origin"] == "built":
        how = "warm-started" if record["warm_start_steps"] else "built (no warm start)"
        return f"policy: tiny model {how} in {duration(record['seconds'])}, cached in {record['source']}"
    if record["origin"] == "shipped":
        return f"policy: tiny model shipped with the platform for this preset, copied into {record['source']}"
    return f"policy: tiny model from the cache, {record['source']}"


def plan_stage(cfg: ExperimentConfig, data_dir: Path, out_dir: Path, tokenizer=None,
               overwrite: bool = False) -> dict[str, Any]:
    """Write the prompt schedule over the prepared train rows (``plan.parquet`` + ``plan.json``); see
    :mod:`grpo.algo.plan`. ``grpo plan`` calls this too, on the data :func:`cached_prep` prepared for the config (the
    rows a run trains on)."""
    prompts = list(load_prepared(data_dir)["train"]["prompt"])
    tokenizer = None if cfg.model.is_tiny else tokenizer
    texts = prompts if tokenizer is None else prompt_texts(prompts, tokenizer, config_chat_tools(cfg.environment))
    summary = build_plan(cfg, prompt_token_lengths(texts, tokenizer), out_dir, overwrite=overwrite)
    return {**summary.to_dict(), "plan_path": str(out_dir / "plan.parquet")}


def cached_plan(cfg: ExperimentConfig, data_dir: str | Path, content_hash: str, out_dir: Path | None = None
                ) -> dict[str, Any]:
    """The plan stage into its content-addressed directory (tokenizer loaded here for a hub/local model), or the
    summary of the complete plan already there. ``out_dir``: that directory when the caller has it already."""
    out_dir = Path(out_dir) if out_dir is not None else plan_dir_for(cfg, content_hash)
    with locked(out_dir):
        summary = out_dir / "plan.json"
        if summary.is_file():
            return {**json.loads(summary.read_text()), "plan_path": str(out_dir / "plan.parquet")}
        return plan_stage(cfg, Path(data_dir), out_dir, plan_tokenizer(cfg))


def plan_summary(plan: dict[str, Any]) -> str:
    """The plan stage's console line."""
    return (f"plan: {count(plan['optimizer_steps'], 'optimizer step')} in "
            f"{count(plan['generation_rounds'], 'generation round')} of {count(plan['prompts_per_round'], 'prompt')} "
            f"({count(plan['epochs'], 'epoch')})")


def evaluate_model(cfg: ExperimentConfig, model: str, data_dir: str | Path, out_file: str | Path) -> dict[str, Any]:
    """Evaluate ``model``: ``"policy"`` for the policy GRPO starts from, or a trained model's directory."""
    policy = (trained_policy(Path(model)) if model != "policy"
              else policy_stage(cfg, Path(data_dir), log=lambda *_: None))
    return eval_stage(cfg, policy, Path(data_dir), Path(out_file))


def eval_stage(cfg: ExperimentConfig, policy: Policy, data_dir: Path, out_file: Path) -> dict[str, Any]:
    """Greedy accuracy and pass@k on the held-out split, with an environment its figures too (``env``: turns, tool
    calls, sampled success, the evaluation variants); writes ``out_file`` (with sample completions or episodes)."""
    ev = load_prepared(data_dir)["eval"]
    if cfg.evaluation.num_prompts is not None:
        ev = ev.select(range(min(cfg.evaluation.num_prompts, len(ev))))
    result: EvalResult
    if cfg.environment.enabled:
        env = cfg.environment
        result = evaluate_environment(
            policy.model, policy.tokenizer, list(ev["prompt"]), ev.to_list(), env.name, kwargs=env.kwargs,
            variants=cfg.evaluation.environment_variants, max_turns=env.max_turns,
            max_completion_length=cfg.grpo.max_completion_length, batch_size=cfg.evaluation.batch_size,
            pass_k=cfg.evaluation.pass_k, pass_k_temperature=cfg.evaluation.pass_k_temperature, seed=cfg.grpo.seed,
            step_timeout=env.step_timeout, max_workers=env.max_concurrency, protocol=env.protocol, tools=env.tools,
            correctness=get_reward(cfg.evaluation.correctness_reward),
        )
    else:
        result = evaluate_policy(
            policy.model, policy.tokenizer, list(ev["prompt"]), list(ev["answer"]),
            get_reward(cfg.evaluation.correctness_reward),
            max_new_tokens=cfg.grpo.max_completion_length, batch_size=cfg.evaluation.batch_size,
            pass_k=cfg.evaluation.pass_k, pass_k_temperature=cfg.evaluation.pass_k_temperature, seed=cfg.grpo.seed,
        )
    record = {"accuracy": result.accuracy, f"pass@{result.k}": result.pass_at_k, "num_prompts": result.num_prompts,
              "samples": result.samples}
    if result.env:
        record["env"] = result.env
    out_file.parent.mkdir(parents=True, exist_ok=True)
    out_file.write_text(json.dumps(record, indent=2))
    return record


def train_stage(cfg: ExperimentConfig, run: RunDir, data_dir: str | Path, plan_path: str | Path, resume: bool,
                callbacks: Sequence[Any] = (), log: Callable[[str], None] = print) -> dict[str, Any]:
    """GRPO into ``run`` on every rank, from the last checkpoint when there is one (a retried attempt resumes).
    Rank 0 loads the starting policy first (building the cached tiny model once), then the other ranks."""
    resume = resume or run.latest_checkpoint() is not None
    main = distributed.is_main_process()
    policy = policy_stage(cfg, Path(data_dir), log=log) if main else None
    distributed.barrier()
    if not main:
        policy = policy_stage(cfg, Path(data_dir), log=log)
    result = train_grpo(cfg, policy, load_prepared(Path(data_dir))["train"], run, resume, plan_path=Path(plan_path),
                        callbacks=list(callbacks), echo=log)
    return {**dataclasses.asdict(result), "model_dir": str(run.model_dir), "policy_source": policy.source}
