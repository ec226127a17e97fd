"""The pipeline's Prefect run form (flows/run_form.py): what its schema offers and what a submitted form trains.

The browser test in test_infra.py looks at the rendered form; these check the schema and the mapping quickly."""

import pytest
import yaml

from flows.pipeline import grpo_pipeline
from flows.run_form import COMMON_FIELDS, SECTIONS, collapsed_sections, form_settings, section_schemas
from grpo.config import ConfigError, flatten, load_config, presets, resolve_config

REPO_PREFECT_YAML = "infra/prefect.yaml"


def _walk(props: dict, prefix: str = ""):
    for name, prop in props.items():
        yield f"{prefix}{name}", prop
        if "properties" in prop:
            yield from _walk(prop["properties"], f"{prefix}{name}.")


def test_form_order_titles_and_no_null_toggles():
    """Preset first, the common fields next with plain titles, no parameter offers a None branch or starts at null."""
    schema = grpo_pipeline.parameters.model_dump()
    props = schema["properties"]
    order = sorted(props, key=lambda k: props[k]["position"])
    assert order[:8] == ["preset", *COMMON_FIELDS]
    assert props["preset"]["enum"][:-1] == presets() and props["preset"]["type"] == "string"
    assert [props[k]["title"] for k in COMMON_FIELDS] == [title for _, title in COMMON_FIELDS.values()]
    assert props["loss_type"]["enum"] == ["grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo"]
    assert {"answer_tag_format", "digits_format", "exact_match", "last_number_match"} <= set(
        props["reward_funcs"]["items"]["enum"])  # and whatever else is registered
    assert props["run_name"]["title"] == "MLflow run name"  # not a second "Run Name" next to Prefect's own
    assert schema.get("required", []) == []
    for path, prop in _walk(props):
        assert "anyOf" not in prop or all(b.get("type") != "null" for b in prop["anyOf"]), path
        assert prop.get("default", "absent") is not None, f"{path} starts at null"
        assert prop.get("title"), path
    assert props["resume"]["default"] is False


def test_section_fields_have_no_defaults_and_unambiguous_titles():
    """Every config field sits in exactly one section; none has a default (empty = the preset's value); each names its
    dotted key; no two fields share a title (there were two "Learning Rate")."""
    sections = section_schemas()
    assert list(sections) == list(SECTIONS)
    leaves = []
    for param, schema in sections.items():
        for path, prop in _walk(schema["properties"]):
            if "properties" not in prop:
                leaves.append(prop)
                assert "default" not in prop, (param, path)
    dotted = [p["description"].split("`")[1] for p in leaves]
    assert sorted(dotted) == sorted(flatten(load_config("tiny")))
    titles = [p["title"] for p in leaves]
    assert len(titles) == len(set(titles)), sorted(t for t in titles if titles.count(t) > 1)
    lr = {p["description"].split("`")[1]: p["title"] for p in leaves if "learning_rate`" in p["description"]}
    assert lr == {"grpo.learning_rate": "Learning Rate (GRPO training)",
                  "model.warm_start.learning_rate": "Learning Rate (Warm Start)"}


def test_each_fields_help_names_every_presets_value_mappings_whole():
    """A mapping field's help shows each preset's whole value (tiny-calculator's ``{tool: on}``), not "Every preset:
    {}" read from the presets where it happens to be empty; registered names are the dropdowns' options."""
    env = section_schemas()["environment_settings"]["properties"]
    assert env["kwargs"]["description"].endswith(
        "Presets qwen2.5-0.5b-gsm8k: {}; tiny: {}; tiny-calculator: {tool: on}; "
        "tiny-calculator-agent: {agent: calculator_agent}; tiny-guess-digit: {}.")
    # the GPU preset is in the Preset dropdown on a machine without vLLM too, so its values are in the help
    grpo = section_schemas()["grpo_settings"]["properties"]
    assert "qwen2.5-0.5b-gsm8k: 16" in grpo["per_device_train_batch_size"]["description"]
    assert "qwen2.5-0.5b-gsm8k: true" in grpo["use_vllm"]["description"]
    from grpo.environments.agents import AGENTS

    # registered names (a module that registered its own agents in this process adds them), the built-in among them
    assert "calculator_agent" in env["agent"]["enum"] and set(env["agent"]["enum"]) <= set(AGENTS.names())
    variants = section_schemas()["evaluation_settings"]["properties"]["environment_variants"]["description"]
    assert "tiny-calculator: {tool_off: {tool: off}};" in variants
    assert {"calculator", "guess_digit", "openenv", "tool_use"} <= set(env["name"]["enum"])
    assert "calculator" in env["tools"]["items"]["enum"]


def test_what_the_form_sets_changes_only_those_fields_of_the_chosen_preset():
    tiny = load_config("tiny")
    settings = form_settings(
        {"learning_rate": 3e-4, "max_steps": None, "batch_size": None, "num_generations": None,
         "reward_funcs": ["exact_match", "digits_format"], "loss_type": "bnpo", "seed": None},
        {"model_settings": {"name_or_path": "", "warm_start": {"steps": 7, "learning_rate": None}, "tiny": {}},
         "grpo_settings": {}, "experiment_settings": {"name": "from-form"}, "async_settings": None})
    assert settings == {"model": {"warm_start": {"steps": 7}}, "name": "from-form",
                        "grpo": {"learning_rate": 3e-4, "reward_funcs": ["exact_match", "digits_format"],
                                 "loss_type": "bnpo"}}
    cfg = resolve_config(None, "tiny", ["grpo.beta=0.04"], settings)
    changed = {k: v for k, v in flatten(cfg).items() if flatten(tiny)[k] != v}
    assert changed == {"name": "from-form", "model.warm_start.steps": 7, "grpo.learning_rate": 3e-4,
                       "grpo.reward_funcs": ["exact_match", "digits_format"], "grpo.loss_type": "bnpo",
                       "grpo.beta": 0.04}
    # No preset and no config: the default preset. A whole config with the form's fields on top.
    assert resolve_config(None, None, None, {"grpo": {"max_steps": 3}}) == load_config("tiny", ["grpo.max_steps=3"])
    base = load_config("tiny", ["grpo.learning_rate=2e-3"])
    assert resolve_config(base, None, None, {"grpo": {"max_steps": 3}}).grpo.learning_rate == 2e-3
    with pytest.raises(ConfigError, match=r"grpo.max_steps"):
        resolve_config(None, "tiny", None, {"grpo": {"max_steps": 0}})


def test_prefect_yaml_collapses_every_section_of_both_pipeline_deployments():
    with open(REPO_PREFECT_YAML) as f:
        spec = yaml.safe_load(f)
    pipelines = [d for d in spec["deployments"] if d["entrypoint"].endswith(":grpo_pipeline")]
    assert len(pipelines) == 2
    for d in pipelines:
        assert {k: v for k, v in d["parameters"].items() if k in SECTIONS} == collapsed_sections(), d["name"]


def test_trls_help_is_read_without_importing_trl_and_is_trls_own():
    """The form's "(TRL)" help comes from ``trl.GRPOConfig``'s source (``grpo serve`` imports no TRL): the same text,
    field by field, as the dataclass's own metadata, and it reaches the form."""
    import dataclasses

    from trl import GRPOConfig

    from grpo.config.trl_and_rewards import grpo_config_help

    assert grpo_config_help() == {f.name: f.metadata["help"] for f in dataclasses.fields(GRPOConfig)
                                  if f.metadata.get("help")}
    epsilon = section_schemas()["grpo_settings"]["properties"]["epsilon"]["description"]
    assert " ".join(grpo_config_help()["epsilon"].split()).split(". ")[0].rstrip(".") + " (TRL)" in epsilon, epsilon
