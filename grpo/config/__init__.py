"""The experiment config: one pydantic model, loaded from YAML, validated before anything is built.

Field names follow ``trl.GRPOConfig`` (section ``grpo``) and axolotl's async ``trl:`` block (section ``async``), so
settings carry over. Every rule that can be checked without a model is checked here; a bad value fails at load
with the field's dotted path and the valid values.

Presets ship inside the package (``grpo/presets/*.yaml``, read with :mod:`importlib.resources`): ``load_config`` takes
a file or a preset name. The defaults are the ``tiny`` preset's values except ``DEFAULTS_NOT_FROM_TINY``.

The package's modules, in import order (:mod:`.rules` names :class:`ExperimentConfig` in type hints only):

* :mod:`.trl_and_rewards`: the checks against TRL's ``GRPOConfig`` fields, transformers' loggers and the reward
  registry, and the Prefect form's help and reward choices from them; the config's only imports from above it;
* :mod:`.rules`: the rules across sections, one function per rule;
* :mod:`.sections`: the schema, one model per YAML section and :class:`ExperimentConfig`;
* :mod:`.loading`: presets, YAML, run-form settings, ``--set`` overrides and the one-line error messages.

``tests/test_layers.py`` checks what each may import.
"""

from grpo.config.loading import (
    DEFAULT_PRESET,
    DEFAULTS_NOT_FROM_TINY,
    PRESETS_FOLDER,
    PRESETS_PACKAGE,
    apply_overrides,
    config_from_dict,
    flatten,
    load_config,
    merge_settings,
    parse_override,
    preset_file,
    presets,
    read_text_file,
    resolve_config,
    to_yaml,
)
from grpo.config.sections import (
    LORA_REFUSED_TARGETS,
    AsyncSection,
    DataConfig,
    EvaluationConfig,
    ExperimentConfig,
    GRPOSection,
    ISMode,
    LoraSection,
    LossType,
    LRScheduler,
    ModelConfig,
    SamplingConfig,
    ScaleRewards,
    TinyModelConfig,
    TrackingConfig,
    WarmStartConfig,
)
from grpo.config.trl_and_rewards import TRL_FIELDS_SET_BY_PLATFORM, TRL_SECRET_FIELDS
from grpo.errors import ConfigError

__all__ = [
    "DEFAULTS_NOT_FROM_TINY",
    "DEFAULT_PRESET",
    "LORA_REFUSED_TARGETS",
    "PRESETS_FOLDER",
    "PRESETS_PACKAGE",
    "TRL_FIELDS_SET_BY_PLATFORM",
    "TRL_SECRET_FIELDS",
    "AsyncSection",
    "ConfigError",
    "DataConfig",
    "EvaluationConfig",
    "ExperimentConfig",
    "GRPOSection",
    "ISMode",
    "LRScheduler",
    "LoraSection",
    "LossType",
    "ModelConfig",
    "SamplingConfig",
    "ScaleRewards",
    "TinyModelConfig",
    "TrackingConfig",
    "WarmStartConfig",
    "apply_overrides",
    "config_from_dict",
    "flatten",
    "load_config",
    "merge_settings",
    "parse_override",
    "preset_file",
    "presets",
    "read_text_file",
    "resolve_config",
    "to_yaml",
]
