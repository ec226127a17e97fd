"""A user's own model folder (Qwen2, byte-level BPE, chat template, no pad token) and a chat-format data file: load,
plan with that tokenizer, warm-start, train, evaluate and save, end to end on the real loading code."""

from __future__ import annotations

import json
from pathlib import Path

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
from tests.own_model import CHAT_TEMPLATE, build_own_model, write_dataset, write_gsm8k_conversational

pytestmark = pytest.mark.integration  # trains a model: not in `make test-fast`

SEEN: list[tuple[object, object]] = []  # (prompt, completion) pairs the reward below was called with


@register_reward("exact_match_chat_recorded")
def exact_match_chat_recorded(prompts, completions, answer, **kwargs):
    SEEN.extend(zip(prompts, completions))
    return exact_match(completions, answer)


KWARGS: list[dict] = []  # extra columns the reward below was given


@register_reward("last_number_match_recorded")
def last_number_match_recorded(prompts, completions, answer, **kwargs):
    from grpo.rewards import last_number_match

    KWARGS.append({"prompts": prompts, "answer": list(answer), "steps": kwargs.get("steps")})
    return last_number_match(completions, answer)


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


# A custom template in the config (not the folder's ChatML): role tags in brackets.
CUSTOM_TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                   "{% if add_generation_prompt %}[assistant] {% endif %}")


def test_conversational_gsm8k_file_with_a_custom_chat_template_end_to_end(own, tmp_path):
    """#14: a GSM8K-style file in TRL's conversational format (message-list prompts, ``#### n`` answers, an extra
    column), a chat template set in the config, 30 steps on the model folder, tracked in MLflow; the logged model
    reloads with ``mlflow.transformers.load_model`` and generates with its tokenizer and that template."""
    import mlflow.transformers
    from mlflow import MlflowClient

    model_dir, _ = own
    data_file = write_gsm8k_conversational(tmp_path / "gsm8k.jsonl")
    template = tmp_path / "brackets.jinja"
    template.write_text(CUSTOM_TEMPLATE)
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = own_config(model_dir, data_file, tmp_path / "runs", "data.prompt_format=plain", "data.system_prompt=null",
                     "data.answer_regex='####\\s*(-?\\d+)'", f"model.chat_template={template}",
                     "grpo.reward_funcs=[last_number_match_recorded]", "grpo.max_completion_length=8",
                     "grpo.max_steps=30", "grpo.logging_steps=10", "tracking.backend=mlflow",
                     f"tracking.tracking_uri={store}", "tracking.log_system_metrics=false")

    # Prep: conversations kept as given, answers extracted by answer_regex, a bad conversation and a repeat quarantined.
    prep = cached_prep(cfg)
    data = load_prepared(prep["data_dir"])
    first = data["train"][0]
    assert [m["role"] for m in first["prompt"]] == ["system", "user"] and first["answer"].lstrip("-").isdigit()
    assert "steps" in data["train"].column_names
    quarantined = [json.loads(line) for line in (Path(prep["data_dir"]) / "quarantine.jsonl").read_text().splitlines()]
    assert sorted(r["rules"][0] for r in quarantined) == ["duplicate_prompt", "prompt_type"]
    bad = next(r for r in quarantined if r["rules"] == ["prompt_type"])
    assert "message 0 has role 'narrator'" in bad["reason"] and "'system', 'user', 'assistant'" in bad["reason"]

    # The plan counts tokens of the prompt rendered with the config's template, not the folder's.
    plan = cached_plan(cfg, prep["data_dir"], prep["content_hash"])
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.chat_template = CUSTOM_TEMPLATE
    row = pq.read_table(plan["plan_path"], columns=["prompt_index", "prompt_tokens"]).to_pylist()[0]
    ids = tok.apply_chat_template(data["train"]["prompt"][row["prompt_index"]], add_generation_prompt=True,
                                  tokenize=True, return_dict=False)
    assert row["prompt_tokens"] == len(ids)

    KWARGS.clear()
    run = open_run_dir(cfg, "gsm8k-chat", resume=False)
    summary = run_experiment(cfg, run, log=lambda *_: None)
    assert summary["steps"] == 30 and summary["eval_accuracy_after"] is not None
    # TRL gave the reward the conversations, the extracted answers and the extra column
    call = KWARGS[0]
    assert call["prompts"][0][-1]["role"] == "user" and "How many" in call["prompts"][0][-1]["content"]
    assert all(a.lstrip("-").isdigit() for a in call["answer"]) and set(call["steps"]) <= {2, 3}
    saved = AutoTokenizer.from_pretrained(run.model_dir)
    assert saved.chat_template == CUSTOM_TEMPLATE

    # The MLflow model reloads with its tokenizer and template and generates from a rendered conversation.
    client = MlflowClient(store)
    assert client.get_run(summary["mlflow_run_id"]).info.status == "FINISHED"
    mlflow.set_tracking_uri(store)
    try:
        # the logged model is named after the run
        loaded = mlflow.transformers.load_model(f"runs:/{summary['mlflow_run_id']}/gsm8k-chat",
                                                return_type="components")
    finally:
        mlflow.set_tracking_uri(None)
    tokenizer, model = loaded["tokenizer"], loaded["model"]
    assert tokenizer.chat_template == CUSTOM_TEMPLATE
    prompt = tokenizer.apply_chat_template(first["prompt"], add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("[assistant] ") and "[user] " in prompt
    inputs = tokenizer(prompt, return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=4, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    assert out.shape[1] > inputs["input_ids"].shape[1]
    state, trained = model.state_dict(), load_file(run.model_dir / "model.safetensors")
    assert all(torch.equal(state[k].to(v.dtype), v) for k, v in trained.items())  # the trained weights, not others
