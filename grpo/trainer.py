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

from typing import Any

import torch
import trl
from torch.utils.data import Sampler
from trl.trainer.utils import shuffle_sequence_dict, split_pixel_values_by_grid, split_tensor_dict, unsplit_pixel_values_by_grid

from grpo.config import ExperimentConfig

TESTED_TRL_VERSION = "1.16.0"


class GRPOTrainer(trl.GRPOTrainer):
    """TRL's GRPO trainer with extension points; see the module docstring."""

    def __init__(self, *args: Any, experiment: ExperimentConfig | None = None, **kwargs: Any) -> None:
        if trl.__version__ != TESTED_TRL_VERSION:
            raise RuntimeError(
                f"grpo.trainer overrides TRL internals tested with trl=={TESTED_TRL_VERSION}, found {trl.__version__}; "
                f"install the pinned version (pip install -e .)"
            )
        self.experiment = experiment
        super().__init__(*args, **kwargs)

    # ------------------------------------------------------------ 1. which prompts each rank sees

    def _get_train_sampler(self, dataset=None) -> Sampler:
        return self.build_train_sampler(dataset if dataset is not None else self.train_dataset)

    def build_train_sampler(self, dataset) -> Sampler:
        """The sampler over prompt indices; TRL's ``RepeatSampler`` by default."""
        return super()._get_train_sampler(dataset)

    # ------------------------------------------------------------ 2. generation batch: assemble, then split

    def _prepare_inputs(self, generation_batch: dict[str, torch.Tensor | Any]) -> dict[str, torch.Tensor | Any]:
        # Same schedule as TRL: one generation round every steps_per_generation * num_iterations micro-steps, whose
        # micro-batches are then served in turn. Only the two halves are separate methods here.
        if not self.model.training:
            return self.assemble_generation_batch(generation_batch)
        generate_every = self.args.steps_per_generation * self.num_iterations
        if self._step % generate_every == 0 or self._buffered_inputs is None:
            batch = self.assemble_generation_batch(generation_batch)
            self._buffered_inputs = self.split_generation_batch(batch)
        return self._buffered_inputs[self._step % self.args.steps_per_generation]

    def assemble_generation_batch(self, inputs: list[dict[str, Any]]) -> dict[str, torch.Tensor | Any]:
        """Generate completions for the rows, score them and compute advantages (TRL's implementation)."""
        return self._generate_and_score_completions(inputs)

    def split_generation_batch(self, batch: dict[str, torch.Tensor | Any]) -> list[dict[str, torch.Tensor | Any]]:
        """Shuffle the scored batch and cut it into ``steps_per_generation`` micro-batches (TRL's behaviour)."""
        batch = split_pixel_values_by_grid(batch)
        batch = shuffle_sequence_dict(batch)
        parts = split_tensor_dict(batch, self.args.steps_per_generation)
        return [unsplit_pixel_values_by_grid(part) for part in parts]

    # ------------------------------------------------------------ 3. loss

    def _compute_loss(self, model, inputs) -> torch.Tensor:
        return self.compute_policy_loss(model, inputs)

    def compute_policy_loss(self, model, inputs: dict[str, torch.Tensor | Any]) -> torch.Tensor:
        """The clipped GRPO surrogate for one micro-batch (TRL's implementation)."""
        return super()._compute_loss(model, inputs)
