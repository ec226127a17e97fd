"""Loading a config: presets (package data), YAML files, run-form settings and ``--set`` overrides, and the one-line
messages a bad value gets (the field's dotted path, "did you mean" for a misspelt field).

Presets ship inside the package (``grpo/presets/*.yaml``, read with :mod:`importlib.resources`): ``load_config`` takes
a file or a preset name. The defaults are the ``tiny`` preset's values except ``DEFAULTS_NOT_FROM_TINY``.
"""

from __future__ import annotations

import difflib
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from grpo.config.sections import ExperimentConfig
from grpo.errors import ConfigError


def _format_validation_error(err: ValidationError) -> str:
    parts = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"] if p != "__root__")
        if e["type"] == "extra_forbidden":
            parts.append(f"{loc}: unknown field{_suggest(e['loc'])}")
        elif e["type"] == "missing":
            parts.append(f"{loc}: required field missing")
        else:
            msg = e["msg"].removeprefix("Value error, ")
            head, sep, rest = msg.partition(": ")
            if sep and loc and head.isidentifier():  # "source: ..." raised inside section "data" -> "data.source: ..."
                loc, msg = f"{loc}.{head}", rest
            got = e.get("input")
            shown = (f" (got {got!r})"
                     if got is not None and not isinstance(got, dict) and e["type"] != "value_error" else "")
            parts.append(f"{loc}: {msg}{shown}" if loc else msg)
    return "; ".join(parts)


def _suggest(loc: tuple) -> str:
    model: type[BaseModel] = ExperimentConfig
    for part in loc[:-1]:
        fields = {f.alias or n: f for n, f in model.model_fields.items()}
        field = fields.get(str(part))
        if field is None or not (isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)):
            return ""
        model = field.annotation
    names = [f.alias or n for n, f in model.model_fields.items()]
    close = difflib.get_close_matches(str(loc[-1]), names, n=1)
    return f" (did you mean {close[0]!r}?)" if close else f"; valid fields: {', '.join(names)}"


def parse_override(item: str) -> tuple[list[str], Any]:
    """``grpo.learning_rate=3e-4`` -> (["grpo", "learning_rate"], 0.0003); values are parsed as YAML scalars."""
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected key=value, e.g. grpo.learning_rate=3e-4")
    key, raw = item.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"--set {item!r}: empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.split("."), value


def _is_section(path: list[str]) -> bool:
    model: type[BaseModel] = ExperimentConfig
    for part in path:
        field = {f.alias or n: f for n, f in model.model_fields.items()}.get(part)
        if field is None or not (isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)):
            return False
        model = field.annotation
    return True


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Set each ``key=value``. A mapping given for a whole section is merged into it field by field; an empty one
    (``grpo={}``) is refused, since replacing the section would silently reset all its fields to defaults."""
    for item in overrides:
        path, value = parse_override(item)
        node = data
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"--set {item!r}: {part} is not a section")
            node = child
        if isinstance(value, dict) and _is_section(path):
            if not value:
                raise ConfigError(f"--set {item!r}: an empty mapping would reset section {'.'.join(path)} to its "
                                  f"defaults; set fields one by one ({'.'.join(path)}.FIELD=VALUE)")
            current = node.get(path[-1])
            node[path[-1]] = {**current, **value} if isinstance(current, dict) else value
        else:
            node[path[-1]] = value
    return data


def config_from_dict(data: dict, source: str = "config") -> ExperimentConfig:
    try:
        return ExperimentConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(f"{source}: {_format_validation_error(err)}") from None


def read_text_file(path: Path) -> str:
    """A config file's text; a file that is not UTF-8 is a :class:`ConfigError` naming the line, not a traceback."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data[: err.start].count(b"\n") + 1
        raise ConfigError(
            f"{path}: not UTF-8 text (line {line}: byte {data[err.start]:#04x}); save it as UTF-8"
        ) from None


# ---------------------------------------------------------------- presets (package data: grpo/presets/)

# Where ExperimentConfig() differs from the tiny preset, and why (tests/test_config.py checks every other field).
DEFAULTS_NOT_FROM_TINY: dict[str, str] = {
    "model.warm_start.carry_error_rate": "0: imperfect demonstrations are the tiny experiment's choice, and any other "
    "value is refused for non-synthetic data",
    "evaluation.num_prompts": "null (every held-out prompt) for any dataset; tiny caps it at its 500",
    "tracking.backend": "'none': a bare config writes only its run directory; tiny tracks into MLflow",
    "tracking.experiment_name": "'grpo' for any experiment; tiny logs under 'grpo-tiny'",
}

PRESETS_PACKAGE = "grpo"
PRESETS_FOLDER = "presets"
DEFAULT_PRESET = "tiny"  # the starting values of run forms (grpo serve, the pipeline flow's config parameter)


def _preset_dir(kind: str = "") -> Traversable:
    folder = resources.files(PRESETS_PACKAGE).joinpath(PRESETS_FOLDER)
    return folder.joinpath(kind) if kind else folder


def presets(kind: str = "") -> list[str]:
    """Names of the presets shipped with the package: experiment configs (``tiny``, ``tiny-calculator``,
    ``tiny-guess-digit``, ``qwen2.5-0.5b-gsm8k``) in ``grpo/presets/``, or with ``kind="spaces"`` the sweep search
    spaces in ``grpo/presets/spaces/``."""
    folder = _preset_dir(kind)
    if not folder.is_dir():
        return []
    return sorted(f.name[: -len(".yaml")] for f in folder.iterdir() if f.is_file() and f.name.endswith(".yaml"))


def preset_file(name: str, kind: str = "") -> Traversable:
    """The packaged YAML of preset ``name`` (read it with ``.read_text()``; it need not be a file on disk)."""
    if name not in presets(kind):
        what = "space preset" if kind == "spaces" else "preset"
        raise ConfigError(f"unknown {what} {name!r}; valid: {', '.join(presets(kind))}")
    return _preset_dir(kind).joinpath(f"{name}.yaml")


def _looks_like_name(value: str) -> bool:
    return "/" not in value and "\\" not in value and not value.endswith((".yaml", ".yml", ".json"))


def _config_source(path: str | Path) -> tuple[str, str]:
    """(YAML text, name for messages) of a config file, else of the preset of that name."""
    file = Path(path)
    if file.is_file():
        return read_text_file(file), str(file)
    name = str(path)
    if name in presets():
        return preset_file(name).read_text(encoding="utf-8"), f"preset {name}"
    hint = f"; or a preset name: {', '.join(presets())}" if _looks_like_name(name) else ""
    raise ConfigError(f"config file not found: {file}{hint}")


def load_config(path: str | Path | None = None, overrides: list[str] | None = None,
                settings: dict | None = None) -> ExperimentConfig:
    """Read YAML from a file or a preset (a name from :func:`presets`, e.g. ``tiny``; a file of that name wins), or
    the built-in defaults when ``path`` is None; merge ``settings`` (a nested mapping, what a run form's fields set),
    apply ``--set`` overrides, validate."""
    data: dict = {}
    source = "defaults"
    if path is not None:
        text, source = _config_source(path)
        try:
            loaded = yaml.safe_load(text)
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            problem = getattr(err, "problem", None) or str(err).splitlines()[0]
            raise ConfigError(f"{source}: YAML syntax error{where}: {problem}") from None
        if loaded is None:
            raise ConfigError(f"{source}: the file is empty (no sections); write the settings to change, or start "
                              f"from a preset such as `--config tiny` ({', '.join(presets())})")
        if not isinstance(loaded, dict):
            raise ConfigError(f"{source}: top level must be a mapping of sections (data, model, grpo, ...)")
        data = loaded
    data = apply_overrides(merge_settings(data, settings or {}), overrides or [])
    return config_from_dict(data, source)


def merge_settings(data: dict, settings: dict) -> dict:
    """``data`` with the fields of ``settings`` set one by one, section into section (a partial section changes only
    the fields it names)."""
    for key, value in settings.items():
        current = data.get(key)
        if isinstance(value, dict) and isinstance(current, dict):
            data[key] = merge_settings(dict(current), value)
        else:
            data[key] = value
    return data


def _is_preset(config: ExperimentConfig, preset: str) -> bool:
    try:
        return config == load_config(preset)
    except ConfigError:  # the preset needs an override to load here (qwen2.5-0.5b-gsm8k without vllm)
        return False


def resolve_config(config: ExperimentConfig | dict | None, preset: str | None = None,
                   overrides: list[str] | None = None, settings: dict | None = None) -> ExperimentConfig:
    """What a form submits: a preset (replacing ``config``; neither means :data:`DEFAULT_PRESET`), then the fields the
    form sets (``settings``, a nested mapping) and ``key=value`` overrides on top.

    A deployment that names a preset keeps it among its parameters; a run of it that also brings a config of its own
    (an edited form, an API call, a sweep trial) would silently train the preset instead, so a config that is neither
    the form's default (:data:`DEFAULT_PRESET`) nor the preset itself is refused next to a preset. A mapping (a flow
    run's JSON parameter) is validated as a config first."""
    if isinstance(config, dict):
        config = config_from_dict(config, "config")
    if preset is not None:
        if preset not in presets():
            raise ConfigError(f"preset: unknown preset {preset!r}; valid: {', '.join(presets())}")
        chosen = load_config(preset, overrides, settings)
        if (config is not None and config not in (load_config(DEFAULT_PRESET), chosen)
                and not _is_preset(config, preset)):
            raise ConfigError(
                f"preset: {preset!r} replaces the whole config, but a changed config was given too; set preset to "
                "null to run that config, or keep the preset and change fields with the form's fields or overrides "
                "(key=value)"
            )
        return chosen
    if config is None:
        return load_config(DEFAULT_PRESET, overrides, settings)
    if overrides or settings:
        data = apply_overrides(merge_settings(config.model_dump(mode="json", by_alias=True), settings or {}),
                               overrides or [])
        return config_from_dict(data, "overrides" if not settings else "run form")
    return config


def to_yaml(config: ExperimentConfig) -> str:
    return yaml.safe_dump(config.model_dump(mode="json", by_alias=True), sort_keys=False)


def flatten(config: ExperimentConfig) -> dict[str, Any]:
    """Dotted keys for every field (e.g. ``grpo.learning_rate``): MLflow params and sweep spaces use these."""
    out: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict) and value:
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else k, v)
        else:
            out[prefix] = value

    walk("", config.model_dump(mode="json", by_alias=True))
    return out
