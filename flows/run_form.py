"""How the pipeline's parameters read in the Prefect UI's run form, and how what a person fills in becomes a config.

Prefect renders a flow's parameters from their JSON schema. The whole :class:`~grpo.config.ExperimentConfig` as one
parameter made a 130-field, 14,500 px form where every field said "(Optional)" and every ``X | None`` field showed a
type toggle. The form is instead:

1. **Preset**: a dropdown of the packaged presets, the starting point.
2. **The fields people change most** (learning rate, steps, batch, group size, reward functions, loss type, seed)
   with plain titles. Empty means "the preset's value", so choosing another preset never drags the first preset's
   numbers along.
3. **Run name and resume.**
4. **One parameter per config section** (data, model, grpo, ...). Deployments start each one as a one-line JSON box
   (``{}``, see :func:`collapsed_sections`); "Use form input" in its menu opens the section's fields. Every field is
   empty unless typed (the schema carries no defaults and no ``null`` branch), and only typed fields change the
   preset.
5. ``overrides`` (``key=value``, the CLI's ``--set``) and, for the API, CLI and sweeps, a whole ``config``.

The schemas are attached with pydantic's ``WithJsonSchema``. Prefect builds a deployment's parameter schema from the
signature, so ``grpo serve``, ``prefect deploy`` and ``to_deployment`` all show the same form. The Python types stay
plain, and a call from code passes ``config=`` as before.
"""

from __future__ import annotations

import copy
import functools
from typing import Annotated, Any

from fastapi.encoders import ENCODERS_BY_TYPE
from pydantic import MISSING, Field, WithJsonSchema

from grpo.config import ExperimentConfig, load_config, presets
from grpo.errors import GRPOPlatformError
from grpo.formatting import human_number

# Section parameters of the form, in the order they appear: parameter name -> (config key, title, what it holds).
SECTIONS: dict[str, tuple[str | None, str, str]] = {
    "data_settings": ("data", "Data", "Dataset source, task size, splits and quarantine rules"),
    "model_settings": ("model", "Model", "Policy model, dtype, chat template, tiny-model shape and warm start"),
    "grpo_settings": ("grpo", "GRPO training", "Every other trl.GRPOConfig field: clipping, KL, sampling, schedule, "
                      "checkpoints, vLLM"),
    "sampling_settings": ("sampling", "Sampling and balancing", "Prompt order over ranks and sequence balancing"),
    "async_settings": ("async", "Async generation", "The asynchronous rollout producer, staleness and replay"),
    "environment_settings": ("environment", "Environments and tools", "Multi-turn rollouts: the environment, its "
                             "tools, protocol and turn limit"),
    "evaluation_settings": ("evaluation", "Evaluation", "Held-out evaluation before and after training"),
    "tracking_settings": ("tracking", "MLflow tracking", "Tracking URI, experiment, what gets logged"),
    "experiment_settings": (None, "Experiment", "Experiment name and the folder runs are written to"),
}

# The fields people change most: form parameter -> (dotted config key, title).
COMMON_FIELDS: dict[str, tuple[str, str]] = {
    "learning_rate": ("grpo.learning_rate", "Learning rate"),
    "max_steps": ("grpo.max_steps", "Training steps"),
    "batch_size": ("grpo.per_device_train_batch_size", "Batch size (completions per device per step)"),
    "num_generations": ("grpo.num_generations", "Completions per prompt (group size)"),
    "reward_funcs": ("grpo.reward_funcs", "Reward functions"),
    "loss_type": ("grpo.loss_type", "Loss type"),
    "seed": ("grpo.seed", "Seed"),
}


@functools.cache
def _config_schema() -> dict[str, Any]:
    """The config's JSON schema, built once per process (the form's 15 annotations read it at import; callers copy
    before changing anything)."""
    return ExperimentConfig.model_json_schema(by_alias=True)


def _inline(schema: Any, defs: dict[str, Any]) -> Any:
    """``schema`` with its ``$ref``s replaced by the definitions (the form's schema must stand alone)."""
    if isinstance(schema, dict):
        if "$ref" in schema:
            target = copy.deepcopy(defs[schema["$ref"].rsplit("/", 1)[-1]])
            rest = {k: v for k, v in schema.items() if k != "$ref"}
            return _inline({**target, **rest}, defs)
        return {k: _inline(v, defs) for k, v in schema.items()}
    if isinstance(schema, list):
        return [_inline(v, defs) for v in schema]
    return schema


def _without_null(prop: dict[str, Any]) -> dict[str, Any]:
    """``X | None`` as ``X``: an empty field already means "keep the preset's value", so the form needs no None
    toggle."""
    branches = prop.get("anyOf")
    if branches:
        kept = [b for b in branches if b.get("type") != "null"]
        if len(kept) == 1:
            prop = {**{k: v for k, v in prop.items() if k != "anyOf"}, **kept[0]}
        else:
            prop = {**prop, "anyOf": kept}
    return prop


def _for_form(prop: dict[str, Any], path: str) -> dict[str, Any]:
    """One field as the section form shows it: no default (empty = the preset's value), no ``null`` branch, its
    dotted key and the presets' values in the description (the key is the name ``overrides`` and the CLI's ``--set``
    use). An on/off field is a true/false dropdown that starts empty: Prefect's switch shows "off" and sends
    ``false`` once a section is opened, which would switch off what a preset switches on."""
    prop = _without_null({k: v for k, v in prop.items() if k != "default"})
    if prop.get("type") == "object" and "properties" in prop:
        prop["title"] = path.rsplit(".", 1)[-1].replace("_", " ").title()  # not the class name (WarmStartConfig)
        prop = {**prop, "properties": {name: _for_form(child, f"{path}.{name}")
                                       for name, child in prop["properties"].items()}}
        prop.pop("required", None)
        return prop
    if prop.get("type") == "boolean":
        prop = {**{k: v for k, v in prop.items() if k != "type"}, "enum": [True, False]}
    text = prop.get("description", "").strip().rstrip(".")
    note = _preset_note(path)
    prop["description"] = f"`{path}`" + (f": {text}." if text else ".") + (f" {note}" if note else "")
    return prop


@functools.cache
def _preset_values() -> dict[str, dict[str, Any]]:
    """Each preset's resolved fields by dotted key, a mapping field (``environment.kwargs``) as its whole value too,
    not only its keys. The GPU preset is listed on a machine without vLLM too (the Preset dropdown offers it, and
    "every preset: 256" would be wrong for it): its values are read with ``grpo.use_vllm`` off, then shown as its
    YAML sets it. A preset that does not load even so is left out."""
    values = {}
    for name in presets():
        try:
            values[name] = _every_path(load_config(name).model_dump(mode="json", by_alias=True))
        except GRPOPlatformError:
            try:
                values[name] = _every_path(load_config(name, ["grpo.use_vllm=false"]).model_dump(
                    mode="json", by_alias=True)) | {"grpo.use_vllm": True}
            except GRPOPlatformError:
                continue
    return values


def _every_path(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        path = f"{prefix}.{key}" if prefix else key
        out[path] = value
        if isinstance(value, dict):
            out |= _every_path(value, path)
    return out


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "empty"
    if isinstance(value, float):
        return human_number(value)
    if isinstance(value, list):
        return "[" + ", ".join(_shown(v) for v in value) + "]"
    if isinstance(value, dict):  # as the preset's YAML writes it: {tool: on}
        return "{" + ", ".join(f"{k}: {_shown(v)}" for k, v in value.items()) + "}"
    return str(value)


def _preset_values_text(path: str) -> str:
    """``tiny: true`` (the value each preset gives the field; ``every preset: X`` when they agree)."""
    shown = {name: _shown(values[path]) for name, values in _preset_values().items() if path in values}
    if len(set(shown.values())) == 1 and len(shown) > 1:
        return f"every preset: {next(iter(shown.values()))}"
    return "; ".join(f"{name}: {value}" for name, value in shown.items())


def _preset_note(path: str) -> str:
    """``Preset tiny: true.``, ``Presets tiny: 1e-4; tiny-calculator: 5e-4.`` or ``Every preset: true.``"""
    shown = {name: _shown(values[path]) for name, values in _preset_values().items() if path in values}
    if not shown:
        return ""
    if len(shown) > 1 and len(set(shown.values())) == 1:
        return f"Every preset: {next(iter(shown.values()))}."
    return ("Preset " if len(shown) == 1 else "Presets ") + "; ".join(f"{n}: {v}" for n, v in shown.items()) + "."


def _count_titles(properties: dict[str, Any], seen: dict[str, int]) -> None:
    for prop in properties.values():
        seen[prop.get("title", "")] = seen.get(prop.get("title", ""), 0) + 1
        if "properties" in prop:
            _count_titles(prop["properties"], seen)


def _distinct_titles(properties: dict[str, Any], parent: str, seen: dict[str, int]) -> None:
    """A field whose title repeats elsewhere in the config gets its parent's name: the two "Learning Rate" fields
    read "Learning Rate (GRPO training)" and "Learning Rate (Warm Start)"."""
    for prop in properties.values():
        title = prop.get("title", "")
        if seen.get(title, 0) > 1:
            prop["title"] = f"{title} ({parent})"
        if "properties" in prop:
            _distinct_titles(prop["properties"], title, seen)


@functools.cache
def section_schemas() -> dict[str, dict[str, Any]]:
    """The JSON schema of each section parameter (see :data:`SECTIONS`), built once per process; read-only."""
    full = _config_schema()
    defs = full.get("$defs", {})
    properties = _inline(full["properties"], defs)
    forms: dict[str, dict[str, Any]] = {}
    for param, (key, title, description) in SECTIONS.items():
        if key is None:
            fields = {k: v for k, v in properties.items() if not ("properties" in v and v.get("type") == "object")}
            section = {"type": "object", "properties": fields}
            prefix = ""
        else:
            section = properties[key]
            prefix = f"{key}."
        body = {name: _for_form(prop, f"{prefix}{name}") for name, prop in section["properties"].items()}
        forms[param] = {"type": "object", "title": title, "properties": body,
                        "description": f"{description}. Only the fields you fill in change the preset; "
                                       "“Use form input” in this field's menu (⋮) shows them all."}
    seen: dict[str, int] = {}
    for schema in forms.values():
        _count_titles(schema["properties"], seen)
    for schema in forms.values():
        _distinct_titles(schema["properties"], schema["title"], seen)
    return forms


def common_field_schema(param: str) -> dict[str, Any]:
    """The schema of one of :data:`COMMON_FIELDS`: the config field's type and checks, titled plainly, no default."""
    path, title = COMMON_FIELDS[param]
    full = _config_schema()
    section, name = path.split(".")
    defs = full.get("$defs", {})
    prop = _inline(full["properties"][section], defs)["properties"][name]
    prop = _without_null({k: v for k, v in prop.items() if k not in ("default", "title")})
    text = prop.get("description", "").strip().rstrip(".")
    values = _preset_values_text(path)
    prop["description"] = ((f"{text}. " if text else "")
                           + f"Empty: the preset's value{f' ({values})' if values else ''}."
                           f" (`{path}`)")
    return {"title": title, **prop}


def _form(schema: dict[str, Any], python_type: Any = Any) -> Any:
    """``python_type`` shown in the form as ``schema``. The title goes through ``json_schema_extra`` because Prefect
    titles every parameter with its Python name, which ``WithJsonSchema`` alone can not override."""
    body = {k: v for k, v in schema.items() if k != "title"}
    return Annotated[python_type, WithJsonSchema(body), Field(json_schema_extra={"title": schema["title"]})]


# A form parameter left empty has the default UNSET (pydantic's MISSING): a JSON schema without a default, so the
# form starts the field empty instead of at ``null`` (which Prefect's validation refuses for a typed field, and which
# the ``X | None`` toggle would otherwise have to offer). Prefect records a direct call's parameters with their
# defaults; there UNSET reads as null.
UNSET: Any = MISSING
ENCODERS_BY_TYPE.setdefault(type(MISSING), lambda _: None)


def given(value: Any) -> Any:
    """A form parameter's value, None when it was left empty."""
    return None if value is UNSET else value


PresetChoice = _form({  # null stays valid for API callers that run a whole config on a deployment naming a preset
    "type": "string", "title": "Preset", "enum": [*presets(), None],
    "description": "The experiment to start from (grpo/presets/). Empty: the deployment's config (`Whole config` "
                   "below), or the tiny preset.",
})
RunName = _form({
    "type": "string", "title": "MLflow run name",
    "description": "Also the run's folder under the output directory. Empty: the preset's name and the Prefect run's "
                   "name (Run Name at the top), e.g. tiny-beta870-armus-expanse. An existing run is never "
                   "overwritten: switch on Resume to continue it.",
})
Resume = _form({
    "type": "boolean", "title": "Resume",
    "description": "Continue the run named above from its last checkpoint, into the same MLflow run.",
}, bool)
Overrides = _form({
    "type": "array", "items": {"type": "string"}, "title": "More settings (key=value)",
    "description": "Any config field by its dotted key, applied last, e.g. `grpo.beta=0.04` (the CLI's --set).",
})
WholeConfig = _form({
    "type": "object", "title": "Whole config (advanced)",
    "description": "A complete experiment config (what `grpo validate --config` prints, as JSON), used when no preset "
                   "is chosen. The CLI and sweeps pass it; a deployment served from a config file starts from it.",
})  # Any, not ExperimentConfig: Prefect validates a run's omitted parameters as their default (UNSET), which a model
# type refuses; resolve_config validates the mapping as a config, naming the field that is wrong
TrackingTags = _form({
    "type": "object", "title": "Extra MLflow run tags",
    "description": "e.g. {\"team\": \"rl\"}. A sweep sets mlflow.parentRunId here to nest its trials.",
})


def common(param: str) -> Any:
    """The annotation of a common field parameter (see :data:`COMMON_FIELDS`)."""
    return _form(common_field_schema(param))


def section(param: str) -> Any:
    """The annotation of a section parameter: a mapping of that section's fields."""
    return _form(section_schemas()[param])


# The annotations of the pipeline flow's form parameters, one per common field and section.
LearningRateField = common("learning_rate")
MaxStepsField = common("max_steps")
BatchSizeField = common("batch_size")
NumGenerationsField = common("num_generations")
RewardFuncsField = common("reward_funcs")
LossTypeField = common("loss_type")
SeedField = common("seed")
DataSettings = section("data_settings")
ModelSettings = section("model_settings")
GRPOSettings = section("grpo_settings")
SamplingSettings = section("sampling_settings")
AsyncSettings = section("async_settings")
EnvironmentSettings = section("environment_settings")
EvaluationSettings = section("evaluation_settings")
TrackingSettings = section("tracking_settings")
ExperimentSettings = section("experiment_settings")


def collapsed_sections() -> dict[str, dict[str, str]]:
    """Deployment parameters that start every section as an empty JSON box (Prefect's ``json`` kind, resolved to
    ``{}`` when the run is created): the form shows one line per section instead of all its fields."""
    return {param: {"__prefect_kind": "json", "value": "{}"} for param in SECTIONS}


def form_settings(common_values: dict[str, Any], sections: dict[str, dict | None]) -> dict[str, Any]:
    """What the form's fields set, as one nested mapping of config keys (``{"grpo": {"learning_rate": ...}}``):
    empty fields (None) are left out, so the preset's values stay."""
    settings: dict[str, Any] = {}
    for param, value in sections.items():
        value = given(value)
        if not value:
            continue
        if not isinstance(value, dict):
            raise ValueError(f"{param}: expected a mapping of {SECTIONS[param][1]} fields, got {value!r}")
        key = SECTIONS[param][0]
        if key is None:
            settings.update(_drop_empty(value))
        else:
            settings.setdefault(key, {}).update(_drop_empty(value))
    for param, value in common_values.items():
        value = given(value)
        if value is None:
            continue
        section_key, name = COMMON_FIELDS[param][0].split(".")
        settings.setdefault(section_key, {})[name] = value
    return {k: v for k, v in settings.items() if v != {}}


def _drop_empty(value: dict) -> dict:
    out = {}
    for k, v in value.items():
        if isinstance(v, dict):
            v = _drop_empty(v)
            if not v:
                continue
        elif v is None or v == "":
            continue
        out[k] = v
    return out
