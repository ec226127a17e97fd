"""``GRPOTrainer``: ``trl.GRPOTrainer`` with named extension points, numerics unchanged.

TRL's trainer does three things in places that are hard to reach: it picks a sampler, assembles and splits a
generation batch, and computes the loss. This subclass gives each a public method with TRL's behaviour as the
default, so platform features plug in by overriding one method:

* :meth:`build_train_sampler` — which prompts each rank sees (sequence-parallel sampler, sampler plans);
* :meth:`assemble_generation_batch` / :meth:`split_generation_batch` — generation, scoring, balancing, replay;
* :meth:`compute_policy_loss` — chunked backward, zero-advantage skipping, off-policy corrections.

Each platform feature is one mixin module named after its config section, composed here:

=====================================  ==============================================================
``async.use_data_producer`` / prefetch  :mod:`grpo.training.async_rollouts` (``AsyncRollouts``)
``async.vllm_importance_sampling_*``    :mod:`grpo.training.off_policy` (``OffPolicyCorrection``)
``async.reward_num_workers``, streaming :mod:`grpo.training.reward_scoring` (``RewardScoring``)
``async.replay_*``, ``async.reroll_*``  :mod:`grpo.training.replay` (``ReplayAndReroll``)
``sampling.seqlen_balancing``           :mod:`grpo.training.seqlen_balancing` (``SeqlenBalancing``)
``async.skip_zero_advantage_batches``,  :mod:`grpo.training.zero_advantage` (``ZeroAdvantageSkip``)
``async.compact_zero_advantage``
``async.shared_prompt_forward``         :mod:`grpo.training.shared_prompt` (``SharedPromptForward``)
``grpo.num_generations_chunks``         :mod:`grpo.training.chunked_loss` (``ChunkedLoss``)
``environment``                         :mod:`grpo.training.episodes` (``EnvironmentRollouts``)
``environment.agent`` (rewrites)        :mod:`grpo.training.call_samples` (``CallSamples``)
(always on, exact)                      :mod:`grpo.training.host_batching` (``HostBatching``): the batch's tensors
                                        built per batch, not per row
=====================================  ==============================================================

This module keeps the sequence (sampler, generation batch, loss) readable top to bottom. Everything else (every
``trl.GRPOConfig`` option, vLLM, PEFT, logging) is TRL's own.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
import trl
from torch.utils.data import Sampler
from trl.trainer.utils import (
    shuffle_sequence_dict,
    split_pixel_values_by_grid,
    split_tensor_dict,
    unsplit_pixel_values_by_grid,
)

from grpo.algo.batch_layout import BatchLayout
from grpo.algo.plan import PlanSampler
from grpo.algo.sampling import SequenceParallelRepeatRandomSampler
from grpo.config import ExperimentConfig
from grpo.distributed import check_launch_matches_config, launched_world_size
from grpo.training.async_rollouts import AsyncRollouts
from grpo.training.call_samples import CallSamples, split_rows
from grpo.training.chunked_loss import ChunkedLoss
from grpo.training.episodes import EnvironmentRollouts
from grpo.training.host_batching import HostBatching
from grpo.training.model_support import parameters_left_out
from grpo.training.off_policy import OffPolicyCorrection
from grpo.training.replay import ReplayAndReroll
from grpo.training.reward_scoring import RewardScoring
from grpo.training.seqlen_balancing import SeqlenBalancing
from grpo.training.shared_prompt import SharedPromptForward
from grpo.training.zero_advantage import ZeroAdvantageSkip

TESTED_TRL_VERSION = "1.16.0"

# Every method of trl.GRPOTrainer this class overrides, and why. tests/test_layers.py checks the list against the
# class (an override missing here fails) and against the pinned TRL (a hook renamed or re-signed upstream fails).
TRL_HOOKS: dict[str, str] = {
    "__init__": "wires the plan sampler, replay/re-roll buffers, the async producer, the reward pool and the "
                "environment (rollout_func for protocol text, TRL's environment_factory/tools for chat)",
    "_get_train_sampler": "the sampler plan (plan.parquet) or the sequence-parallel repeat sampler",
    "get_train_dataloader": "keeps accelerate from sharding the rank-aware sampler's batches a second time",
    "_prepare_inputs": "TRL's schedule split in two: assemble a generation batch (re-rolls, replay, off-policy), then "
                       "split it (balancing)",
    "_generate_single_turn": "async rollouts: completions produced ahead by the producer thread; in-process generate "
                            "prefills each distinct prompt once (async.shared_prompt_forward) and builds its batch "
                            "per batch, not per row (host_batching)",
    "_generate_and_score_completions": "TRL's code with its row-by-row pad bound to a per-batch one (host_batching)",
    "_tokenize_prompts": "each run of equal prompts (a group's copies) tokenised once (host_batching)",
    "_generate": "starts streaming reward scoring while the log-prob passes run",
    "_calculate_rewards": "the persistent reward pool / streamed rewards instead of in-process calls; NaN rewards "
                          "for episodes whose environment failed",
    "_compute_loss": "zero-advantage skip, balanced micro-batch weights and chunked backward; IS weights from the "
                     "training forward",
    "_get_per_token_logps_and_entropies": "hands the training forward's log-probs to the deferred IS correction; runs "
                                          "each group's prompt once (async.shared_prompt_forward)",
    "get_high_entropy_mask": "the entropy quantile over chunks, equal to the unchunked mask",
    "_issue_warnings_after_load": "a resumed checkpoint's tied weights (stored once, under one of their names) are "
                                  "not reported as missing keys",
}



class GRPOTrainer(AsyncRollouts, EnvironmentRollouts, CallSamples, RewardScoring, ReplayAndReroll, SeqlenBalancing,
                  ZeroAdvantageSkip, ChunkedLoss, OffPolicyCorrection, SharedPromptForward, HostBatching,
                  trl.GRPOTrainer):
    # AsyncRollouts before EnvironmentRollouts: its _episodes_for takes a round's episodes from the rollout engine;
    # OffPolicyCorrection after the others: every loss call passes through it; SharedPromptForward next to TRL: it
    # changes only how TRL's log-prob forward runs the model; HostBatching last: TRL's own steps, built per batch
    """TRL's GRPO trainer with extension points; see the module docstring."""

    def __init__(
        self, *args: Any, experiment: ExperimentConfig | None = None, plan_path: str | Path | None = None, **kwargs: Any
    ) -> None:
        if trl.__version__ != TESTED_TRL_VERSION:
            raise RuntimeError(
                f"grpo.training.trainer overrides TRL internals tested with trl=={TESTED_TRL_VERSION}, "
                f"found {trl.__version__}; install the pinned version (pip install -e .)"
            )
        self._check_streaming_rewards(experiment, kwargs.get("reward_funcs"))
        self.experiment = experiment
        self.plan_path = Path(plan_path) if plan_path is not None else None
        self._environment_trainer_kwargs(experiment, kwargs)
        self._choose_ddp_unused_parameter_search(kwargs.get("model", args[0] if args else None),
                                                 kwargs.get("args", args[2] if len(args) > 2 else None))
        # rollout_func (protocol text) and environment_factory (protocol chat) are how environments reach TRL here
        # (episodes.py), by design: TRL's "experimental" warning leaves the user nothing to act on (TRL is pinned, and
        # TRL_HOOKS lists what the platform builds on).
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="You are using '(rollout_func|environment_factory)'",
                                    category=UserWarning)
            super().__init__(*args, **kwargs)
        self._init_replay()
        self._init_reward_scoring()
        self._init_async_rollouts()
        if experiment is not None:
            check_launch_matches_config(experiment, self.accelerator.num_processes)

    @staticmethod
    def _choose_ddp_unused_parameter_search(model: Any, args: Any) -> None:
        """DDP's ``find_unused_parameters`` where the user and activation checkpointing leave it open, on several
        processes: on only when a forward leaves parameters out (``model_support.parameters_left_out``).
        transformers turns it on for every model, which costs a graph traversal per backward and, where nothing is
        left out, prints a warning from every rank."""
        if launched_world_size() <= 1 or model is None or isinstance(model, str) or args is None:
            return
        if args.ddp_find_unused_parameters is not None:
            return
        if args.gradient_checkpointing or getattr(args, "activation_checkpointing", False):
            return  # transformers turns the search off: it breaks checkpointing
        if args.deepspeed or args.fsdp:
            return  # not DDP
        try:
            left_out = parameters_left_out(model)
        except Exception:  # noqa: BLE001 -- a model the probe cannot run keeps transformers' choice (search on)
            return
        args.ddp_find_unused_parameters = bool(left_out)

    def _record(self, name: str, value: float) -> None:
        """One value of a training metric for this logging step (TRL averages each over the step and logs it)."""
        self._metrics["train"][name].append(value)

    def _issue_warnings_after_load(self, load_result: Any) -> None:
        """On resume transformers' Trainer loads the checkpoint with a plain ``load_state_dict``. The checkpoint
        stores a tied pair of weights once, under one name (the tiny model's ``lm_head.weight`` is its
        ``model.embed_tokens.weight``), so the other name reads as missing and transformers warns "There were missing
        keys in the checkpoint model loaded: ['lm_head.weight']" on every resume, though that tensor is loaded under
        its partner's name. A missing name the model ties (``all_tied_weights_keys``) to a loaded one, the very same
        parameter, is left out of the warning, as ``from_pretrained`` (which knows the tie) leaves it out; any other
        missing or unexpected key is still reported."""
        missing = set(load_result.missing_keys)
        loaded_by_tie = {name for pair in (getattr(self.model, "all_tied_weights_keys", None) or {}).items()
                         for name, partner in (pair, pair[::-1])
                         if name in missing and partner not in missing and _same_parameter(self.model, name, partner)}
        if loaded_by_tie:
            load_result = load_result._replace(missing_keys=[k for k in load_result.missing_keys
                                                             if k not in loaded_by_tie])
        super()._issue_warnings_after_load(load_result)

    # ------------------------------------------------------------ 1. which prompts each rank sees

    def _get_train_sampler(self, dataset=None) -> Sampler:
        return self.build_train_sampler(dataset if dataset is not None else self.train_dataset)

    def build_train_sampler(self, dataset) -> Sampler:
        """The sampler over prompt indices.

        With a sampler plan (``grpo run`` writes one per run): the plan's rows for this rank. Otherwise, one process:
        TRL's ``RepeatSampler`` (a global order that accelerate shards). Several processes: the
        rank-aware :class:`SequenceParallelRepeatRandomSampler`, so every rank draws whole prompt groups of its own
        (different ranks, different prompts), the same on every restart.
        """
        world = self.accelerator.num_processes
        sp_degree = self.experiment.sampling.sequence_parallel_degree if self.experiment else 1
        if self.plan_path is not None:  # the pipeline's plan stage wrote the schedule: follow it exactly
            return PlanSampler(self.plan_path, self.accelerator.process_index, sp_degree)
        if world == 1 and sp_degree == 1:
            return super()._get_train_sampler(dataset)
        return SequenceParallelRepeatRandomSampler(
            dataset,
            mini_repeat_count=self.num_generations,
            world_size=world,
            rank=self.accelerator.process_index,
            batch_size=self.prompts_per_rank_per_generation,
            repeat_count=self.batch_layout.micro_steps_per_round,
            sequence_parallel_degree=sp_degree,
            shuffle=self.shuffle_dataset,
            seed=self.args.seed,
            drop_last=self.experiment.sampling.drop_last if self.experiment else False,
        )

    @property
    def batch_layout(self) -> BatchLayout:
        """The batch layout of this trainer: TRL's resolved arguments and the launched processes (the same numbers
        as ``experiment.batch_layout`` when the launch matches the config, which ``__init__`` checks).

        Read at every micro-step: derived again only when one of its inputs changed."""
        inputs = dict(
            world_size=self.accelerator.num_processes,
            sequence_parallel_degree=self.experiment.sampling.sequence_parallel_degree if self.experiment else 1,
            per_device_train_batch_size=self.args.per_device_train_batch_size,
            gradient_accumulation_steps=self.args.gradient_accumulation_steps,
            num_generations=self.num_generations,
            num_iterations=self.num_iterations,
            steps_per_generation=self.args.steps_per_generation,
        )
        cached = getattr(self, "_batch_layout_of", None)
        if cached is None or cached[0] != inputs:
            cached = self._batch_layout_of = (inputs, BatchLayout.derive(**inputs))
        return cached[1]

    @property
    def prompts_per_rank_per_generation(self) -> int:
        layout = self.batch_layout
        if not layout.whole_groups_per_rank:
            raise ValueError(
                f"with several processes each rank generates whole groups: grpo.per_device_train_batch_size "
                f"({layout.per_device_train_batch_size}) x steps_per_generation ({layout.steps_per_generation}) "
                f"must be divisible by grpo.num_generations ({layout.num_generations})"
            )
        return layout.prompts_per_rank

    def get_train_dataloader(self):
        dataloader = super().get_train_dataloader()
        # A rank-aware sampler already yields this rank's data; accelerate's BatchSamplerShard would shard it a
        # second time (each rank keeping every world_size-th of its own batches). Make the wrapper a passthrough.
        sharded = getattr(dataloader, "batch_sampler", None)
        inner = getattr(sharded, "batch_sampler", None)
        if isinstance(getattr(inner, "sampler", None), (SequenceParallelRepeatRandomSampler, PlanSampler)):
            sharded.num_processes = 1
            sharded.process_index = 0
        return dataloader

    # ------------------------------------------------------------ 2. generation batch: assemble, then split

    def _prepare_inputs(self, generation_batch: dict[str, torch.Tensor | Any]) -> dict[str, torch.Tensor | Any]:
        # Same schedule as TRL: one generation round every steps_per_generation * num_iterations micro-steps, whose
        # micro-batches are then served in turn. Only the two halves are separate methods here.
        if not self.model.training:
            return self.assemble_generation_batch(generation_batch)
        generate_every = self.batch_layout.micro_steps_per_round
        if self._step % generate_every == 0 or self._buffered_inputs is None:
            batch = self.assemble_generation_batch(generation_batch)
            self._buffered_inputs = self.split_generation_batch(batch)
        return self._buffered_inputs[self._step % self.args.steps_per_generation]

    def assemble_generation_batch(self, inputs: list[dict[str, Any]]) -> dict[str, torch.Tensor | Any]:
        """Generate completions for the rows, score them and compute advantages (TRL's implementation); in
        training, append the episodes' earlier samples as rows (:mod:`grpo.training.call_samples`); with
        ``sampling.seqlen_balancing`` and several ranks, then exchange whole groups for balanced token loads."""
        training = self.model.training
        replaced: list[slice] = []
        if training and self._reroll is not None:
            inputs = self._inject_rerolls(inputs)
        self._stream_inputs = inputs if training and self._streaming else None
        self._rollout_rows = inputs  # an environment's episodes start from the rows (reset(**row))
        try:
            batch = self._generate_and_score_completions(inputs)
        finally:
            self._rollout_rows = None
        self._log_chat_tool_metrics(len(inputs))
        if training and (self._replay is not None or self._reroll is not None):
            rewards = self._local_rewards(len(inputs))
            if self._reroll is not None:
                self._buffer_failed_groups(inputs, rewards)
            if self._replay is not None:
                replaced = self._apply_replay(batch, rewards)
        if training:  # an episode's earlier samples (an agent that rewrote its history): rows of their own
            batch = self._append_call_samples(batch, replaced)
        else:
            self._episode_samples = None
        if training and self._async and "sampling_per_token_logps" in batch and not self.use_vllm:
            self._correct_off_policy(batch, replaced if self._replay is not None else [])
        if training and self._balancing:
            batch = self._rebalance(batch)
        return batch

    def split_generation_batch(self, batch: dict[str, torch.Tensor | Any]) -> list[dict[str, torch.Tensor | Any]]:
        """Cut the scored batch into ``steps_per_generation`` micro-batches: TRL's shuffle-and-split, or balanced
        token budgets when sequence-length balancing is on."""
        if self._balancing:
            return self._split_by_token_budget(batch)
        if self._call_sample_rows:  # rows beyond TRL's count: near-equal micro-batches, weighted by their rows
            return split_rows(batch, self.args.steps_per_generation)
        batch = split_pixel_values_by_grid(batch)
        batch = shuffle_sequence_dict(batch)
        parts = split_tensor_dict(batch, self.args.steps_per_generation)
        return [unsplit_pixel_values_by_grid(part) for part in parts]

    # ------------------------------------------------------------ 3. loss

    def _compute_loss(self, model, inputs) -> torch.Tensor:
        return self.compute_policy_loss(model, inputs)

    def compute_policy_loss(self, model, inputs: dict[str, torch.Tensor | Any]) -> torch.Tensor:
        """The clipped GRPO surrogate for one micro-batch: TRL's implementation, plus

        * ``async.skip_zero_advantage_batches``: when every advantage on every rank is zero the micro-batch has no
          policy-gradient signal, so its forward/backward is skipped on all ranks together (DDP never waits on a
          rank that skipped alone). Other micro-batches keep their normalisation: each is normalised on its own or
          by the generation batch's global token count, never by the number of micro-batches that ran.
        * ``grpo.num_generations_chunks``: the micro-batch's completions are split into chunks, each with its own
          forward and backward, so activation memory is bounded by a chunk while advantages still come from the
          whole group. Chunk losses are weighted so the summed gradient equals the unchunked one.
        * ``async.compact_zero_advantage``: the forward/backward runs on the completions with a non-zero advantage
          only (then chunked), the loss rescaled to the full micro-batch's normaliser: the same gradient. Where that
          is not exact (``beta > 0``, entropy options) the whole micro-batch is computed.
        """
        if model.training and self._skip_zero_advantage and self._no_signal_anywhere(inputs["advantages"]):
            self._record("skipped_zero_adv_batches", 1.0)
            return self._zero_loss(model, inputs)
        if model.training and self._skip_zero_advantage:
            self._record("skipped_zero_adv_batches", 0.0)
        chunks = self.experiment.grpo.num_generations_chunks if self.experiment else 1
        weight = self._balanced_weight(inputs)
        if not model.training or not torch.is_grad_enabled():
            return super()._compute_loss(model, inputs) * weight
        with self._compaction(inputs, chunks) as (inputs, share):
            if chunks == 1:
                return super()._compute_loss(model, inputs) * (weight * share)
            return self._chunked_loss(model, inputs, chunks, weight * share)


def _same_parameter(model: Any, name: str, other: str) -> bool:
    """Whether ``name`` and ``other`` are one tensor of ``model`` (tied), not two that merely share a role."""
    try:
        return model.get_parameter(name) is model.get_parameter(other)
    except AttributeError:
        return False
