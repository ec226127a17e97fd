"""The batch layout: how one generation round's completions are laid out over ranks, micro-steps and prompts.

Derived once, here, the way ``trl.GRPOConfig`` derives it, and read by everything that needs the numbers: the config's
validation and ``ExperimentConfig.generation_batch_size``, the sampler plan (a :class:`grpo.algo.plan.PlanSpec` holds
one), the trainer's sampler (:attr:`grpo.training.trainer.GRPOTrainer.batch_layout`) and the plan's cache key
(:func:`grpo.pipeline.cache_dirs.plan_dir_for`). It takes plain numbers: the config builds its layout
(:attr:`grpo.config.ExperimentConfig.batch_layout`), the trainer from TRL's resolved arguments.

* ``steps_per_generation`` is ``grpo.steps_per_generation``, else
  ``generation_batch_size // (per_device_train_batch_size * world_size)`` when that is set, else
  ``gradient_accumulation_steps`` (TRL's default);
* one round gives every rank ``per_device_train_batch_size * steps_per_generation`` completions, i.e.
  ``prompts_per_rank`` prompts x ``num_generations``; the ranks of one sequence-parallel group share its prompts, so a
  round holds ``prompts_per_rank * num_sp_groups`` prompts and serves ``steps_per_generation * num_iterations``
  micro-steps.

Deriving never raises: the callers validate (each with the message naming its own inputs) and read the numbers here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

__all__ = ["BatchLayout"]


@dataclass(frozen=True)
class BatchLayout:
    """The batch numbers of one generation round; build it with :meth:`derive`."""

    world_size: int
    sequence_parallel_degree: int
    per_device_train_batch_size: int
    gradient_accumulation_steps: int
    num_generations: int
    num_iterations: int
    steps_per_generation: int  # micro-batches one generation round is split into (per rank)
    generation_batch_size: int  # completions generated per round, all ranks together
    steps_per_generation_from: str  # the config field steps_per_generation came from (for error messages)

    @classmethod
    def derive(
        cls,
        *,
        world_size: int,
        per_device_train_batch_size: int,
        gradient_accumulation_steps: int,
        num_generations: int,
        num_iterations: int = 1,
        sequence_parallel_degree: int = 1,
        generation_batch_size: int | None = None,
        steps_per_generation: int | None = None,
    ) -> BatchLayout:
        """TRL's derivation of ``steps_per_generation`` and ``generation_batch_size`` from what is set."""
        global_batch = per_device_train_batch_size * world_size
        if steps_per_generation is not None:
            spg, source = steps_per_generation, "grpo.steps_per_generation"
            gen_batch = global_batch * spg
        elif generation_batch_size is not None:
            spg, source = generation_batch_size // global_batch, "grpo.generation_batch_size"
            gen_batch = generation_batch_size
        else:
            spg, source = gradient_accumulation_steps, "grpo.gradient_accumulation_steps"
            gen_batch = global_batch * spg
        return cls(
            world_size=world_size,
            sequence_parallel_degree=sequence_parallel_degree,
            per_device_train_batch_size=per_device_train_batch_size,
            gradient_accumulation_steps=gradient_accumulation_steps,
            num_generations=num_generations,
            num_iterations=num_iterations,
            steps_per_generation=spg,
            generation_batch_size=gen_batch,
            steps_per_generation_from=source,
        )

    @property
    def global_batch_size(self) -> int:
        """Completions per micro-step, all ranks together."""
        return self.per_device_train_batch_size * self.world_size

    @property
    def num_sp_groups(self) -> int:
        return self.world_size // self.sequence_parallel_degree

    @property
    def completions_per_rank(self) -> int:
        """Completions each rank holds of one round: ``per_device_train_batch_size * steps_per_generation``."""
        return self.per_device_train_batch_size * self.steps_per_generation

    @property
    def whole_groups_per_rank(self) -> bool:
        """Whether each rank's share of a round is whole prompt groups (needed with several ranks or SP groups)."""
        return self.completions_per_rank % self.num_generations == 0

    @property
    def prompts_per_rank(self) -> int:
        """Prompts each rank (each SP group: its ranks share them) generates for in one round; check
        :attr:`whole_groups_per_rank` first."""
        return self.completions_per_rank // self.num_generations

    @property
    def prompts_per_round(self) -> int:
        return self.prompts_per_rank * self.num_sp_groups

    @property
    def micro_steps_per_round(self) -> int:
        """Micro-steps one round serves: each of its micro-batches ``num_iterations`` times."""
        return self.steps_per_generation * self.num_iterations

    def cache_key_payload(self) -> dict[str, Any]:
        """The numbers a cached output laid out by this batch depends on (JSON); how they were set is not one of
        them, so ``generation_batch_size: 64`` and the ``steps_per_generation`` giving 64 share a key."""
        payload = dataclasses.asdict(self)
        del payload["steps_per_generation_from"]
        return payload

