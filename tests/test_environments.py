"""Environments and tools by registered name (grpo.environments), the built-ins, and `grpo environments`."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from grpo.environments import (
    StepResult,
    ToolEnvironment,
    available_environments,
    available_tools,
    get_environment,
    get_tool,
    load_environment_module,
    make_environment,
    register_environment,
    register_tool,
    tool_schema,
)
from grpo.environments.builtin import (
    CalculatorEnvironment,
    GuessDigitEnvironment,
    calculator,
    evaluate_integer_expression,
)
from grpo.errors import ConfigError
from grpo.rewards import get_reward, load_reward_module

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_registries_by_name_and_unknown_names_name_the_valid_ones():
    assert {"calculator", "guess_digit"} <= set(available_environments())
    assert "calculator" in available_tools()
    assert get_environment("calculator") is CalculatorEnvironment and get_tool("calculator") is calculator
    with pytest.raises(ConfigError,
                       match=r"^unknown environment 'nope'; registered environments: .*calculator.*guess_digit"):
        get_environment("nope")
    with pytest.raises(ConfigError, match=r"^unknown tool 'nope'; registered tools: .*calculator"):
        get_tool("nope")


def test_duplicate_registration_is_refused():
    with pytest.raises(ValueError, match="environment 'calculator' is already registered"):
        register_environment("calculator")(type("Other", (), {}))
    with pytest.raises(ValueError, match="tool 'calculator' is already registered"):
        register_tool("calculator")(lambda expression: expression)


def test_a_tool_schema_comes_from_its_signature_and_docstring():
    assert tool_schema("calculator") == {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate integer arithmetic with +, - and * (parentheses allowed).",
            "parameters": {"type": "object", "required": ["expression"], "properties": {
                "expression": {"type": "string", "description": "integers joined by +, - or *, e.g. 27+15"}}},
            "return": {"type": "string"},
        },
    }

    def undocumented(x: int) -> int:
        """No argument section."""
        return x

    with pytest.raises(Exception, match="no description for the argument 'x'"):
        tool_schema(undocumented)


def test_an_env_module_registers_environments_and_tools_and_may_also_hold_rewards(tmp_path):
    """One file can register a reward, an environment and a tool; named by --reward-module and --env-module, it is
    imported once (a second import would register its reward again and fail as a duplicate)."""
    module = tmp_path / "my_envs.py"
    module.write_text(textwrap.dedent('''
        from grpo.environments import StepResult, register_environment, register_tool
        from grpo.rewards import register_reward

        @register_tool("shout_test")
        def shout(text: str) -> str:
            """Upper-case.

            Args:
                text: the text
            """
            return text.upper()

        @register_environment("echo_test")
        class Echo:
            def __init__(self, suffix="!"):
                self.suffix = suffix
            def reset(self, **row):
                return None
            def step(self, action):
                return StepResult(action + self.suffix, True, 1.0)

        @register_reward("echo_reward_test")
        def echo_reward(completions, **kwargs):
            return [1.0] * len(completions)
    '''))
    assert load_environment_module(module) == ["echo_test", "shout_test"]
    assert load_reward_module(module) == []  # already imported: its reward registered with it
    assert get_reward("echo_reward_test")(completions=["a"]) == [1.0]
    assert make_environment("echo_test", suffix="?").step("hi")[:3] == ("hi?", True, 1.0)
    assert get_tool("shout_test")("a") == "A"
    with pytest.raises(ConfigError, match="^--env-module: file not found: "):
        load_environment_module(tmp_path / "missing.py")
    bad = tmp_path / "bad_envs.py"
    bad.write_text("raise RuntimeError('broken on purpose')\n")
    with pytest.raises(ConfigError, match=r"^--env-module: importing .*bad_envs.py failed: RuntimeError: broken on"):
        load_environment_module(bad)


LIST_NAMES = ("from grpo.environments import available_environments as e, available_tools as t; "
              "from grpo.environments.agents import available_agents as a; print(e(), t(), a())")


def test_grpo_env_modules_and_entry_points_reach_a_fresh_process(tmp_path):
    """How workers, the async generator and served runs get them: GRPO_ENV_MODULES files and the entry-point groups
    of an installed package (a real distribution's metadata on sys.path, no install needed)."""
    (tmp_path / "file_envs.py").write_text(
        "from grpo.environments import register_environment, register_tool\n"
        "@register_environment('from_file')\nclass E:\n    pass\n"
        "@register_tool('file_tool')\ndef f(x: str) -> str:\n    return x\n"
        "from grpo.environments.agents import register_agent\n"
        "@register_agent('file_agent')\ndef a(client, row):\n    return None\n")
    pkg = tmp_path / "site"
    (pkg / "ep_envs").mkdir(parents=True)
    (pkg / "ep_envs" / "__init__.py").write_text("class Env:\n    pass\ndef tool(x: str) -> str:\n    return x\n"
                                                  "def agent(client, row):\n    return None\n")
    dist = pkg / "ep_envs-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: ep-envs\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        "[grpo.environments]\nfrom_entry_point = ep_envs:Env\n\n[grpo.tools]\nentry_tool = ep_envs:tool\n\n"
        "[grpo.agents]\nentry_agent = ep_envs:agent\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, str(pkg)]),
           "GRPO_ENV_MODULES": str(tmp_path / "file_envs.py")}
    result = subprocess.run([sys.executable, "-c", LIST_NAMES], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == ("['agent', 'calculator', 'from_entry_point', 'from_file', 'guess_digit', "
                                     "'openenv', 'tool_use'] ['calculator', 'entry_tool', 'file_tool'] "
                                     "['calculator_agent', 'entry_agent', 'file_agent', 'verifiers']")


def test_the_calculator_evaluates_integer_arithmetic_and_nothing_else():
    cases = {"27+15": 42, "07+45": 52, "2*3+4": 10, "2+3*4": 14, "-(2-5)*3": 9, " 10 - 3 - 2 ": 5, "99*99": 9801}
    assert {e: evaluate_integer_expression(e) for e in cases} == cases
    for expression, error in [("__import__('os')", "bad expression"), ("2**10", "bad expression"),
                              ("1/2", "bad expression"), ("1+", "bad expression"), ("(1+2", "bad expression"),
                              ("1 2", "bad expression"), ("9" * 19 + "*9", "too large"), ("1+" * 40 + "1", "too long")]:
        with pytest.raises(ValueError, match=error):
            evaluate_integer_expression(expression)


def test_the_calculator_environment_answers_calls_and_scores_the_final_answer():
    env = make_environment("calculator")
    assert env.reset(prompt="27+15=", answer="42") is None
    assert env.step("[27+15]")[:3] == ("42|", False, None)
    assert env.step("[calculator(2*3)]")[:3] == ("6|", False, None)
    assert env.step("[2**3]")[:3] == ("error: bad expression|", False, None)
    assert env.step("42") == StepResult(None, True, 1.0) and env.step("41") == StepResult(None, True, 0.0)
    assert [tc.status for tc in env.step("[1+1]").tool_calls] == ["ok"]
    off, broken = make_environment("calculator", tool="off"), make_environment("calculator", tool="broken")
    assert off.step("[27+15]")[0] == "error: off|" and off.step("[27+15]").tool_calls[0].status == "error"
    assert broken.step("[27+15]")[0] == "43|"
    with pytest.raises(ValueError, match="tool must be one of on, off, broken"):
        make_environment("calculator", tool="maybe")
    # every character the environment writes is in its alphabet (a character-level tokenizer is built from it)
    for text in ("42|", "error: bad expression|", "error: too large|", "error: too long|", "error: off|",
                 "error: unknown tool calculator|", "error: no [|"):
        assert set(text) <= set(CalculatorEnvironment.alphabet), text


def test_a_tool_environment_parses_calls_without_evaluating_code():
    seen = []

    def pair(a: int, b: str) -> str:
        """Pair.

        Args:
            a: a number
            b: a word
        """
        seen.append((a, b))
        return f"{a}{b}"

    def count(n: int) -> int:
        """Count.

        Args:
            n: how many
        """
        return n + 1

    env = ToolEnvironment([pair, count])
    assert env.step('say [pair(2, "x")]')[0] == "2x|" and seen == [(2, "x")]
    assert env.step("[count(41)]")[0] == "42|"
    assert env.step("[7, 'y']")[0] == "7y|"  # no name: the first tool
    assert env.step("[pair(__import__('os'), 1)]")[0].startswith("error: malformed node")  # literals only
    assert env.step("[count(x)]")[0].startswith("error: invalid literal for int()")
    assert env.step("[nope()]").tool_calls[0].status == "unknown"
    assert env.step("the end") == StepResult(None, True, None)


def test_guess_digit_answers_each_guess_and_a_bisecting_player_always_wins_in_four():
    env = GuessDigitEnvironment()
    env.reset(prompt="guess:", answer="3")
    assert env.step("5") == StepResult(">", False, 0.0) and env.step("1") == StepResult("<", False, 0.0)
    assert env.step("3") == StepResult("=", True, 1.0)
    env.reset(answer="3")
    assert [env.step(g).done for g in "0124"] == [False, False, False, True] and env.step("x").done
    for digit in range(10):
        env.reset(answer=str(digit))
        lo, hi, reward = 0, 9, None
        for _ in range(4):
            guess = (lo + hi + 1) // 2
            obs, done, reward = env.step(str(guess))[:3]
            lo, hi = (guess + 1, hi) if obs == "<" else (lo, guess - 1) if obs == ">" else (lo, hi)
            if done:
                break
        assert reward == 1.0, digit
    # without a one-digit answer the hidden digit follows from the prompt (a hash, the same in every process)
    digits = set()
    for i in range(30):
        env.reset(prompt=f"guess #{i}:")
        first = env.digit
        env.reset(prompt=f"guess #{i}:", answer="not a digit")
        assert env.digit == first
        digits.add(first)
    assert len(digits) > 5


def grpo(*args: str, cwd, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "grpo.app.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120, env=env)


def test_grpo_environments_lists_environments_and_tools(tmp_path):
    module = tmp_path / "cli_envs.py"
    module.write_text("from grpo.environments import register_environment\n"
                      "from grpo.environments.agents import register_agent\n"
                      "@register_environment('cli_env')\nclass E:\n    '''Listed from a file.'''\n"
                      "@register_agent('cli_agent')\ndef a(client, row):\n    '''An agent from a file.'''\n")
    result = grpo("environments", "--env-module", str(module), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    envs, tools = lines[1:lines.index("tools:")], lines[lines.index("tools:") + 1:lines.index("agents:")]
    agents = lines[lines.index("agents:") + 1:]
    assert lines[0] == "environments:"
    assert [line.split()[0] for line in envs] == ["agent", "calculator", "cli_env", "guess_digit", "openenv",
                                                  "tool_use"]
    assert "Listed from a file." in envs[2] and [line.split()[0] for line in tools] == ["calculator"]
    assert [line.split()[0] for line in agents] == ["calculator_agent", "cli_agent", "verifiers"]
    assert "An agent from a file." in agents[1]


@pytest.mark.parametrize("args, env, fragment", [
    (["--env-module", "nope.py"], {}, "--env-module: file not found: nope.py"),
    ([], {"GRPO_ENV_MODULES": "gone.py"}, "GRPO_ENV_MODULES: file not found: gone.py"),
])
def test_a_missing_env_module_is_one_line_exit_2(tmp_path, args, env, fragment):
    result = grpo("environments", *args, cwd=tmp_path, env={**os.environ, **env})
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and fragment in lines[0], result.stderr
    assert "Traceback" not in result.stderr + result.stdout
