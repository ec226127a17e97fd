"""Chunked backward (``grpo.num_generations_chunks``) and zero-advantage skipping, on the real trainer."""

from __future__ import annotations

import pytest
import torch

from grpo.config import load_config
from grpo.data import load_task_data
from grpo.policy import load_policy
from grpo.rewards import get_reward
from grpo.train import grpo_args
from grpo.trainer import GRPOTrainer
from tests.conftest import MICRO, micro_overrides


def make_trainer(tmp_path, **extra) -> GRPOTrainer:
    cfg = load_config(MICRO, micro_overrides(tmp_path, **{"model.warm_start.steps": 200, **extra}))
    data = load_task_data(cfg.data)
    policy = load_policy(cfg, data, log=lambda *_: None)
    trainer = GRPOTrainer(model=policy.model, processing_class=policy.tokenizer,
                          reward_funcs=[get_reward(n) for n in cfg.grpo.reward_funcs],
                          args=grpo_args(cfg, tmp_path / "out"), train_dataset=data["train"], experiment=cfg)
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.train()
    return trainer


def gradients(trainer: GRPOTrainer, batch) -> torch.Tensor:
    trainer.model.zero_grad(set_to_none=True)
    loss = trainer.compute_loss(trainer.model, batch)
    trainer.accelerator.backward(loss)
    return torch.cat([p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None]), loss.detach()


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "bnpo", "dr_grpo"])
def test_chunked_backward_gradients_equal_unchunked(tmp_path, loss_type):
    trainer = make_trainer(tmp_path, **{"grpo.loss_type": loss_type, "grpo.per_device_train_batch_size": 16,
                                        "grpo.num_generations": 8, "grpo.temperature": 1.5})
    torch.manual_seed(0)
    rows = [trainer.train_dataset[i] for i in range(2) for _ in range(8)]
    batch = trainer.assemble_generation_batch(rows)
    if float(batch["advantages"].abs().sum()) == 0:
        batch["advantages"] = torch.linspace(-1, 1, batch["advantages"].numel())  # make sure there is signal
    full, full_loss = gradients(trainer, batch)
    assert full.abs().sum() > 0
    for chunks in (2, 4, 8):
        trainer.experiment.grpo.num_generations_chunks = chunks
        chunked, chunked_loss = gradients(trainer, batch)
        rel = ((chunked - full).abs().max() / full.abs().max()).item()
        assert rel < 1e-5, (chunks, rel)
        assert torch.allclose(chunked_loss, full_loss, rtol=1e-5, atol=1e-7)
    trainer.experiment.grpo.num_generations_chunks = 1


def test_zero_advantage_micro_batch_is_skipped_and_counted(tmp_path):
    trainer = make_trainer(tmp_path, **{"async.skip_zero_advantage_batches": "true"})
    torch.manual_seed(0)
    rows = [trainer.train_dataset[i] for i in range(4) for _ in range(4)]
    batch = trainer.assemble_generation_batch(rows)
    batch["advantages"] = torch.zeros_like(batch["advantages"])
    grads, loss = gradients(trainer, batch)
    assert float(loss) == 0.0 and float(grads.abs().sum()) == 0.0
    assert trainer._metrics["train"]["skipped_zero_adv_batches"][-1] == 1.0
    assert "entropy" not in trainer._metrics["train"] or len(trainer._metrics["train"]["entropy"]) == 0  # no forward

    batch["advantages"][0] = 1.0
    grads, _ = gradients(trainer, batch)
    assert float(grads.abs().sum()) > 0
    assert trainer._metrics["train"]["skipped_zero_adv_batches"][-1] == 0.0
