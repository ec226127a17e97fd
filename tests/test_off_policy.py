"""Importance-sampling correction for async rollouts: truncate clamps at the cap, mask gives exactly zero."""

from __future__ import annotations

import json
import math

import pytest
import torch

from grpo.config import load_config
from grpo.pipeline.data import load_data
from grpo.pipeline.experiment import run_experiment
from grpo.rewards import get_reward
from grpo.runs import open_run_dir
from grpo.training.policy import load_policy
from grpo.training.train import grpo_args
from grpo.training.trainer import GRPOTrainer
from tests import deterministic_rewards  # noqa: F401 - registers completion_length
from tests.conftest import MICRO, micro_overrides


def trainer_with(tmp_path, mode: str, **extra) -> GRPOTrainer:
    cfg = load_config(MICRO, micro_overrides(tmp_path, **{
        "async.use_data_producer": "true", "async.vllm_importance_sampling_correction": "true",
        "async.vllm_importance_sampling_mode": mode, "async.vllm_importance_sampling_cap": 2.0, **extra}))
    data = load_data(cfg)
    policy = load_policy(cfg, data, log=lambda *_: None)
    return GRPOTrainer(model=policy.model, processing_class=policy.tokenizer, reward_funcs=[get_reward("exact_match")],
                       args=grpo_args(cfg, tmp_path / "out"), train_dataset=data["train"], experiment=cfg)


def batch_with_ratios(ratios: list[list[float]], advantages: list[float]) -> dict:
    r = torch.tensor(ratios)
    n, t = r.shape
    return {"prompt_ids": torch.ones(n, 2, dtype=torch.long), "prompt_mask": torch.ones(n, 2, dtype=torch.long),
            "completion_ids": torch.ones(n, t, dtype=torch.long), "completion_mask": torch.ones(n, t, dtype=torch.long),
            "advantages": torch.tensor(advantages), "old_per_token_logps": r.log(),
            "sampling_per_token_logps": torch.zeros(n, t)}


@pytest.mark.parametrize("mode, expected", [
    ("token_truncate", [[0.5, 1.5, 2.0], [1.0, 1.0, 2.0]]),
    ("token_mask", [[0.5, 1.5, 0.0], [1.0, 1.0, 0.0]]),
])
def test_token_modes(tmp_path, mode, expected):
    trainer = trainer_with(tmp_path, mode)
    batch = batch_with_ratios([[0.5, 1.5, 3.0], [1.0, 1.0, 9.0]], [1.0, -2.0])
    trainer._correct_off_policy(batch, [])
    want = torch.tensor(expected) * torch.tensor([[1.0], [-2.0]])
    assert torch.allclose(batch["advantages"], want)
    if mode == "token_mask":
        assert (batch["advantages"][:, 2] == 0).all()  # exactly zero, never clamped back to 1/C or C
        assert trainer._metrics["train"]["sampling/is_frac_masked"][-1] == pytest.approx(2 / 6)
    else:
        assert trainer._metrics["train"]["sampling/is_frac_clamped"][-1] == pytest.approx(2 / 6)
    assert trainer._metrics["train"]["sampling/importance_sampling_ratio/max"][-1] == pytest.approx(9.0)


@pytest.mark.parametrize("mode", ["sequence_truncate", "sequence_mask"])
def test_sequence_modes(tmp_path, mode):
    trainer = trainer_with(tmp_path, mode)
    batch = batch_with_ratios([[1.2, 1.2, 1.0], [2.0, 2.0, 1.0]], [1.0, 1.0])  # sequence ratios 1.44 and 4
    trainer._correct_off_policy(batch, [])
    assert torch.allclose(batch["advantages"][0], torch.full((3,), 1.44))
    assert torch.allclose(batch["advantages"][1], torch.full((3,), 2.0 if mode == "sequence_truncate" else 0.0))


def test_replayed_rows_are_not_reweighted(tmp_path):
    trainer = trainer_with(tmp_path, "token_mask")
    batch = batch_with_ratios([[3.0, 3.0], [3.0, 3.0]], [1.0, 1.0])
    trainer._correct_off_policy(batch, [slice(1, 2)])
    assert batch["advantages"][0].tolist() == [0.0, 0.0] and batch["advantages"][1].tolist() == [1.0, 1.0]


def test_opsm_fraction_is_logged(tmp_path):
    trainer = trainer_with(tmp_path, "token_truncate", **{"async.off_policy_mask_threshold": 0.5})
    # sampling log-probs above the trainer's by 1 nat on row 0 (KL 1 > 0.5), equal on row 1; row 0 negative advantage
    batch = batch_with_ratios([[math.exp(-1), math.exp(-1)], [1.0, 1.0]], [-1.0, -1.0])
    trainer._correct_off_policy(batch, [])
    assert trainer._metrics["train"]["sampling/opsm_frac_masked"][-1] == pytest.approx(0.5)


@pytest.mark.parametrize("mode", ["token_truncate", "sequence_mask"])
def test_weights_from_the_training_forward_equal_an_extra_pass_with_one_forward_fewer(tmp_path, mode):
    """#13.2: without ``old_per_token_logps`` (on-policy for the trainer) the IS weights come from the training
    forward's log-probs inside the loss: the same weighted advantages as the separate no-grad pass gave, and the loss
    call runs one forward (the policy's), not two."""
    trainer = trainer_with(tmp_path, mode, **{"async.compact_zero_advantage": "false"})
    trainer.current_gradient_accumulation_steps = 1
    model = trainer.model
    model.train()
    g = torch.Generator().manual_seed(0)
    n, p, t = 8, 5, 4
    vocab = model.config.vocab_size
    batch = {"prompt_ids": torch.randint(3, vocab, (n, p), generator=g),
             "prompt_mask": torch.ones(n, p, dtype=torch.long),
             "completion_ids": torch.randint(3, vocab, (n, t), generator=g),
             "completion_mask": torch.ones(n, t, dtype=torch.long), "advantages": torch.randn(n, generator=g),
             "num_items_in_batch": torch.tensor(float(n * t))}
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(
            model, torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1),
            torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1), t)
    batch["sampling_per_token_logps"] = logps + 0.4 * torch.randn(n, t, generator=g)  # a lagging generator

    eager = {**batch, "old_per_token_logps": logps}
    trainer._correct_off_policy(eager, [])
    deferred = dict(batch)
    trainer._correct_off_policy(deferred, [])
    assert deferred["advantages"].shape == (n,) and "is_weight_one" in deferred  # nothing computed yet

    forwards = []
    method = type(trainer)._get_per_token_logps_and_entropies
    trainer._get_per_token_logps_and_entropies = lambda *a, **k: (forwards.append(1), method(trainer, *a, **k))[1]
    try:
        trainer._compute_loss(model, deferred).backward()
    finally:
        del trainer._get_per_token_logps_and_entropies
    assert forwards == [1]
    assert torch.allclose(deferred["advantages"], eager["advantages"], rtol=1e-5, atol=1e-6)
    assert not torch.equal(eager["advantages"], batch["advantages"].unsqueeze(1).expand(n, t))  # weights not all 1


@pytest.mark.integration
def test_async_training_with_is_mask_runs_end_to_end(tmp_path):
    """#28: with exact_match the micro policy scored 0 on every completion, so every advantage was 0, the gradient
    was 0 and the "stale" policy was the current one: the ratios were 1 +- one float32 ulp (the generator's KV-cached
    batched forward against the trainer's), and which tokens rounded above the cap of 1.0 depended on kernel paths
    (batch shape after compaction, memory layout), not on staleness -- all 0 in some suite runs. A reward that
    varies within groups makes the policy move every step, so the masking measures real one-step staleness."""
    cfg = load_config(MICRO, micro_overrides(tmp_path, **{
        "async.use_data_producer": "true", "async.async_prefetch": "true",
        "async.vllm_importance_sampling_correction": "true", "async.vllm_importance_sampling_mode": "token_mask",
        "async.vllm_importance_sampling_cap": 1.0, "async.max_staleness": 1,
        "async.off_policy_mask_threshold": 1.0, "grpo.max_steps": 4, "grpo.logging_steps": 1,
        "grpo.reward_funcs": "[completion_length]", "evaluation.enabled": "false"}))
    run = open_run_dir(cfg, "is", resume=False)
    summary = run_experiment(cfg, run, log=lambda *_: None)
    assert summary["steps"] == 4
    rows = [json.loads(line)["metrics"] for line in run.metrics_file.read_text().splitlines()]
    rows = [r for r in rows if "sampling/is_frac_masked" in r]
    masked = [r["sampling/is_frac_masked"] for r in rows]
    means = [r["sampling/importance_sampling_ratio/mean"] for r in rows]
    assert len(masked) == len(means) == 4
    assert [r["async/staleness_max"] for r in rows] == [0.0, 1.0, 1.0, 1.0]  # the schedule: prefetch_depth 1
    assert all(r["grad_norm"] > 0 for r in rows), [r["grad_norm"] for r in rows]  # every step moves the policy
    # One-step-stale rollouts of a moving policy: ratios spread far beyond float32 rounding (1e-7) around 1 ...
    spread = [r["sampling/importance_sampling_ratio/max"] - r["sampling/importance_sampling_ratio/min"]
              for r in rows[1:]]
    assert all(s > 1e-3 for s in spread), spread
    # ... so a cap of 1.0 masks some tokens and keeps others.
    assert all(0.0 <= f <= 1.0 for f in masked) and max(masked) > 0.0 and min(masked) < 1.0, masked
    assert all(abs(m - 1.0) < 0.25 for m in means), means
