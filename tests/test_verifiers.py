"""verifiers (0.4, v1 tasksets) trained as agents (#47): a taskset written here, played by verifiers' own harnesses
and interception server, every model call reaching the episode's endpoint (grpo.environments.verifiers_tasksets).

The taskset is this file's :data:`TASKSET` source, written as a module into a temporary folder on the import path (a
taskset id is an importable module, as an installed taskset package is): nothing is downloaded."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

TASKSET_ID = "grpo_test_sum_taskset"
TASKSET = '''
"""Add two small numbers; the rubric: the right answer (weight 1) and a short reply (weight 0.5)."""
import json
import os

import verifiers.v1 as vf


class SumData(vf.TaskData):
    answer: str


class SumTask(vf.Task[SumData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def correct(self, task, trace) -> float:
        return float(trace.last_reply.strip() == task.answer)

    @vf.reward(weight=0.5)
    async def brief(self, task, trace) -> float:
        return 1 / (1 + len(trace.last_reply))

    async def score(self, trace, runtime=None):
        await super().score(trace, runtime)
        if os.environ.get("SUM_TASKSET_LOG"):  # what the rubric scored, for the test to compare with the run's reward
            with open(os.environ["SUM_TASKSET_LOG"], "a") as f:
                f.write(json.dumps({"reply": trace.last_reply, "reward": trace.reward}) + "\\n")


class SumTaskset(vf.Taskset[SumTask, vf.TasksetConfig]):
    def load(self):
        for a, b in [(1, 2), (3, 4), (2, 5), (4, 4), (1, 6), (3, 3), (2, 2), (5, 1)]:
            yield SumTask(SumData(prompt=f"{a}+{b}=", answer=str(a + b)), self.config.task)


__all__ = ["SumTaskset"]
'''


@pytest.fixture(scope="module")
def taskset_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tasksets")
    (folder / f"{TASKSET_ID}.py").write_text(TASKSET)
    (folder / "sum2.py").write_text(TASKSET)  # given as a file (imported as the module sum2)
    sys.path.insert(0, str(folder))
    yield folder
    sys.path.remove(str(folder))


def test_a_taskset_plays_through_the_endpoint_its_rubric_the_reward_its_tokens_the_sampled_ones(taskset_dir):
    """verifiers' ``bash`` harness on two tasks, the model scripted: it calls the bash tool, reads its answer and
    answers (right on one task, wrong on the other). Each episode is one sequence: the harness's requests reached
    the runner's ``generate`` through the endpoint (streamed, as verifiers' chat program asks), the model tokens are
    exactly the sampled ones with their log-probs, the second call's input the whole sequence before it, the tool's
    answer environment tokens (masked) as the chat template renders it, and the reward is the taskset's weighted
    rubric (right 1 + 0.5 x 1/2; wrong 0 + 0.5 x 1/2)."""
    from trl.chat_template_utils import qwen2_5_chat_template

    import grpo.training.chat_loop  # noqa: F401 - the endpoint's chat parser (TRL's), as training sets it
    from grpo.environments import make_environment
    from grpo.environments.chat import turn_suffix_text
    from grpo.environments.endpoint import sampling_params
    from grpo.environments.episodes import run_episodes
    from grpo.environments.verifiers_tasksets import taskset_rows
    from tests.own_model import bpe_tokenizer

    tok = bpe_tokenizer(["1+2=3 3+4=7 echo"], 300, qwen2_5_chat_template)
    call = '<tool_call>\n{"name": "bash", "arguments": {"command": "echo $((%s))"}}\n</tool_call>'
    sampled: dict[str, list[tuple[list[int], list[int]]]] = {}

    class Scripted:
        sampling = sampling_params(1.0)

        def __call__(self, seqs, max_new_tokens, stop_strings):
            out = []
            for seq in seqs:
                text = tok.decode(seq)
                task = "1+2" if "1+2=" in text else "3+4"
                reply = {"1+2": "3", "3+4": "8"}[task] if "<tool_response>" in text else call % task
                ids = tok(reply, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
                sampled.setdefault(task, []).append((list(seq), ids))
                out.append((ids, [-0.25 - j / 1000 for j in range(len(ids))]))
            return out

    rows = taskset_rows(TASKSET_ID)[:2]
    assert rows == [{"prompt": "1+2=", "answer": "3", "task_idx": 0}, {"prompt": "3+4=", "answer": "7", "task_idx": 1}]
    envs = [make_environment("agent", agent="verifiers", taskset=TASKSET_ID, harness="bash") for _ in rows]
    eps = run_episodes([[0]] * len(rows), envs, Scripted(), tok, rows=rows, max_turns=4, max_completion_length=300,
                       step_timeout=60.0)
    assert [(ep.error, ep.turns, ep.stop_reason) for ep in eps] == [(None, 2, "eos")] * 2
    assert [ep.reward for ep in eps] == [1.0 + 0.5 / 2, 0.0 + 0.5 / 2]
    for ep, task in zip(eps, ("1+2", "3+4")):
        (first_in, first_out), (second_in, second_out) = sampled[task]
        sequence = ep.prompt_ids + ep.completion_ids
        assert first_in == ep.prompt_ids
        assert tok.decode(first_in).endswith(f"{task}=<|im_end|>\n<|im_start|>assistant\n")
        assert second_in == sequence[: len(second_in)] and sequence[len(second_in):] == second_out
        env = ep.completion_ids[len(first_out): len(second_in) - len(ep.prompt_ids)]
        assert ep.completion_ids == first_out + env + second_out
        assert ep.env_mask == [1] * len(first_out) + [0] * len(env) + [1] * len(second_out)
        answer = {"1+2": "3", "3+4": "7"}[task]
        assert tok.decode(env) == turn_suffix_text(tok, [{"role": "tool", "content": f"{answer}\n"}])
        model_logprobs = [lp for lp, m in zip(ep.logprobs, ep.env_mask) if m]
        assert model_logprobs == pytest.approx([-0.25 - j / 1000 for out in (first_out, second_out)
                                                for j in range(len(out))])


def test_the_config_names_a_taskset_and_a_mistake_is_one_line(taskset_dir, monkeypatch):
    """``environment: {agent: verifiers, kwargs: {taskset: ...}}`` loads (a taskset's .py file too); an unknown
    taskset, a harness that needs a container, a bad token cap, the tiny model (no chat template), an option another
    agent does not take, and verifiers not installed are each one line naming the field."""
    from grpo.config import load_config
    from grpo.errors import ConfigError

    base = ["model.name_or_path=Qwen/Qwen2.5-0.5B-Instruct", "environment.agent=verifiers",
            f"environment.kwargs.taskset={TASKSET_ID}"]
    cfg = load_config("tiny-calculator-agent", base)
    assert cfg.environment.kwargs == {"agent": "verifiers", "taskset": TASKSET_ID}
    as_file = load_config("tiny-calculator-agent", [*base[:2], f"environment.kwargs.taskset={taskset_dir}/sum2.py"])
    assert as_file.environment.kwargs["taskset"].endswith("sum2.py")
    for overrides, message in (
        (["environment.kwargs.taskset=no_such_taskset"],
         r"environment\.kwargs: environment 'agent' cannot be built with .*taskset 'no_such_taskset' cannot be "
         r"loaded: ModuleNotFoundError: taskset 'no_such_taskset' not found"),
        (["environment.kwargs.harness=codex"], r"environment\.kwargs: .*harness 'codex': one of null, bash"),
        (["environment.kwargs.max_tokens=0"], r"environment\.kwargs: .*max_tokens 0: a positive integer"),
        (["model.name_or_path=tiny"], r"environment\.agent 'verifiers': verifiers' harnesses call the model through "
                                      r"chat completions, and the 'tiny' model's character tokenizer has no chat"),
        (["environment.agent=calculator_agent"],
         r"environment\.kwargs: .*agent 'calculator_agent' takes no options; got taskset"),
    ):
        with pytest.raises(ConfigError, match=message) as err:
            load_config("tiny-calculator-agent", [*base, *overrides])
        assert "\n" not in str(err.value)
    monkeypatch.setitem(sys.modules, "verifiers.v1", None)  # as if the extra were not installed
    with pytest.raises(ConfigError, match=r"environment\.kwargs: .*verifiers is not installed: install the "
                                          r"'verifiers' extra \(pip install -e '\.\[verifiers\]'\)$"):
        load_config("tiny-calculator-agent", [*base[:2], "environment.kwargs.taskset=another"])


@pytest.mark.integration
def test_grpo_run_trains_a_taskset_with_its_rubric_as_the_runs_reward(taskset_dir, tmp_path, prefect_server):
    """``grpo run`` on a small chat model (built here, randomly initialised, with Qwen2.5's chat template, which the
    endpoint parses completions with) with the taskset's rows as its data and ``environment.agent: verifiers``: it
    trains, and the step's logged reward is the mean of what verifiers' rubric scored for the step's episodes
    (evaluation off, so every episode scored is a training one)."""
    from transformers import AutoTokenizer
    from trl.chat_template_utils import qwen2_5_chat_template

    from grpo.environments.verifiers_tasksets import write_taskset_rows
    from tests.conftest import MICRO, REPO
    from tests.own_model import build_own_model

    model = build_own_model(tmp_path / "model")
    tok = AutoTokenizer.from_pretrained(model)
    tok.chat_template = qwen2_5_chat_template
    tok.save_pretrained(model)
    data = write_taskset_rows(TASKSET_ID, tmp_path / "tasks.jsonl")
    log = tmp_path / "rubric.jsonl"
    settings = {"model.name_or_path": model, "data.source": data, "data.eval_fraction": 0.25,
                "environment.agent": "verifiers", "environment.kwargs.taskset": TASKSET_ID,
                "environment.kwargs.max_tokens": 6,  # each reply ends in the harness (and is scored) within the budget
                "grpo.reward_funcs": "[env_reward]", "model.warm_start.steps": 0, "grpo.max_steps": 1,
                "grpo.per_device_train_batch_size": 4, "grpo.num_generations": 2, "grpo.max_completion_length": 8,
                "grpo.logging_steps": 1, "grpo.save_steps": 100, "evaluation.enabled": False,
                "output_dir": tmp_path / "runs"}
    args = [a for k, v in settings.items() for a in ("--set", f"{k}={v}")]
    env = prefect_server.env(HF_HUB_OFFLINE="1", SUM_TASKSET_LOG=str(log),
                             PYTHONPATH=f"{taskset_dir}:{REPO}")
    proc = subprocess.run([sys.executable, "-m", "grpo", "run", "--config", str(MICRO), "--run-name", "vf", *args],
                          cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = tmp_path / "runs" / "vf"
    assert json.loads((run / "summary.json").read_text())["steps"] == 1
    scored = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(scored) == 4, scored  # the step's 2 prompts x 2 episodes, each scored once by verifiers' rubric
    [metrics] = [json.loads(line)["metrics"] for line in (run / "metrics.jsonl").read_text().splitlines()
                 if "reward" in json.loads(line)["metrics"]]
    assert metrics["reward"] == pytest.approx(sum(s["reward"] for s in scored) / 4, abs=1e-6), (metrics, scored)
    assert metrics["grad_norm"] > 0  # the rubric's scores differ within a group: the step moved the policy
