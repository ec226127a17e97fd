"""Environments and tools by registered name, like rewards (:mod:`grpo.rewards`).

An environment (:mod:`grpo.environments.base`) turns a rollout into turns: ``reset(**row)`` starts an episode,
``step(action)`` answers each model turn with ``(observation, done, reward)``. A tool is a typed Python function with
a docstring; its JSON schema comes from them (:func:`tool_schema`, transformers' ``get_json_schema``, as TRL builds
the schemas of ``GRPOTrainer(tools=...)``). :func:`grpo.environments.episodes.run_episodes` runs the episodes.

Configs name environments and tools; code gets into the registries as for rewards (:mod:`grpo.registry`):

* the built-ins (:mod:`grpo.environments.builtin`): environments ``calculator``, ``guess_digit``; tool ``calculator``;
  ``openenv`` (:mod:`grpo.environments.openenv`), an environment behind an OpenEnv server;
* the ``grpo.environments`` and ``grpo.tools`` entry-point groups of an installed package;
* ``--env-module path/to/my_envs.py``, a file using :func:`register_environment` / :func:`register_tool`;
* ``GRPO_ENV_MODULES`` (such files, separated by ``os.pathsep``) in the environment of a worker, the async
  generator process or a server.

A registered environment is a factory: a class (or function) whose keyword arguments are the environment's
options, returning one instance per concurrent episode.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from grpo.environments.base import ConcurrencyLimit, Environment, StepResult, ToolCall, ToolEnvironment
from grpo.registry import Registry

EnvironmentFactory = Callable[..., Any]
Tool = Callable[..., Any]
ENVIRONMENTS_ENTRY_POINT_GROUP = "grpo.environments"
TOOLS_ENTRY_POINT_GROUP = "grpo.tools"
MODULES_ENV = "GRPO_ENV_MODULES"
ROUTING_COLUMN = "environment"
"""The dataset column naming each row's environment (TRL's dict of environment factories): prep quarantines a row
naming no registered one, and rollouts and evaluation build the environment it names."""


def _tool_named(name: str, fn: Tool) -> None:
    fn.__name__ = name  # the model calls it by this name, and TRL's schema and tool dicts use __name__


ENVIRONMENTS: Registry[EnvironmentFactory] = Registry(
    "environment", entry_point_group=ENVIRONMENTS_ENTRY_POINT_GROUP, modules_env=MODULES_ENV,
    module_prefix="grpo_user_environments_",
)
TOOLS: Registry[Tool] = Registry(
    "tool", entry_point_group=TOOLS_ENTRY_POINT_GROUP, modules_env=MODULES_ENV,
    module_prefix="grpo_user_environments_", on_register=_tool_named,
)


def register_environment(name: str) -> Callable[[EnvironmentFactory], EnvironmentFactory]:
    """Decorator: make an environment class (or factory function) selectable by ``name`` in a config."""
    return ENVIRONMENTS.register(name)


def register_tool(name: str) -> Callable[[Tool], Tool]:
    """Decorator: make a typed, documented function selectable as a tool by ``name`` (also its ``__name__``)."""
    return TOOLS.register(name)


def load_environment_module(path: str | Path, source: str = "--env-module") -> list[str]:
    """Import a local Python file so its environments and tools join the registries; returns the names it added
    (environments, then tools, then agents). ``source`` names where the path came from, for the error message."""
    from grpo.environments.agents import AGENTS

    tools_before, agents_before = set(TOOLS.names()), set(AGENTS.names())
    added = ENVIRONMENTS.load_module(path, source)
    return added + sorted(set(TOOLS.names()) - tools_before) + sorted(set(AGENTS.names()) - agents_before)


def available_environments() -> list[str]:
    return ENVIRONMENTS.names()


def routable_environments(env_cfg: Any) -> list[str] | None:
    """The names a dataset row's ``environment`` column may route to (the ``environment`` config section given):
    every registered environment when the run trains on environments (prep quarantines rows naming another), else
    None, and the column is an ordinary extra column."""
    return available_environments() if env_cfg.enabled else None


def available_tools() -> list[str]:
    return TOOLS.names()


def get_environment(name: str) -> EnvironmentFactory:
    """The factory registered as ``name``; an unknown name is a ConfigError naming the registered ones."""
    return ENVIRONMENTS.get(name)


def make_environment(name: str, **kwargs: Any) -> Any:
    """A new instance of the environment ``name`` with its options ``kwargs``."""
    return get_environment(name)(**kwargs)


def get_tool(name: str) -> Tool:
    """The tool registered as ``name``; an unknown name is a ConfigError naming the registered ones."""
    return TOOLS.get(name)


def environment_alphabet(names: Iterable[str], tools: Iterable[str] = ()) -> str:
    """The characters the environments ``names`` write or parse (their ``alphabet``) and the names of the extra
    ``tools`` (the model writes ``[name(args)]``): what a character-level tokenizer built for a task must add."""
    chars = set("".join(tools))
    for name in names:
        chars.update(getattr(get_environment(name), "alphabet", "") or "")
    return "".join(sorted(chars))


def tool_schema(tool: Tool | str) -> dict[str, Any]:
    """The tool's JSON schema from its signature and docstring (transformers' ``get_json_schema``, what TRL renders
    into a chat template's tools)."""
    from transformers.utils import get_json_schema

    return get_json_schema(get_tool(tool) if isinstance(tool, str) else tool)


from grpo.environments import agents, builtin, openenv, verifiers_tasksets  # noqa: E402,F401  (register the built-ins; they import the names above)

__all__ = [
    "ENVIRONMENTS", "MODULES_ENV", "TOOLS", "ConcurrencyLimit", "Environment", "StepResult", "ToolCall",
    "ToolEnvironment", "available_environments", "available_tools", "environment_alphabet", "get_environment",
    "get_tool", "load_environment_module",
    "make_environment", "register_environment", "register_tool", "routable_environments", "tool_schema",
]
