"""Sequence-length balancing across ranks (``sampling.seqlen_balancing``, ``sampling.balance_quadratic_coef``): the
trainer side.

With several ranks, whole groups are exchanged so every rank's token load is even (:mod:`grpo.algo.group_balancing`,
Karmarkar-Karp in :mod:`grpo.algo.balance`), and each rank's batch is cut into token-budget micro-batches. The
loss weight below keeps the step's gradient equal to the unbalanced step's.
"""

from __future__ import annotations

from typing import Any

import torch

from grpo.algo.group_balancing import BALANCED_ROWS, rebalance_groups, split_by_token_budget
from grpo.training.call_samples import append_rows
from grpo.training.zero_advantage import select_rows


class SeqlenBalancing:
    """Mixin of :class:`grpo.training.trainer.GRPOTrainer`."""

    @property
    def _balancing(self) -> bool:
        return bool(self.experiment and self.experiment.sampling.seqlen_balancing
                    and self.accelerator.num_processes > 1)

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
        options depend on which rows share a micro-batch and are refused with balancing at config load. The
        micro-batches of a batch with per-call samples (:mod:`grpo.training.call_samples`) record their rows too, so
        each sample weighs one row."""
        rows = inputs.get(BALANCED_ROWS)
        if rows is None or self.loss_type not in self._PER_SEQUENCE_MEAN:
            return 1.0
        return rows / self.args.per_device_train_batch_size


    def _rebalance(self, batch: dict[str, torch.Tensor | Any]) -> dict[str, torch.Tensor | Any]:
        """Exchange whole groups between ranks for balanced token loads; logs ``balance/*``. Rows appended after
        the groups (an episode's earlier samples, :mod:`grpo.training.call_samples`) stay on their rank."""
        pad_token_id = self.processing_class.pad_token_id if hasattr(self.processing_class, "pad_token_id") else 0
        extra = getattr(self, "_call_sample_rows", 0)
        n = batch["completion_ids"].shape[0]
        groups = select_rows(batch, torch.arange(n - extra)) if extra else batch
        balanced, metrics = rebalance_groups(
            groups, self.num_generations, self.accelerator.process_index, self.accelerator.num_processes,
            pad_token_id, self.experiment.sampling.balance_quadratic_coef,
        )
        if extra:
            balanced = append_rows(balanced, select_rows(batch, torch.arange(n - extra, n)), pad_token_id)
        for name, value in metrics.items():
            self._record(name, value)
        return balanced

    def _split_by_token_budget(self, batch: dict[str, torch.Tensor | Any]) -> list[dict[str, torch.Tensor | Any]]:
        return split_by_token_budget(batch, self.args.steps_per_generation)
