"""Built-in rewards, the registry, and user reward modules."""

from __future__ import annotations

import pytest

from grpo.errors import ConfigError
from grpo.rewards import (
    answer_tag_format,
    available_rewards,
    digits_format,
    exact_match,
    get_reward,
    last_number_match,
    load_reward_module,
    register_reward,
)


def test_exact_match_plain_and_conversational():
    assert exact_match(completions=["46", " 46 ", "47", "", "460"], answer=["46"] * 5) == [1.0, 1.0, 0.0, 0.0, 0.0]
    chat = [[{"role": "assistant", "content": "12"}], [{"role": "assistant", "content": "13"}]]
    assert exact_match(completions=chat, answer=["12", "12"]) == [1.0, 0.0]


def test_last_number_match_gsm8k_style():
    completions = ["so 3 + 4 = 7. <answer>7</answer>", "It is 1,234", "first 5 then 6", "no number", "-2.0"]
    answers = ["7", "1234", "5", "1", "-2"]
    assert last_number_match(completions=completions, answer=answers) == [1.0, 1.0, 0.0, 0.0, 1.0]


def test_format_rewards():
    assert digits_format(completions=["46", "-3", "4 6", "46a", ""]) == [1.0, 1.0, 0.0, 0.0, 0.0]
    assert (answer_tag_format(completions=["think <answer>7</answer>", "<answer>7</answer> extra", "7"])
            == [1.0, 0.0, 0.0])


def test_registry_by_name_and_unknown_names():
    assert {"exact_match", "last_number_match", "digits_format", "answer_tag_format"} <= set(available_rewards())
    assert get_reward("exact_match") is exact_match
    with pytest.raises(ConfigError, match="unknown reward 'nope'; registered rewards: .*exact_match"):
        get_reward("nope")


def test_duplicate_registration_is_refused():
    with pytest.raises(ValueError, match="already registered"):
        register_reward("exact_match")(lambda completions, **kw: [0.0] * len(completions))


def test_user_reward_module_registers_and_is_usable_in_config(tmp_path):
    module = tmp_path / "my_rewards.py"
    module.write_text(
        "from grpo.rewards import register_reward\n"
        "@register_reward('length_penalty_test')\n"
        "def length_penalty(completions, **kwargs):\n"
        "    return [-float(len(c)) for c in completions]\n"
    )
    assert load_reward_module(module) == ["length_penalty_test"]
    assert get_reward("length_penalty_test")(completions=["ab", "abc"]) == [-2.0, -3.0]
    from grpo.config import load_config

    cfg = load_config(None, ["grpo.reward_funcs=[exact_match, length_penalty_test]"])
    assert cfg.grpo.reward_funcs == ["exact_match", "length_penalty_test"]


def test_missing_reward_module_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="--reward-module: file not found"):
        load_reward_module(tmp_path / "nope.py")
