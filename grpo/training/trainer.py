"""``GRPOTrainer``: ``trl.GRPOTrainer`` with named extension points, numerics unchanged.

TRL's trainer does three things in places that are hard to reach: it picks a sampler, assembles and splits a
generation batch, and computes the loss. This subclass gives each a public method with TRL's behaviour as the
default, so platform features plug in by overriding one method:

* :meth:`build_train_sampler` — which prompts each rank sees (sequence-parallel sampler, sampler plans);
* :meth:`assemble_generation_batch` / :meth:`split_generation_batch` — generation, scoring, balancing, replay;
* :meth:`compute_policy_loss` — chunked backward, zero-advantage skipping, off-policy corrections.

Everything else (every ``trl.GRPOConfig`` option, vLLM, PEFT, logging) is TRL's own.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch
import trl
from transformers import TrainerCallback
from torch.utils.data import Sampler
from trl.trainer.utils import shuffle_sequence_dict, split_pixel_values_by_grid, split_tensor_dict, unsplit_pixel_values_by_grid

from grpo.algo.batch_layout import BatchLayout
from grpo.algo.group_balancing import BALANCED_ROWS, rebalance_groups, split_by_token_budget
from grpo.algo.plan import PlanSampler
from grpo.algo.sampling import SequenceParallelRepeatRandomSampler
from grpo.config import ExperimentConfig
from grpo.errors import ConfigError
from grpo.training.replay import ReplayBuffer, RerollBuffer, group_advantages, group_reward_std, inject_rerolls, place_group

TESTED_TRL_VERSION = "1.16.0"

# Every method of trl.GRPOTrainer this class overrides, and why. tests/test_layers.py checks the list against the
# class (an override missing here fails) and against the pinned TRL (a hook renamed or re-signed upstream fails).
TRL_HOOKS: dict[str, str] = {
    "__init__": "wires the plan sampler, replay/re-roll buffers, the async producer and the reward pool",
    "_get_train_sampler": "the sampler plan (plan.parquet) or the sequence-parallel repeat sampler",
    "get_train_dataloader": "keeps accelerate from sharding the rank-aware sampler's batches a second time",
    "_prepare_inputs": "TRL's schedule split in two: assemble a generation batch (re-rolls, replay, off-policy), then split it (balancing)",
    "_generate_single_turn": "async rollouts: completions produced ahead by the producer thread",
    "_generate": "starts streaming reward scoring while the log-prob passes run",
    "_calculate_rewards": "the persistent reward pool / streamed rewards instead of in-process calls",
    "_compute_loss": "zero-advantage skip, balanced micro-batch weights and chunked backward",
    "get_high_entropy_mask": "the entropy quantile over chunks, equal to the unchunked mask",
}


class GRPOTrainer(trl.GRPOTrainer):
    """TRL's GRPO trainer with extension points; see the module docstring."""

    def __init__(
        self, *args: Any, experiment: ExperimentConfig | None = None, plan_path: str | Path | None = None, **kwargs: Any
    ) -> None:
        if trl.__version__ != TESTED_TRL_VERSION:
            raise RuntimeError(
                f"grpo.training.trainer overrides TRL internals tested with trl=={TESTED_TRL_VERSION}, found {trl.__version__}; "
                f"install the pinned version (pip install -e .)"
            )
        if experiment is not None and experiment.async_.streaming_partial_batch:
            funcs = kwargs.get("reward_funcs")
            if any(isinstance(fn, (str, torch.nn.Module)) for fn in (funcs if isinstance(funcs, list) else [funcs])):
                raise ConfigError(
                    "async.streaming_partial_batch scores reward functions in a background thread; reward models run "
                    "on the trainer's device: turn streaming off or use reward functions"
                )
        self.experiment = experiment
        self.plan_path = Path(plan_path) if plan_path is not None else None
        super().__init__(*args, **kwargs)
        a = experiment.async_ if experiment is not None else None
        self._replay = ReplayBuffer(a.replay_buffer_size, seed=self.args.seed) if a and a.replay_buffer_size else None
        self._reroll = RerollBuffer(a.reroll_buffer_size) if a and a.reroll_start_fraction < 1.0 else None
        self._last_rewards_per_func: torch.Tensor | None = None
        self._reward_pool = None
        if a is not None and a.reward_num_workers > 1:
            from grpo.rewards.pool import RewardWorkerPool

            # Functions are pickled (by reference) and sent once now; an unpicklable one fails here, not mid-run.
            self._reward_pool = RewardWorkerPool(self.reward_funcs, a.reward_num_workers, timeout=a.reward_timeout)
        self._streaming = bool(a and a.streaming_partial_batch)
        self._stream_inputs: list[dict[str, Any]] | None = None  # this round's rows, until its completions exist
        self._stream = None  # (StreamingScorer, per-chunk pool error counts) of the batch being assembled
        self._producer = None  # the CPU generator process of async runs, started below (see _start_producer)
        self._async = bool(a and (a.use_data_producer or a.async_prefetch))
        self._round_prompts: list[list[int]] | None = None
        self._submitted: set[int] = set()
        self._last_round_end: float | None = None
        if self._async:
            self.add_callback(_WeightSync(self))
            if self.args.max_steps > 0:
                self._start_producer()
        if experiment is not None:
            check_launch_matches_config(experiment, self.accelerator.num_processes)


    # ------------------------------------------------------------ 1. which prompts each rank sees

    def _record(self, name: str, value: float) -> None:
        """One value of a training metric for this logging step (TRL averages each over the step and logs it)."""
        self._metrics["train"][name].append(value)

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
        as ``experiment.batch_layout`` when the launch matches the config, which ``__init__`` checks)."""
        return BatchLayout.derive(
            world_size=self.accelerator.num_processes,
            sequence_parallel_degree=self.experiment.sampling.sequence_parallel_degree if self.experiment else 1,
            per_device_train_batch_size=self.args.per_device_train_batch_size,
            gradient_accumulation_steps=self.args.gradient_accumulation_steps,
            num_generations=self.num_generations,
            num_iterations=self.num_iterations,
            steps_per_generation=self.args.steps_per_generation,
        )

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
        """Generate completions for the rows, score them and compute advantages (TRL's implementation); with
        ``sampling.seqlen_balancing`` and several ranks, then exchange whole groups for balanced token loads."""
        training = self.model.training
        replaced: list[slice] = []
        if training and self._reroll is not None:
            inputs = self._inject_rerolls(inputs)
        self._stream_inputs = inputs if training and self._streaming else None
        batch = self._generate_and_score_completions(inputs)
        if training and (self._replay is not None or self._reroll is not None):
            rewards = self._local_rewards(len(inputs))
            if self._reroll is not None:
                self._buffer_failed_groups(inputs, rewards)
            if self._replay is not None:
                replaced = self._apply_replay(batch, rewards)
        if training and self._async and "sampling_per_token_logps" in batch and not self.use_vllm:
            self._correct_off_policy(batch, replaced if self._replay is not None else [])
        if training and self._balancing:
            batch, metrics = rebalance_groups(
                batch, self.num_generations, self.accelerator.process_index, self.accelerator.num_processes,
                self.processing_class.pad_token_id if hasattr(self.processing_class, "pad_token_id") else 0,
                self.experiment.sampling.balance_quadratic_coef,
            )
            for name, value in metrics.items():
                self._record(name, value)
        return batch

    # ---- async rollouts (async.use_data_producer / async.async_prefetch)

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        if not (self._async and self.model.training) or images is not None:
            return super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations,
                                                 has_tool_images)
        return self._async_rollouts(prompt_ids)

    @property
    def _micro_steps_per_round(self) -> int:
        return self.batch_layout.micro_steps_per_round

    def _current_round(self) -> int:
        ga = self.args.gradient_accumulation_steps
        return (self.state.global_step * ga + self._step % ga) // self._micro_steps_per_round

    def _future_round_prompt_ids(self, round_id: int) -> list[list[int]] | None:
        """Prompt token ids of a future round, read from a fresh copy of the (deterministic) train sampler."""
        if self._round_prompts is None:
            import itertools

            sampler = self.build_train_sampler(self.train_dataset)
            rows = self.batch_layout.completions_per_rank
            block = rows * self._micro_steps_per_round
            self._round_iter = (list(itertools.islice(it, rows)) for it in iter(
                lambda s=iter(sampler): list(itertools.islice(s, block)), []))
            self._round_prompts = []
        while len(self._round_prompts) <= round_id:
            try:
                idx = next(self._round_iter)
            except StopIteration:
                return None
            prompts = [self.train_dataset[i]["prompt"] for i in idx]
            self._round_prompts.append(self._tokenize_prompts(prompts)[0])
        return self._round_prompts[round_id]

    def _start_producer(self) -> None:
        """Spawn the generator process. Called at construction, so its start-up (imports, model load) overlaps the
        rest of set-up; its first round is generated with weights pushed at that moment (see _async_rollouts)."""
        from grpo.training.async_producer import AsyncRolloutProducer, producer_threads

        from safetensors.torch import save_file

        # Each rank writes its own copy: under torch.distributed, save_pretrained writes on rank 0 only, so another
        # rank's generator would find an empty (or half-written) directory.
        init_dir = Path(self.args.output_dir) / f"generator-init-rank{self.accelerator.process_index}"
        init_dir.mkdir(parents=True, exist_ok=True)
        model = self.accelerator.unwrap_model(self.model)
        model.config.save_pretrained(init_dir)
        # Every tensor under its own name (tied embeddings included): safetensors' save_model keeps one name of a
        # tied pair, and from_pretrained then left the other randomly initialised, so the generator sampled garbage.
        state = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}
        save_file(state, str(init_dir / "model.safetensors"), metadata={"format": "pt"})
        gc = self.generation_config
        gen = {"max_new_tokens": self.max_completion_length, "temperature": gc.temperature, "top_p": gc.top_p,
               "top_k": gc.top_k, "pad_token_id": self._tokenizer.pad_token_id, "eos_token_ids": list(self.eos_token_ids)}
        # The trainer keeps all its intra-op threads: the generator is idle most of a step, and measured on 2 cores
        # (150 steps of the tiny preset) a trainer cut to 1 thread was 1.23x slower than one sharing the cores.
        self._producer = AsyncRolloutProducer(str(init_dir), gen, seed=self.args.seed + self.accelerator.process_index,
                                              threads=producer_threads())

    def _async_rollouts(self, prompt_ids: list[list[int]]):
        import time as _time

        a = self.experiment.async_
        if self._producer is None:
            self._start_producer()
        producer = self._producer
        round_id = self._current_round()
        now = _time.perf_counter()
        train_s = now - self._last_round_end if self._last_round_end is not None else 0.0

        rollout, dropped = None, 0
        if round_id in self._submitted:
            candidate = producer.get(round_id)
            self._submitted.discard(round_id)
            if candidate.prompt_ids != [list(p) for p in prompt_ids]:
                candidate = None  # the round's rows changed after submission (re-roll injection): generate them now
            elif self.state.global_step - candidate.version > a.max_staleness:
                dropped = 1  # too old: never trained on, generated again below with current weights
                candidate = None
            rollout = candidate
        if rollout is None:
            producer.push_weights(self.state.global_step, self.accelerator.unwrap_model(self.model).state_dict())
            producer.submit(-1 - round_id, [list(p) for p in prompt_ids])
            rollout = producer.get(-1 - round_id)
        waited = _time.perf_counter() - now

        depth = a.prefetch_depth if a.async_prefetch else 0
        for future in range(round_id + 1, round_id + 1 + depth):
            if future not in self._submitted:
                ids = self._future_round_prompt_ids(future)
                if ids is not None:
                    producer.submit(future, [list(p) for p in ids])
                    self._submitted.add(future)

        staleness = float(self.state.global_step - rollout.version)
        m = self._metrics["train"]
        m["async/staleness_mean"].append(staleness)
        m["async/staleness_max"].append(staleness)
        m["async/dropped_stale"].append(float(dropped))
        m["async/queue_wait_s"].append(waited)
        m["async/generate_s"].append(rollout.generate_seconds)
        m["async/train_s"].append(train_s)
        self._last_round_end = _time.perf_counter()
        return rollout.completion_ids, rollout.logprobs

    def close_producer(self, wait: bool = True) -> None:
        if self._producer is not None:
            self._producer.close(wait=wait)
            self._producer = None

    # ---- off-policy correction for async rollouts (the generator's weights lag the trainer's)

    def _correct_off_policy(self, batch: dict[str, Any], replayed: list[slice]) -> None:
        """Importance-sampling correction between generator and trainer, and the OPSM fraction.

        ``vllm_importance_sampling_mode``: ``*_truncate`` clamps the ratio pi_train / pi_generator at
        ``vllm_importance_sampling_cap``; ``*_mask`` gives tokens (or whole sequences) above the cap weight exactly 0
        -- not a clamped 1/C. The weight multiplies each token's policy-gradient term; since it is >= 0 it is applied
        through per-token advantages, which TRL's loss accepts as (B, T). Replayed rows had their log-probs
        recomputed for the current policy, so their weight is 1.
        """
        a = self.experiment.async_
        if not a.vllm_importance_sampling_correction and a.off_policy_mask_threshold is None:
            return  # nothing to correct or log: skip the extra log-prob pass
        mask = batch["completion_mask"].float()
        sampling = torch.nan_to_num(batch["sampling_per_token_logps"], nan=0.0)
        if "old_per_token_logps" not in batch:
            ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
            attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
            with torch.no_grad():
                old, _, _ = self._get_per_token_logps_and_entropies(self.model, ids, attention,
                                                                    batch["completion_ids"].shape[1])
        else:
            old = batch["old_per_token_logps"]
        diff = (old - sampling) * mask

        if a.off_policy_mask_threshold is not None:  # TRL applies the mask in its loss; this logs its first-pass size
            seq_kl = (-diff).sum(1) / mask.sum(1).clamp(min=1.0)
            masked = (batch["advantages"] < 0) & (seq_kl > a.off_policy_mask_threshold)
            self._record("sampling/opsm_frac_masked", masked.float().mean().item())
        if not a.vllm_importance_sampling_correction:
            return
        if a.vllm_importance_sampling_mode.startswith("sequence"):
            ratio = diff.sum(1, keepdim=True).exp().expand_as(mask)
        else:
            ratio = diff.exp()
        over = ratio > a.vllm_importance_sampling_cap
        if a.vllm_importance_sampling_mode.endswith("truncate"):
            weight = ratio.clamp(max=a.vllm_importance_sampling_cap)
        else:
            weight = torch.where(over, torch.zeros_like(ratio), ratio)
        for rows in replayed:
            weight[rows] = 1.0
        valid = mask.bool()
        r = ratio[valid]
        m = self._metrics["train"]
        if r.numel():
            m["sampling/importance_sampling_ratio/min"].append(r.min().item())
            m["sampling/importance_sampling_ratio/mean"].append(r.mean().item())
            m["sampling/importance_sampling_ratio/max"].append(r.max().item())
        frac = over[valid].float().mean().item() if r.numel() else 0.0
        m["sampling/is_frac_clamped" if a.vllm_importance_sampling_mode.endswith("truncate") else
          "sampling/is_frac_masked"].append(frac)
        advantages = batch["advantages"]
        batch["advantages"] = (advantages.unsqueeze(1) if advantages.dim() == 1 else advantages) * weight * mask

    # ---- rewards of the last batch (TRL keeps them local to _generate_and_score_completions)

    def _generate(self, prompts: list):
        out = super()._generate(prompts)
        if self._stream_inputs is not None:  # async.streaming_partial_batch: score while the log-prob passes run
            inputs, self._stream_inputs = self._stream_inputs, None
            self._stream = self._start_streaming(inputs, prompts, completions=out[3], completion_ids=out[1])
        return out

    def _start_streaming(self, inputs, prompts, completions, completion_ids):
        from grpo.rewards.streaming import StreamingScorer, chunk_bounds, score_in_process

        columns = _reward_columns(inputs)
        pool, errors = self._reward_pool, []
        extra = {"trainer_state": self.state, "log_extra": self._log_completion_extra, "log_metric": self._log_metric}

        def score(lo: int, hi: int) -> list[list[float]]:
            part = {k: v[lo:hi] for k, v in columns.items()}
            if pool is None:
                return score_in_process(self.reward_funcs, prompts[lo:hi], completions[lo:hi], completion_ids[lo:hi],
                                        part, extra)
            rows = pool.compute(prompts[lo:hi], completions[lo:hi], completion_ids[lo:hi], part,
                                group_size=self.num_generations)
            errors.append(pool.metrics["rewards/errors"])
            return rows

        chunks = chunk_bounds(len(completions), self.num_generations, self.experiment.async_.streaming_min_groups)
        return StreamingScorer(score, chunks), errors

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        if self._stream is not None:
            rewards_per_func = self._streamed_rewards()
        elif self._reward_pool is not None and self.model.training:
            rewards_per_func = self._pool_rewards(inputs, prompts, completions, completion_ids_list)
        else:
            rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._last_rewards_per_func = rewards_per_func
        return rewards_per_func

    def _pool_rewards(self, inputs, prompts, completions, completion_ids_list) -> torch.Tensor:
        """``async.reward_num_workers`` persistent processes score the batch, whole groups per worker. A reward that
        raises, hangs past ``reward_timeout`` or crashes its worker gives NaN for those samples (their advantage is
        zeroed like TRL's unscorable rows) and the worker is replaced; the batch never waits forever."""
        from accelerate.utils import gather

        columns = _reward_columns(inputs)
        rows = self._reward_pool.compute(prompts, completions, completion_ids_list, columns,
                                         group_size=self.num_generations)
        local = torch.tensor(rows, dtype=torch.float32, device=self.accelerator.device)
        for name, value in self._reward_pool.metrics.items():
            self._record(name, float(value))
        return gather(local)

    def _streamed_rewards(self) -> torch.Tensor:
        from accelerate.utils import gather

        (stream, pool_errors), self._stream = self._stream, None
        rows, metrics = stream.result()
        if self._reward_pool is not None:
            metrics["rewards/errors"] = float(sum(pool_errors))
            metrics["rewards/worker_restarts"] = float(self._reward_pool.metrics["rewards/worker_restarts"])
        for name, value in metrics.items():
            self._record(name, float(value))
        local = torch.tensor(rows, dtype=torch.float32, device=self.accelerator.device)
        return gather(local)

    def close_reward_pool(self) -> None:
        if self._reward_pool is not None:
            self._reward_pool.close()
            self._reward_pool = None

    def _local_rewards(self, n: int) -> torch.Tensor:
        """This rank's weighted total reward per completion (NaN where every reward function abstained)."""
        rpf = self._last_rewards_per_func
        start = self.accelerator.process_index * n
        local = rpf[start : start + n]
        total = (local * self.reward_weights.to(local.device).unsqueeze(0)).nansum(dim=1)
        total[torch.isnan(local).all(dim=1)] = torch.nan
        return total.detach().cpu()

    # ---- deferred re-roll

    def _inject_rerolls(self, inputs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        a = self.experiment.async_
        start_step = int(a.reroll_start_fraction * self.args.max_steps)
        taken = self._reroll.take(a.reroll_max_groups) if self.state.global_step >= start_step else []
        self._record("reroll_injected", float(len(taken)))
        return inject_rerolls(inputs, taken, self.num_generations) if taken else inputs

    def _buffer_failed_groups(self, inputs: list[dict[str, Any]], rewards: torch.Tensor) -> None:
        grouped = torch.nan_to_num(rewards, nan=0.0).view(-1, self.num_generations)
        failed = (grouped.max(dim=1).values <= 0) & (grouped.std(dim=1) == 0)
        for g in failed.nonzero().flatten().tolist():
            self._reroll.add(inputs[g * self.num_generations])
        self._record("reroll_buffered", float(failed.sum()))
        self._record("reroll_buffer_size", float(len(self._reroll)))
        self._record("reroll_dropped", float(self._reroll.dropped))

    # ---- replay buffer

    def _apply_replay(self, batch: dict[str, Any], rewards: torch.Tensor) -> list[slice]:
        """Replace zero-signal groups by buffered ones, then buffer this batch's groups that have signal."""
        G = self.num_generations
        grouped = rewards.view(-1, G)  # NaN where unscorable: kept, so replayed advantages leave them out as TRL does
        std = group_reward_std(grouped)
        advantages = batch["advantages"].detach().cpu().view(-1, G)
        pad = getattr(self.processing_class, "pad_token_id", 0) or 0
        per_token = [k for k in batch if k.endswith("per_token_logps") and isinstance(batch[k], torch.Tensor)]

        zero = (std == 0).nonzero().flatten().tolist()
        batch_std = None
        if self.scale_rewards == "batch":  # TRL scales by the std of the whole (gathered) batch
            from trl.trainer.utils import nanstd

            rpf = self._last_rewards_per_func
            all_rewards = (rpf * self.reward_weights.to(rpf.device).unsqueeze(0)).nansum(dim=1)
            all_rewards[torch.isnan(rpf).all(dim=1)] = torch.nan
            batch_std = float(nanstd(all_rewards))
        replaced = []
        for g, group in zip(zero, self._replay.sample(len(zero))):
            rows = slice(g * G, (g + 1) * G)
            place_group(batch, rows, group, pad)
            batch["advantages"][rows] = group_advantages(group["rewards"], self.scale_rewards, batch_std).to(
                batch["advantages"].device, batch["advantages"].dtype
            )
            replaced.append(rows)
        if replaced:
            self._refresh_replayed(batch, replaced)
        # Recount the tokens the loss is normalised by on every rank, whether or not it replaced a group: a
        # collective joined only by the ranks that replaced one would wait forever for the others.
        tokens = batch["completion_mask"].sum().float().reshape(1)
        batch["num_items_in_batch"] = self.accelerator.reduce(tokens, reduction="sum").squeeze(0)

        for g in (std > 0).nonzero().flatten().tolist():
            rows = slice(g * G, (g + 1) * G)
            score = float(advantages[g].abs().sum() * std[g])
            group = {k: batch[k][rows].detach().cpu().clone() for k in
                     ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", *per_token)}
            group["rewards"] = grouped[g].clone()
            self._replay.add(score, group)
        self._record("replay_buffer_replacements", float(len(replaced)))
        self._record("replay_buffer_size", float(len(self._replay)))
        return replaced

    def _refresh_replayed(self, batch: dict[str, Any], replaced: list[slice]) -> None:
        """Replayed groups were sampled by an older policy: recompute their old (and reference) log-probs for the
        current one when asked."""
        if self.experiment.async_.replay_recompute_logps:
            logits_to_keep = batch["completion_ids"].shape[1]
            models = {"old_per_token_logps": self.model}
            if self.beta != 0.0 and self.ref_model is not None:
                models["ref_per_token_logps"] = self.ref_model
            with torch.no_grad():
                for key, model in models.items():
                    if key not in batch:
                        continue
                    for rows in replaced:
                        ids = torch.cat([batch["prompt_ids"][rows], batch["completion_ids"][rows]], 1)
                        mask = torch.cat([batch["prompt_mask"][rows], batch["completion_mask"][rows]], 1)
                        logps, _, _ = self._get_per_token_logps_and_entropies(model, ids, mask, logits_to_keep)
                        batch[key][rows] = logps
        if "importance_sampling_ratio" in batch:  # the generator's ratio does not apply to replayed rows
            for rows in replaced:
                batch["importance_sampling_ratio"][rows] = 1.0

    @property
    def _balancing(self) -> bool:
        return bool(self.experiment and self.experiment.sampling.seqlen_balancing and self.accelerator.num_processes > 1)

    def split_generation_batch(self, batch: dict[str, torch.Tensor | Any]) -> list[dict[str, torch.Tensor | Any]]:
        """Cut the scored batch into ``steps_per_generation`` micro-batches: TRL's shuffle-and-split, or balanced
        token budgets when sequence-length balancing is on."""
        if self._balancing:
            return split_by_token_budget(batch, self.args.steps_per_generation)
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
        """
        if model.training and self._skip_zero_advantage and self._no_signal_anywhere(inputs["advantages"]):
            self._record("skipped_zero_adv_batches", 1.0)
            return self._zero_loss(model, inputs)
        if model.training and self._skip_zero_advantage:
            self._record("skipped_zero_adv_batches", 0.0)
        chunks = self.experiment.grpo.num_generations_chunks if self.experiment else 1
        weight = self._balanced_weight(inputs)
        if chunks == 1 or not model.training or not torch.is_grad_enabled():
            return super()._compute_loss(model, inputs) * weight
        return self._chunked_loss(model, inputs, chunks, weight)

    # Loss types whose micro-batch loss is a mean over its sequences (TRL divides by the row count).
    _PER_SEQUENCE_MEAN = ("grpo", "sapo", "dr_grpo", "luspo")

    def _balanced_weight(self, inputs: dict[str, torch.Tensor | Any]) -> float:
        """Weight of a token-budget micro-batch (``sampling.seqlen_balancing``) so the step's gradient is the
        unbalanced step's.

        Unbalanced, every micro-batch on every rank holds ``per_device_train_batch_size`` rows, so a loss that is a
        mean over sequences gives each row the weight 1 / (per_device_train_batch_size x accumulation), and DDP's
        average over ranks divides by the world size. Token budgets give micro-batches (and, after the group
        exchange, ranks) unequal row counts; TRL divides by the actual count, so multiplying by
        rows / per_device_train_batch_size restores every row's weight (0 for a zero-weight filler). Losses
        normalised by the generation batch's token count (dapo, cispo, vespo) need no weight; bnpo and the entropy
        options depend on which rows share a micro-batch and are refused with balancing at config load."""
        rows = inputs.get(BALANCED_ROWS)
        if rows is None or self.loss_type not in self._PER_SEQUENCE_MEAN:
            return 1.0
        return rows / self.args.per_device_train_batch_size

    def _zero_loss(self, model, inputs: dict[str, torch.Tensor | Any]) -> torch.Tensor:
        """A zero loss whose backward gives every parameter a zero gradient, for a skipped micro-batch.

        DDP decides in its forward whether the next backward all-reduces. On the micro-step that synchronises (the
        last of an accumulation window) the zero must therefore come out of the DDP module's forward, or the
        gradients accumulated under ``no_sync`` in the window's earlier micro-steps are never averaged and the ranks
        step apart. One row is enough. Elsewhere a zero built from the parameters costs no forward at all.
        """
        if self.accelerator.num_processes > 1 and self.accelerator.sync_gradients:
            ids = torch.cat([inputs["prompt_ids"][:1], inputs["completion_ids"][:1]], 1)
            mask = torch.cat([inputs["prompt_mask"][:1], inputs["completion_mask"][:1]], 1)
            return model(input_ids=ids, attention_mask=mask).logits.sum() * 0.0
        return sum(p.sum() for p in model.parameters() if p.requires_grad) * 0.0

    @property
    def _skip_zero_advantage(self) -> bool:
        return bool(self.experiment and self.experiment.async_.skip_zero_advantage_batches)

    def _no_signal_anywhere(self, advantages: torch.Tensor) -> bool:
        has_signal = (advantages != 0).any().float().reshape(1)
        return bool(self.accelerator.reduce(has_signal, reduction="sum").item() == 0)

    def _chunked_loss(self, model, inputs: dict[str, torch.Tensor | Any], chunks: int, scale: float = 1.0
                      ) -> torch.Tensor:
        """Backward every chunk but the last here; return the last chunk's loss for the trainer's own backward.

        Each chunk is TRL's loss on its rows, weighted so the chunks sum to the micro-batch's loss: the policy term by
        the chunk's share of the loss type's normaliser, TRL's entropy options by their micro-batch meaning. The
        high-entropy token mask (``top_entropy_quantile``) comes from one quantile over the whole micro-batch (all
        ranks), computed by a no-grad forward pass per chunk before the backward passes (one extra forward); the
        entropy bonus (``entropy_coef``, a token mean over the micro-batch) is rescaled per chunk to the chunk's
        share of that mean. (``use_adaptive_entropy`` is refused with chunks at load.) ``scale`` multiplies the
        whole micro-batch loss (see :meth:`_balanced_weight`).

        DDP decides at forward time whether a backward all-reduces, so the earlier chunks run forward *and* backward
        under ``no_sync``: gradients are synchronised once, by the last chunk, and only on the micro-step where the
        trainer synchronises at all.
        """
        n = inputs["completion_ids"].shape[0]
        bounds = [round(i * n / chunks) for i in range(chunks + 1)]
        spans = [(lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:]) if hi > lo]
        per_sample = [k for k, v in inputs.items() if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == n]
        mask = inputs["completion_mask"]
        if "tool_mask" in inputs:  # TRL's loss mask: tool-call tokens do not count
            mask = mask * inputs["tool_mask"]
        chunk_inputs = [{k: (v[lo:hi] if k in per_sample else v) for k, v in inputs.items()} for lo, hi in spans]

        entropy_mask = None
        if self.top_entropy_quantile < 1.0:
            entropies = torch.cat([self._chunk_entropies(model, chunk) for chunk in chunk_inputs])
            entropy_mask = super().get_high_entropy_mask(entropies, mask, 1 - self.top_entropy_quantile)
        bonus_mask = mask if entropy_mask is None else mask * entropy_mask
        bonus_tokens = float(bonus_mask.sum())
        total_tokens = float(mask.sum())
        coef = self.entropy_coef
        logged_coefs = self._metrics["train"]["entropy_coef"]
        logged_before = len(logged_coefs)

        done = torch.zeros((), device=mask.device)
        loss = done
        try:
            for i, ((lo, hi), chunk) in enumerate(zip(spans, chunk_inputs)):
                if self.loss_type == "bnpo":  # normalised by the micro-batch's token count
                    weight = float(mask[lo:hi].sum()) / total_tokens if total_tokens else 0.0
                elif self.loss_type in ("cispo", "dapo", "vespo"):  # normalised by the generation batch's token count
                    weight = 1.0
                else:  # grpo, sapo, dr_grpo, luspo: means over sequences
                    weight = (hi - lo) / n
                if self._entropy_bonus_enabled:
                    # TRL subtracts coef x (this chunk's entropy mean); after the weight it must be coef x (this
                    # chunk's entropy sum / the micro-batch's bonus tokens). (weight 0: no tokens, nothing to scale)
                    share = float(bonus_mask[lo:hi].sum()) / bonus_tokens if bonus_tokens else 0.0
                    self.entropy_coef = coef * share / weight if weight > 0 else coef
                self._entropy_mask_override = None if entropy_mask is None else entropy_mask[lo:hi]
                last = i == len(spans) - 1
                with contextlib.nullcontext() if last else self.accelerator.no_sync(model):
                    loss = super()._compute_loss(model, chunk) * (weight * scale)
                    if not last:
                        self.accelerator.backward(loss)
                        done = done + loss.detach()
        finally:
            self.entropy_coef = coef
            self._entropy_mask_override = None
        if len(logged_coefs) > logged_before:  # TRL logged the per-chunk coefficients: log the real one, once
            del logged_coefs[logged_before:]
            logged_coefs.append(coef)
        # the caller backpropagates the returned tensor: only the last chunk's graph is still attached
        return loss + done

    _entropy_mask_override: torch.Tensor | None = None

    def get_high_entropy_mask(self, entropies: torch.Tensor, mask: torch.Tensor, threshold: float) -> torch.Tensor:
        """TRL's mask, except inside a chunked loss, where the chunk's rows of the micro-batch's mask are used."""
        if self._entropy_mask_override is not None:
            return self._entropy_mask_override
        return super().get_high_entropy_mask(entropies, mask, threshold)

    @torch.no_grad()
    def _chunk_entropies(self, model, chunk: dict[str, torch.Tensor | Any]) -> torch.Tensor:
        """Per-token entropies of one chunk, computed exactly as TRL's loss computes them (no graph kept)."""
        ids = torch.cat([chunk["prompt_ids"], chunk["completion_ids"]], dim=1)
        attention = torch.cat([chunk["prompt_mask"], chunk["completion_mask"]], dim=1)
        multimodal = ("pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes",
                      "num_tiles", "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids")
        _, entropies, _ = self._get_per_token_logps_and_entropies(
            model, ids, attention, chunk["completion_ids"].size(1), compute_entropy=True,
            **{k: chunk.get(k) for k in multimodal},
        )
        return entropies


def _reward_columns(inputs: list[dict[str, Any]]) -> dict[str, list]:
    """The dataset columns TRL passes to reward functions as keyword arguments (all but prompt/completion)."""
    return {k: [row[k] for row in inputs] for k in inputs[0] if k not in ("prompt", "completion", "completion_ids")}


def check_launch_matches_config(experiment: ExperimentConfig, launched: int) -> None:
    """The config's world size and SP degree must describe the processes actually launched."""
    sampling = experiment.sampling
    if sampling.world_size != launched:
        raise ConfigError(
            f"sampling.world_size is {sampling.world_size} but {launched} process(es) were launched; set "
            f"sampling.world_size={launched} or launch {sampling.world_size} (accelerate launch --num_processes N)"
        )
    if sampling.sequence_parallel_degree > 1:
        raise ConfigError(
            f"sampling.sequence_parallel_degree={sampling.sequence_parallel_degree} needs sequence-parallel "
            "attention (ring/Ulysses context parallelism on GPUs), which this backend does not provide: "
            "trl.GRPOTrainer rejects cp_size/sp_size > 1 and CPU training has no such kernels. Use 1; the sampler "
            "layout itself (grpo.algo.sampling.SequenceParallelRepeatRandomSampler) is ready for a GPU backend."
        )


class _WeightSync(TrainerCallback):
    """Push the trainer's weights to the generator every ``async.vllm_sync_interval`` optimizer steps."""

    def __init__(self, trainer: GRPOTrainer) -> None:
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        t = self.trainer
        if t._producer is not None and state.global_step % t.experiment.async_.vllm_sync_interval == 0:
            t._producer.push_weights(state.global_step, t.accelerator.unwrap_model(t.model).state_dict())
