"""``python -m benchmarks time_to_accuracy``: training time until held-out greedy accuracy reaches a target, our
GRPOTrainer (its speed features on, both by default and both exact: zero-advantage compaction and the shared-prompt
forward, which runs each group's prompt once in the log-prob forward and in generation's prefill) versus stock
``trl.GRPOTrainer``.

How users judge a GRPO stack: not steps per second but wall time to a given accuracy. Both trainers start from the same
warm-started tiny policy on the default task with the same data, seed and hyperparameters (the tiny preset). Every
``BENCH_EVAL_EVERY`` optimizer steps the run pauses its clock, measures greedy accuracy on a fixed subset of the
held-out split and stops once it is >= ``BENCH_TARGET``; evaluation time is excluded for both. Runs alternate (seed 0:
ours then TRL; seed 1: TRL then ours) so machine noise hits both alike.

Reported: the ratio of median training seconds to target (ours / TRL; goal <= 0.6), steps to target for both (sample
efficiency apart from step speed), the final accuracy of both, and the per-step time ratio at equal steps (training
seconds to the last step both runs reached).

A third trainer, ``ours_async``, is its own row, not the default: ours with the CPU generator process producing the
next round while this one trains (``benchmarks.async_overlap``'s settings: one round ahead, ``max_staleness`` 1, the
IS correction on). It is not exact (a round samples from weights one step old), so its accuracy curve may differ
from TRL's; its ratio says what overlapping generation with training adds on top of the exact defaults. Its
generator starts with the trainer, before the clock (``on_train_begin``), as a long run amortises it.

Environment: BENCH_TARGET (0.90), BENCH_EVAL_EVERY (25), BENCH_EVAL_PROMPTS (256), BENCH_MAX_STEPS (500), BENCH_SEEDS
(2), BENCH_ASYNC (1: run the ``ours_async`` row; 0: skip it). ``--smoke``: at most 2 steps of 64 completions, an
evaluation every step on 16 prompts, target 0.0 (reached at the first evaluation), 1 seed.
"""

from __future__ import annotations

import copy
import os
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks._sizes import TINY_SMOKE_OVERRIDES, size
from benchmarks.async_overlap import ASYNC


def main(smoke: bool = False) -> dict:
    target = size("BENCH_TARGET", 0.90, 0.0, smoke)
    eval_every = size("BENCH_EVAL_EVERY", 25, 1, smoke)
    eval_prompts = size("BENCH_EVAL_PROMPTS", 256, 16, smoke)
    max_steps = size("BENCH_MAX_STEPS", 500, 2, smoke)
    seeds = size("BENCH_SEEDS", 2, 1, smoke)
    with_async = bool(size("BENCH_ASYNC", 1, 1, smoke))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import trl
    from transformers import PrinterCallback, TrainerCallback, set_seed

    from grpo.config import load_config
    from grpo.pipeline.data import load_data
    from grpo.rewards import get_reward
    from grpo.training.evaluation import evaluate_policy
    from grpo.training.policy import load_policy
    from grpo.training.train import grpo_args
    from grpo.training.trainer import GRPOTrainer

    out = Path(tempfile.mkdtemp(prefix="bench-tta-"))
    base = [f"output_dir={out}", f"grpo.max_steps={max_steps}", f"grpo.logging_steps={eval_every}",
            *(TINY_SMOKE_OVERRIDES if smoke else [])]
    cfg = load_config("tiny", base)
    data = load_data(cfg)
    policy = load_policy(cfg, data, log=lambda *_: None)
    held_out = data["eval"].select(range(min(eval_prompts, len(data["eval"]))))
    prompts, answers = list(held_out["prompt"]), list(held_out["answer"])
    correctness = get_reward(cfg.evaluation.correctness_reward)

    class EvalClock(TrainerCallback):
        """Training seconds (evaluation excluded) and greedy accuracy every ``eval_every`` steps; stops at target."""

        def __init__(self, trainer) -> None:
            self.trainer, self.evals, self.paused = trainer, [], 0.0

        def on_train_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step % eval_every and state.global_step < args.max_steps:
                return
            pause = time.perf_counter()
            model = self.trainer.model
            model.eval()
            accuracy = evaluate_policy(model, self.trainer.processing_class, prompts, answers, correctness,
                                       max_new_tokens=cfg.grpo.max_completion_length,
                                       batch_size=cfg.evaluation.batch_size).accuracy
            model.train()
            self.evals.append((state.global_step, pause - self.start - self.paused, accuracy))
            self.paused += time.perf_counter() - pause
            if accuracy >= target:
                control.should_training_stop = True

    def one(trainer_cls, tag: str, seed: int) -> dict:
        run_cfg = load_config("tiny", [*base, f"grpo.seed={seed}", *(ASYNC if tag == "ours_async" else [])])
        set_seed(seed)
        args = grpo_args(run_cfg, out / f"{tag}-{seed}")
        args.save_strategy, args.disable_tqdm = "no", True
        extra = {"experiment": run_cfg} if trainer_cls is GRPOTrainer else {}
        trainer = trainer_cls(model=copy.deepcopy(policy.model), processing_class=policy.tokenizer,
                              reward_funcs=[get_reward(n) for n in run_cfg.grpo.reward_funcs], args=args,
                              train_dataset=data["train"], **extra)
        trainer.remove_callback(PrinterCallback)  # the log dicts Trainer prints without tqdm: noise here
        clock = EvalClock(trainer)
        trainer.add_callback(clock)
        try:
            trainer.train()
        finally:
            if hasattr(trainer, "close_producer"):
                trainer.close_producer(wait=False)  # the async row's generator process
        reached = next(((s, t) for s, t, a in clock.evals if a >= target), None)

        def mean_of(metric: str) -> float | None:
            values = [h[metric] for h in trainer.state.log_history if metric in h]
            return round(statistics.mean(values), 3) if values else None

        return {"trainer": tag, "seed": seed, "evals": [[s, round(t, 3), a] for s, t, a in clock.evals],
                "steps_to_target": reached[0] if reached else None,
                "train_s_to_target": round(reached[1], 3) if reached else None,
                "final_accuracy": clock.evals[-1][2] if clock.evals else None,
                "compaction_rows_skipped_frac": mean_of("compaction/rows_skipped_frac"),
                "shared_prompt_forwards_frac": mean_of("shared_prompt/prompt_forwards_frac")}

    runs = []
    for seed in range(seeds):
        order = [(GRPOTrainer, "ours"), (trl.GRPOTrainer, "trl")]
        order += [(GRPOTrainer, "ours_async")] if with_async else []
        for trainer_cls, tag in order if seed % 2 == 0 else order[::-1]:
            runs.append(one(trainer_cls, tag, cfg.grpo.seed + seed))

    def median_of(tag: str, key: str):
        values = [r[key] for r in runs if r["trainer"] == tag]
        return statistics.median(values) if values and None not in values else None

    def step_ratio(tag: str) -> float | None:
        """The median over seeds of ``tag``'s training seconds over TRL's at the last step both reached."""
        ratios = []
        for seed in {r["seed"] for r in runs}:
            ours, theirs = ({s: t for s, t, _ in r["evals"]} for want in (tag, "trl") for r in runs
                            if r["trainer"] == want and r["seed"] == seed)
            common = max(set(ours) & set(theirs), default=None)
            if common:
                ratios.append(ours[common] / theirs[common])
        return round(statistics.median(ratios), 3) if ratios else None

    def time_ratio(tag: str) -> float | None:
        ours_s, trl_s = median_of(tag, "train_s_to_target"), median_of("trl", "train_s_to_target")
        return round(ours_s / trl_s, 3) if ours_s and trl_s else None

    ratio = time_ratio("ours")
    async_row = {} if not with_async else {
        "ours_async_train_s_to_target": median_of("ours_async", "train_s_to_target"),
        "ratio_time_to_target_ours_async_over_trl": time_ratio("ours_async"),
        "ours_async_steps_to_target": median_of("ours_async", "steps_to_target"),
        "ratio_step_time_ours_async_over_trl": step_ratio("ours_async"),
        "ours_async_final_accuracy": median_of("ours_async", "final_accuracy"),
    }
    return {
        "target_accuracy": target, "eval_every": eval_every, "eval_prompts": len(prompts), "max_steps": max_steps,
        "seeds": seeds, "completions_per_step": cfg.generation_batch_size // (cfg.grpo.steps_per_generation or 1),
        "runs": runs,
        "ours_train_s_to_target": median_of("ours", "train_s_to_target"),
        "trl_train_s_to_target": median_of("trl", "train_s_to_target"),
        "ratio_time_to_target_ours_over_trl": ratio,
        "ours_steps_to_target": median_of("ours", "steps_to_target"),
        "trl_steps_to_target": median_of("trl", "steps_to_target"),
        "ratio_step_time_ours_over_trl": step_ratio("ours"),
        "ours_final_accuracy": median_of("ours", "final_accuracy"),
        "trl_final_accuracy": median_of("trl", "final_accuracy"),
        **async_row,
        "goal_ratio": 0.6, "goal_met": ratio is not None and ratio <= 0.6,
    }
