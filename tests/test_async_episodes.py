"""Rounds of episodes through the async CPU generator process (#30 §2 "Async"): the engine runs THE episode runner
with its own policy copy and seeded sampler, every episode of a round is sampled with one policy version, the
environments are built in the generator process (``GRPO_ENV_MODULES`` files included), and an environment's fault
(raise, hang, unbuildable) costs its episode a NaN reward while the round, and the process, go on."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from grpo.environments.builtin import CalculatorEnvironment, GuessDigitEnvironment
from grpo.training.async_producer import (
    TEST_DELAY_ENV,
    AsyncRolloutProducer,
    EpisodeSettings,
    environment_module_files,
    run_episode_round,
    sampling_generate,
)
from grpo.training.tiny_model import build_char_tokenizer, build_tiny_qwen2

pytestmark = pytest.mark.integration  # starts the generator process

ALPHABET = "".join(sorted(set(CalculatorEnvironment.alphabet + GuessDigitEnvironment.alphabet + "=")))
TOK = build_char_tokenizer(ALPHABET)
EOS = TOK.eos_token_id
GEN = {"eos_token_ids": [EOS], "pad_token_id": TOK.pad_token_id, "max_new_tokens": 24, "temperature": 1.0,
       "top_p": 1.0, "top_k": 0, "shared_prompt": False}


def enc(text: str) -> list[int]:
    return TOK(text, add_special_tokens=False)["input_ids"]


def model(seed: int):
    return build_tiny_qwen2(TOK, 32, 1, 2, 64, 128, seed=seed).eval()


def save_generator_dir(path, policy) -> str:
    """What the trainer writes for its generator (see AsyncRollouts._start_producer): config and every tensor by
    name (the episode runner's tokenizer goes to the process whole)."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    policy.config.save_pretrained(path)
    save_file({k: v.detach().contiguous().clone() for k, v in policy.state_dict().items()},
              str(path / "model.safetensors"), metadata={"format": "pt"})
    return str(path)


def rows_of(prompts: list[str], **extra) -> list[dict]:
    """Rows routed to guess_digit and calculator alternately (the dataset's ``environment`` column)."""
    return [{"prompt": p, "answer": str(sum(map(int, p[:-1].split("+")))),
             "environment": "calculator" if i % 2 else "guess_digit", **extra} for i, p in enumerate(prompts)]


def test_the_generator_runs_each_round_of_episodes_with_one_policy_version_and_the_in_process_tokens(
        tmp_path, monkeypatch):
    """Round 0 submitted, then new weights pushed, then round 1. The generator sleeps before each round (test hook),
    so the push is already waiting while round 0 runs its turns: still every episode of round 0 equals the one the
    in-process runner samples with the first weights (same seed, same sampler), and round 1's equals the one with
    the pushed weights, turn for turn, log-prob for log-prob. An engine that took the weights between turns would
    break round 0's later turns."""
    first, second = model(0), model(1)
    settings = EpisodeSettings(name="guess_digit", max_turns=4, max_completion_length=24, step_timeout=60,
                               max_concurrency=4)
    prompts = [["12+3=", "4+4=", "7+1=", "2+2="], ["9+9=", "3+4=", "5+0=", "1+6="]]
    rounds = [([enc(p) for p in ps], rows_of(ps)) for ps in prompts]

    monkeypatch.setenv(TEST_DELAY_ENV, "0.5")
    producer = AsyncRolloutProducer(save_generator_dir(tmp_path / "gen", first), GEN, seed=3, threads=1,
                                    episodes=settings, tokenizer=TOK)
    try:
        producer.submit(0, *rounds[0][:1], rows=rounds[0][1])
        producer.push_weights(1, second.state_dict())
        producer.submit(1, *rounds[1][:1], rows=rounds[1][1])
        got = [producer.get(0), producer.get(1)]
    finally:
        producer.close()

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the generator's
    try:
        torch.manual_seed(3)
        expected = [run_episode_round(ids, rows, sampling_generate(policy, GEN, TOK), TOK, settings, [EOS])
                    for (ids, rows), policy in zip(rounds, (first, second))]
    finally:
        torch.set_num_threads(threads)

    assert [r.version for r in got] == [0, 1]
    episodes = got[0].episodes + got[1].episodes
    assert any(ep.turns > 1 for ep in got[0].episodes)  # round 0 had turns after the push arrived
    assert {ep.transcript[0][0] for ep in episodes} == {"model"} and all(ep.error is None for ep in episodes)
    assert any(ep.tool_calls or ep.stop_reason == "done" for ep in episodes)  # both environments really answered
    for rollout, want in zip(got, expected):
        # token ids, env masks, turns, rewards, transcripts exactly; log-probs to float rounding (the generator's
        # model is loaded from disk, whose attention kernel may sum in another order)
        assert [replace(ep, logprobs=None) for ep in rollout.episodes] == [replace(ep, logprobs=None) for ep in want]
        for ep, ref in zip(rollout.episodes, want):
            assert ep.logprobs == pytest.approx(ref.logprobs, abs=1e-5)
        assert rollout.completion_ids == [ep.completion_ids for ep in want]
        assert rollout.rows == [r for r in (rounds[0][1] if rollout.round_id == 0 else rounds[1][1])]


FAULTY = '''
import string
import threading

from grpo.environments import StepResult, register_environment


@register_environment("faulty")
class Faulty:
    """Each row says how its step goes: answer, raise, or hang forever."""

    stop_strings = tuple(string.printable)  # every turn is one character, then the step
    default_reward = 0.0

    def reset(self, **row):
        self.fault = row["fault"]

    def step(self, action):
        if self.fault == "raise":
            raise RuntimeError("the environment broke")
        if self.fault == "hang":
            threading.Event().wait()
        return StepResult(None, True, 1.0)


@register_environment("unbuildable")
def unbuildable():
    raise ValueError("no such service")
'''


def test_environment_faults_cost_their_episode_a_nan_reward_and_the_generator_serves_on(tmp_path, monkeypatch):
    """Environments from a GRPO_ENV_MODULES file, built in the generator process: a step that raises, a step that
    never returns (past ``step_timeout``) and a factory that raises each end their own episode with a NaN reward and
    the reason; the other episode of the round scores, the round returns, and the same process serves the next
    round. A round the model itself cannot generate (a token id outside the vocabulary) fails with that reason, and
    the process still serves the round after it; at close it exits cleanly, the hung step's thread with it."""
    module = tmp_path / "faulty_envs.py"
    module.write_text(FAULTY)
    monkeypatch.setenv("GRPO_ENV_MODULES", str(module))
    settings = EpisodeSettings(name="faulty", max_turns=2, max_completion_length=16, step_timeout=3.0,
                               max_concurrency=4, modules=environment_module_files())
    # the generator loads this file (and any --env-module file this process loaded before, as a CLI run would)
    assert settings.modules[-1] == str(module) and settings.modules.count(str(module)) == 1
    faults = ["none", "raise", "hang", "none"]
    rows = [{"prompt": "1+1=", "fault": f, "environment": "unbuildable" if i == 3 else None}
            for i, f in enumerate(faults)]
    ids = [enc("1+1=")] * 4
    producer = AsyncRolloutProducer(save_generator_dir(tmp_path / "gen", model(0)), GEN, seed=0, threads=1,
                                    episodes=settings, tokenizer=TOK)
    try:
        producer.submit(0, ids, rows=rows)
        producer.submit(1, [[10 ** 6]], rows=rows[:1])
        producer.submit(2, ids[:1], rows=rows[:1])
        eps = producer.get(0, timeout=300).episodes
        with pytest.raises(RuntimeError, match=r"generator process failed round 1: .*index"):
            producer.get(1, timeout=300)
        again = producer.get(2, timeout=300).episodes
        assert producer._proc.is_alive()
    finally:
        producer.close()
    assert producer._proc.exitcode == 0  # stopped when told, though a thread of it still waits in the hung step

    assert (eps[0].reward, eps[0].error, eps[0].stop_reason) == (1.0, None, "done")
    for ep, why in zip(eps[1:], ("environment step: RuntimeError: the environment broke",
                                 "environment step: timed out after 3 s",
                                 "environment reset: RuntimeError: building the environment failed: ValueError: "
                                 "no such service")):
        assert math.isnan(ep.reward) and ep.stop_reason == "error" and ep.error == why, (ep.error, why)
    assert (again[0].reward, again[0].error, again[0].stop_reason) == (1.0, None, "done")


# ---------------------------------------------------------------- the trainer's side: AsyncRollouts._episodes_for

ASYNC = {"async.use_data_producer": "true", "async.async_prefetch": "true", "async.generator_threads": 1}


def batch_of(trainer, first: int) -> tuple[list[list[int]], list[dict]]:
    rows = [dict(trainer.train_dataset[i]) for i in range(first, first + 2) for _ in range(4)]
    return trainer._tokenize_prompts([r["prompt"] for r in rows])[0], rows


def sync_episodes_of_first_batch(sync) -> tuple[list[list[int]], list[dict], list]:
    """The sync trainer's episodes for its first batch, sampled on one thread (the generator's,
    ``async.generator_threads``) from its seed: what the generator process must make for the same batch."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        torch.manual_seed(sync.args.seed)
        ids, rows = batch_of(sync, 0)
        return ids, rows, sync._episodes_for(ids, rows)
    finally:
        torch.set_num_threads(threads)


def model_logprobs(policy, ep) -> list[float]:
    """The policy's log-prob of each completion token, one forward over prompt + completion (temperature 1)."""
    ids = torch.tensor([ep.prompt_ids + ep.completion_ids])
    with torch.no_grad():
        logps = torch.log_softmax(policy(ids).logits[0, :-1].float(), -1)
    return logps[len(ep.prompt_ids) - 1:].gather(-1, ids[0, len(ep.prompt_ids):, None]).squeeze(-1).tolist()


def test_sync_and_async_trainers_sample_identical_episodes_for_the_same_seed(tmp_path):
    """The same policy, seed and batch: the sync trainer's in-process episodes and the async trainer's (round 0,
    from the generator process) have the same token ids, environment masks, turns and rewards, and log-probs to
    float rounding; the async trainer's round 1 was submitted ahead with its rows. With a budget of 48 tokens where a
    guess_digit turn is a few, both stop each turn where it ends: generated tokens over kept <= 1.05 (every turn
    sampled the episode's remaining budget before)."""
    from tests.trainers import environment_trainer

    def make_trainer(path, **extra):
        return environment_trainer(path, **{"grpo.max_completion_length": 48, **extra})

    sync = make_trainer(tmp_path / "sync")
    ids, rows, expected = sync_episodes_of_first_batch(sync)
    trainer = make_trainer(tmp_path / "async", **ASYNC)
    try:
        got = trainer._episodes_for(ids, rows)
        assert sorted(trainer._submitted) == [1] and trainer._producer._pending[1][1] is not None
    finally:
        trainer.close_producer()
    assert any(ep.turns > 1 for ep in got) and any(ep.env_tokens for ep in got)  # the loop really ran turns
    for episodes in (expected, got):
        generated, kept = sum(ep.generated_tokens for ep in episodes), sum(ep.model_tokens for ep in episodes)
        assert generated <= 1.05 * kept, (generated, kept)
    # the engine names each episode's environment; the sync trainer does so later (in _rollout_episodes)
    assert [replace(ep, logprobs=None, environment=None) for ep in got] == [replace(ep, logprobs=None)
                                                                           for ep in expected]
    for ep, ref in zip(got, expected):
        assert ep.logprobs == pytest.approx(ref.logprobs, abs=1e-5)


def test_a_stale_round_of_episodes_is_generated_again_whole_with_current_weights(tmp_path):
    """max_staleness 0 (set past the load-time rule, as in tests/test_async.py): round 1, prefetched at step 0 with
    the first weights, is one version old at step 1, so it is dropped and every episode is generated again with the
    current weights: every model token's recorded log-prob is the new policy's (none is the old policy's, which
    differs), across all turns."""
    from tests.trainers import environment_trainer as make_trainer

    trainer = make_trainer(tmp_path, **ASYNC, **{"grpo.temperature": 1.0})
    trainer.experiment.async_.max_staleness = 0
    policy = trainer.accelerator.unwrap_model(trainer.model)
    try:
        trainer._episodes_for(*batch_of(trainer, 0))
        ids, rows = trainer._producer._pending[1]  # what was submitted ahead for round 1
        old = {k: v.clone() for k, v in policy.state_dict().items()}
        torch.manual_seed(1)
        with torch.no_grad():
            for param in policy.parameters():
                param.add_(0.3 * torch.randn_like(param))
        trainer.state.global_step = 1
        episodes = trainer._episodes_for(ids, rows)
    finally:
        trainer.close_producer()
    assert trainer._metrics["train"]["async/dropped_stale"] == [0.0, 1.0]
    assert trainer._metrics["train"]["async/staleness_max"] == [0.0, 0.0]
    assert any(ep.turns > 1 for ep in episodes)
    policy.eval()
    new = [model_logprobs(policy, ep) for ep in episodes]
    policy.load_state_dict(old)
    before = [model_logprobs(policy, ep) for ep in episodes]
    for ep, now, then in zip(episodes, new, before):
        model = [j for j, m in enumerate(ep.env_mask) if m]
        assert [ep.logprobs[j] for j in model] == pytest.approx([now[j] for j in model], abs=1e-4)
        assert [ep.logprobs[j] for j in model] != pytest.approx([then[j] for j in model], abs=1e-4)


def test_async_training_on_an_environment_trains_on_the_engines_episodes(tmp_path):
    """A whole async run on guess_digit (prefetch depth 1, max_staleness 1): every step's round came from the
    generator process (staleness 1 after the first), nothing was dropped, and the episode metrics reach the log."""
    from tests.test_async import async_run

    _, summary, rows = async_run(tmp_path, "env-async", **{
        "environment.name": "guess_digit", "grpo.reward_funcs": "[env_reward]", "grpo.max_steps": 4,
        "async.max_staleness": 1, "async.generator_threads": 1, "model.warm_start.steps": 0,
        "grpo.max_completion_length": 10, "grpo.per_device_train_batch_size": 8})
    assert summary["steps"] == 4
    staleness = [r["async/staleness_max"] for r in rows if "async/staleness_max" in r]
    assert staleness == [0.0, 1.0, 1.0, 1.0], staleness
    assert sum(r.get("async/dropped_stale", 0) for r in rows) == 0
    assert all("env/turns/mean" in r for r in rows if "async/staleness_max" in r)
    assert max(r["env/turns/max"] for r in rows if "env/turns/max" in r) > 1
