"""The pipeline's stages as plain functions that pass paths: prep → plan → train → eval.

``grpo.experiment.run_experiment`` calls them in order in one process; the Prefect flows in ``flows/`` call the same
functions as subflows. Each stage reads what the previous one wrote (Parquet data, a plan file, a model
directory) and returns a small JSON-able summary, so nothing large travels between stages.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from grpo.config import ExperimentConfig
from grpo.evaluation import EvalResult, evaluate_policy
from grpo.plan import build_plan, prompt_token_lengths
from grpo.policy import Policy, load_policy
from grpo.prep import load_prepared, prepare_dataset
from grpo.rewards import get_reward


def prep_stage(cfg: ExperimentConfig, out_dir: Path) -> dict[str, Any]:
    """Validate the data source into train/eval Parquet plus a quarantine of every rejected row (with its rule)."""
    d = cfg.data
    result = prepare_dataset(d, out_dir, max_prompt_chars=d.max_prompt_chars, max_answer_chars=d.max_answer_chars,
                             duplicates=d.duplicates, min_rows=d.min_rows)
    return {**result.stats, "data_dir": str(out_dir)}


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


def plan_stage(cfg: ExperimentConfig, data_dir: Path, out_dir: Path, tokenizer=None) -> dict[str, Any]:
    """Write the prompt schedule for training (``plan.parquet`` + ``plan.json``); see :mod:`grpo.plan`."""
    prompts = list(load_prepared(data_dir)["train"]["prompt"])
    summary = build_plan(cfg, prompt_token_lengths(prompts, None if cfg.model.is_tiny else tokenizer), out_dir)
    return {**summary.to_dict(), "plan_path": str(out_dir / "plan.parquet")}


def eval_stage(cfg: ExperimentConfig, policy: Policy, data_dir: Path, out_file: Path) -> dict[str, Any]:
    """Greedy accuracy and pass@k on the held-out split; writes ``out_file`` (with sample completions)."""
    ev = load_prepared(data_dir)["eval"]
    if cfg.evaluation.num_prompts is not None:
        ev = ev.select(range(min(cfg.evaluation.num_prompts, len(ev))))
    result: EvalResult = evaluate_policy(
        policy.model, policy.tokenizer, list(ev["prompt"]), list(ev["answer"]),
        get_reward(cfg.evaluation.correctness_reward),
        max_new_tokens=cfg.grpo.max_completion_length, batch_size=cfg.evaluation.batch_size,
        pass_k=cfg.evaluation.pass_k, pass_k_temperature=cfg.evaluation.pass_k_temperature, seed=cfg.grpo.seed,
    )
    record = {"accuracy": result.accuracy, f"pass@{result.k}": result.pass_at_k, "num_prompts": result.num_prompts,
              "samples": result.samples}
    out_file.parent.mkdir(parents=True, exist_ok=True)
    out_file.write_text(json.dumps(record, indent=2))
    return record


def trained_policy(model_dir: Path) -> Policy:
    """The model a training stage saved, for evaluation."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo.policy import MODEL_LOCK

    with MODEL_LOCK:
        model = AutoModelForCausalLM.from_pretrained(model_dir,
                                                     dtype="auto" if torch.cuda.is_available() else torch.float32)
        return Policy(model, AutoTokenizer.from_pretrained(model_dir), str(model_dir), True, 0.0, [])
