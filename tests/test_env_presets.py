"""The embedded environments as experiments (#30 §4): their data and warm start, the presets, and evaluation with
environments (greedy episodes, sampled success, evaluation variants such as the calculator's tool switched off).

The evaluation's figures are checked against a scripted policy whose episodes are known turn by turn (the episode
runner's ``generate`` contract, as in tests/test_episodes.py), and through the pipeline's evaluation stage with the
real tiny model on tiny sizes.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from grpo.config import load_config
from grpo.environments import get_environment
from grpo.environments.builtin import CalculatorEnvironment, GuessDigitEnvironment
from grpo.errors import ConfigError
from grpo.tasks import calculator_demonstrations, guess_digit_demonstrations, guess_digit_problems
from grpo.training.evaluation import evaluate_environment
from grpo.training.tiny_model import build_char_tokenizer

TOK = build_char_tokenizer("".join(sorted(set(CalculatorEnvironment.alphabet + GuessDigitEnvironment.alphabet
                                               + "=?"))))
EOS = TOK.eos_token_id


def test_the_environment_presets_load_with_their_environment_reward_and_variants():
    calc, guess = load_config("tiny-calculator"), load_config("tiny-guess-digit")
    assert (calc.environment.name, calc.environment.kwargs, calc.data.source) == ("calculator", {"tool": "on"},
                                                                                 "synthetic:addition")
    assert calc.evaluation.environment_variants == {"tool_off": {"tool": "off"}}
    assert (guess.environment.name, guess.environment.max_turns, guess.data.source) == ("guess_digit", 4,
                                                                                      "synthetic:guess_digit")
    assert calc.grpo.reward_funcs == guess.grpo.reward_funcs == ["env_reward"]
    # YAML's unquoted off is false: the calculator reads it as off
    off = load_config("tiny-calculator", ["evaluation.environment_variants={tool_off: {tool: off}}"])
    assert get_environment("calculator")(**off.evaluation.environment_variants["tool_off"]).mode == "off"
    # a variant that cannot build the environment, or one without an environment, is refused at load
    with pytest.raises(ConfigError, match=r"evaluation.environment_variants.bad: environment 'calculator' cannot be "
                                          r"built with \{'tool': 'of'\}: calculator: tool must be one of on, off"):
        load_config("tiny-calculator", ["evaluation.environment_variants={bad: {tool: of}}"])
    with pytest.raises(ConfigError, match=r"environment_variants is set but environment.name is empty"):
        load_config("tiny", ["evaluation.environment_variants={tool_off: {tool: 'off'}}"])
    with pytest.raises(ConfigError, match=r"'tool off' is not a valid variant name"):
        load_config("tiny-calculator", ["evaluation.environment_variants={'tool off': {tool: 'off'}}"])


def test_guess_digit_rows_are_deterministic_disjoint_and_hide_one_digit():
    ds = guess_digit_problems(300, 100, seed=3)
    assert ds["train"].to_dict() == guess_digit_problems(300, 100, seed=3)["train"].to_dict()
    assert not set(ds["train"]["prompt"]) & set(ds["eval"]["prompt"])
    assert len(set(ds["train"]["prompt"])) == 300
    assert all(re.fullmatch(r"\d{4}\?", p) for p in ds["train"]["prompt"])
    assert all(re.fullmatch(r"\d", a) for a in list(ds["train"]["answer"]) + list(ds["eval"]["answer"]))


def test_the_calculator_warm_start_is_the_probes_mix():
    prompts = [f"{a:02d}+{b:02d}=" for a in range(100) for b in range(100)]
    answers = [str(int(p[:2]) + int(p[3:5])) for p in prompts]
    got = calculator_demonstrations(prompts, answers, carry_error_rate=0.6, seed=0)
    assert got == calculator_demonstrations(prompts, answers, carry_error_rate=0.6, seed=0)
    kinds = {"call": 0, "expression": 0, "copy": 0, "direct": 0}
    forgot = carrying = 0
    for prompt, (p, c), answer in zip(prompts, zip(*got), answers):
        expr = prompt[:-1]
        if p == prompt and c == f"[{expr}]{answer}|{answer}":
            kinds["call"] += 1
        elif p == prompt + "[":
            assert c == f"{expr}]"
            kinds["expression"] += 1
        elif p.startswith(prompt + "["):
            assert (p, c) == (f"{prompt}[{expr}]{answer}|", answer)
            kinds["copy"] += 1
        else:
            assert p == prompt and c in (answer, str(int(answer) - 10))
            kinds["direct"] += 1
            if int(prompt[1]) + int(prompt[4]) >= 10:
                carrying += 1
                forgot += c != answer
    n = len(prompts)
    assert abs(kinds["call"] / n - 0.01) < 0.004 and abs(kinds["expression"] / n - 0.1) < 0.015
    assert abs(kinds["copy"] / n - 0.2) < 0.02 and abs(forgot / carrying - 0.6) < 0.03


def test_the_guess_digit_warm_start_plays_by_the_environment_and_succeeds_about_72_percent():
    answers = [str(i % 10) for i in range(5000)]
    episodes = guess_digit_demonstrations(answers, seed=0)
    wins = 0
    for answer, episode in zip(answers, episodes):
        env = GuessDigitEnvironment()
        env.reset(answer=answer)
        replayed = ""
        for guess in episode[::2]:  # each guess is answered by the environment as the demonstration says
            result = env.step(guess)
            replayed += guess + (result.observation or "")
            if result.done:
                wins += result.reward == 1.0
                break
        assert replayed == episode
    assert 0.68 < wins / len(answers) < 0.76


def policy_script(text: str) -> str:
    """A fixed calculator policy: 27+15 and 19+19 call the tool and copy its answer (an error answer: write 0),
    38+19 answers right, 11+11 wrong."""
    if text.endswith("|"):
        got = text[text.rindex("]") + 1 : -1]
        return (got if got.isdigit() else "0") + "<eos>"
    return {"27+15=": "[27+15]", "19+19=": "[19+19]", "38+19=": "57<eos>", "11+11=": "21<eos>"}[text]


def scripted(calls: list) -> object:
    def generate_with(do_sample: bool, temperature: float):
        def generate(seqs, max_new_tokens, stops):
            calls.append((do_sample, temperature, len(seqs)))
            return [(TOK(policy_script(TOK.decode(s)), add_special_tokens=False)["input_ids"], None) for s in seqs]
        return generate
    return generate_with


def test_environment_evaluation_reports_success_turns_tool_calls_sampled_success_and_variants():
    prompts = ["27+15=", "38+19=", "11+11=", "19+19="]
    rows = [{"prompt": p, "answer": str(int(p[:2]) + int(p[3:5]))} for p in prompts]
    calls: list = []
    result = evaluate_environment(None, TOK, prompts, rows, "calculator", kwargs={"tool": "on"},
                                  variants={"tool_off": {"tool": "off"}, "broken": {"tool": "broken"}},
                                  max_turns=3, max_completion_length=24, pass_k=2, pass_k_temperature=0.7,
                                  generate_with=scripted(calls))
    # tool on: the two callers copy the right answer, 38+19 is right, 11+11 wrong
    assert result.accuracy == 0.75 and result.pass_at_k == 0.75 and result.k == 2
    assert result.env == {
        "turns_mean": 1.5, "tool_call_rate": 0.5, "truncated_frac": 0.0, "sampled_success": 0.75,
        # tool off: the callers get `error: off|` and write 0; broken: they copy one more than the truth
        "tool_off/accuracy": 0.25, "tool_off/turns_mean": 1.5, "tool_off/tool_call_rate": 0.5,
        "tool_off/truncated_frac": 0.0,
        "broken/accuracy": 0.25, "broken/turns_mean": 1.5, "broken/tool_call_rate": 0.5, "broken/truncated_frac": 0.0,
    }
    assert [s["completion"] for s in result.samples] == ["[27+15]42|42", "57", "21", "[19+19]38|38"]
    assert [s["correct"] for s in result.samples] == [True, True, False, True]
    # greedy turns, then the sampled ones (k per prompt, at pass_k_temperature), then one greedy pass per variant
    assert [c[:2] for c in calls] == [(False, 1.0)] * 2 + [(True, 0.7)] * 2 + [(False, 1.0)] * 4
    assert [c[2] for c in calls] == [4, 2, 8, 4, 4, 2, 4, 2]
    assert result.as_metrics()["eval/env/tool_off/accuracy"] == 0.25


def tiny_cfg(preset: str, tmp_path: Path, *extra: str):
    return load_config(preset, [
        f"output_dir={tmp_path}", "data.num_train=200", "data.num_eval=40", "model.tiny.hidden_size=32",
        "model.tiny.num_hidden_layers=1", "model.tiny.num_attention_heads=2", "model.tiny.intermediate_size=64",
        "model.warm_start.steps=30", "model.warm_start.batch_size=16", "evaluation.num_prompts=12",
        "evaluation.pass_k=2", "tracking.backend=none", *extra,
    ])


@pytest.mark.integration
@pytest.mark.parametrize("preset", ["tiny-calculator", "tiny-guess-digit"])
def test_the_evaluation_stage_reports_the_environment_figures_before_and_after(preset, tmp_path, monkeypatch):
    """The pipeline's evaluation stage with the real tiny model: the environment's figures in eval_*.json, as
    eval/env/* metrics, and in summary.json before and after; the tokenizer covers the environment's alphabet."""
    from grpo.pipeline.recipe import write_summary
    from grpo.pipeline.stages import cached_prep, eval_stage, policy_stage
    from grpo.runs import RunDir
    from grpo.tracking.run_tracking import eval_metrics

    monkeypatch.setenv("GRPO_CACHE_DIR", str(tmp_path / "cache"))
    cfg = tiny_cfg(preset, tmp_path)
    data_dir = Path(cached_prep(cfg, tmp_path / "data")["data_dir"])
    policy = policy_stage(cfg, data_dir, log=lambda *_: None)
    env_alphabet = get_environment(cfg.environment.name).alphabet
    assert set(env_alphabet) <= set(policy.tokenizer.get_vocab())
    before = eval_stage(cfg, policy, data_dir, tmp_path / "eval_before.json")
    assert json.loads((tmp_path / "eval_before.json").read_text())["env"] == before["env"]
    names = {"turns_mean", "tool_call_rate", "truncated_frac", "sampled_success"}
    if preset == "tiny-calculator":
        names |= {f"tool_off/{k}" for k in ("accuracy", "turns_mean", "tool_call_rate", "truncated_frac")}
    assert set(before["env"]) == names
    assert 1.0 <= before["env"]["turns_mean"] <= cfg.environment.max_turns
    assert all(0.0 <= v <= 1.0 for k, v in before["env"].items() if not k.endswith("turns_mean"))
    assert before["num_prompts"] == 12 and len(before["samples"]) == 12
    metrics = eval_metrics(before)
    assert {f"eval/env/{k}" for k in names} | {"eval/accuracy", "eval/pass_at_2"} == set(metrics)
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    trained = {"steps": 0, "seconds": 0.0, "policy_source": "", "resumed_from": None, "reward_curve": [],
               "metric_names": []}
    after = dict(before, env={k: v / 2 for k, v in before["env"].items()})
    summary = write_summary(cfg, run, trained, before, after, None, 1.0)
    for key in names:
        flat = key.replace("/", "_")
        assert summary[f"eval_env_{flat}_before"] == before["env"][key]
        assert summary[f"eval_env_{flat}_after"] == before["env"][key] / 2


@pytest.mark.integration
def test_a_short_calculator_run_trains_on_episodes_and_reports_the_environment_before_and_after(tmp_path, monkeypatch):
    """The tiny-calculator preset, shortened (tiny model, a few GRPO steps): the recipe trains on episodes (the
    episode metrics are logged), the environment's reward is the reward, and summary.json has the environment's
    figures before and after, the tool-off variant included. Learning itself is measured in docs/benchmarks.md."""
    from grpo.pipeline.experiment import run_experiment
    from grpo.runs import open_run_dir

    monkeypatch.setenv("GRPO_CACHE_DIR", str(tmp_path / "cache"))
    cfg = tiny_cfg("tiny-calculator", tmp_path, "grpo.max_steps=3", "grpo.logging_steps=1", "grpo.save_steps=1000",
                   "grpo.per_device_train_batch_size=16", "grpo.num_generations=4")
    run = open_run_dir(cfg, "calc-smoke", resume=False)
    summary = run_experiment(cfg, run, log=lambda *_: None)
    assert summary["steps"] == 3
    assert {"rewards/env_reward/mean", "env/turns/mean", "env/tools/call_frequency"} <= set(summary["metrics"])
    for when in ("before", "after"):
        for key in ("turns_mean", "tool_call_rate", "sampled_success", "tool_off_accuracy", "tool_off_tool_call_rate"):
            assert 0.0 <= summary[f"eval_env_{key}_{when}"] <= cfg.environment.max_turns, (key, when)
    rows = [json.loads(line) for line in run.metrics_file.read_text().splitlines()]
    assert [r["metrics"]["rewards/env_reward/mean"] for r in rows if "rewards/env_reward/mean" in r["metrics"]]
    after = json.loads((run.path / "eval_after.json").read_text())
    assert after["env"]["tool_off/accuracy"] == summary["eval_env_tool_off_accuracy_after"]
