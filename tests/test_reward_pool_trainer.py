"""The trainer scoring through the reward worker pool: raising, hanging and crashing rewards never stall a batch."""

from __future__ import annotations

import pytest
import torch

from grpo.config import load_config
from grpo.pipeline.data import load_data
from grpo.rewards import get_reward, load_reward_module
from grpo.training.policy import load_policy
from grpo.training.train import grpo_args
from grpo.training.trainer import GRPOTrainer
from tests.conftest import MICRO, micro_overrides

MODULE = '''
import os, time
from grpo.rewards import register_reward

@register_reward("pool_test_reward")
def pool_test_reward(prompts, completions, **kwargs):
    """Raises on prompts starting with 1, hangs on 2, kills its worker on 3, else rewards every other completion."""
    first = prompts[0][0]
    if first == "1":
        raise ValueError("broken reward")
    if first == "2":
        time.sleep(600)
    if first == "3":
        os._exit(1)
    return [float(i % 2) for i in range(len(prompts))]
'''


@pytest.mark.integration
def test_trainer_scores_through_the_pool_and_survives_bad_rewards(tmp_path):
    module = tmp_path / "pool_rewards.py"
    module.write_text(MODULE)
    load_reward_module(module)
    cfg = load_config(MICRO, micro_overrides(tmp_path, **{
        "grpo.reward_funcs": "[pool_test_reward]", "async.reward_num_workers": 2, "async.reward_timeout": 3}))
    data = load_data(cfg)
    policy = load_policy(cfg, data, log=lambda *_: None)
    trainer = GRPOTrainer(model=policy.model, processing_class=policy.tokenizer,
                          reward_funcs=[get_reward("pool_test_reward")], args=grpo_args(cfg, tmp_path / "out"),
                          train_dataset=data["train"], experiment=cfg)
    trainer.model.train()
    G = trainer.num_generations

    def group(first_digit: str) -> list[dict]:
        row = next(r for r in trainer.train_dataset if r["prompt"][0] == first_digit)
        return [row] * G

    try:
        good = trainer.assemble_generation_batch(group("4") + group("6"))
        assert (good["advantages"].abs() > 0).all()
        assert trainer._metrics["train"]["rewards/errors"][-1] == 0

        # one worker's shard raises, the other's is fine: NaN only there, advantages zeroed only there
        batch = trainer.assemble_generation_batch(group("1") + group("6"))
        assert (batch["advantages"][:G] == 0).all() and (batch["advantages"][G:].abs() > 0).all()
        assert trainer._metrics["train"]["rewards/errors"][-1] == G

        # hangs for 600 s: returning at all shows the pool's 3 s deadline ended the wait
        batch = trainer.assemble_generation_batch(group("2") + group("6"))
        assert (batch["advantages"][:G] == 0).all() and (batch["advantages"][G:].abs() > 0).all()
        restarts = trainer._metrics["train"]["rewards/worker_restarts"][-1]
        assert restarts >= 1

        batch = trainer.assemble_generation_batch(group("3") + group("4"))  # crashes a worker mid-batch
        assert (batch["advantages"][:G] == 0).all()
        assert trainer._metrics["train"]["rewards/worker_restarts"][-1] > restarts

        again = trainer.assemble_generation_batch(group("4") + group("6"))  # the pool recovered
        assert (again["advantages"].abs() > 0).all() and trainer._metrics["train"]["rewards/errors"][-1] == 0
    finally:
        trainer.close_reward_pool()
    assert isinstance(good["advantages"], torch.Tensor)
