"""Combinations of options that defeat each other are refused at load, with the fields, the reason and what to do
instead; the nearest valid combination loads. (Loss layouts that are made exact instead of refused are tested on
gradients in tests/test_loss_extensions.py.)"""

from __future__ import annotations

import pytest

from grpo.config import TRL_FIELDS_SET_BY_PLATFORM, load_config
from grpo.errors import ConfigError
from tests.test_config import rejects

BALANCED = ["sampling.world_size=2", "sampling.seqlen_balancing=true"]

# (refused overrides, fragments its message must hold, the nearby overrides that load)
REFUSED = {
    "adaptive_entropy_with_chunks": (
        ["grpo.extra.use_adaptive_entropy=true", "grpo.num_generations_chunks=2"],
        ["grpo.extra.use_adaptive_entropy", "grpo.num_generations_chunks (2)", "once per chunk",
         "use num_generations_chunks: 1"],
        ["grpo.extra.entropy_coef=0.1", "grpo.num_generations_chunks=2"],
    ),
    "bnpo_with_balancing": (
        [*BALANCED, "grpo.loss_type=bnpo"],
        ["grpo.loss_type 'bnpo' with sampling.seqlen_balancing", "own token count", "use loss_type 'dapo'"],
        [*BALANCED, "grpo.loss_type=dr_grpo"],
    ),
    "entropy_bonus_with_balancing": (
        [*BALANCED, "grpo.extra.entropy_coef=0.1"],
        ["grpo.extra.entropy_coef", "sampling.seqlen_balancing", "token mean per micro-batch",
         "turn seqlen_balancing off"],
        ["grpo.extra.entropy_coef=0.1"],
    ),
    "adaptive_entropy_with_balancing": (
        [*BALANCED, "grpo.extra.use_adaptive_entropy=true"],
        ["use_adaptive_entropy with sampling.seqlen_balancing"],
        ["grpo.extra.use_adaptive_entropy=true"],
    ),
    "entropy_quantile_with_balancing_and_several_micro_batches": (
        [*BALANCED, "grpo.extra.top_entropy_quantile=0.5", "grpo.steps_per_generation=2"],
        ["grpo.extra.top_entropy_quantile (0.5)", "2 micro-batches", "use steps_per_generation 1"],
        [*BALANCED, "grpo.extra.top_entropy_quantile=0.5", "grpo.steps_per_generation=1"],
    ),
    "sync_interval_above_staleness": (
        ["async.async_prefetch=true", "async.vllm_sync_interval=3", "async.max_staleness=2"],
        ["async.vllm_sync_interval (3) > async.max_staleness (2)", "dropped and generated again",
         "set async.vllm_sync_interval <= async.max_staleness"],
        ["async.async_prefetch=true", "async.vllm_sync_interval=2", "async.max_staleness=2"],
    ),
    # Nearby: the same async run on the CPU engine (server mode itself loads only where vllm is installed; it is
    # loaded with vllm faked present in test_async_vllm_server_mode_loads_and_selects_the_server_engine).
    "async_with_colocated_vllm": (
        ["async.use_data_producer=true", "grpo.use_vllm=true", "grpo.vllm_mode=colocate"],
        ["async.use_data_producer (or async_prefetch) with grpo.use_vllm and grpo.vllm_mode 'colocate'",
         "can not run ahead of training", "set grpo.vllm_mode: server"],
        ["async.use_data_producer=true"],
    ),
    "async_prefetch_with_colocated_vllm": (
        ["async.async_prefetch=true", "grpo.use_vllm=true"],
        ["grpo.vllm_mode 'colocate'", "can not run ahead of training"],
        ["async.async_prefetch=true"],
    ),
    "async_vllm_server_with_several_processes": (
        ["async.use_data_producer=true", "grpo.use_vllm=true", "grpo.vllm_mode=server", "sampling.world_size=2",
         "grpo.per_device_train_batch_size=8"],
        ["grpo.use_vllm in server mode and sampling.world_size (2) > 1", "not implemented",
         "use sampling.world_size: 1"],
        ["async.use_data_producer=true", "sampling.world_size=2", "grpo.per_device_train_batch_size=8"],
    ),
    "extra_overrides_async_is_mode": (
        ["grpo.extra.vllm_importance_sampling_mode=sequence_mask"],
        ["grpo.extra: 'vllm_importance_sampling_mode' is set from async.vllm_importance_sampling_mode",
         "set that instead"],
        ["async.vllm_importance_sampling_mode=sequence_mask"],
    ),
    "extra_report_to": (
        ["grpo.extra.report_to=[tensorboard]"],
        ["grpo.extra: 'report_to' is set from grpo.report_to"],
        ["grpo.report_to=[]"],
    ),
    "report_to_mlflow": (
        ["grpo.report_to=[mlflow]"],
        ["grpo.report_to: 'mlflow'", "second MLflow run", "tracking.backend: mlflow"],
        ["tracking.backend=mlflow"],
    ),
    "report_to_unknown": (
        ["grpo.report_to=[tensorbored]"],
        ["grpo.report_to: unknown logger 'tensorbored'", "tensorboard", "wandb"],
        ["grpo.report_to=[]"],
    ),
    "lora_after_a_full_warm_start_of_a_model_folder": (
        ["model.lora.enabled=true", "model.name_or_path=org/model", "model.warm_start.steps=10"],
        ["model: lora.enabled with warm_start.steps (10) > 0", "saved nowhere", "set model.warm_start.steps: 0"],
        ["model.lora.enabled=true", "model.name_or_path=org/model", "model.warm_start.steps=0"],
    ),
    "lora_with_sync_ref_model": (
        ["model.lora.enabled=true", "grpo.beta=0.04", "grpo.extra.sync_ref_model=true"],
        ["grpo.extra.sync_ref_model with model.lora.enabled", "adapter disabled", "drop sync_ref_model"],
        ["model.lora.enabled=true", "grpo.beta=0.04"],
    ),
    "lora_on_the_output_layer": (
        ["model.lora.enabled=true", "model.lora.target_modules=[q_proj,lm_head]"],
        ["model.lora.target_modules: 'lm_head' can not carry an adapter", "lm_head.weight directly",
         "valid: 'all-linear'"],
        ["model.lora.enabled=true", "model.lora.target_modules=[q_proj,v_proj]"],
    ),
    "lora_on_the_tied_embeddings": (
        ["model.lora.target_modules=[embed_tokens]"],
        ["model.lora.target_modules: 'embed_tokens' can not carry an adapter"],
        ["model.lora.target_modules=all-linear"],
    ),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused_combination_names_fields_reason_and_fix(name):
    refused, fragments, nearby = REFUSED[name]
    rejects(refused, *fragments)
    load_config(None, nearby)  # the nearby valid combination loads


@pytest.mark.parametrize("field", sorted(TRL_FIELDS_SET_BY_PLATFORM))
def test_extra_can_not_override_a_field_the_platform_sets(field):
    with pytest.raises(ConfigError, match=f"grpo.extra: '{field}' is set from"):
        load_config(None, [f"grpo.extra.{field}=1"])


def test_platform_mapped_fields_reach_trl(tmp_path):
    """What TRL_FIELDS_SET_BY_PLATFORM names as the source is what grpo_args passes to trl.GRPOConfig."""
    from grpo.training.train import grpo_args

    cfg = load_config(None, ["async.use_data_producer=true", "async.vllm_importance_sampling_correction=true",
                             "async.vllm_importance_sampling_mode=sequence_mask",
                             "async.vllm_importance_sampling_cap=3", "async.off_policy_mask_threshold=0.25",
                             "async.use_bias_correction_kl=true", "sampling.shuffle=false"])
    args = grpo_args(cfg, tmp_path)
    assert args.vllm_importance_sampling_correction is True
    assert args.vllm_importance_sampling_mode == "sequence_mask" and args.vllm_importance_sampling_clip_max == 3
    assert args.off_policy_mask_threshold == 0.25 and args.use_bias_correction_kl is True
    assert args.shuffle_dataset is False and args.report_to == []


def test_report_to_adds_an_installed_logger(tmp_path, monkeypatch):
    """TRL's report_to (e.g. TensorBoard beside MLflow) is allowed for installed integrations."""
    from transformers.integrations import integration_utils

    from grpo.training.train import grpo_args

    if "tensorboard" not in integration_utils.get_available_reporting_integrations():
        with pytest.raises(ConfigError, match="grpo.report_to: 'tensorboard' is not installed"):
            load_config(None, ["grpo.report_to=[tensorboard]"])
        monkeypatch.setattr(integration_utils, "get_available_reporting_integrations", lambda: ["tensorboard"])
    cfg = load_config(None, ["grpo.report_to=[tensorboard]", "tracking.backend=mlflow"])
    assert grpo_args(cfg, tmp_path).report_to == ["tensorboard"]


def test_reward_timeout_is_finite_by_default():
    from grpo.config import AsyncSection

    timeout = load_config(None).async_.reward_timeout
    assert timeout is not None and 60 <= timeout <= 3600
    assert "default" in AsyncSection.model_fields["reward_timeout"].description
    assert load_config(None, ["async.reward_timeout=null"]).async_.reward_timeout is None  # waiting forever: explicit


def test_async_vllm_server_mode_loads_and_selects_the_server_engine(tmp_path, monkeypatch):
    """Async with vLLM in server mode is the supported GPU combination: it loads (vllm faked installed: CPU machines
    never install it), the trainer picks the vLLM server engine, and TRL's own vLLM path stays off (the engine owns
    the client and the weight syncs). Without async, use_vllm goes to TRL unchanged."""
    import importlib.util

    from grpo.training.rollout_engines import engine_kind
    from grpo.training.train import grpo_args

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else real(name, *a))
    cfg = load_config(None, ["async.use_data_producer=true", "async.async_prefetch=true", "grpo.use_vllm=true",
                             "grpo.vllm_mode=server", "async.vllm_importance_sampling_correction=true"])
    assert engine_kind(cfg) == "vllm_server"
    assert grpo_args(cfg, tmp_path).use_vllm is False
    assert engine_kind(load_config(None, ["async.use_data_producer=true"])) == "cpu_process"
    assert engine_kind(load_config(None, ["grpo.use_vllm=true", "grpo.vllm_mode=server"])) is None
