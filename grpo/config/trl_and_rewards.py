"""What the config checks against the layers above it: ``trl.GRPOConfig``'s fields and help text, transformers'
logger integrations (``grpo.report_to``), the reward registry (:mod:`grpo.rewards`) and the environment and tool
registries (:mod:`grpo.environments`).

This module is the config's one way up: no other :mod:`grpo.config` module imports TRL, transformers or
:mod:`grpo.rewards` (``tests/test_layers.py``). It imports them inside the functions that read them, so importing the
config (every ``grpo`` command, every test) costs no TRL import (seconds) and a config that sets neither
``grpo.extra`` nor ``grpo.report_to`` never imports TRL at all.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import difflib
import functools
import importlib.util
from collections.abc import Collection, Iterable
from pathlib import Path
from typing import Any

__all__ = [
    "TRL_FIELDS_SET_BY_PLATFORM",
    "TRL_SECRET_FIELDS",
    "check_extra_fields",
    "check_report_to",
    "check_agent_name",
    "check_environment_builds",
    "check_environment_names",
    "check_reward_names",
    "environment_kind",
    "environment_lacks_step",
    "agent_enum",
    "environment_enum",
    "grpo_config_help",
    "reward_enum",
    "tool_enum",
    "trl_help",
]

# trl.GRPOConfig fields that hold secrets, with the environment variable the library reads instead. Refused in
# grpo.extra: a config is written to config.yaml, shown as Prefect flow-run parameters and logged to MLflow.
TRL_SECRET_FIELDS = {"hub_token": "HF_TOKEN"}

# trl.GRPOConfig fields the platform sets itself (grpo.training.train.grpo_args), with where their value comes from.
# grpo.extra may not set them: kwargs from extra are applied last and would silently win over the platform's field.
TRL_FIELDS_SET_BY_PLATFORM: dict[str, str] = {
    "output_dir": "the run directory (output_dir + run name)",
    "use_cpu": "the machine (CPU when no CUDA device is present)",
    "report_to": "grpo.report_to",
    "shuffle_dataset": "sampling.shuffle",
    "vllm_importance_sampling_correction": "async.vllm_importance_sampling_correction",
    "vllm_importance_sampling_mode": "async.vllm_importance_sampling_mode",
    "vllm_importance_sampling_clip_max": "async.vllm_importance_sampling_cap",
    "off_policy_mask_threshold": "async.off_policy_mask_threshold",
    "use_bias_correction_kl": "async.use_bias_correction_kl",
}


# ---------------------------------------------------------------- checks (raise ValueError naming the field)


def check_extra_fields(extra: Iterable[str], regular_fields: Collection[str]) -> None:
    """``grpo.extra`` holds only ``trl.GRPOConfig`` fields that no regular field or platform setting covers, and no
    secret; ``regular_fields``: the ``grpo`` section's own field names."""
    from trl import GRPOConfig

    trl_fields = {f.name for f in dataclasses.fields(GRPOConfig)}
    for key in extra:
        if key in TRL_SECRET_FIELDS:
            raise ValueError(
                f"extra: {key!r} is a secret, and a config is stored in plain text (the run directory's "
                f"config.yaml, the Prefect flow-run parameters); set the {TRL_SECRET_FIELDS[key]} environment "
                "variable instead (huggingface_hub reads it)"
            )
        if key in TRL_FIELDS_SET_BY_PLATFORM:
            raise ValueError(
                f"extra: {key!r} is set from {TRL_FIELDS_SET_BY_PLATFORM[key]}; set that instead (a value here "
                "would silently override it)"
            )
        if key in regular_fields:
            raise ValueError(f"extra: {key!r} is a regular field here; set grpo.{key} instead")
        if key not in trl_fields:
            close = difflib.get_close_matches(key, sorted(trl_fields), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"extra: {key!r} is not a trl.GRPOConfig field{hint}")


def check_report_to(report_to: Iterable[str]) -> None:
    """``grpo.report_to`` names installed transformers loggers other than MLflow (the platform's own tracking)."""
    from transformers.integrations.integration_utils import (
        INTEGRATION_TO_CALLBACK,
        get_available_reporting_integrations,
    )

    for name in report_to:
        if name in ("mlflow", "dagshub", "all"):
            raise ValueError(
                f"report_to: {name!r} would make TRL log a second MLflow run beside the platform's: MLflow "
                "tracking is tracking.backend: mlflow; list the other loggers by name (e.g. ['tensorboard'])"
            )
        if name == "none":
            raise ValueError("report_to: use an empty list [] for no extra loggers, not 'none'")
        if name not in INTEGRATION_TO_CALLBACK:
            valid = sorted(set(INTEGRATION_TO_CALLBACK) - {"mlflow", "dagshub"})
            raise ValueError(f"report_to: unknown logger {name!r}; valid: {', '.join(valid)}")
        if name not in get_available_reporting_integrations():
            raise ValueError(f"report_to: {name!r} is not installed in this environment (pip install {name})")


def check_reward_names(fields: dict[str, list[str]]) -> None:
    """Every reward named by a config field (dotted key -> names) is registered."""
    from grpo.rewards import available_rewards

    known = available_rewards()
    for field, names in fields.items():
        for name in names:
            if name not in known:
                raise ValueError(f"{field}: unknown reward {name!r}; registered rewards: {', '.join(known)}")


def check_environment_names(field: str, name: str | None, tools_field: str, tools: list[str]) -> None:
    """The environment and the tools a config names are registered (built-ins, entry points, ``GRPO_ENV_MODULES``,
    ``--env-module``)."""
    from grpo.environments import available_environments, available_tools

    if name is not None and name not in (known := available_environments()):
        raise ValueError(f"{field}: unknown environment {name!r}; registered environments: {', '.join(known)}")
    known_tools = available_tools()
    for tool in tools:
        if tool not in known_tools:
            raise ValueError(f"{tools_field}: unknown tool {tool!r}; registered tools: {', '.join(known_tools)}")


def check_agent_name(field: str, name: str | None) -> None:
    """The agent a config names is registered (built-ins, entry points, ``GRPO_ENV_MODULES``, ``--env-module``)."""
    from grpo.environments.agents import available_agents

    if name is not None and name not in (known := available_agents()):
        raise ValueError(f"{field}: unknown agent {name!r}; registered agents: {', '.join(known)}")


def check_environment_builds(field: str, name: str, kwargs: dict[str, Any]) -> None:
    """The registered environment ``name`` can be built with ``kwargs`` (its own check of its options included)."""
    from grpo.environments import make_environment

    try:
        make_environment(name, **kwargs)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{field}: environment {name!r} cannot be built with {kwargs}: {err}") from None


# ---------------------------------------------------------------- Prefect form helpers (pydantic json_schema_extra)


# Where trl.GRPOConfig's fields are declared, base class first (a later class's field overrides an earlier one's).
_GRPO_CONFIG_CLASSES = (("transformers", "training_args.py", "TrainingArguments"),
                        ("trl", "trainer/base_config.py", "_BaseConfig"),
                        ("trl", "trainer/grpo_config.py", "GRPOConfig"))


@functools.lru_cache(maxsize=1)
def grpo_config_help() -> dict[str, str]:
    """``trl.GRPOConfig``'s help text by field name, read from the source of the dataclasses that declare it
    (:data:`_GRPO_CONFIG_CLASSES`) without importing them: importing TRL imports transformers and torch (~7 s of CPU),
    and ``grpo serve`` / ``grpo deploy`` need only the text for their forms. When a file or class has moved (a TRL or
    transformers release), it falls back to the dataclass itself (``tests/test_run_form.py`` checks both agree)."""
    help_text: dict[str, str] = {}
    for package, relative, class_name in _GRPO_CONFIG_CLASSES:
        spec = importlib.util.find_spec(package)  # a top-level package's spec: found, not imported
        source = (Path(spec.submodule_search_locations[0]) / relative
                  if spec is not None and spec.submodule_search_locations else None)
        fields = _dataclass_help(source, class_name) if source is not None and source.is_file() else None
        if not fields:
            return _imported_grpo_config_help()
        help_text.update(fields)
    return help_text


def _dataclass_help(source: Path, class_name: str) -> dict[str, str] | None:
    """``{field: metadata["help"]}`` of the fields ``class_name`` declares in ``source`` (``name: T = field(...,
    metadata={"help": <literal>})``), or None when the class is not there."""
    tree = ast.parse(source.read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            found = {}
            for item in node.body:
                if not (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
                        and isinstance(item.value, ast.Call)):
                    continue
                for keyword in item.value.keywords:
                    if keyword.arg == "metadata" and isinstance(keyword.value, ast.Dict):
                        for key, value in zip(keyword.value.keys, keyword.value.values):
                            if isinstance(key, ast.Constant) and key.value == "help":
                                with contextlib.suppress(ValueError, TypeError, SyntaxError, MemoryError,
                                                         RecursionError):
                                    found[item.target.id] = ast.literal_eval(value)
            return found
    return None


def _imported_grpo_config_help() -> dict[str, str]:
    from trl import GRPOConfig

    return {f.name: f.metadata["help"] for f in dataclasses.fields(GRPOConfig) if f.metadata.get("help")}


def trl_help(schema: dict[str, Any]) -> None:
    """Describe fields from ``trl.GRPOConfig``'s own help text where we have none (for the Prefect form)."""
    help_text = grpo_config_help()
    for name, prop in schema.get("properties", {}).items():
        text = " ".join((help_text.get(name) or "").split())
        if text and "description" not in prop:
            sentences = text.split(". ")
            short = sentences[0]
            for more in sentences[1:]:
                if len(short) + len(more) > 220:
                    break
                short += ". " + more
            prop["description"] = short.rstrip(".") + " (TRL)"


def environment_kind(name: str) -> tuple[bool, bool]:
    """``(is a ToolEnvironment, has a text-protocol step)`` of the registered environment ``name``."""
    from grpo.environments import ToolEnvironment, get_environment

    factory = get_environment(name)
    return (isinstance(factory, type) and issubclass(factory, ToolEnvironment),
            callable(getattr(factory, "step", None)))


def environment_lacks_step(name: str) -> bool:
    """Whether the registered environment ``name`` is a class without ``step`` (one written for TRL's tool loop). A
    factory function's instances are known only once built, so it never lacks one here."""
    from grpo.environments import get_environment

    factory = get_environment(name)
    return isinstance(factory, type) and not callable(getattr(factory, "step", None))


def environment_enum(schema: dict[str, Any]) -> None:
    """Registered environment names as a closed choice (a dropdown in the Prefect form)."""
    from grpo.environments import available_environments

    _choices(schema, available_environments())


def agent_enum(schema: dict[str, Any]) -> None:
    """Registered agent names as a closed choice."""
    from grpo.environments.agents import available_agents

    _choices(schema, available_agents())


def tool_enum(schema: dict[str, Any]) -> None:
    """Registered tool names as a closed choice."""
    from grpo.environments import available_tools

    _choices(schema, available_tools())


def _choices(schema: dict[str, Any], names: list[str]) -> None:
    """Set the enum on a list's items, or on the one non-null branch of an optional field."""
    if "items" in schema:
        schema["items"]["enum"] = sorted(names)
    elif "anyOf" in schema:
        for branch in schema["anyOf"]:
            if branch.get("type") != "null":
                branch["enum"] = sorted(names)
    else:
        schema["enum"] = sorted(names)


def reward_enum(schema: dict[str, Any]) -> None:
    """Registered reward names as a closed choice (built-ins, entry points, ``GRPO_REWARD_MODULES``)."""
    from grpo.rewards import available_rewards

    target = schema.get("items", schema)
    target["enum"] = sorted(available_rewards())
