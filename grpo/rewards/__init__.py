"""Reward functions by registered name, with TRL's reward signature.

A reward function is called as ``fn(prompts=..., completions=..., completion_ids=..., **dataset_columns)`` and
returns one float (or None, "not applicable") per completion — exactly what ``trl.GRPOTrainer`` expects, so any
function written for TRL works here.

Configs name rewards; they never hold import strings. Code gets into the registry three ways, all chosen by whoever
installs or launches the platform, never by a UI user typing a config value:

* the built-ins below;
* the ``grpo.rewards`` entry-point group of an installed package (``name = "pkg.module:function"``);
* ``grpo run --reward-module path/to/my_rewards.py``, a file whose functions use :func:`register_reward`;
* ``GRPO_REWARD_MODULES`` (such files, separated by ``os.pathsep``) in the environment of a worker or server, so
  flow runs started from the Prefect UI find the same rewards as the CLI.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path

from grpo.errors import ConfigError

RewardFunc = Callable[..., list[float | None]]
_REGISTRY: dict[str, RewardFunc] = {}
_ENTRY_POINTS_LOADED = False
ENTRY_POINT_GROUP = "grpo.rewards"
MODULES_ENV = "GRPO_REWARD_MODULES"


def register_reward(name: str) -> Callable[[RewardFunc], RewardFunc]:
    """Decorator: make ``fn`` selectable as ``grpo.reward_funcs: [name]`` in a config."""

    def deco(fn: RewardFunc) -> RewardFunc:
        if name in _REGISTRY and _REGISTRY[name] is not fn:
            raise ValueError(f"reward {name!r} is already registered by {_REGISTRY[name].__module__}")
        fn.__name__ = name  # TRL names per-reward metrics after __name__: rewards/<name>/mean
        _REGISTRY[name] = fn
        return fn

    return deco


def _load_entry_points() -> None:
    global _ENTRY_POINTS_LOADED
    if _ENTRY_POINTS_LOADED:
        return
    _ENTRY_POINTS_LOADED = True
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name not in _REGISTRY:
            register_reward(ep.name)(ep.load())
    for path in filter(None, os.environ.get(MODULES_ENV, "").split(os.pathsep)):
        load_reward_module(path, source=MODULES_ENV)


def load_reward_module(path: str | Path, source: str = "--reward-module") -> list[str]:
    """Import a local Python file so its ``@register_reward`` functions join the registry; returns their names.
    ``source`` names where the path came from, for the error message."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{source}: file not found: {path}")
    before = set(_REGISTRY)
    module_name = f"grpo_user_rewards_{path.stem}"
    loaded = sys.modules.get(module_name)
    if loaded is not None and Path(getattr(loaded, "__file__", "")).resolve() == path.resolve():
        return []  # already imported (e.g. named by both --reward-module and GRPO_REWARD_MODULES)
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"{source}: cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # so worker processes can unpickle its functions
    try:
        spec.loader.exec_module(module)
    except Exception as err:  # the user's code: any error is theirs to fix, named in one line
        sys.modules.pop(module_name, None)
        raise ConfigError(f"{source}: importing {path} failed: {type(err).__name__}: {err}") from None
    return sorted(set(_REGISTRY) - before)


def available_rewards() -> list[str]:
    _load_entry_points()
    return sorted(_REGISTRY)


def get_reward(name: str) -> RewardFunc:
    _load_entry_points()
    if name not in _REGISTRY:
        raise ConfigError(f"unknown reward {name!r}; registered rewards: {', '.join(available_rewards())}")
    return _REGISTRY[name]


def _text(completion) -> str:
    """Plain completions are strings; conversational ones are [{"role": "assistant", "content": ...}]."""
    if isinstance(completion, str):
        return completion
    return completion[-1]["content"] if completion else ""


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


@register_reward("answer_tag_format")
def answer_tag_format(completions, **kwargs) -> list[float]:
    """1.0 when the completion has reasoning followed by exactly one ``<answer>...</answer>`` block, else 0.0."""
    pattern = re.compile(r"^(?s:.*?)<answer>\s*[^<]+?\s*</answer>\s*$")
    return [float(pattern.match(_text(c).strip()) is not None) for c in completions]
