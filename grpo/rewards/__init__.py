"""Reward functions by registered name, with TRL's reward signature.

A reward function is called as ``fn(prompts=..., completions=..., completion_ids=..., **dataset_columns)`` and
returns one float (or None, "not applicable") per completion — exactly what ``trl.GRPOTrainer`` expects, so any
function written for TRL works here.

Configs name rewards; they never hold import strings. Code gets into the registry (:class:`grpo.registry.Registry`,
shared with environments and tools) only by choice of whoever installs or launches the platform, never by a UI user
typing a config value:

* the built-ins below;
* the ``grpo.rewards`` entry-point group of an installed package (``name = "pkg.module:function"``);
* ``grpo run --reward-module path/to/my_rewards.py``, a file whose functions use :func:`register_reward`;
* ``GRPO_REWARD_MODULES`` (such files, separated by ``os.pathsep``) in the environment of a worker or server, so
  flow runs started from the Prefect UI find the same rewards as the CLI.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

from grpo.registry import Registry

RewardFunc = Callable[..., list[float | None]]
ENTRY_POINT_GROUP = "grpo.rewards"
MODULES_ENV = "GRPO_REWARD_MODULES"


def _named(name: str, fn: RewardFunc) -> None:
    fn.__name__ = name  # TRL names per-reward metrics after __name__: rewards/<name>/mean


REWARDS: Registry[RewardFunc] = Registry(
    "reward", entry_point_group=ENTRY_POINT_GROUP, modules_env=MODULES_ENV, module_prefix="grpo_user_rewards_",
    on_register=_named,
)


def register_reward(name: str) -> Callable[[RewardFunc], RewardFunc]:
    """Decorator: make ``fn`` selectable as ``grpo.reward_funcs: [name]`` in a config."""
    return REWARDS.register(name)


def load_reward_module(path: str | Path, source: str = "--reward-module") -> list[str]:
    """Import a local Python file so its ``@register_reward`` functions join the registry; returns their names.
    ``source`` names where the path came from, for the error message."""
    return REWARDS.load_module(path, source)


def available_rewards() -> list[str]:
    return REWARDS.names()


def get_reward(name: str) -> RewardFunc:
    return REWARDS.get(name)


def _text(completion) -> str:
    """Plain completions are strings; conversational ones are message lists ([{"role": "assistant", "content": ...}],
    with TRL's tool loop assistant and tool messages in turn): the model's last message is its answer, never a tool's
    output (an episode cut off after a tool call ends on the tool's message)."""
    if isinstance(completion, str):
        return completion
    answer = next((m for m in reversed(completion) if m.get("role", "assistant") == "assistant"), None)
    content = answer.get("content") if answer else None
    return content if isinstance(content, str) else ""


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def _as_number(text: str) -> float | None:
    try:
        return float(text.replace(",", "").strip())
    except ValueError:
        return None


@register_reward("exact_match")
def exact_match(completions, answer, **kwargs) -> list[float]:
    """1.0 when the stripped completion equals the stripped answer, else 0.0."""
    return [float(_text(c).strip() == str(a).strip()) for c, a in zip(completions, answer)]


@register_reward("last_number_match")
def last_number_match(completions, answer, **kwargs) -> list[float]:
    """1.0 when the last number in the completion equals the answer numerically (GSM8K-style), else 0.0."""
    out = []
    for c, a in zip(completions, answer):
        numbers = _NUMBER.findall(_text(c))
        got, want = (_as_number(numbers[-1]) if numbers else None), _as_number(str(a))
        out.append(float(got is not None and want is not None and abs(got - want) < 1e-6))
    return out


@register_reward("digits_format")
def digits_format(completions, **kwargs) -> list[float]:
    """1.0 when the completion is a bare integer (what the arithmetic task asks for), else 0.0."""
    return [float(re.fullmatch(r"-?\d+", _text(c).strip()) is not None) for c in completions]


@register_reward("env_reward")
def env_reward(completions, env_reward=None, **kwargs) -> list[float | None]:
    """The environment's own reward of each episode (``environment`` section: the sum of its steps' rewards, the
    column ``env_reward`` the episode runner adds). None (not applicable) without an environment, and for an
    episode whose environment failed (NaN): the group statistics leave it out."""
    if env_reward is None:
        return [None] * len(completions)
    return [None if r is None or r != r else float(r) for r in env_reward]


@register_reward("answer_tag_format")
def answer_tag_format(completions, **kwargs) -> list[float]:
    """1.0 when the completion has reasoning followed by exactly one ``<answer>...</answer>`` block, else 0.0."""
    pattern = re.compile(r"^(?s:.*?)<answer>\s*[^<]+?\s*</answer>\s*$")
    return [float(pattern.match(_text(c).strip()) is not None) for c in completions]
