"""The platform's trainer on the micro config, built the way training builds it, for tests that drive its steps by
hand. Shared by several test modules (a test module imported by another would be imported twice and register its
rewards and environments twice)."""

from __future__ import annotations

from grpo.config import load_config
from grpo.pipeline.data import load_data
from grpo.rewards import get_reward
from grpo.training.policy import load_policy
from grpo.training.train import grpo_args
from grpo.training.trainer import GRPOTrainer
from tests.conftest import MICRO, micro_overrides


def micro_trainer(tmp_path, overrides: dict) -> GRPOTrainer:
    """The micro config with ``overrides`` (dotted keys), its data and policy, in training mode at GA 1."""
    cfg = load_config(MICRO, micro_overrides(tmp_path, **overrides))
    data = load_data(cfg)
    policy = load_policy(cfg, data, log=lambda *_: None)
    trainer = GRPOTrainer(model=policy.model, processing_class=policy.tokenizer,
                          reward_funcs=[get_reward(n) for n in cfg.grpo.reward_funcs],
                          args=grpo_args(cfg, tmp_path / "out"), train_dataset=data["train"], experiment=cfg)
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.train()
    return trainer


def environment_trainer(tmp_path, env: str = "guess_digit", **extra) -> GRPOTrainer:
    """A trainer whose rollouts are episodes in ``env`` (no warm start, short episodes, the environment's reward)."""
    return micro_trainer(tmp_path, {
        "model.warm_start.steps": 0, "grpo.per_device_train_batch_size": 8, "grpo.num_generations": 4,
        "grpo.max_completion_length": 10, "grpo.temperature": 1.5, "environment.name": env,
        "grpo.reward_funcs": "[env_reward]", **extra})


def logp_gradient(trainer: GRPOTrainer, batch: dict):
    """The gradient of the trainer's loss on ``batch`` with respect to its per-token log-probs (the output of TRL's
    ``_get_per_token_logps_and_entropies``), after one backward pass from zeroed gradients."""
    import torch

    captured = {}
    original = trainer._get_per_token_logps_and_entropies

    def capture(*args, **kwargs):
        out = original(*args, **kwargs)
        if torch.is_grad_enabled():
            out[0].retain_grad()
            captured["logps"] = out[0]
        return out

    trainer._get_per_token_logps_and_entropies = capture
    try:
        trainer.model.zero_grad(set_to_none=True)
        trainer.compute_loss(trainer.model, batch).backward()
    finally:
        del trainer._get_per_token_logps_and_entropies
    return captured["logps"].grad
