"""The sync trainer's environment path (``environment`` section, protocol text; issue #30 §2, §3, §5): episodes
through TRL's ``rollout_func``, rows reaching ``reset``, zero gradient on environment tokens, NaN rewards for failed
environments, episode metrics, and TRL's own arguments for protocol chat."""

from __future__ import annotations

import math

import pytest
import torch

from grpo.environments import Environment, StepResult, register_environment
from grpo.environments.episodes import Episode
from grpo.environments.metrics import episode_metrics
from grpo.training.train import grpo_args
from grpo.training.trainer import GRPOTrainer
from tests.conftest import MICRO
from tests.trainers import environment_trainer as make_trainer
from tests.trainers import logp_gradient

pytestmark = pytest.mark.integration


@register_environment("test_recording_env")
class RecordingEnvironment(Environment):
    """guess_digit's syntax (every digit ends a turn); records the rows it was reset with; ``fail_on`` makes reset
    raise for rows whose answer ends with that digit."""

    stop_strings = tuple("0123456789")
    alphabet = "0123456789<>="
    default_reward = 0.0
    rows: list[dict] = []

    def __init__(self, fail_on: str | None = None) -> None:
        self.fail_on = fail_on

    def reset(self, **row):
        RecordingEnvironment.rows.append(dict(row))
        if self.fail_on is not None and str(row.get("answer", "")).endswith(self.fail_on):
            raise RuntimeError("environment down")
        return None

    def step(self, action: str) -> StepResult:
        if not action or not action[-1].isdigit():
            return StepResult(None, True, 0.0)
        return StepResult("<", False, 0.5)


@pytest.fixture(scope="module")
def guess(tmp_path_factory):
    """A trainer on guess_digit and one scored generation batch (2 prompts x 4 episodes)."""
    trainer = make_trainer(tmp_path_factory.mktemp("guess"))
    torch.manual_seed(0)
    rows = [dict(trainer.train_dataset[i]) for i in range(2) for _ in range(4)]
    batch = trainer.assemble_generation_batch(rows)
    return trainer, rows, batch


def test_episodes_reach_trl_with_their_environment_mask(guess):
    trainer, rows, batch = guess
    assert "tool_mask" in batch
    env_tokens = (batch["completion_mask"] * (1 - batch["tool_mask"])).sum()
    assert env_tokens > 0, "no environment token in the batch: the episodes never got feedback"
    tok = trainer.processing_class
    for i in range(len(rows)):  # every environment token is feedback (<, >, =) or the closing EOS
        n = int(batch["completion_mask"][i].sum())
        ids, mask = batch["completion_ids"][i, :n].tolist(), batch["tool_mask"][i, :n].tolist()
        env_text = [tok.convert_ids_to_tokens(t) for t, m in zip(ids, mask) if m == 0]
        assert set(env_text) <= {"<", ">", "=", tok.eos_token}
    logged = trainer._metrics["train"]
    for name in ("env/turns/mean", "env/turns/max", "env/env_tokens/mean", "env/truncated_frac", "env/errors",
                 "env/tools/call_frequency", "env/guess_digit/reward_mean", "env/generated_tokens/mean",
                 "env/generated_over_kept"):
        assert logged[name], f"{name} not logged"
    assert logged["env/turns/max"][-1] >= 2
    # the sync trainer's sampler stops each turn at its digit, EOS or the episode's budget: nothing generated is cut
    assert logged["env/generated_over_kept"][-1] <= 1.05, logged["env/generated_over_kept"]
    # TRL's completion lengths count model tokens only
    model_tokens = (batch["completion_mask"] * batch["tool_mask"]).sum(1).float()
    assert logged["completions/mean_length"][-1] == pytest.approx(model_tokens.mean().item())


def test_environment_tokens_carry_exactly_zero_gradient(guess):
    """Changing the ids of environment tokens changes what later tokens attend to, so the test changes the logits'
    view of them only through the loss: their log-probs' gradient is exactly zero (the loss does not read them), and
    the loss with env tokens masked equals the loss with their advantages and old log-probs set to anything."""
    trainer, _, batch = guess
    batch = dict(batch)
    batch["advantages"] = torch.linspace(-1, 1, batch["advantages"].numel())
    env = (batch["completion_mask"] * (1 - batch["tool_mask"])).bool()

    def grads(inputs):
        trainer.model.zero_grad(set_to_none=True)
        loss = trainer.compute_loss(trainer.model, inputs)
        loss.backward()
        return torch.cat([p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None]), loss.detach()

    base, base_loss = grads(batch)
    # perturb what the loss could read at environment positions: old/sampling log-probs and per-token advantages
    perturbed = dict(batch)
    adv = batch["advantages"].unsqueeze(1).expand_as(env).clone()
    adv[env] = 1e3
    perturbed["advantages"] = adv
    if perturbed.get("old_per_token_logps") is not None:
        old = perturbed["old_per_token_logps"].clone()
        old[env] = -50.0
        perturbed["old_per_token_logps"] = old
    g, loss = grads(perturbed)
    assert torch.equal(g, base) and torch.equal(loss, base_loss)

    # the per-token log-prob gradient at environment positions is exactly zero
    grad = logp_gradient(trainer, batch)
    assert grad[env].abs().max() == 0
    assert grad[~env & batch["completion_mask"].bool()].abs().max() > 0


def test_the_loss_normaliser_leaves_environment_tokens_out(guess):
    trainer, _, batch = guess
    loss_tokens = (batch["completion_mask"] * batch["tool_mask"]).sum()
    assert batch["num_items_in_batch"] == loss_tokens < batch["completion_mask"].sum()


def test_rows_reach_reset_and_a_failing_environment_scores_nan(tmp_path):
    RecordingEnvironment.rows.clear()
    trainer = make_trainer(tmp_path, env="test_recording_env", **{"environment.kwargs": "{fail_on: '0'}"})
    torch.manual_seed(0)
    data = trainer.train_dataset
    failing = next(i for i in range(len(data)) if data[i]["answer"].endswith("0"))
    others = [i for i in range(len(data)) if not data[i]["answer"].endswith("0")][:1]
    rows = [dict(data[i]) for i in (failing, *others) for _ in range(4)]
    answers = [r["answer"] for r in rows]
    batch = trainer.assemble_generation_batch(rows)
    seen = RecordingEnvironment.rows
    assert [r["answer"] for r in seen] == answers and all("prompt" in r for r in seen)
    assert all("env_reward" not in r for r in seen)
    rewards = trainer._last_rewards_per_func[:, 0]
    failed = torch.tensor([a.endswith("0") for a in answers])
    assert torch.isnan(rewards[failed]).all() and not torch.isnan(rewards[~failed]).any()
    assert (batch["advantages"][failed] == 0).all()
    errors = trainer._metrics["train"]["env/errors"][-1]
    assert errors == pytest.approx(failed.float().mean().item())


def test_episode_metrics_names_and_values():
    eps = [
        Episode([1], [5, 6, 7], [0.0] * 3, [1, 0, 1], turns=2, tool_calls={"calculator": 2},
                tool_failures={"calculator": 1}, stop_reason="eos", reward=1.0, tool_seconds={"calculator": 0.5},
                environment="calculator", generated_tokens=5),
        Episode([1], [5], [0.0], [1], turns=1, unknown_tool_calls=1, stop_reason="max_turns", reward=0.0,
                environment="calculator", generated_tokens=1),
        Episode([1], [], [], [], turns=0, stop_reason="error", reward=math.nan, error="boom", environment="calculator"),
    ]
    m = episode_metrics(eps)
    assert m["env/tools/call_frequency"] == pytest.approx(3 / 3)
    assert m["env/tools/failure_frequency"] == pytest.approx(2 / 3)
    assert m["env/turns/mean"] == pytest.approx(1.0) and m["env/turns/max"] == 2
    assert m["env/env_tokens/mean"] == pytest.approx(1 / 3)
    assert m["env/generated_tokens/mean"] == pytest.approx(6 / 3)
    assert m["env/generated_over_kept"] == pytest.approx(6 / 3)  # 3 model tokens kept of the 6 generated
    assert m["env/truncated_frac"] == pytest.approx(1 / 3)
    assert m["env/errors"] == pytest.approx(1 / 3)
    assert m["env/unknown_tool_calls"] == pytest.approx(1 / 3)
    assert m["env/tools/calculator/calls"] == pytest.approx(2 / 3)
    assert m["env/tools/calculator/failures"] == pytest.approx(1 / 3)
    assert m["env/tools/calculator/latency_s"] == pytest.approx(0.25)
    assert m["env/calculator/reward_mean"] == pytest.approx(0.5)  # the NaN episode left out
    assert not any(math.isnan(v) for v in m.values())
    assert episode_metrics([]) == {}


def test_chat_protocol_passes_trls_own_arguments(tmp_path):
    """Protocol chat is TRL's tool loop: the environment factory (a dict by name with an ``environment`` column),
    the tools and max_tool_calling_iterations go to trl.GRPOTrainer unchanged; text-protocol environments and the
    tiny model are refused at load."""
    from datasets import Dataset

    from grpo.config import config_from_dict
    from grpo.environments import get_tool
    from grpo.errors import ConfigError
    from grpo.training.episodes import chat_environment_factory

    base = {"environment": {"name": "calculator", "protocol": "chat"}}
    with pytest.raises((ConfigError, ValueError), match="tiny"):
        config_from_dict(base, "t")
    with pytest.raises((ConfigError, ValueError), match="text-protocol environment"):
        config_from_dict({**base, "model": {"name_or_path": "Qwen/Qwen2.5-0.5B-Instruct"}}, "t")
    tool_use = {"environment": {"name": "tool_use", "protocol": "chat", "tools": ["calculator"]},
                "model": {"name_or_path": "Qwen/Qwen2.5-0.5B-Instruct"}}
    config_from_dict(tool_use, "t")
    with pytest.raises((ConfigError, ValueError), match="async rollouts .* sample episodes ahead for protocol text"):
        config_from_dict({**tool_use, "async": {"async_prefetch": True}}, "t")  # TRL's loop generates turn by turn
    with pytest.raises((ConfigError, ValueError), match="'tool_use' has no step"):
        config_from_dict({"environment": {"name": "tool_use"}}, "t")  # the text protocol steps its environment

    class Env:  # what TRL's environment_factory expects: reset plus public tool methods
        def __init__(self, k: int = 0) -> None:
            self.k = k

        def reset(self, **row):
            return None

    from grpo.environments import ENVIRONMENTS

    ENVIRONMENTS.register("test_chat_env")(Env)
    cfg = config_from_dict({"environment": {"name": "test_chat_env", "protocol": "chat", "kwargs": {"k": 3},
                                            "tools": ["calculator"], "max_tool_calling_iterations": 5},
                            "model": {"name_or_path": "Qwen/Qwen2.5-0.5B-Instruct"}}, "t")
    assert grpo_args(cfg, tmp_path).max_tool_calling_iterations == 5
    single = chat_environment_factory(cfg.environment, Dataset.from_dict({"prompt": ["a"]}))
    assert isinstance(single(), Env) and single().k == 3
    routed = chat_environment_factory(cfg.environment, Dataset.from_dict(
        {"prompt": ["a", "b"], "environment": ["test_chat_env", "guess_digit"]}))
    assert set(routed) == {"test_chat_env", "guess_digit"} and routed["test_chat_env"]().k == 3
    kwargs: dict = {}
    GRPOTrainer._environment_trainer_kwargs(object.__new__(GRPOTrainer), cfg, kwargs)
    # the registered tool, recorded for the per-tool metrics (grpo.environments.chat.ToolLedger)
    assert [t.__wrapped__ for t in kwargs["tools"]] == [get_tool("calculator")] and "rollout_func" not in kwargs
    assert kwargs["environment_factory"]().k == 3


def test_importance_weights_and_their_statistics_leave_environment_tokens_out(guess):
    """The off-policy IS correction (async.vllm_importance_sampling_*): what the trainer's log-probs say about
    environment tokens changes neither the weights nor the logged ratio (sequence mode sums over the sequence)."""
    trainer, _, batch = guess
    env = (batch["completion_mask"] * (1 - batch["tool_mask"])).bool()
    experiment = trainer.experiment
    a = experiment.async_.model_copy(update={"vllm_importance_sampling_correction": True,
                                             "vllm_importance_sampling_mode": "sequence_truncate",
                                             "vllm_importance_sampling_cap": 3.0})
    trainer.experiment = experiment.model_copy(update={"async_": a})
    old = batch["sampling_per_token_logps"] - 0.01 * batch["completion_mask"]

    def weighted(old_logps):
        b = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
        b["advantages"] = torch.ones(b["completion_ids"].shape[0])
        trainer._apply_importance_weights(b, old_logps, torch.zeros(b["completion_ids"].shape[0], dtype=torch.bool))
        return b["advantages"], trainer._metrics["train"]["sampling/importance_sampling_ratio/max"][-1]

    try:
        weights, ratio_max = weighted(old)
        changed = old.clone()
        changed[env] = -7.0
        assert torch.equal(weighted(changed)[0], weights) and weighted(changed)[1] == ratio_max
    finally:
        trainer.experiment = experiment


def test_a_replayed_episode_group_keeps_its_environment_mask():
    """The replay buffer stores rollouts: a replayed group's environment tokens stay out of the loss."""
    from grpo.algo.replay import place_group

    batch = {"prompt_ids": torch.ones(4, 2, dtype=torch.long), "prompt_mask": torch.ones(4, 2, dtype=torch.long),
             "completion_ids": torch.ones(4, 3, dtype=torch.long),
             "completion_mask": torch.ones(4, 3, dtype=torch.long), "tool_mask": torch.ones(4, 3, dtype=torch.long)}
    group = {"prompt_ids": torch.ones(2, 2, dtype=torch.long), "prompt_mask": torch.ones(2, 2, dtype=torch.long),
             "completion_ids": torch.full((2, 5), 7), "completion_mask": torch.ones(2, 5, dtype=torch.long),
             "tool_mask": torch.tensor([[1, 0, 0, 1, 1], [1, 1, 0, 1, 1]])}
    place_group(batch, slice(2, 4), group, pad_token_id=0)
    assert batch["tool_mask"].shape == batch["completion_ids"].shape == (4, 5)
    assert torch.equal(batch["tool_mask"][2:], group["tool_mask"])
    assert torch.equal(batch["tool_mask"][:2], torch.ones(2, 5, dtype=torch.long))  # widened with TRL's padding 1


ECHO_ENV = '''
from grpo.environments import StepResult, register_environment


@register_environment("cli_echo")
class Echo:
    stop_strings = ("]",)

    def reset(self, **row):
        return None

    def step(self, action):
        return StepResult("ok|", True, 1.0)
'''


@pytest.mark.parametrize("command", ["validate", "plan", "run", "sweep"])
def test_env_module_registers_environments_for_the_command_and_its_children(tmp_path, command):
    """``--env-module FILE`` as ``--reward-module``: without it the name is refused (one line, exit 2); with it the
    config loads, and processes started from the CLI find it through GRPO_ENV_MODULES."""
    import os
    import subprocess
    import sys

    (tmp_path / "my_envs.py").write_text(ECHO_ENV)
    base = [sys.executable, "-m", "grpo.app.cli", command, "--config", str(MICRO), "--set",
            "environment.name=cli_echo", "--set", f"output_dir={tmp_path / 'runs'}"]
    if command == "sweep":
        (tmp_path / "space.yaml").write_text("grpo.learning_rate: {type: float, low: 0.001, high: 0.01}\n")
        base += ["--space", str(tmp_path / "space.yaml")]
    env = {k: v for k, v in os.environ.items() if k != "GRPO_ENV_MODULES"}
    refused = subprocess.run(base, cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)
    assert refused.returncode == 2 and "unknown environment 'cli_echo'" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1
    if command != "validate":
        return
    ok = subprocess.run([*base, "--env-module", "my_envs.py"], cwd=tmp_path, capture_output=True, text=True,
                        timeout=120, env=env)
    assert ok.returncode == 0, ok.stderr
    assert "name: cli_echo" in ok.stdout


def test_env_modules_reach_child_processes(tmp_path, monkeypatch):
    import subprocess
    import sys

    from grpo.app.cli import _load

    (tmp_path / "child_envs.py").write_text(ECHO_ENV.replace("cli_echo", "child_echo"))
    monkeypatch.setenv("GRPO_ENV_MODULES", "")  # restored after the test: the CLI loader appends to it
    cfg = _load(MICRO, ["environment.name=child_echo", f"output_dir={tmp_path}"], None, [tmp_path / "child_envs.py"])
    assert cfg.environment.name == "child_echo"
    child = subprocess.run([sys.executable, "-c", "from grpo.environments import make_environment; "
                            "print(type(make_environment('child_echo')).__name__)"], capture_output=True, text=True,
                           timeout=120)
    assert child.returncode == 0 and child.stdout.strip() == "Echo", child.stderr
