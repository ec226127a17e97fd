"""``python -m benchmarks trl_parity``: our GRPOTrainer versus stock ``trl.GRPOTrainer``.

Same tiny warm-started model, data, seed, config and number of steps, in one process; ours with its defaults (the
exact speed features, zero-advantage compaction and the shared-prompt forward, on). The two trainers run
alternately (ours, TRL, ours, TRL, ...) so machine noise hits both alike; throughput is the median over rounds.

Environment: BENCH_STEPS (60), BENCH_ROUNDS (3). ``--smoke``: 3 steps of 64 completions, 1 round, a short warm start.
"""

from __future__ import annotations

import copy
import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks._sizes import TINY_SMOKE_OVERRIDES, size


def build_trainer(trainer_cls: type, cfg: Any, policy: Any, train_dataset: Any, output_dir: Path,
                  use_cpu: bool = True, callbacks: Sequence[Any] = ()) -> Any:
    """``trainer_cls`` (ours or stock ``trl.GRPOTrainer``) as these benchmarks compare them: a copy of ``policy``'s
    model, the config's ``trl.GRPOConfig`` (``grpo_args``) and rewards, the config's seed, no checkpoints and no
    printed log dicts; ours also gets the config (``experiment``)."""
    from transformers import PrinterCallback, set_seed

    from grpo.rewards import get_reward
    from grpo.training.train import grpo_args
    from grpo.training.trainer import GRPOTrainer

    set_seed(cfg.grpo.seed)
    args = grpo_args(cfg, output_dir, use_cpu=use_cpu)
    args.save_strategy, args.disable_tqdm = "no", True
    extra = {"experiment": cfg} if trainer_cls is GRPOTrainer else {}
    trainer = trainer_cls(model=copy.deepcopy(policy.model), processing_class=policy.tokenizer,
                          reward_funcs=[get_reward(n) for n in cfg.grpo.reward_funcs], args=args,
                          train_dataset=train_dataset, callbacks=list(callbacks), **extra)
    trainer.remove_callback(PrinterCallback)  # the log dicts Trainer prints without tqdm: noise here
    return trainer


def main(smoke: bool = False) -> dict:
    steps = size("BENCH_STEPS", 60, 3, smoke)
    rounds = size("BENCH_ROUNDS", 3, 1, smoke)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import trl

    from grpo.config import load_config
    from grpo.pipeline.data import load_data
    from grpo.training.policy import load_policy
    from grpo.training.trainer import GRPOTrainer

    out = Path(tempfile.mkdtemp(prefix="bench-parity-"))
    cfg = load_config("tiny", [f"output_dir={out}", f"grpo.max_steps={steps}",
                                                       f"grpo.logging_steps={steps}",
                                                       *(TINY_SMOKE_OVERRIDES if smoke else [])])
    data = load_data(cfg)
    policy = load_policy(cfg, data, log=lambda *_: None)
    completions_per_step = cfg.generation_batch_size // (cfg.grpo.steps_per_generation or 1)

    def one(trainer_cls, tag: str) -> tuple[float, float]:
        trainer = build_trainer(trainer_cls, cfg, policy, data["train"], out / tag)
        start = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - start
        rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
        return steps * completions_per_step / seconds, rewards[-1]

    ours, stock = [], []
    for _ in range(rounds):
        ours.append(one(GRPOTrainer, "ours"))
        stock.append(one(trl.GRPOTrainer, "trl"))
    ours_cps = statistics.median(c for c, _ in ours)
    trl_cps = statistics.median(c for c, _ in stock)
    return {
        "steps": steps,
        "rounds": rounds,
        "completions_per_step": completions_per_step,
        "ours_completions_per_s": round(ours_cps, 1),
        "trl_completions_per_s": round(trl_cps, 1),
        "ratio_ours_over_trl": round(ours_cps / trl_cps, 3),
        "ours_final_mean_reward": ours[-1][1],
        "trl_final_mean_reward": stock[-1][1],
        "target_ratio": 0.95,
        "target_met": ours_cps / trl_cps >= 0.95,
    }
