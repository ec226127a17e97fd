"""The per-model decision of the speed features (grpo/training/model_support.py), on real tiny models built from the
configs of tests/own_model.py (no training): which feature applies to which architecture, under the wrappers the
trainer sees, and a fallback said once per model, feature and reason."""

from __future__ import annotations

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
