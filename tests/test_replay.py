"""Replay buffer and deferred re-roll: buffers, and the trainer really replacing groups / re-injecting prompts."""

from __future__ import annotations

import torch

from grpo.algo.replay import ReplayBuffer, RerollBuffer, group_advantages, inject_rerolls, nan_std, place_group
from grpo.config import load_config
from grpo.pipeline.data import load_data
from grpo.rewards import get_reward, register_reward
from grpo.training.policy import load_policy
from grpo.training.train import grpo_args
from grpo.training.trainer import GRPOTrainer
from tests.conftest import MICRO, micro_overrides

SCORED: list[list[str]] = []


@register_reward("test_signal_if_even")
def signal_if_even(prompts, completions, **kwargs):
    """Groups of prompts starting with an even digit get varied rewards; all others get 0 (no signal, failed)."""
    SCORED.append(list(prompts))
    return [float((int(p[0]) % 2 == 0) and (i % 2 == 0)) for i, p in enumerate(prompts)]


@register_reward("test_unscorable_mix")
def unscorable_mix(prompts, completions, **kwargs):
    """Even-digit prompts: [1, 0, None, 0] per group (signal, one unscorable); odd: [1, 1, 1, None] (no signal)."""
    even, odd = [1.0, 0.0, None, 0.0], [1.0, 1.0, 1.0, None]
    return [(even if int(p[0]) % 2 == 0 else odd)[i % 4] for i, p in enumerate(prompts)]


NAN = float("nan")


def test_group_advantages_leave_unscorable_completions_out_like_trl():
    """Issue #10 item 7: TRL excludes NaN rewards from the group mean/std and gives them advantage 0."""
    adv = group_advantages(torch.tensor([1.0, 0.0, NAN, 0.0]), "group")
    assert torch.allclose(adv, torch.tensor([1.1546, -0.5773, 0.0, -0.5773]), atol=1e-3), adv
    assert torch.equal(group_advantages(torch.tensor([1.0, 1.0, 1.0, NAN]), "group"), torch.zeros(4))
    assert torch.allclose(group_advantages(torch.tensor([2.0, 0.0, NAN, 1.0]), "none"), torch.tensor([1.0, -1.0, 0, 0]))


def test_nan_std_equals_trls_nanstd():
    """grpo.algo stays free of TRL, so it has its own NaN-aware std: it must equal TRL's (advantages depend on it)."""
    from trl.trainer.utils import nanstd

    x = torch.tensor([[1.0, 2.0, float("nan"), 4.0], [float("nan")] * 3 + [1.0], [3.0] * 4, [0.5, -1.0, 2.0, 7.0]])
    ours, theirs = nan_std(x, dim=1), nanstd(x, dim=1)
    assert torch.equal(torch.isnan(ours), torch.isnan(theirs)) and torch.isnan(ours[1])
    assert torch.allclose(ours.nan_to_num(-1.0), theirs.nan_to_num(-1.0))


def test_replay_buffer_keeps_the_best_and_samples_by_score():
    buf = ReplayBuffer(2, seed=0)
    assert not buf.add(0.0, {"id": "zero"})  # no signal, never kept
    assert buf.add(1.0, {"id": "a"}) and buf.add(3.0, {"id": "b"})
    assert buf.add(2.0, {"id": "c"})  # evicts a (1.0)
    assert not buf.add(0.5, {"id": "d"})
    assert len(buf) == 2 and sorted(g["id"] for g in buf.sample(50)) != []
    draws = [g["id"] for g in buf.sample(3000)]
    assert set(draws) == {"b", "c"} and 0.5 < draws.count("b") / draws.count("c") < 2.0  # ~3:2


def test_reroll_buffer_is_bounded_and_counts_drops():
    buf = RerollBuffer(2)
    for i in range(5):
        buf.add({"prompt": str(i)})
    assert len(buf) == 2 and buf.dropped == 3
    assert [r["prompt"] for r in buf.take(5)] == ["3", "4"] and len(buf) == 0


def test_inject_rerolls_replaces_last_groups():
    rows = [{"prompt": p} for p in "aabbcc"]
    out = inject_rerolls(rows, [{"prompt": "x"}, {"prompt": "y"}], num_generations=2)
    assert [r["prompt"] for r in out] == ["a", "a", "y", "y", "x", "x"]
    assert [r["prompt"] for r in rows] == list("aabbcc")


def test_place_group_widens_the_batch():
    batch = {"prompt_ids": torch.ones(4, 2, dtype=torch.long), "prompt_mask": torch.ones(4, 2, dtype=torch.long),
             "completion_ids": torch.ones(4, 2, dtype=torch.long),
             "completion_mask": torch.ones(4, 2, dtype=torch.long), "advantages": torch.zeros(4)}
    group = {"prompt_ids": torch.full((2, 3), 7), "prompt_mask": torch.ones(2, 3, dtype=torch.long),
             "completion_ids": torch.full((2, 4), 9), "completion_mask": torch.ones(2, 4, dtype=torch.long)}
    place_group(batch, slice(2, 4), group, pad_token_id=0)
    assert batch["prompt_ids"].shape == (4, 3) and batch["completion_ids"].shape == (4, 4)
    assert batch["prompt_ids"][0].tolist() == [0, 1, 1] and batch["prompt_mask"][0].tolist() == [0, 1, 1]
    assert batch["completion_ids"][3].tolist() == [9, 9, 9, 9] and batch["completion_mask"][0].tolist() == [1, 1, 0, 0]


def make_trainer(tmp_path, **extra) -> GRPOTrainer:
    cfg = load_config(MICRO, micro_overrides(tmp_path, **{"grpo.reward_funcs": "[test_signal_if_even]", **extra}))
    data = load_data(cfg)
    policy = load_policy(cfg, data, log=lambda *_: None)
    trainer = GRPOTrainer(model=policy.model, processing_class=policy.tokenizer,
                          reward_funcs=[get_reward(n) for n in cfg.grpo.reward_funcs],
                          args=grpo_args(cfg, tmp_path / "out"), train_dataset=data["train"], experiment=cfg)
    trainer.model.train()
    return trainer


def rows_starting_with(trainer, digits: str, groups: int, skip: int = 0) -> list[dict]:
    picked = [r for r in trainer.train_dataset if r["prompt"][0] in digits][skip : skip + groups]
    return [r for r in picked for _ in range(trainer.num_generations)]


def test_trainer_replaces_zero_signal_groups_with_replayed_ones(tmp_path):
    trainer = make_trainer(tmp_path, **{"async.replay_buffer_size": 4})
    torch.manual_seed(0)
    trainer.assemble_generation_batch(rows_starting_with(trainer, "2468", 4))  # all groups have signal: buffered
    assert trainer._metrics["train"]["replay_buffer_size"][-1] == 4
    assert trainer._metrics["train"]["replay_buffer_replacements"][-1] == 0

    batch = trainer.assemble_generation_batch(rows_starting_with(trainer, "13579", 4))  # no group has signal
    assert trainer._metrics["train"]["replay_buffer_replacements"][-1] == 4
    adv = batch["advantages"].view(4, trainer.num_generations)
    assert (adv.abs().sum(dim=1) > 0).all()  # every group now carries signal
    def first_completion(ids, mask):
        return tuple(t for t, m in zip(ids.tolist(), mask.tolist()) if m)

    stored = {first_completion(e.group["completion_ids"][0], e.group["completion_mask"][0])
              for e in trainer._replay._heap}
    for g in range(4):
        r = g * trainer.num_generations
        assert first_completion(batch["completion_ids"][r], batch["completion_mask"][r]) in stored
    assert int(batch["num_items_in_batch"]) == int(batch["completion_mask"].sum())


def test_failed_prompts_are_reinjected_and_generated_again(tmp_path):
    trainer = make_trainer(tmp_path, **{"async.reroll_start_fraction": 0.0, "async.reroll_max_groups": 2})
    SCORED.clear()
    failing = rows_starting_with(trainer, "13579", 1)
    first = failing + rows_starting_with(trainer, "2468", 3)
    trainer.assemble_generation_batch(first)
    assert trainer._metrics["train"]["reroll_buffered"][-1] == 1
    assert trainer._metrics["train"]["reroll_buffer_size"][-1] == 1

    second = rows_starting_with(trainer, "2468", 4, skip=3)
    assert failing[0]["prompt"] not in {r["prompt"] for r in second}
    trainer.assemble_generation_batch(second)
    assert trainer._metrics["train"]["reroll_injected"][-1] == 1
    # the failed prompt was generated for and scored again, as a whole group, in the second batch
    assert SCORED[-1].count(failing[0]["prompt"]) == trainer.num_generations
    assert trainer._metrics["train"]["reroll_buffer_size"][-1] == 1  # it failed again, so it is buffered again


def test_reroll_waits_for_the_start_fraction(tmp_path):
    trainer = make_trainer(tmp_path, **{"async.reroll_start_fraction": 0.5})
    trainer.assemble_generation_batch(rows_starting_with(trainer, "13579", 1) + rows_starting_with(trainer, "2468", 3))
    trainer.assemble_generation_batch(rows_starting_with(trainer, "2468", 4, skip=3))
    assert trainer._metrics["train"]["reroll_injected"] == [0.0, 0.0]  # global_step 0 < 0.5 * max_steps
    trainer.state.global_step = trainer.args.max_steps // 2
    trainer.assemble_generation_batch(rows_starting_with(trainer, "2468", 4, skip=7))
    assert trainer._metrics["train"]["reroll_injected"][-1] == 1


def test_replay_with_unscorable_completions_matches_trl(tmp_path):
    """Issue #10 item 7: a group whose scorable rewards are equal ([1, 1, 1, None]) has no signal and is replaced; the
    replayed group's advantages are TRL's, unscorable completion at 0."""
    trainer = make_trainer(tmp_path, **{"async.replay_buffer_size": 4, "grpo.reward_funcs": "[test_unscorable_mix]"})
    torch.manual_seed(0)
    first = trainer.assemble_generation_batch(rows_starting_with(trainer, "2468", 2))
    trl = first["advantages"].view(2, 4)
    assert torch.allclose(trl, torch.tensor([1.1546, -0.5773, 0.0, -0.5773]).expand(2, 4), atol=1e-3)

    batch = trainer.assemble_generation_batch(rows_starting_with(trainer, "13579", 2))
    assert trainer._metrics["train"]["replay_buffer_replacements"][-1] == 2
    assert torch.allclose(batch["advantages"].view(2, 4), trl, atol=1e-5)


def completion_logps(model, batch, rows: slice, temperature: float) -> torch.Tensor:
    """Per-token log-probs of the batch's completions under ``model``: one plain forward, written out here."""
    ids = torch.cat([batch["prompt_ids"][rows], batch["completion_ids"][rows]], 1)
    mask = torch.cat([batch["prompt_mask"][rows], batch["completion_mask"][rows]], 1)
    width = batch["completion_ids"].shape[1]
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits[:, -width - 1 : -1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, batch["completion_ids"][rows].unsqueeze(-1)).squeeze(-1)


def test_replayed_groups_get_old_logps_recomputed_by_the_current_model(tmp_path):
    """``async.replay_recompute_logps``: a replayed group was sampled (and its old log-probs computed) by an older
    policy; after the weights moved, its old log-probs in the new batch are a fresh forward of the current model."""
    # num_iterations 2: TRL keeps old_per_token_logps in the batch (several passes over one generation batch)
    trainer = make_trainer(tmp_path, **{"async.replay_buffer_size": 4, "grpo.num_iterations": 2})
    assert trainer.experiment.async_.replay_recompute_logps  # the default
    torch.manual_seed(0)
    first = trainer.assemble_generation_batch(rows_starting_with(trainer, "2468", 4))  # buffered with old logps
    assert "old_per_token_logps" in first
    before = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    with torch.no_grad():  # the policy moves on (as after optimizer steps)
        for p in trainer.model.parameters():
            p.add_(0.05 * torch.randn_like(p))

    batch = trainer.assemble_generation_batch(rows_starting_with(trainer, "13579", 4))  # every group replaced
    assert trainer._metrics["train"]["replay_buffer_replacements"][-1] == 4
    rows = slice(0, batch["completion_ids"].shape[0])
    mask = batch["completion_mask"][rows].bool()
    got = batch["old_per_token_logps"][rows][mask]
    fresh = completion_logps(trainer.model, batch, rows, trainer.temperature)[mask]
    trainer.model.load_state_dict(before)  # (a deepcopy of the model would still run the trainer's wrapped forward)
    stale = completion_logps(trainer.model, batch, rows, trainer.temperature)[mask]
    assert (fresh - stale).abs().max() > 1e-2  # the weights really moved: the buffered log-probs are out of date
    assert torch.allclose(got, fresh, atol=1e-5), (got - fresh).abs().max()
