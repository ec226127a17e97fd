"""Every architecture TRL's own GRPOTrainer suite trains, trained here with the default speed features (#32).

Each model is built offline from a tiny config (2 layers, hidden size 64; MoE routers, sliding windows shorter than a
prompt, and for the hybrids one Mamba / linear-attention layer beside an attention layer) with the locally trained
BPE tokenizer of tests/own_model.py, and:

- trains one step through ``grpo run``'s real path (prep, the model folder's loader, TRL's in-process generation with
  the shared prefill, the loss with compaction and the shared-prompt forward, evaluation's cached generation), and a
  model whose feature cannot apply says so once in the log;
- gives stock ``trl.GRPOTrainer``'s gradient of one step (1e-5 relative, fp32) on the same scored batch, with the
  speed features on where they apply, which is checked too (the shared prompt's forwards fraction < 1, compacted rows).
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import trl
from transformers import AutoConfig

from grpo.config import load_config
from grpo.pipeline.data import load_data
from grpo.pipeline.experiment import run_experiment
from grpo.rewards import get_reward
from grpo.runs import open_run_dir
from grpo.training.model_support import COMPACT_ZERO_ADVANTAGE, SHARED_PROMPT_FORWARD, unsupported
from grpo.training.policy import load_policy
from grpo.training.train import grpo_args
from grpo.training.trainer import GRPOTrainer
from tests.conftest import MICRO
from tests.own_model import ARCHITECTURES, build_own_model, write_dataset

pytestmark = pytest.mark.integration  # trains models: not in `make test-fast`

REL = 1e-5
# Where a feature falls back, and the words its log line gives as the reason.
RECURRENT = {"nemotron_h", "falcon_h1", "qwen3_next"}  # shared prompt: recurrent-state cache layers
ROUTER_AUX_LOSS = {"qwen3_moe", "gpt_oss", "qwen3_next"}  # compaction: TRL adds the router's aux loss (coef != 0)
GROUPS, SIZE = 2, 4
ADVANTAGES = torch.tensor([0.9, 0.0, -0.4, 0.0, 0.0, 1.3, 0.0, -1.1])  # 4 of 8 rows zero: compaction drops them


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """The model folders (built on first use) and one data file of word problems."""
    root = tmp_path_factory.mktemp("architectures")
    built: dict[str, object] = {"data": write_dataset(root / "problems.jsonl", n=48)}

    def folder(arch: str):
        if arch not in built:
            built[arch] = build_own_model(root / arch, architecture=arch)
        return built[arch]

    return folder, built["data"]


def config(model, data, out, *extra: str):
    return load_config(MICRO, [
        f"output_dir={out}", f"model.name_or_path={model}", f"data.source={data}", "data.prompt_format=chat",
        "data.num_eval=8", "model.warm_start.steps=0", "grpo.max_completion_length=4", "grpo.max_steps=1",
        f"grpo.per_device_train_batch_size={GROUPS * SIZE}", f"grpo.num_generations={SIZE}", "grpo.save_steps=100",
        "grpo.logging_steps=1", "grpo.temperature=1.5", "evaluation.num_prompts=4", "evaluation.pass_k=0", *extra,
    ])


def fallback_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.getMessage().startswith((SHARED_PROMPT_FORWARD, COMPACT_ZERO_ADVANTAGE))]


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_one_grpo_run_step_with_the_default_speed_features(folders, arch, tmp_path, caplog):
    folder, data = folders
    cfg = config(folder(arch), data, tmp_path)
    model_class = AutoConfig.from_pretrained(folder(arch)).architectures[0]
    assert cfg.async_.shared_prompt_forward and cfg.async_.compact_zero_advantage  # the defaults
    with caplog.at_level(logging.INFO, logger="grpo.training"):
        summary = run_experiment(cfg, open_run_dir(cfg, f"arch-{arch}", resume=False), log=lambda *_: None)
    assert summary["steps"] == 1 and summary["eval_accuracy_after"] is not None  # evaluation generated too
    lines = fallback_lines(caplog)
    expected = []
    if arch in RECURRENT:  # once, from generation's prefill or the training forward, whichever came first
        expected.append(f"{SHARED_PROMPT_FORWARD}: TRL's forward runs for {model_class} (its cache has "
                        "recurrent-state layers")
    if arch in ROUTER_AUX_LOSS:
        expected.append(f"{COMPACT_ZERO_ADVANTAGE}: computing every completion (no compaction) with a router "
                        "auxiliary loss")
    assert len(lines) == len(expected) and all(any(line.startswith(e) for line in lines) for e in expected), lines


def gradient(trainer, batch) -> tuple[torch.Tensor, torch.Tensor]:
    trainer.model.train()
    trainer.model.zero_grad(set_to_none=True)
    trainer.current_gradient_accumulation_steps = 1
    loss = trainer.compute_loss(trainer.model, batch)
    trainer.accelerator.backward(loss)
    return torch.cat([p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None]), loss.detach()


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_gradient_equals_stock_trl(folders, arch, tmp_path):
    folder, data_file = folders
    cfg = config(folder(arch), data_file, tmp_path)
    data = load_data(cfg)
    policy = load_policy(cfg, data, log=lambda *_: None)
    rewards = [get_reward(n) for n in cfg.grpo.reward_funcs]
    ours = GRPOTrainer(model=copy.deepcopy(policy.model), processing_class=policy.tokenizer, reward_funcs=rewards,
                       args=grpo_args(cfg, tmp_path / "ours"), train_dataset=data["train"], experiment=cfg)
    stock = trl.GRPOTrainer(model=copy.deepcopy(policy.model), processing_class=policy.tokenizer,
                            reward_funcs=rewards, args=grpo_args(cfg, tmp_path / "trl"), train_dataset=data["train"])
    assert ours.aux_loss_enabled == stock.aux_loss_enabled == (arch in ROUTER_AUX_LOSS)
    assert (unsupported(SHARED_PROMPT_FORWARD, ours.model) is None) == (arch not in RECURRENT)

    # A scored batch from our in-process generation (the shared prefill where it applies), with advantages of both
    # signs and zeros, prompts and completions of unequal length and an older policy's log-probs.
    torch.manual_seed(0)
    batch = ours.assemble_generation_batch([data["train"][i] for i in range(GROUPS) for _ in range(SIZE)])
    batch["advantages"] = ADVANTAGES.clone()
    # The first group's prompt one token shorter, left-padded as TRL pads (the windows then start at other positions).
    batch["prompt_ids"][:SIZE, 0] = ours.processing_class.pad_token_id
    batch["prompt_mask"][:SIZE, 0] = 0
    width = batch["completion_mask"].shape[1]
    for i in range(GROUPS * SIZE):
        batch["completion_mask"][i, (i * 3) % width + 1:] = 0
    with torch.no_grad():
        ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
        mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
        old, _, _ = stock._get_per_token_logps_and_entropies(stock.model, ids, mask, width)
    # The prompts are longer than the sliding windows (the windowed layers attend to part of the cached prompt).
    assert batch["prompt_ids"].shape[1] > ARCHITECTURES[arch].get("sliding_window", 0)
    batch["old_per_token_logps"] = old + 0.05 * torch.randn(old.shape, generator=torch.Generator().manual_seed(1))

    reference, reference_loss = gradient(stock, batch)
    got, loss = gradient(ours, batch)
    assert reference.abs().sum() > 0
    rel = ((got - reference).abs().max() / reference.abs().max()).item()
    assert rel < REL, rel
    assert torch.allclose(loss, reference_loss, rtol=1e-5, atol=1e-7), (loss, reference_loss)

    metrics = ours._metrics["train"]
    if arch in RECURRENT:
        assert "shared_prompt/prompt_forwards_frac" not in metrics or not metrics["shared_prompt/prompt_forwards_frac"]
    else:  # each distinct prompt ran once for the rows computed
        assert metrics["shared_prompt/prompt_forwards_frac"][-1] < 1
    skipped = metrics["compaction/rows_skipped_frac"][-1]
    assert skipped == (0.0 if arch in ROUTER_AUX_LOSS else float((ADVANTAGES == 0).sum()) / len(ADVANTAGES))


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_the_async_generator_samples_as_without_the_speed_features(folders, arch):
    """The CPU async generator's round (:func:`sample_round`: the shared prefill where it applies, the KV cache)
    draws the same completions, with the same sampling log-probs, as without the shared prefill."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo.training.async_producer import sample_round

    folder, _ = folders
    model = AutoModelForCausalLM.from_pretrained(folder(arch), dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder(arch))
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": f"What is {a} plus 3?"}],
                                             add_generation_prompt=True, tokenize=True, return_dict=False)
               for a in (4, 17)]
    prompts[0] = prompts[0][1:]  # unequal lengths: left padding
    gen = {"eos_token_ids": [tokenizer.eos_token_id], "pad_token_id": tokenizer.eos_token_id, "max_new_tokens": 4,
           "temperature": 1.5, "top_p": 1.0, "top_k": 0}

    def sample(**options):
        torch.manual_seed(3)
        return sample_round(model, [p for p in prompts for _ in range(SIZE)], {**gen, **options})

    completions, logps = sample()
    plain_completions, plain_logps = sample(shared_prompt=False)
    assert completions == plain_completions
    assert all(len(c) for c in completions)
    flat, plain = torch.tensor(sum(logps, [])), torch.tensor(sum(plain_logps, []))
    assert ((flat - plain).abs().max() / plain.abs().max()).item() < REL


# A reward with spread inside every group of an untrained model (its completion's length): the steps move the weights.
LENGTH_REWARD = """
from grpo.rewards import _text, register_reward

@register_reward("completion_chars")
def completion_chars(completions, **kwargs):
    return [float(len(_text(c))) for c in completions]
"""


@pytest.mark.parametrize("arch", ["gpt_oss", "nemotron_h"])
def test_two_ranks_stay_one_model(folders, arch, tmp_path):
    """``grpo run`` under torchrun (2 ranks, gloo) with the defaults: a MoE model with sliding-window layers and TRL's
    aux loss (shared prompt exact, compaction falling back) and a hybrid Mamba model (shared prompt falling back,
    compaction on) train 2 steps, and both ranks end with the same weights, changed by training."""
    import os
    import subprocess
    import sys

    from tests.servers import free_port
    from tests.test_multiprocess import PARAM_DIGEST, rank_param_digests

    folder, data = folders
    digest_module = tmp_path / "param_digest.py"
    digest_module.write_text(PARAM_DIGEST + LENGTH_REWARD)
    digests = tmp_path / "digests.jsonl"
    overrides = [f"model.name_or_path={folder(arch)}", f"data.source={data}", "data.prompt_format=chat",
                 "data.num_eval=8", "model.warm_start.steps=0", "grpo.max_completion_length=4", "grpo.max_steps=2",
                 f"grpo.per_device_train_batch_size={GROUPS * SIZE}", f"grpo.num_generations={SIZE}",
                 "grpo.save_steps=100", "grpo.temperature=1.5", "grpo.reward_funcs=[completion_chars]",
                 "evaluation.enabled=false", "sampling.world_size=2", f"output_dir={tmp_path}"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           "-m", "grpo.app.cli", "run", "--config", str(MICRO), "--run-name", "ddp", "--reward-module",
           str(digest_module)]
    for item in overrides:
        cmd += ["--set", item]
    env = {**os.environ, "PARAM_LOG": str(digests), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    # MoE experts fused per layer, Mamba layers: every forward reaches every parameter, so DDP runs without its
    # unused-parameter search (and without the warning it prints on every rank when it finds none)
    assert "find_unused_parameters=True was specified" not in result.stderr, result.stderr[-3000:]
    params = rank_param_digests(digests)
    assert sorted(params["begin"]) == sorted(params["end"]) == [0, 1], params
    assert len(set(params["begin"].values())) == 1 and len(set(params["end"].values())) == 1, params
    assert params["end"][0] != params["begin"][0], "training did not change the parameters"
