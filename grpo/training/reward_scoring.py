"""Reward scoring (``async.reward_num_workers``, ``async.reward_timeout``, ``async.streaming_partial_batch``,
``async.streaming_min_groups``): the trainer side of the reward worker pool and of streamed scoring.

TRL scores rewards in-process after generation. Here a persistent pool of worker processes
(:mod:`grpo.rewards.pool`, functions sent once per worker) can score whole groups in parallel, and streaming
(:mod:`grpo.rewards.streaming`) starts scoring while TRL's log-prob passes run. The last batch's per-function
rewards are kept (TRL keeps them local), for replay and re-roll.
"""

from __future__ import annotations

from typing import Any

import torch

from grpo.errors import ConfigError


class RewardScoring:
    """Mixin of :class:`grpo.training.trainer.GRPOTrainer`: TRL's ``_generate`` / ``_calculate_rewards`` hooks."""

    @staticmethod
    def _check_streaming_rewards(experiment, reward_funcs) -> None:
        """Streaming scores in a background thread; reward models run on the trainer's device and cannot."""
        if experiment is None or not experiment.async_.streaming_partial_batch:
            return
        funcs = reward_funcs if isinstance(reward_funcs, list) else [reward_funcs]
        if any(isinstance(fn, (str, torch.nn.Module)) for fn in funcs):
            raise ConfigError(
                "async.streaming_partial_batch scores reward functions in a background thread; reward models run "
                "on the trainer's device: turn streaming off or use reward functions"
            )

    def _init_reward_scoring(self) -> None:
        a = self.experiment.async_ if self.experiment is not None else None
        self._last_rewards_per_func: torch.Tensor | None = None
        self._reward_pool = None
        if a is not None and a.reward_num_workers > 1:
            from grpo.rewards.pool import RewardWorkerPool

            # Functions are pickled (by reference) and sent once now; an unpicklable one fails here, not mid-run.
            self._reward_pool = RewardWorkerPool(self.reward_funcs, a.reward_num_workers, timeout=a.reward_timeout)
        self._streaming = bool(a and a.streaming_partial_batch)
        self._stream_inputs: list[dict[str, Any]] | None = None  # this round's rows, until its completions exist
        self._stream = None  # (StreamingScorer, per-chunk pool error counts) of the batch being assembled

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


def _reward_columns(inputs: list[dict[str, Any]]) -> dict[str, list]:
    """The dataset columns TRL passes to reward functions as keyword arguments (all but prompt/completion)."""
    return {k: [row[k] for row in inputs] for k in inputs[0] if k not in ("prompt", "completion", "completion_ids")}

