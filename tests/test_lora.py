"""LoRA (``model.lora``): TRL's peft path on the tiny model, on CPU.

Only the adapter trains (the base stays byte-identical), evaluation and the async generator use the adapted policy,
``--resume`` continues from the adapter checkpoint, and the adapter (and the merged model) reach MLflow and reload.
The micro model scores 0 on exact answers, so these runs reward the digit format too: groups then have reward
variance and the adapter really moves (learning rate 5e-3).
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch

from grpo.config import load_config
from grpo.pipeline.experiment import run_experiment
from grpo.runs import open_run_dir
from tests.conftest import MICRO, micro_overrides

pytestmark = pytest.mark.integration  # trains a model, starts processes: not in `make test-fast`

LORA = {"model.lora.enabled": "true", "model.lora.r": 4, "model.lora.alpha": 8,
        "grpo.reward_funcs": "[digits_format,exact_match]", "evaluation.correctness_reward": "digits_format",
        "grpo.learning_rate": "5e-3", "grpo.logging_steps": 1}


def lora_config(tmp_path, **extra):
    return load_config(MICRO, micro_overrides(tmp_path, **{**LORA, **extra}))


def make_trainer(cfg, out_dir):
    """The platform's trainer with the config's peft_config, as ``grpo.training.train`` builds it."""
    from grpo.pipeline.data import load_data
    from grpo.rewards import get_reward
    from grpo.training.policy import load_policy
    from grpo.training.train import grpo_args, peft_config
    from grpo.training.trainer import GRPOTrainer

    data = load_data(cfg)
    policy = load_policy(cfg, data, log=lambda *_: None)
    base = {k: v.detach().clone() for k, v in policy.model.state_dict().items()}
    trainer = GRPOTrainer(model=policy.model, processing_class=policy.tokenizer,
                          reward_funcs=[get_reward(n) for n in cfg.grpo.reward_funcs], args=grpo_args(cfg, out_dir),
                          train_dataset=data["train"], experiment=cfg, peft_config=peft_config(cfg))
    return trainer, base, policy


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0].float()


def sample_ids(tokenizer, n=4):
    return [tokenizer(f"{i + 12}+{3 * i + 29}=", add_special_tokens=False)["input_ids"] for i in range(n)]


def test_only_the_adapter_trains_and_the_base_stays_byte_identical(tmp_path):
    from peft import PeftModel

    from grpo.training.async_producer import base_weights

    cfg = lora_config(tmp_path, **{"grpo.max_steps": 3, "grpo.save_steps": 100, "evaluation.enabled": "false"})
    trainer, base, _ = make_trainer(cfg, tmp_path / "out")
    model = trainer.model
    assert isinstance(model, PeftModel)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable), sorted(trainable)
    # all-linear on Qwen2: every projection of every layer, never the tied embedding / lm_head
    targets = {n.split(".")[-4] for n in trainable}
    assert targets == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}, targets
    assert sum(p.numel() for n, p in model.named_parameters() if n in trainable) < 0.2 * sum(
        p.numel() for p in model.parameters())
    before = {n: p.detach().clone() for n, p in model.named_parameters() if n in trainable}
    trainer.train()

    assert trainer.state.global_step == 3
    now = {n: p.detach() for n, p in model.named_parameters()}
    moved = [n for n in trainable if not torch.equal(now[n], before[n])]
    assert any(".lora_B." in n for n in moved) and any(".lora_A." in n for n in moved), moved
    frozen = base_weights(model)
    assert set(frozen) == set(base)
    changed = [k for k, v in frozen.items() if not torch.equal(v, base[k])]
    assert changed == [], changed  # every base tensor bit for bit as it was before GRPO


def test_evaluation_after_training_uses_the_adapted_policy_and_the_merged_model_loads_plainly(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo.pipeline.stages import eval_stage
    from grpo.training.policy import Policy, load_adapted, trained_policy

    cfg = lora_config(tmp_path, **{"grpo.max_steps": 4, "grpo.save_steps": 100, "model.lora.save_merged": "true",
                                   "evaluation.pass_k": 0})
    run = open_run_dir(cfg, "eval", resume=False)
    summary = run_experiment(cfg, run, log=lambda *_: None)
    assert summary["steps"] == 4
    files = set(os.listdir(run.model_dir))
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= files
    assert "model.safetensors" not in files  # the adapter only, not a copy of the base
    base_path = json.loads((run.model_dir / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert os.path.isabs(base_path) and os.path.isdir(base_path)  # loads from any working directory

    adapted = load_adapted(run.model_dir, torch.float32)  # the unmerged peft model, as training ran it
    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    merged = AutoModelForCausalLM.from_pretrained(run.merged_model_dir, dtype=torch.float32)  # plain transformers
    tokenizer = AutoTokenizer.from_pretrained(run.model_dir)
    evaluated = trained_policy(run.model_dir).model  # what the eval-after stage loads
    for ids in sample_ids(tokenizer):
        want = logits(adapted, ids)
        assert (logits(base, ids) - want).abs().max() > 1e-3  # the adapter changed the policy
        assert torch.allclose(logits(evaluated, ids), want, atol=1e-5)
        assert torch.allclose(logits(merged, ids), want, atol=1e-5)
    # eval_after.json is the adapted policy's evaluation: the unmerged peft model scores the same completions
    data_dir = json.loads((run.path / "inputs.json").read_text())["data_dir"]
    record = eval_stage(cfg, Policy(adapted, tokenizer, "", True, 0.0, []), Path(data_dir), tmp_path / "again.json")
    after = json.loads((run.path / "eval_after.json").read_text())
    assert record["accuracy"] == after["accuracy"] == summary["eval_accuracy_after"]
    assert record["samples"] == after["samples"]


def test_the_async_generator_samples_from_the_adapted_policy(tmp_path):
    """With ``async.use_data_producer`` the generator process holds the base plus the adapter; weight syncs send the
    adapter. After training steps and a sync, its sampling log-probs are the trainer's adapted policy's."""
    cfg = lora_config(tmp_path, **{"grpo.max_steps": 3, "grpo.save_steps": 100, "evaluation.enabled": "false",
                                   "async.use_data_producer": "true"})
    trainer, _, policy = make_trainer(cfg, tmp_path / "out")
    try:
        trainer.train()
        producer = trainer._producer
        assert producer is not None
        producer.push_weights(99, trainer._generator_weights())
        prompts = sample_ids(policy.tokenizer, 8)
        producer.submit(1000, prompts)
        rollout = producer.get(1000)
        assert rollout.version == 99
        model = trainer.model.eval()
        worst, off = 0.0, 0.0
        for prompt, completion, sampled in zip(prompts, rollout.completion_ids, rollout.logprobs):
            ids = prompt + completion
            scale = trainer.temperature
            own = torch.log_softmax(logits(model, ids)[len(prompt) - 1:-1] / scale, -1)
            own = own.gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)
            with model.disable_adapter():
                plain = torch.log_softmax(logits(model, ids)[len(prompt) - 1:-1] / scale, -1)
            plain = plain.gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)
            worst = max(worst, float((own - torch.tensor(sampled)).abs().max()))
            off = max(off, float((plain - torch.tensor(sampled)).abs().max()))
        assert worst < 1e-4, worst  # the generator computes the adapted policy
        assert off > 1e-2, off  # ... which is not the base
    finally:
        trainer.close_producer()


def test_resume_continues_from_the_adapter_checkpoint(tmp_path):
    """Interrupted during step 2 (a checkpoint at 2, the adapter only), then resumed: the final adapter equals that of
    an uninterrupted run, step for step."""
    from safetensors.torch import load_file
    from transformers import TrainerCallback

    class Interrupt(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 1:
                os.kill(os.getpid(), signal.SIGINT)

    extra = {"grpo.max_steps": 4, "grpo.save_steps": 100, "evaluation.enabled": "false"}
    cfg = lora_config(tmp_path / "straight", **extra)
    straight = open_run_dir(cfg, "straight", resume=False)
    run_experiment(cfg, straight, log=lambda *_: None)

    cfg = lora_config(tmp_path / "resumed", **extra)
    run = open_run_dir(cfg, "resumed", resume=False)
    with pytest.raises(KeyboardInterrupt):
        run_experiment(cfg, run, log=lambda *_: None, callbacks=[Interrupt()])
    ckpt = run.latest_checkpoint()
    assert ckpt is not None and ckpt.name == "checkpoint-2"
    files = set(os.listdir(ckpt))
    assert "adapter_model.safetensors" in files and "model.safetensors" not in files
    at_two = load_file(ckpt / "adapter_model.safetensors")

    seen = {}

    class Start(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            from peft import get_peft_model_state_dict
            seen["start"] = {k: v.clone() for k, v in get_peft_model_state_dict(model).items()}

        def on_step_begin(self, args, state, control, **kwargs):
            seen.setdefault("first_step", state.global_step)

    run = open_run_dir(cfg, "resumed", resume=True)
    summary = run_experiment(cfg, run, resume=True, log=lambda *_: None, callbacks=[Start()])
    assert summary["steps"] == 4 and summary["resumed_from"].endswith("checkpoint-2")
    assert seen["first_step"] == 2  # steps 3 and 4 only
    resumed, expected = load_file(run.model_dir / "adapter_model.safetensors"), load_file(
        straight.model_dir / "adapter_model.safetensors")
    assert set(resumed) == set(expected) == set(at_two)
    assert any(not torch.equal(resumed[k], at_two[k]) for k in resumed)  # it trained on from step 2
    assert all(torch.equal(resumed[k], expected[k]) for k in resumed), max(
        float((resumed[k] - expected[k]).abs().max()) for k in resumed)
    rows = [json.loads(line) for line in run.metrics_file.read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r["metrics"]] == [1, 2, 3, 4]  # each step logged once


def test_a_lora_run_logs_the_adapter_and_the_merged_model_to_mlflow(tmp_path):
    """The pipeline with MLflow tracking into a local SQLite store: the logged model is the peft adapter, and
    ``mlflow.transformers.load_model`` gives back the adapted policy; ``save_merged`` logs a plain model too."""
    import mlflow
    import mlflow.transformers
    from mlflow import MlflowClient
    from peft import PeftModel
    from transformers import AutoTokenizer

    from grpo.training.policy import load_adapted

    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = lora_config(tmp_path / "runs", **{"grpo.max_steps": 2, "grpo.save_steps": 100, "evaluation.pass_k": 0,
                                            "model.lora.save_merged": "true", "tracking.backend": "mlflow",
                                            "tracking.tracking_uri": store, "tracking.log_system_metrics": "false"})
    run = open_run_dir(cfg, "tracked", resume=False)
    summary = run_experiment(cfg, run, log=lambda *_: None)
    client = MlflowClient(store)
    mlrun = client.get_run(summary["mlflow_run_id"])
    assert mlrun.info.status == "FINISHED"
    assert mlrun.data.params["model.lora.enabled"] == "True" and mlrun.data.params["model.lora.r"] == "4"
    names = {m.name for m in client.search_logged_models(experiment_ids=[mlrun.info.experiment_id])}
    assert names == {"tracked", "tracked-merged"}, names  # named after the run

    mlflow.set_tracking_uri(store)
    try:
        adapter = mlflow.transformers.load_model(f"runs:/{summary['mlflow_run_id']}/tracked", return_type="components")
        merged = mlflow.transformers.load_model(f"runs:/{summary['mlflow_run_id']}/tracked-merged",
                                                return_type="components")
    finally:
        mlflow.set_tracking_uri(None)
    assert isinstance(adapter["model"], PeftModel) and not isinstance(merged["model"], PeftModel)
    trained = load_adapted(run.model_dir, torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(run.model_dir)
    for ids in sample_ids(tokenizer, 2):
        want = logits(trained, ids)
        assert torch.allclose(logits(adapter["model"].float(), ids), want, atol=1e-5)
        assert torch.allclose(logits(merged["model"].float(), ids), want, atol=1e-5)
