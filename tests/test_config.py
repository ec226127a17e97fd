"""Every config rule: invalid values and combinations are rejected at load, naming the field and valid values."""

from __future__ import annotations

import tomllib

import pytest

from grpo.config import DEFAULTS_NOT_FROM_TINY, ExperimentConfig, flatten, load_config, preset_file, presets, to_yaml
from grpo.errors import ConfigError
from tests.conftest import REPO


def rejects(overrides: list[str], *fragments: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    assert "\n" not in message
    return message


def test_defaults_and_presets_load():
    assert (presets() == ["qwen2.5-0.5b-gsm8k", "tiny", "tiny-calculator", "tiny-calculator-agent", "tiny-guess-digit"]
            and presets("spaces") == ["tiny-lr-beta", "tiny-tpe-pruned"])
    cfg = load_config("tiny")
    assert cfg.model.is_tiny and cfg.data.synthetic
    assert cfg.grpo.reward_funcs == ["exact_match"]
    # The GPU preset is valid apart from needing vllm, which CPU machines never install.
    gpu = load_config("qwen2.5-0.5b-gsm8k", ["grpo.use_vllm=false"])
    assert gpu.model.name_or_path == "Qwen/Qwen2.5-0.5B-Instruct" and gpu.data.prompt_format == "chat"


def test_gpu_preset_without_vllm_is_rejected_at_load():
    with pytest.raises(ConfigError, match=r"preset qwen2.5-0.5b-gsm8k: grpo.use_vllm: vllm is not installed; install "
                                          r"the 'gpu' extra"):
        load_config("qwen2.5-0.5b-gsm8k")


def test_defaults_are_the_tiny_preset_except_the_listed_fields():
    defaults, tiny = flatten(ExperimentConfig()), flatten(load_config("tiny"))
    assert defaults.keys() == tiny.keys()
    differ = {k for k in defaults if defaults[k] != tiny[k]}
    assert differ == set(DEFAULTS_NOT_FROM_TINY), {k: (defaults[k], tiny[k]) for k in differ}


def test_presets_are_package_data_not_files_of_the_source_tree(tmp_path, monkeypatch):
    """Presets load by name from any working directory, read through importlib.resources from the installed
    package; pyproject.toml ships them in the wheel (the wheel itself: tests/test_install.py)."""
    from importlib import resources

    monkeypatch.chdir(tmp_path)
    for name in presets():
        packaged = resources.files("grpo").joinpath("presets", f"{name}.yaml").read_text()
        assert preset_file(name).read_text() == packaged
        assert load_config(name, ["grpo.use_vllm=false"]).name == name
    for package in ("grpo", "flows", "dashboards"):  # nothing reads files relative to the source tree
        for source in (REPO / package).rglob("*.py"):
            text = source.read_text()
            assert "parent.parent" not in text and "parents[1]" not in text and '"configs"' not in text, source
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert pyproject["tool"]["setuptools"]["package-data"]["grpo"] == ["presets/*.yaml", "presets/spaces/*.yaml",
                                                                      "presets/policies/*/*"]  # the shipped policies
    # a file of that name wins over the preset; an unknown name lists the presets
    (tmp_path / "tiny").write_text("name: mine\n")
    assert load_config("tiny").name == "mine"
    with pytest.raises(ConfigError, match=r"config file not found: tni; or a preset name: qwen2.5-0.5b-gsm8k, tiny, "
                                          r"tiny-calculator, tiny-calculator-agent, tiny-guess-digit"):
        load_config("tni")


def test_a_preset_replaces_the_form_default_and_refuses_a_changed_config():
    """A deployment names a preset; a run that brings a config of its own must not silently train the preset."""
    from grpo.config import resolve_config

    tiny = load_config("tiny")
    gpu = resolve_config(tiny, "qwen2.5-0.5b-gsm8k", ["grpo.use_vllm=false"])  # the form's default config: replaced
    assert gpu.name == "qwen2.5-0.5b-gsm8k" and not gpu.grpo.use_vllm
    assert resolve_config(tiny, "tiny", ["grpo.beta=0.1"]).grpo.beta == 0.1
    changed = load_config("tiny", ["grpo.learning_rate=3e-4"])
    with pytest.raises(ConfigError, match=r"preset: 'tiny' replaces the whole config, but a changed config was given"):
        resolve_config(changed, "tiny")
    assert resolve_config(changed, None) == changed
    with pytest.raises(ConfigError, match=r"preset: unknown preset 'tni'; valid: qwen2.5-0.5b-gsm8k, tiny, "
                                          r"tiny-calculator, tiny-calculator-agent, tiny-guess-digit"):
        resolve_config(tiny, "tni")


def test_set_overrides_are_typed_and_nested():
    cfg = load_config(None, ["grpo.learning_rate=3e-4", "grpo.reward_funcs=[exact_match, digits_format]",
                             "async.prefetch_depth=2", "evaluation.num_prompts=null", "name=exp1"])
    assert cfg.grpo.learning_rate == pytest.approx(3e-4)
    assert cfg.grpo.reward_funcs == ["exact_match", "digits_format"]
    assert cfg.async_.prefetch_depth == 2
    assert cfg.evaluation.num_prompts is None
    assert cfg.name == "exp1"


def test_yaml_round_trip_and_flatten():
    cfg = load_config(None, ["grpo.beta=0.04"])
    again = ExperimentConfig.model_validate(__import__("yaml").safe_load(to_yaml(cfg)))
    assert again == cfg
    flat = flatten(cfg)
    assert flat["grpo.beta"] == 0.04 and flat["async.replay_buffer_size"] == 0 and "model.tiny.hidden_size" in flat


@pytest.mark.parametrize(
    "overrides, fragments",
    [
        (["grpo.num_generation=4"], ["grpo.num_generation: unknown field", "did you mean 'num_generations'"]),
        (["bogus.x=1"], ["bogus: unknown field"]),
        (["grpo.loss_type=ppo"], ["grpo.loss_type", "'grpo', 'dr_grpo', 'dapo'", "got 'ppo'"]),
        (["grpo.scale_rewards=yes"], ["grpo.scale_rewards", "'group', 'batch' or 'none'"]),
        (["async.vllm_importance_sampling_mode=clip"], ["async.vllm_importance_sampling_mode", "'token_truncate'"]),
        (["grpo.learning_rate=-1"], ["grpo.learning_rate", "greater than 0"]),
        (["grpo.learning_rate=fast"], ["grpo.learning_rate", "valid number"]),
        (["grpo.num_generations=1"], ["grpo.num_generations", "greater than or equal to 2"]),
        (["grpo.num_generations=3"],
         ["divisible by grpo.num_generations (3)", "valid num_generations: [2, 4, 8, 16, 32, 64, 128, 256]"]),
        (["grpo.generation_batch_size=64", "grpo.steps_per_generation=2"], ["can not both be set"]),
        (["grpo.generation_batch_size=48"],
         ["generation_batch_size (48) must be divisible by the global batch", "= 256"]),
        (["grpo.num_generations_chunks=3"], ["grpo.num_generations_chunks (3)", "valid: [1, 2, 4, 8]"]),
        (["grpo.epsilon_high=0.1"], ["grpo.epsilon_high (0.1) must be >= grpo.epsilon (0.2)"]),
        (["grpo.loss_type=luspo"], ["requires grpo.importance_sampling_level: sequence"]),
        (["grpo.reward_funcs=[exact_match, nope]"], ["grpo.reward_funcs: unknown reward 'nope'", "exact_match"]),
        (["grpo.reward_funcs=[]"], ["grpo.reward_funcs", "at least 1"]),
        (["grpo.reward_weights=[1.0, 2.0]"], ["reward_weights has 2 values but grpo.reward_funcs has 1"]),
        (["evaluation.correctness_reward=nope"], ["evaluation.correctness_reward: unknown reward 'nope'"]),
        (["async.streaming_min_groups=0"], ["async.streaming_min_groups", "greater than or equal to 1"]),
        (["data.prompt_format=chat"], ["'tiny' has no chat template"]),
        (["model.tiny.max_position_embeddings=8"], ["max_position_embeddings (8) is too small"]),
        (["model.tiny.hidden_size=30"], ["model.tiny.hidden_size: 30 must be divisible by num_attention_heads (4)"]),
        (["sampling.world_size=4", "sampling.sequence_parallel_degree=3"],
         ["sampling.sequence_parallel_degree", "valid degrees: [1, 2, 4]"]),
        (["data.num_train=10000"], ["data.num_train", "exceeds the 10000 distinct problems"]),
        (["data.source=synthetic:multiply"], ["data.source: unknown synthetic task", "'synthetic:addition'"]),
        (["data.source=nowhere/data.jsonl"], ["data.source: file does not exist: nowhere/data.jsonl"]),
        (["data.source=data.txt"], ["data.source", ".jsonl/.json/.parquet/.csv"]),
        (["data.source='hub:'"], ["data.source", "needs a dataset id"]),
        (["data.eval_fraction=1.5"], ["data.eval_fraction", "less than 1"]),
        (["async.reward_num_workers=0"], ["async.reward_num_workers", "greater than or equal to 1"]),
        (["async.reroll_start_fraction=2"], ["async.reroll_start_fraction", "less than or equal to 1"]),
        (["tracking.backend=wandb"], ["tracking.backend", "'none' or 'mlflow'"]),
        (["async.vllm_importance_sampling_correction=true"],
         ["async.vllm_importance_sampling_correction", "needs async.use_data_producer"]),
        (["async.off_policy_mask_threshold=0.5"], ["async.off_policy_mask_threshold", "needs async.use_data_producer"]),
        (["grpo=3"], ["grpo", "valid dictionary"]),
    ],
)
def test_invalid_values_are_rejected_with_field_and_valid_values(overrides, fragments):
    rejects(overrides, *fragments)


def test_set_syntax_errors():
    rejects(["grpo.learning_rate"], "--set 'grpo.learning_rate': expected key=value")
    rejects(["grpo.learning_rate.x=1"], "grpo.learning_rate")
    rejects(["=3"], "empty key")


def test_yaml_file_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("grpo:\n  learning_rate: [1e-4\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: YAML syntax error at line \d+, column \d+"):
        load_config(bad)
    listy = tmp_path / "list.yaml"
    listy.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(listy)
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "missing.yaml")
    typo = tmp_path / "typo.yaml"
    typo.write_text("grpo:\n  lerning_rate: 1e-4\n")
    with pytest.raises(ConfigError,
                       match=r"typo.yaml: grpo.lerning_rate: unknown field \(did you mean 'learning_rate'\?\)"):
        load_config(typo)
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    with pytest.raises(ConfigError, match="the file is empty"):  # issue #12.12: all defaults, nothing said
        load_config(empty)
