"""Our GRPOTrainer keeps TRL's numerics: same seed, model and data -> the same losses and the same weights."""

from __future__ import annotations

import copy

import pytest
import torch
import trl
from transformers import set_seed

from grpo.config import load_config
from grpo.pipeline.data import load_data
from grpo.rewards import get_reward
from grpo.training.policy import load_policy
from grpo.training.train import grpo_args
from grpo.training.trainer import GRPOTrainer

pytestmark = pytest.mark.integration  # trains a model, starts servers or processes: not in `make test-fast`



class CountingTrainer(GRPOTrainer):
    """Counts calls of the extension points, proving the comparison runs through them."""

    calls: dict[str, int] = {}

    def build_train_sampler(self, dataset):
        self.calls["build_train_sampler"] = self.calls.get("build_train_sampler", 0) + 1
        return super().build_train_sampler(dataset)

    def assemble_generation_batch(self, inputs):
        self.calls["assemble_generation_batch"] = self.calls.get("assemble_generation_batch", 0) + 1
        return super().assemble_generation_batch(inputs)

    def split_generation_batch(self, batch):
        self.calls["split_generation_batch"] = self.calls.get("split_generation_batch", 0) + 1
        return super().split_generation_batch(batch)

    def compute_policy_loss(self, model, inputs):
        self.calls["compute_policy_loss"] = self.calls.get("compute_policy_loss", 0) + 1
        return super().compute_policy_loss(model, inputs)


def _train(trainer_cls, model, tokenizer, data, cfg, out):
    set_seed(0)
    kwargs = {"experiment": cfg} if issubclass(trainer_cls, GRPOTrainer) else {}
    trainer = trainer_cls(model=model, processing_class=tokenizer, reward_funcs=[get_reward("exact_match")],
                          args=grpo_args(cfg, out), train_dataset=data["train"], **kwargs)
    trainer.args.save_strategy = "no"
    trainer.args.disable_tqdm = True
    trainer.train()
    return trainer


def test_same_losses_and_weights_as_stock_trl(tmp_path):
    cfg = load_config("tiny", [
        f"output_dir={tmp_path}", "grpo.max_steps=4", "grpo.logging_steps=1", "grpo.per_device_train_batch_size=32",
        "grpo.steps_per_generation=2", "grpo.num_iterations=2",
        "model.warm_start.steps=250",  # enough for non-zero rewards (checked below); the preset's 1000 cost ~40 s more
        # bit-for-bit equality of the extension points with TRL: compaction changes the float summation order (equal
        # gradients to 1e-5, tests/test_compaction.py and the invariant matrix) and adds its own metrics
        "async.compact_zero_advantage=false",
        # the same for the shared-prompt forward (tests/test_shared_prompt.py: equal to 1e-5, same samples)
        "async.shared_prompt_forward=false",
    ])
    data = load_data(cfg)
    policy = load_policy(cfg, data, log=lambda *_: None)
    ours = _train(CountingTrainer, copy.deepcopy(policy.model), policy.tokenizer, data, cfg, tmp_path / "ours")
    stock = _train(trl.GRPOTrainer, copy.deepcopy(policy.model), policy.tokenizer, data, cfg, tmp_path / "trl")

    def history(trainer):
        timing = {"step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second"}
        return [{k: v for k, v in h.items() if k not in timing} for h in trainer.state.log_history]

    # 4 steps, steps_per_generation=2, num_iterations=2: one generation round, 4 micro-batches of loss
    assert CountingTrainer.calls == {"build_train_sampler": 1, "assemble_generation_batch": 1,
                                     "split_generation_batch": 1, "compute_policy_loss": 4}
    assert [h["step"] for h in history(ours) if "loss" in h] == [1, 2, 3, 4]
    assert any(h.get("reward", 0) > 0 for h in history(ours))
    assert history(ours) == history(stock)
    for (name, a), b in zip(ours.model.state_dict().items(), stock.model.state_dict().values()):
        assert torch.equal(a, b), name
    # and training changed the weights at all, so the comparison above is not vacuous
    assert any(not torch.equal(a, b) for a, b in zip(ours.model.state_dict().values(),
                                                     policy.model.state_dict().values()))
