"""The per-model decision of the speed features (grpo/training/model_support.py), on real tiny models built from the
configs of tests/own_model.py (no training): which feature applies to which architecture, under the wrappers the
trainer sees, and a fallback said once per model, feature and reason."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from grpo.training.model_support import (
    COMPACT_ZERO_ADVANTAGE,
    GENERATION_KV_CACHE,
    SHARED_PROMPT_FORWARD,
    applies,
    unsupported,
)
from tests.own_model import ARCHITECTURES, tiny_config

RECURRENT = {"nemotron_h", "falcon_h1", "qwen3_next"}


def tiny(arch: str):
    config = tiny_config(arch, vocab_size=64)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_which_feature_applies_per_architecture(arch):
    model = tiny(arch)
    reason = unsupported(SHARED_PROMPT_FORWARD, model)
    if arch in RECURRENT:
        assert reason is not None and "recurrent-state layers" in reason and "LinearAttention" in reason
    else:  # dense, sliding window and MoE: the key/value cache selects rows
        assert reason is None
    assert unsupported(COMPACT_ZERO_ADVANTAGE, model) is None
    assert "router auxiliary loss" in unsupported(COMPACT_ZERO_ADVANTAGE, model, router_aux_loss=True)
    assert unsupported(GENERATION_KV_CACHE, model) is None


def test_the_answer_is_the_wrapped_models(caplog):
    """Under PEFT (the trainer's LoRA model) and DDP-style ``.module`` wrappers the causal LM is the one asked, and
    the fallback is said once for it however often and through whichever wrapper it is asked."""

    class Wrapper(torch.nn.Module):  # what DDP and accelerate expose: the model as ``.module``
        def __init__(self, module):
            super().__init__()
            self.module = module

    model = tiny("nemotron_h")
    peft = get_peft_model(model, LoraConfig(r=2, target_modules=["o_proj"]))
    with caplog.at_level(logging.INFO, logger="grpo.training.model_support"):
        assert not applies(SHARED_PROMPT_FORWARD, peft)
        assert not applies(SHARED_PROMPT_FORWARD, Wrapper(peft))
        assert not applies(SHARED_PROMPT_FORWARD, model)
        assert applies(COMPACT_ZERO_ADVANTAGE, model)
        assert applies(SHARED_PROMPT_FORWARD, tiny("qwen2"))
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and lines[0].startswith(
        "async.shared_prompt_forward: TRL's forward runs for NemotronHForCausalLM (its cache has recurrent-state "
        "layers (LinearAttentionLayer: Mamba / linear attention)"), lines


def test_an_unknown_feature_is_refused_with_the_known_ones():
    with pytest.raises(ValueError, match="unknown feature 'async.shared_prompt'.*async.shared_prompt_forward"):
        unsupported("async.shared_prompt", tiny("qwen2"))


class TopOneExperts(torch.nn.Module):
    """A MoE block of the older kind (one module per expert, a router picking one per token) in place of a layer's
    MLP: what remote-code MoE models still build, and what a forward leaves partly unreached."""

    def __init__(self, mlp: torch.nn.Module, hidden: int, count: int = 4) -> None:
        super().__init__()
        self.router = torch.nn.Linear(hidden, count, bias=False)
        self.experts = torch.nn.ModuleList(copy.deepcopy(mlp) for _ in range(count))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights = self.router(x).softmax(-1)
        pick = weights.argmax(-1)
        out = torch.zeros_like(x)
        for e in pick.unique().tolist():
            rows = pick == e
            out[rows] = self.experts[e](x[rows]) * weights[rows][:, e:e + 1]
        return out


def with_expert_modules(arch: str = "qwen2"):
    model = tiny(arch)
    layer = model.model.layers[0]
    layer.mlp = TopOneExperts(layer.mlp, model.config.hidden_size)
    return model


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_a_forward_reaches_every_parameter_of_each_architecture(arch):
    """transformers' MoE models keep a layer's experts in fused tensors: even a one-token forward reaches every
    parameter, so DDP needs no unused-parameter search for any of them (a backward agrees)."""
    from grpo.training.model_support import parameters_left_out

    model = tiny(arch)
    assert parameters_left_out(model) == []
    assert all(p.grad is None for p in model.parameters())  # the probe ran no backward
    model(input_ids=torch.tensor([[5, 7, 9]])).logits.sum().backward()
    assert [n for n, p in model.named_parameters() if p.grad is None] == []


def test_experts_the_router_did_not_pick_are_left_out_and_the_probe_changes_nothing():
    from grpo.training.model_support import parameters_left_out

    model = with_expert_modules()
    model.train()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = torch.random.get_rng_state()
    left_out = parameters_left_out(model)
    assert len(left_out) == 3 * 3 and all(n.startswith("model.layers.0.mlp.experts.") for n in left_out), left_out
    assert model.training and torch.equal(torch.random.get_rng_state(), state)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_ddp_searches_for_unused_parameters_only_where_a_forward_leaves_some_out(monkeypatch, tmp_path):
    """The trainer's choice of DDP's ``find_unused_parameters`` on several processes (transformers: on for every
    model, with a warning from every rank where nothing is left out); the user's setting and activation
    checkpointing keep theirs; one process runs no probe (no DDP)."""
    from trl import GRPOConfig

    from grpo.training.trainer import GRPOTrainer

    def choice(model, world_size=2, **args):
        # gradient checkpointing off: the platform's default (grpo.gradient_checkpointing), not TRL's
        config = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, **{"gradient_checkpointing": False, **args})
        with monkeypatch.context() as launched:  # what torchrun sets (after the config: accelerate reads it too)
            launched.setenv("WORLD_SIZE", str(world_size))
            GRPOTrainer._choose_ddp_unused_parameter_search(model, config)
        return config.ddp_find_unused_parameters

    assert choice(tiny("qwen2")) is False
    assert choice(tiny("gpt_oss")) is False  # fused experts
    assert choice(with_expert_modules()) is True
    assert choice(tiny("qwen2"), ddp_find_unused_parameters=True) is True
    assert choice(with_expert_modules(), ddp_find_unused_parameters=False) is False
    assert choice(with_expert_modules(), gradient_checkpointing=True) is None  # transformers: off (checkpointing)
    assert choice(with_expert_modules(), world_size=1) is None
    assert choice("Qwen/Qwen2.5-0.5B") is None  # a name: TRL loads it; transformers' choice
