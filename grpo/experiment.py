"""The whole experiment as one recipe, read top to bottom: data → policy → eval before → GRPO → eval after.

Each stage is a plain function, callable without Prefect; the Prefect flows in ``flows/`` wrap the same functions.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from datasets import DatasetDict

from grpo import distributed
from grpo.config import ExperimentConfig
from grpo.prep import PrepResult, load_prepared, prepare_dataset
from grpo.evaluation import EvalResult, evaluate_policy
from grpo.plan import build_plan, prompt_token_lengths
from grpo.policy import Policy, load_policy
from grpo.rewards import get_reward
from grpo.runs import RunDir
from grpo.train import train_grpo


def prepare_data(cfg: ExperimentConfig, out_dir) -> PrepResult:
    """Validate the data source into train/eval Parquet plus a quarantine of every rejected row (with its rule)."""
    d = cfg.data
    return prepare_dataset(d, out_dir, max_prompt_chars=d.max_prompt_chars, max_answer_chars=d.max_answer_chars,
                           duplicates=d.duplicates, min_rows=d.min_rows)


def evaluate(cfg: ExperimentConfig, policy: Policy, data: DatasetDict) -> EvalResult:
    ev = data["eval"]
    if cfg.evaluation.num_prompts is not None:
        ev = ev.select(range(min(cfg.evaluation.num_prompts, len(ev))))
    return evaluate_policy(
        policy.model,
        policy.tokenizer,
        list(ev["prompt"]),
        list(ev["answer"]),
        get_reward(cfg.evaluation.correctness_reward),
        max_new_tokens=cfg.grpo.max_completion_length,
        batch_size=cfg.evaluation.batch_size,
        pass_k=cfg.evaluation.pass_k,
        pass_k_temperature=cfg.evaluation.pass_k_temperature,
        seed=cfg.grpo.seed,
    )


def _eval_record(result: EvalResult) -> dict:
    return {"accuracy": result.accuracy, f"pass@{result.k}": result.pass_at_k, "num_prompts": result.num_prompts,
            "samples": result.samples}


def run_experiment(
    cfg: ExperimentConfig, run: RunDir, resume: bool = False, log: Callable[[str], None] = print
) -> dict | None:
    """Run every stage into ``run`` and return the summary (also written to ``summary.json``).

    Under a multi-process launch every rank trains; rank 0 alone builds the cached policy first, evaluates and
    writes the summary (other ranks return None).
    """
    started = time.perf_counter()
    main = distributed.is_main_process()
    if not main:
        log = lambda *_: None  # noqa: E731 - rank 0 speaks for the run

    data_dir = run.path / "data"
    if main and not (resume and (data_dir / "stats.json").is_file()):
        prep = prepare_data(cfg, data_dir)
        s = prep.stats
        log(f"data: {s['rows_valid']} valid / {s['rows_quarantined']} quarantined of {s['rows_in']} rows from "
            f"{cfg.data.source} (content {prep.content_hash[:12]})")
    distributed.barrier()
    data = load_prepared(data_dir)

    if main:
        policy = load_policy(cfg, data, log=log)
    distributed.barrier()  # rank 0 built and cached the policy; the others load it from the cache
    if not main:
        policy = load_policy(cfg, data, log=log)

    plan_path = run.path / "plan" / "plan.parquet"
    if main and not plan_path.is_file():
        tokenizer = None if cfg.model.is_tiny else policy.tokenizer
        lengths = prompt_token_lengths(list(data["train"]["prompt"]), tokenizer)
        plan = build_plan(cfg, lengths, plan_path.parent)
        log(f"plan: {plan.generation_rounds} generation rounds, {plan.prompts_per_round} prompts each")
    distributed.barrier()

    before = run.read_json("eval_before.json") if resume else None
    if main and before is None and cfg.evaluation.enabled and cfg.evaluation.before_training:
        before = _eval_record(evaluate(cfg, policy, data))
        run.write_json("eval_before.json", before)
    if before is not None:
        log(f"eval before: accuracy {before['accuracy']:.3f}")

    result = train_grpo(cfg, policy, data["train"], run, resume, plan_path=plan_path)
    log(f"train: {result.steps} steps in {result.seconds:.1f}s")

    if not main:
        return None
    after = None
    if cfg.evaluation.enabled:
        after = _eval_record(evaluate(cfg, policy, data))
        run.write_json("eval_after.json", after)
        log(f"eval after: accuracy {after['accuracy']:.3f}")

    summary = {
        "run_name": run.path.name,
        "run_dir": str(run.path),
        "steps": result.steps,
        "data_content_hash": (run.read_json("data/stats.json") or {}).get("content_hash"),
        "wall_seconds": round(time.perf_counter() - started, 2),
        "train_seconds": round(result.seconds, 2),
        "policy_source": policy.source,
        "policy_cached": policy.cached,
        "resumed_from": result.resumed_from,
        "eval_accuracy_before": before["accuracy"] if before else None,
        "eval_accuracy_after": after["accuracy"] if after else None,
        f"eval_pass@{cfg.evaluation.pass_k}_before": before.get(f"pass@{cfg.evaluation.pass_k}") if before else None,
        f"eval_pass@{cfg.evaluation.pass_k}_after": after.get(f"pass@{cfg.evaluation.pass_k}") if after else None,
        "reward_first": result.reward_curve[0][1] if result.reward_curve else None,
        "reward_last": result.reward_curve[-1][1] if result.reward_curve else None,
        "metrics": result.metric_names,
    }
    run.write_json("summary.json", summary)
    return summary
