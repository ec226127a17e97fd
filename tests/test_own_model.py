"""A user's own model folder (Qwen2, byte-level BPE, chat template, no pad token) and a chat-format data file: load,
plan with that tokenizer, warm-start, train, evaluate and save, end to end on the real loading code."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from grpo.config import load_config
from grpo.pipeline.experiment import run_experiment
from grpo.pipeline.prep import load_prepared
from grpo.pipeline.stages import cached_plan, cached_prep
from grpo.rewards import exact_match, register_reward
from grpo.runs import open_run_dir
from grpo.training.policy import load_policy
from tests.conftest import MICRO
from tests.own_model import CHAT_TEMPLATE, build_own_model, write_dataset

pytestmark = pytest.mark.integration  # trains a model: not in `make test-fast`

SEEN: list[tuple[object, object]] = []  # (prompt, completion) pairs the reward below was called with


@register_reward("exact_match_chat_recorded")
def exact_match_chat_recorded(prompts, completions, answer, **kwargs):
    SEEN.extend(zip(prompts, completions))
    return exact_match(completions, answer)


@pytest.fixture(scope="module")
def own(tmp_path_factory):
    root = tmp_path_factory.mktemp("own")
    return build_own_model(root / "model"), write_dataset(root / "problems.jsonl")


def own_config(model, data, out, *extra: str):
    return load_config(MICRO, [
        f"output_dir={out}", f"model.name_or_path={model}", f"data.source={data}", "data.prompt_format=chat",
        "data.system_prompt=Answer with the number only.", "model.warm_start.steps=30",
        "model.warm_start.batch_size=16", "grpo.max_completion_length=6", "grpo.max_steps=2", "grpo.save_steps=100",
        "grpo.logging_steps=1", "grpo.reward_funcs=[exact_match_chat_recorded]", "evaluation.num_prompts=8",
        "evaluation.pass_k=0", *extra,
    ])


def test_a_model_folder_loads_with_a_pad_fallback_and_plans_with_its_tokenizer(own, tmp_path):
    model_dir, data_file = own
    cfg = own_config(model_dir, data_file, tmp_path, "model.warm_start.steps=0")
    prep = cached_prep(cfg)
    data = load_prepared(prep["data_dir"])
    policy = load_policy(cfg, data, log=lambda *_: None)
    assert type(policy.model).__name__ == "Qwen2ForCausalLM" and policy.source == str(model_dir)
    assert policy.tokenizer.pad_token == policy.tokenizer.eos_token == "<|im_end|>"  # the folder has no pad token

    # The plan counts tokens of the chat-rendered prompt, as GRPO will see it, with the folder's BPE tokenizer.
    plan = cached_plan(cfg, prep["data_dir"], prep["content_hash"])
    rows = pq.read_table(plan["plan_path"], columns=["prompt_index", "prompt_tokens"]).to_pylist()
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = data["train"]["prompt"]
    assert prompts[0][0] == {"role": "system", "content": "Answer with the number only."}
    for row in rows[:20]:
        ids = tok.apply_chat_template(prompts[row["prompt_index"]], add_generation_prompt=True, tokenize=True,
                                      return_dict=False)
        assert row["prompt_tokens"] == len(ids)
    assert len({r["prompt_tokens"] for r in rows}) > 1 and min(r["prompt_tokens"] for r in rows) > 20  # BPE, not chars


def test_chat_format_training_on_a_model_folder_end_to_end(own, tmp_path):
    model_dir, data_file = own
    cfg = own_config(model_dir, data_file, tmp_path)
    SEEN.clear()
    run = open_run_dir(cfg, "own-chat", resume=False)
    summary = run_experiment(cfg, run, log=lambda *_: None)

    assert summary["steps"] == 2 and summary["policy_source"] == str(model_dir)
    assert summary["eval_accuracy_before"] is not None and summary["eval_accuracy_after"] is not None
    # TRL got conversational prompts and gave the rewards assistant messages (its conversational format).
    prompt, completion = SEEN[0]
    assert prompt[-1]["role"] == "user" and prompt[-1]["content"].startswith("What is ")
    assert completion[0]["role"] == "assistant" and isinstance(completion[0]["content"], str)
    # Evaluation generated from the same rendered prompts and stored them as given.
    before = json.loads((run.path / "eval_before.json").read_text())
    assert before["samples"][0]["prompt"][-1]["content"].startswith("What is ")

    saved = AutoTokenizer.from_pretrained(run.model_dir)
    assert saved.chat_template == CHAT_TEMPLATE and saved.pad_token == "<|im_end|>"
    start, trained = load_file(model_dir / "model.safetensors"), load_file(run.model_dir / "model.safetensors")
    assert start.keys() == trained.keys()
    assert any(not torch.equal(start[k], trained[k]) for k in start)  # warm start + GRPO changed the weights
