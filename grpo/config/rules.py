"""Rules across the config's sections: what each section accepts alone but the experiment can not run together.

One function per rule, each raising ``ValueError`` with the message the user sees (the fields and the fix). The
experiment config runs :data:`RULES` in order when it loads (:class:`grpo.config.ExperimentConfig`),
so the first broken rule is the error; the order is part of the behaviour (the batch rules read a layout the earlier
ones made derivable). Rules within one section are that section's validators (:mod:`grpo.config.sections`).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import TYPE_CHECKING

from grpo.config.trl_and_rewards import (
    check_agent_name,
    check_environment_builds,
    check_environment_names,
    check_reward_names,
    environment_kind,
    environment_lacks_step,
)

if TYPE_CHECKING:
    from grpo.config.sections import ExperimentConfig

__all__ = ["RULES", "check_rules"]


# ---------------------------------------------------------------- rewards


def rewards_are_registered(cfg: ExperimentConfig) -> None:
    """A reward is called by name at training and evaluation; an unknown name would fail only after the model is
    built."""
    check_reward_names({"grpo.reward_funcs": cfg.grpo.reward_funcs,
                        "evaluation.correctness_reward": [cfg.evaluation.correctness_reward]})


def one_weight_per_reward(cfg: ExperimentConfig) -> None:
    """TRL pairs ``reward_weights`` with ``reward_funcs`` by position; a different count has no meaning."""
    g = cfg.grpo
    if g.reward_weights is not None and len(g.reward_weights) != len(g.reward_funcs):
        raise ValueError(
            f"grpo.reward_weights has {len(g.reward_weights)} values but grpo.reward_funcs has {len(g.reward_funcs)}"
        )


# ---------------------------------------------------------------- batch layout (grpo.algo.batch_layout)


def generation_batch_set_one_way(cfg: ExperimentConfig) -> None:
    """``generation_batch_size`` and ``steps_per_generation`` each fix the other (TRL refuses both), so the layout
    is derivable only from one."""
    g = cfg.grpo
    if g.generation_batch_size is not None and g.steps_per_generation is not None:
        raise ValueError("grpo.generation_batch_size and grpo.steps_per_generation can not both be set; set one")


def generation_batch_fills_micro_steps(cfg: ExperimentConfig) -> None:
    """``steps_per_generation`` is ``generation_batch_size`` over the global batch (TRL's derivation): a round is
    cut into whole micro-steps."""
    g = cfg.grpo
    global_batch = cfg.batch_layout.global_batch_size
    if g.generation_batch_size is not None and g.generation_batch_size % global_batch:
        raise ValueError(
            f"grpo.generation_batch_size ({g.generation_batch_size}) must be divisible by the global batch "
            f"per_device_train_batch_size x sampling.world_size = {global_batch}"
        )


def generation_batch_holds_whole_groups(cfg: ExperimentConfig) -> None:
    """Advantages are normalised within a prompt's group, so a generation round must hold whole groups."""
    g = cfg.grpo
    gen_batch = cfg.batch_layout.generation_batch_size
    if gen_batch % g.num_generations:
        raise ValueError(f"generation batch ({gen_batch} completions) must be divisible by grpo.num_generations "
                         f"({g.num_generations}); valid num_generations: {_divisors(gen_batch, start=2)}")


def _divisors(n: int, start: int) -> list[int]:
    """The values from ``start`` up that divide ``n``: the valid choices a divisibility message lists."""
    return [d for d in range(start, n + 1) if n % d == 0]


def chunks_divide_groups(cfg: ExperimentConfig) -> None:
    """``num_generations_chunks`` runs the backward on equal slices of each group's completions."""
    g = cfg.grpo
    if g.num_generations % g.num_generations_chunks:
        raise ValueError(f"grpo.num_generations ({g.num_generations}) must be divisible by "
                         f"grpo.num_generations_chunks ({g.num_generations_chunks}); valid: "
                         f"{_divisors(g.num_generations, start=1)}")


def chunks_fit_the_micro_batch(cfg: ExperimentConfig) -> None:
    """A chunk is a slice of a micro-batch's rows; more chunks than rows would leave chunks empty."""
    g = cfg.grpo
    if g.num_generations_chunks > g.per_device_train_batch_size:
        raise ValueError(
            f"grpo.num_generations_chunks ({g.num_generations_chunks}) can not exceed "
            f"grpo.per_device_train_batch_size ({g.per_device_train_batch_size}), the rows it splits"
        )


# ---------------------------------------------------------------- loss options and the micro-batch layout
#
# Loss options that must mean the same whatever the micro-batch layout (chunks, token-budget balancing).
#
# ``num_generations_chunks`` is exact for every loss type and TRL's static entropy options (chunk weights,
# one entropy mask per micro-batch, see ``GRPOTrainer._chunked_loss``). Token-budget micro-batches are exact
# where the loss is a mean over sequences or normalised by the generation batch's token count (weights
# ``rows / per_device_train_batch_size``, see ``GRPOTrainer.compute_policy_loss``); what depends on which
# completions share a micro-batch can not be reweighted and is refused here.


def _balances_token_budgets(cfg: ExperimentConfig) -> bool:
    """Whether the trainer regroups completions into token-budget micro-batches (sequence-length balancing over
    several ranks)."""
    s = cfg.sampling
    return s.seqlen_balancing and s.world_size > 1


def adaptive_entropy_without_chunks(cfg: ExperimentConfig) -> None:
    """TRL's adaptive entropy controller steps once per loss call, which chunks turn into once per chunk."""
    g = cfg.grpo
    adaptive = bool(g.extra.get("use_adaptive_entropy", False))
    if adaptive and g.num_generations_chunks > 1:
        raise ValueError(
            f"grpo.extra.use_adaptive_entropy with grpo.num_generations_chunks ({g.num_generations_chunks}) > 1: "
            "TRL's adaptive entropy controller updates entropy_coef on every loss call at the optimizer-step "
            "boundary, so with chunks it would update once per chunk instead of once per step: use "
            "num_generations_chunks: 1, or a static grpo.extra.entropy_coef (exact with chunks)"
        )


def bnpo_without_token_budgets(cfg: ExperimentConfig) -> None:
    """bnpo normalises by each micro-batch's own token count, which balancing changes."""
    if not _balances_token_budgets(cfg):
        return
    if cfg.grpo.loss_type == "bnpo":
        raise ValueError(
            "grpo.loss_type 'bnpo' with sampling.seqlen_balancing: bnpo divides each micro-batch's loss by that "
            "micro-batch's own token count, so every completion's weight depends on which completions share its "
            "micro-batch and rank; balancing regroups them into token budgets, and no per-micro-batch weight "
            "gives back the unbalanced gradient: use loss_type 'dapo' (normalised by the generation batch's "
            "token count, unchanged by balancing), 'grpo' or 'dr_grpo' (exact), or turn seqlen_balancing off"
        )


def entropy_bonus_without_token_budgets(cfg: ExperimentConfig) -> None:
    """TRL's entropy bonus is a token mean per micro-batch, which balancing regroups."""
    if not _balances_token_budgets(cfg):
        return
    extra = cfg.grpo.extra
    entropy_coef = extra.get("entropy_coef", 0.0)
    adaptive = bool(extra.get("use_adaptive_entropy", False))
    if entropy_coef != 0.0 or adaptive:
        raise ValueError(
            "grpo.extra.entropy_coef / use_adaptive_entropy with sampling.seqlen_balancing: TRL's entropy bonus "
            "is a token mean per micro-batch, so each token's weight depends on which completions share its "
            "micro-batch and rank; balancing regroups them into token budgets and changes the bonus' gradient: "
            "turn seqlen_balancing off, or drop the entropy bonus"
        )


def entropy_quantile_over_the_whole_batch(cfg: ExperimentConfig) -> None:
    """TRL takes ``top_entropy_quantile`` per micro-batch; with balancing that is only the same quantile when one
    micro-batch holds the whole generation batch."""
    if not _balances_token_budgets(cfg):
        return
    quantile = cfg.grpo.extra.get("top_entropy_quantile", 1.0)
    steps = cfg.batch_layout.steps_per_generation
    if quantile < 1.0 and steps > 1:
        raise ValueError(
            f"grpo.extra.top_entropy_quantile ({quantile}) with sampling.seqlen_balancing and {steps} micro-batches "
            "per generation batch (steps_per_generation): TRL takes the entropy quantile over each micro-batch "
            "(all ranks), so the masked tokens depend on which completions share a micro-batch; balancing "
            "regroups them into token budgets: use steps_per_generation 1 (then the quantile is over the whole "
            "generation batch, which balancing only redistributes), or turn seqlen_balancing off"
        )


# ---------------------------------------------------------------- objective


def lora_keeps_no_reference_copy(cfg: ExperimentConfig) -> None:
    """With an adapter, TRL's reference model is the base with the adapter off: there is no copy to sync."""
    if cfg.model.lora.enabled and cfg.grpo.extra.get("sync_ref_model"):
        raise ValueError("grpo.extra.sync_ref_model with model.lora.enabled: with an adapter the reference model is "
                         "the base with the adapter disabled (TRL keeps no copy to sync); drop sync_ref_model")


def clip_range_is_ordered(cfg: ExperimentConfig) -> None:
    """``epsilon_high`` is DAPO's clip-higher: it raises the upper clip bound above ``epsilon``, never lowers it."""
    g = cfg.grpo
    if g.epsilon_high is not None and g.epsilon_high < g.epsilon:
        raise ValueError(f"grpo.epsilon_high ({g.epsilon_high}) must be >= grpo.epsilon ({g.epsilon})")


def luspo_is_sequence_level(cfg: ExperimentConfig) -> None:
    """LUSPO's loss is defined on sequence-level importance ratios."""
    g = cfg.grpo
    if g.loss_type == "luspo" and g.importance_sampling_level != "sequence":
        raise ValueError("grpo.loss_type 'luspo' requires grpo.importance_sampling_level: sequence")


# ---------------------------------------------------------------- async rollouts with vLLM
#
# Async rollouts with ``grpo.use_vllm``: only a vLLM server on its own GPU can generate while the trainer
# trains (grpo/training/rollout_engines.py).


def _async_with_vllm(cfg: ExperimentConfig) -> bool:
    a = cfg.async_
    return bool((a.use_data_producer or a.async_prefetch) and cfg.grpo.use_vllm)


def async_vllm_is_a_server(cfg: ExperimentConfig) -> None:
    """A colocated vLLM generates inside the training step on the trainer's GPU, so it can not run ahead."""
    if _async_with_vllm(cfg) and cfg.grpo.vllm_mode == "colocate":
        raise ValueError(
            "async.use_data_producer (or async_prefetch) with grpo.use_vllm and grpo.vllm_mode 'colocate': a "
            "colocated vLLM shares the trainer's GPU and generates inside the training step, so it can not run "
            "ahead of training: set grpo.vllm_mode: server (trl vllm-serve on its own GPU), or turn async off "
            "(TRL's synchronous colocated generation)"
        )


def async_vllm_on_one_process(cfg: ExperimentConfig) -> None:
    """One trainer process owns the vLLM server's weight sync and the rollouts' policy versions."""
    s = cfg.sampling
    if _async_with_vllm(cfg) and s.world_size > 1:
        raise ValueError(
            f"async.use_data_producer (or async_prefetch) with grpo.use_vllm in server mode and "
            f"sampling.world_size ({s.world_size}) > 1: one trainer process owns the vLLM server's weight-sync "
            "group and the rollouts' policy versions, and async generation for several processes is not "
            "implemented: use sampling.world_size: 1, or turn async off (TRL's synchronous server mode)"
        )


def vllm_is_installed(cfg: ExperimentConfig) -> None:
    """vLLM is an optional extra (GPU only); without it TRL fails only once the trainer is built."""
    if cfg.grpo.use_vllm and importlib.util.find_spec("vllm") is None:
        raise ValueError("grpo.use_vllm: vllm is not installed; install the 'gpu' extra (pip install -e '.[gpu]')")


# ---------------------------------------------------------------- environments (multi-turn rollouts)


def environment_is_registered(cfg: ExperimentConfig) -> None:
    """An environment and its tools are built by name in every rollout process; an unknown name would fail only
    after the model is built."""
    env = cfg.environment
    check_environment_names("environment.name", env.name, "environment.tools", env.tools)
    check_agent_name("environment.agent", env.agent)
    if env.agent is not None and set(env.kwargs) - {"agent", "max_sessions"}:  # the agent's options: its configure
        check_environment_builds("environment.kwargs", env.name, env.kwargs)
    if env.agent == "verifiers" and cfg.model.is_tiny:
        raise ValueError("environment.agent 'verifiers': verifiers' harnesses call the model through chat completions, "
                         "and the 'tiny' model's character tokenizer has no chat template; set model.name_or_path to a "
                         "chat model")
    if not env.enabled and (env.tools or env.kwargs):
        raise ValueError("environment.tools / environment.kwargs are set but environment.name is empty; name the "
                         "environment they belong to (grpo environments lists them)")


def environment_variants_build(cfg: ExperimentConfig) -> None:
    """Each evaluation variant builds the environment with its kwargs overridden; a wrong option would otherwise fail
    only at the evaluation after training."""
    variants = cfg.evaluation.environment_variants
    if not variants:
        return
    env = cfg.environment
    if not env.enabled:
        raise ValueError("evaluation.environment_variants is set but environment.name is empty; variants override "
                         "the environment's kwargs")
    for name, overrides in variants.items():
        check_environment_builds(f"evaluation.environment_variants.{name}", env.name, env.kwargs | overrides)


def chat_protocol_needs_a_chat_model(cfg: ExperimentConfig) -> None:
    """TRL's tool loop parses tool calls with the chat template's response schema; the tiny model's character
    tokenizer has none, and the text protocol needs none."""
    env = cfg.environment
    if env.is_chat and cfg.model.is_tiny:
        raise ValueError("environment.protocol 'chat' runs TRL's tool-calling loop, which needs a chat model whose "
                         "template TRL recognises (Qwen2.5/3, Llama 3.1/3.2, ...); the 'tiny' model's character "
                         "tokenizer has no chat template: use environment.protocol: text")


def environment_tools_need_a_tool_environment(cfg: ExperimentConfig) -> None:
    """Protocol text: ``environment.tools`` join a ToolEnvironment's own tools (its ``[name(args)]`` call syntax);
    another environment has no way to call them."""
    env = cfg.environment
    if not (env.is_text and env.tools):
        return
    if not environment_kind(env.name)[0]:
        raise ValueError(f"environment.tools: {env.name!r} is not a ToolEnvironment, so its episodes cannot call "
                         f"tools; leave environment.tools empty or choose an environment with tools (calculator)")


def chat_protocol_takes_trl_environments(cfg: ExperimentConfig) -> None:
    """Protocol chat hands the environment to TRL's ``environment_factory``, whose public methods become the model's
    tools; a text-protocol environment (``step(action)``) would expose ``step`` as a tool and never be stepped."""
    env = cfg.environment
    if not env.is_chat:
        return
    if environment_kind(env.name)[1]:
        raise ValueError(f"environment.protocol 'chat': {env.name!r} is a text-protocol environment (step(action)); "
                         f"TRL's tool loop calls an environment's public methods as tools: use environment.protocol: "
                         f"text, or an environment written for TRL's environment_factory")



def text_protocol_steps_its_environment(cfg: ExperimentConfig) -> None:
    """The text protocol calls ``step(action)`` after every model turn; an environment class without one is written
    for TRL's tool loop (its public methods are tools)."""
    env = cfg.environment
    if env.is_text and environment_lacks_step(env.name):
        raise ValueError(f"environment.protocol 'text': {env.name!r} has no step(action); it is an environment for "
                         f"TRL's tool loop: use environment.protocol: chat")


def chat_protocol_trains_synchronously(cfg: ExperimentConfig) -> None:
    """TRL's tool loop generates each turn in the trainer once the previous turn's tools have answered; async rollouts
    sample whole rounds ahead in the generator process, which runs episodes of the text protocol only. Without this
    rule every tool turn would be served from the round cache, with prompts the producer never saw."""
    env, a = cfg.environment, cfg.async_
    if env.is_chat and (a.use_data_producer or a.async_prefetch):
        raise ValueError("environment.protocol 'chat' runs TRL's tool loop in the trainer, turn by turn; async "
                         "rollouts (async.use_data_producer / async.async_prefetch) sample episodes ahead for protocol "
                         "text only: turn them off, or use environment.protocol: text")

# ---------------------------------------------------------------- model and prompts


def tiny_model_takes_plain_prompts(cfg: ExperimentConfig) -> None:
    """The tiny model's character tokenizer has no chat template to wrap prompts with."""
    if cfg.model.is_tiny and cfg.data.prompt_format == "chat":
        raise ValueError("model.name_or_path 'tiny' has no chat template; use data.prompt_format: plain")


def tiny_model_has_no_chat_template(cfg: ExperimentConfig) -> None:
    """A chat template for the tiny model's character tokenizer would never be used."""
    if cfg.model.is_tiny and cfg.model.chat_template:
        raise ValueError("model.chat_template: the 'tiny' model's character tokenizer takes plain prompts only; "
                         "set it for a model folder or hub model")


def chat_template_file_exists(cfg: ExperimentConfig) -> None:
    """A value ending in ``.jinja`` names a template file; a missing one fails at load, not when the tokenizer is
    set up."""
    model = cfg.model
    if model.chat_template_file is not None and not model.chat_template_file.is_file():
        raise ValueError(f"model.chat_template: no file {model.chat_template!r} (a path must end in .jinja "
                         "and exist; anything else is taken as the template itself)")


def tiny_model_fits_a_completion(cfg: ExperimentConfig) -> None:
    """The tiny model's positions must hold a prompt plus the longest completion."""
    model, g = cfg.model, cfg.grpo
    if model.is_tiny and model.tiny.max_position_embeddings < g.max_completion_length + 8:
        raise ValueError(
            f"model.tiny.max_position_embeddings ({model.tiny.max_position_embeddings}) is too small for "
            f"grpo.max_completion_length ({g.max_completion_length}) plus a prompt"
        )


# ---------------------------------------------------------------- async generation and replay


def off_policy_corrections_need_a_lagging_generator(cfg: ExperimentConfig) -> None:
    """Importance-sampling correction and OPSM correct for a generator whose weights lag the trainer's; without a
    producer or vLLM there is none."""
    g, a = cfg.grpo, cfg.async_
    producer = a.use_data_producer or a.async_prefetch or g.use_vllm
    for name, on in (("vllm_importance_sampling_correction", a.vllm_importance_sampling_correction),
                     ("off_policy_mask_threshold", a.off_policy_mask_threshold is not None)):
        if on and not producer:
            raise ValueError(
                f"async.{name} corrects for a generator whose weights lag the trainer's: it needs "
                "async.use_data_producer (or async_prefetch) or grpo.use_vllm"
            )


def prefetch_is_not_outdated_by_sync(cfg: ExperimentConfig) -> None:
    """Prefetched rollouts older than ``max_staleness`` are generated again, so syncing weights less often than
    that wastes the prefetch."""
    a = cfg.async_
    if a.async_prefetch and a.vllm_sync_interval > a.max_staleness:
        raise ValueError(
            f"async.vllm_sync_interval ({a.vllm_sync_interval}) > async.max_staleness ({a.max_staleness}): the "
            f"generator's weights are refreshed only every {a.vllm_sync_interval} steps, so prefetched rollouts "
            f"come from policies up to that many versions old and those older than max_staleness are dropped and "
            f"generated again (the prefetch is wasted): set async.vllm_sync_interval <= async.max_staleness"
        )


def replay_sums_rewards_first(cfg: ExperimentConfig) -> None:
    """Replayed groups' advantages are recomputed from their summed rewards."""
    if cfg.async_.replay_buffer_size and cfg.grpo.multi_objective_aggregation != "sum_then_normalize":
        raise ValueError(
            "async.replay_buffer_size needs grpo.multi_objective_aggregation 'sum_then_normalize': replayed groups' "
            "advantages are recomputed from their summed rewards"
        )


# ---------------------------------------------------------------- ranks


def no_sequence_parallel_attention(cfg: ExperimentConfig) -> None:
    """TRL's trainer rejects context/sequence parallelism and CPU has no ring/Ulysses kernels; only the sampler
    layout for it exists."""
    s = cfg.sampling
    if s.sequence_parallel_degree > 1:
        raise ValueError(
            f"sampling.sequence_parallel_degree={s.sequence_parallel_degree}: sequence-parallel attention "
            "(ring/Ulysses) is not available in this backend (trl.GRPOTrainer rejects cp/sp > 1; CPU has no "
            "kernels); use 1. The sampler layout for it is in grpo/algo/sampling.py"
        )


def ranks_generate_whole_groups(cfg: ExperimentConfig) -> None:
    """The sampler hands each rank whole prompts, each ``num_generations`` times (grpo/algo/sampling.py), so a
    rank's share of a round must be whole groups."""
    if cfg.sampling.world_size > 1:
        layout = cfg.batch_layout
        if not layout.whole_groups_per_rank:
            raise ValueError(
                f"with sampling.world_size > 1 each rank generates whole groups: per_device_train_batch_size x "
                f"steps_per_generation = {layout.completions_per_rank} must be divisible by grpo.num_generations "
                f"({cfg.grpo.num_generations})"
            )


RULES: tuple[Callable[[ExperimentConfig], None], ...] = (
    rewards_are_registered,
    one_weight_per_reward,
    generation_batch_set_one_way,
    generation_batch_fills_micro_steps,
    generation_batch_holds_whole_groups,
    chunks_divide_groups,
    chunks_fit_the_micro_batch,
    adaptive_entropy_without_chunks,
    bnpo_without_token_budgets,
    entropy_bonus_without_token_budgets,
    entropy_quantile_over_the_whole_batch,
    lora_keeps_no_reference_copy,
    clip_range_is_ordered,
    luspo_is_sequence_level,
    async_vllm_is_a_server,
    async_vllm_on_one_process,
    vllm_is_installed,
    tiny_model_takes_plain_prompts,
    tiny_model_has_no_chat_template,
    chat_template_file_exists,
    tiny_model_fits_a_completion,
    off_policy_corrections_need_a_lagging_generator,
    prefetch_is_not_outdated_by_sync,
    replay_sums_rewards_first,
    no_sequence_parallel_attention,
    ranks_generate_whole_groups,
    environment_is_registered,
    environment_variants_build,
    chat_protocol_needs_a_chat_model,
    environment_tools_need_a_tool_environment,
    chat_protocol_takes_trl_environments,
    chat_protocol_trains_synchronously,
    text_protocol_steps_its_environment,
)


def check_rules(cfg: ExperimentConfig) -> None:
    """Run every rule in order; the first broken one raises."""
    for rule in RULES:
        rule(cfg)
