"""Streaming partial-batch scoring: rewards overlap the log-prob passes, whole-batch statistics stay whole-batch."""

from __future__ import annotations

import threading

import pytest
import torch

from grpo.config import load_config
from grpo.errors import ConfigError
from grpo.pipeline.data import load_data
from grpo.rewards import get_reward, load_reward_module
from grpo.rewards.streaming import chunk_bounds
from grpo.training.policy import load_policy
from grpo.training.train import grpo_args
from grpo.training.trainer import GRPOTrainer
from tests.conftest import MICRO, micro_overrides


def varied_reward(prompts, completions, **kwargs):
    """Differs within and between groups, so batch and group scaling give different advantages."""
    return [float(len(c) % 3) + 0.5 * int(p[0]) for p, c in zip(prompts, completions)]


def make_trainer(tmp_path, reward_funcs, **overrides) -> GRPOTrainer:
    cfg = load_config(MICRO, micro_overrides(tmp_path, **overrides))
    data = load_data(cfg)
    policy = load_policy(cfg, data, log=lambda *_: None)
    trainer = GRPOTrainer(model=policy.model, processing_class=policy.tokenizer, reward_funcs=reward_funcs,
                          args=grpo_args(cfg, tmp_path / "out"), train_dataset=data["train"], experiment=cfg)
    trainer.model.train()
    return trainer


def groups(trainer: GRPOTrainer, first_digits: str) -> list[dict]:
    rows = []
    for digit in first_digits:
        row = next(r for r in trainer.train_dataset if r["prompt"][0] == digit)
        rows += [row] * trainer.num_generations
    return rows


def test_chunks_hold_whole_groups():
    assert chunk_bounds(16, 4, 1) == [(0, 4), (4, 8), (8, 12), (12, 16)]
    assert chunk_bounds(16, 4, 3) == [(0, 12), (12, 16)]
    with pytest.raises(ValueError, match="groups of 4"):
        chunk_bounds(10, 4, 1)


@pytest.mark.parametrize("scale_rewards", ["batch", "group"])
def test_streamed_advantages_equal_whole_batch_scoring(tmp_path, scale_rewards):
    """axolotl's streaming path silently used per-chunk statistics for scale_rewards='batch'; here the advantages
    are identical to scoring the whole batch at once."""
    inputs = None
    out = {}
    for streaming in (False, True):
        trainer = make_trainer(tmp_path / str(streaming), [varied_reward], **{
            "grpo.scale_rewards": scale_rewards, "async.streaming_partial_batch": str(streaming).lower(),
            "async.streaming_min_groups": 1})
        inputs = inputs or groups(trainer, "1357")
        torch.manual_seed(0)
        out[streaming] = trainer.assemble_generation_batch(inputs)
        if streaming:
            assert trainer._metrics["train"]["streaming/chunks"] == [4.0]
            assert trainer._metrics["train"]["streaming/reward_s"][-1] > 0
        else:
            assert "streaming/chunks" not in trainer._metrics["train"]
    assert torch.equal(out[False]["completion_ids"], out[True]["completion_ids"])
    assert torch.allclose(out[False]["advantages"], out[True]["advantages"])
    per_group = out[True]["advantages"].view(4, -1)
    assert per_group.abs().sum() > 0
    if scale_rewards == "batch":  # per-group scaling would make every group's advantages have unit spread
        assert not torch.allclose(per_group.std(dim=1), per_group.std(dim=1)[0].expand(4), rtol=0.05)


def test_rewards_are_computed_while_the_log_prob_pass_runs(tmp_path):
    """Ordering, not timing. With streaming, the reward call holds until the reference pass has started, and the
    reference pass sees that call under way (were rewards scored before the pass, in the same thread, the call would
    give up its wait and finish first, and the check would fail). Without streaming (TRL's order) every reference
    pass comes before the first reward call."""
    # streaming: the reward is still running when the reference-model pass starts
    reward_running, reward_done, ref_entered = threading.Event(), threading.Event(), threading.Event()

    def held_reward(prompts, completions, **kwargs):
        reward_running.set()
        ref_entered.wait(timeout=120)
        reward_done.set()
        return varied_reward(prompts, completions)

    def on_ref_pass(*_):
        if not ref_entered.is_set():
            reward_running.wait(timeout=120)
            overlapped.append(reward_running.is_set() and not reward_done.is_set())
            ref_entered.set()

    overlapped: list[bool] = []
    trainer = make_trainer(tmp_path / "stream", [held_reward], **{
        "grpo.beta": 0.05, "async.streaming_partial_batch": "true"})
    trainer.ref_model.register_forward_pre_hook(on_ref_pass)
    trainer.assemble_generation_batch(groups(trainer, "12"))
    assert overlapped == [True]

    # TRL's order: log-prob passes first, then the rewards
    events: list[str] = []

    def logging_reward(prompts, completions, **kwargs):
        events.append("reward")
        return varied_reward(prompts, completions)

    trainer = make_trainer(tmp_path / "plain", [logging_reward], **{"grpo.beta": 0.05})
    trainer.ref_model.register_forward_pre_hook(lambda *_: events.append("ref"))
    trainer.assemble_generation_batch(groups(trainer, "12"))
    assert "ref" in events and "reward" in events
    assert events.index("reward") > max(i for i, e in enumerate(events) if e == "ref"), events


def test_a_raising_reward_fails_the_step_as_in_trl(tmp_path):
    def broken(prompts, completions, **kwargs):
        raise RuntimeError("broken reward")

    trainer = make_trainer(tmp_path, [broken], **{"async.streaming_partial_batch": "true"})
    with pytest.raises(RuntimeError, match="broken reward"):
        trainer.assemble_generation_batch(groups(trainer, "12"))


async def async_reward(prompts, completions, **kwargs):
    return [1.0 if i % 2 else 0.0 for i in range(len(completions))]


def test_coroutine_rewards_stream(tmp_path):
    trainer = make_trainer(tmp_path, [async_reward], **{"async.streaming_partial_batch": "true"})
    batch = trainer.assemble_generation_batch(groups(trainer, "12"))
    assert (batch["advantages"].abs() > 0).all()


POOL_MODULE = '''
from grpo.rewards import register_reward

@register_reward("streaming_pool_reward")
def streaming_pool_reward(prompts, completions, **kwargs):
    if prompts[0][0] == "1":
        raise ValueError("broken reward")
    return [float(i % 2) for i in range(len(prompts))]
'''


def test_streaming_through_the_worker_pool_counts_errors_per_batch(tmp_path):
    module = tmp_path / "streaming_pool_rewards.py"
    module.write_text(POOL_MODULE)
    load_reward_module(module)
    trainer = make_trainer(tmp_path, [get_reward("streaming_pool_reward")], **{
        "grpo.reward_funcs": "[streaming_pool_reward]", "async.reward_num_workers": 2, "async.reward_timeout": 30,
        "async.streaming_partial_batch": "true", "async.streaming_min_groups": 1})
    try:
        G = trainer.num_generations
        batch = trainer.assemble_generation_batch(groups(trainer, "1461"))
        adv = batch["advantages"]
        assert (adv[:G] == 0).all() and (adv[3 * G:] == 0).all() and (adv[G:3 * G].abs() > 0).all()
        metrics = trainer._metrics["train"]
        assert metrics["streaming/chunks"] == [4.0]
        assert metrics["rewards/errors"] == [2.0 * G]  # both broken groups, summed over their chunks
    finally:
        trainer.close_reward_pool()


def test_reward_models_are_refused_with_streaming(tmp_path):
    cfg_overrides = {"async.streaming_partial_batch": "true"}
    model = torch.nn.Linear(2, 1)
    with pytest.raises(ConfigError, match="streaming_partial_batch"):
        make_trainer(tmp_path, [model], **cfg_overrides)
