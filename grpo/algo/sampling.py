"""Prompt-index sampler for GRPO with data and sequence parallelism.

GRPO needs each prompt ``num_generations`` times in a row (one group), the same batch several times in a row
(``num_iterations`` / gradient accumulation reuse), and — with sequence parallelism — identical indices on all ranks
of a sequence-parallel (SP) group, because those ranks split one sequence between them. TRL's ``RepeatSampler``
covers the first two; this one adds the SP layout (axolotl's table, world 4, degree 2, mini_repeat 3, batch 2):

    ranks 0, 1 (SP group 0): 0 0 0 1 1 1 (x repeat_count), then 4 4 4 5 5 5 (x repeat_count), ...
    ranks 2, 3 (SP group 1): 2 2 2 3 3 3 (x repeat_count), then 6 6 6 7 7 7 (x repeat_count), ...

The order depends only on (seed, epoch), never on the rank, so every rank agrees and a restart reproduces it.

Differences from ``trl.trainer.utils.RepeatSampler`` with ``world_size == sequence_parallel_degree == 1``:

* ``drop_last=True`` yields exactly TRL's first epoch (TRL always drops an incomplete final batch), except that a
  dataset smaller than one batch is a ValueError here instead of an empty epoch.
* ``drop_last=False`` (the default) yields TRL's output followed by the completed final batch, whose missing
  indices wrap around to the start of the order.
* Later epochs: TRL keeps advancing one generator; here epoch ``e`` reshuffles with seed ``seed + e`` (call
  :meth:`set_epoch`), so any epoch can be reproduced on its own after a restart.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterator, Sized

import torch
from torch.utils.data import Sampler

__all__ = ["SequenceParallelRepeatRandomSampler", "sp_group_of"]


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _positive_int(value: object, name: str) -> int:
    if not _is_int(value) or value < 1:
        raise ValueError(f"{name} must be a positive integer (>= 1), got {value!r}")
    return int(value)


def sp_group_of(rank: int, sequence_parallel_degree: int) -> int:
    """SP group of ``rank``: consecutive blocks of ``sequence_parallel_degree`` ranks share one group."""
    degree = _positive_int(sequence_parallel_degree, "sequence_parallel_degree")
    if not _is_int(rank) or rank < 0:
        raise ValueError(f"rank must be an integer >= 0, got {rank!r}")
    return int(rank) // degree


class SequenceParallelRepeatRandomSampler(Sampler[int]):
    """Yields dataset indices for one rank: its SP group's slice of each chunk of the shuffled order.

    The order (a permutation of the dataset, same on all ranks) is cut into chunks of ``batch_size *
    num_sp_groups`` indices; SP group ``g`` takes positions ``[g * batch_size, (g + 1) * batch_size)`` of every
    chunk. Each chunk slice is yielded ``repeat_count`` times in a row, each index ``mini_repeat_count`` times
    consecutively. An incomplete final chunk is dropped (``drop_last=True``) or completed by wrapping around to the
    start of the order, as often as needed (``drop_last=False``), so all SP groups yield the same number of indices.
    """

    def __init__(
        self,
        dataset: Sized,
        mini_repeat_count: int,
        world_size: int,
        rank: int,
        batch_size: int = 1,
        repeat_count: int = 1,
        sequence_parallel_degree: int = 1,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        self.mini_repeat_count = _positive_int(mini_repeat_count, "mini_repeat_count")
        self.world_size = _positive_int(world_size, "world_size")
        self.batch_size = _positive_int(batch_size, "batch_size")
        self.repeat_count = _positive_int(repeat_count, "repeat_count")
        self.sequence_parallel_degree = _positive_int(sequence_parallel_degree, "sequence_parallel_degree")
        if not _is_int(rank) or not 0 <= rank < world_size:
            raise ValueError(f"rank must be an integer in [0, world_size={world_size}), got {rank!r}")
        if world_size % sequence_parallel_degree:
            raise ValueError(
                f"world_size={world_size} must be divisible by sequence_parallel_degree={sequence_parallel_degree}"
            )
        if not _is_int(seed):
            raise ValueError(f"seed must be an integer, got {seed!r}")
        try:
            self.num_samples = len(dataset)
        except TypeError:
            raise ValueError(f"dataset must be Sized (have a len()), got {type(dataset).__name__}") from None
        if self.num_samples == 0:
            raise ValueError("dataset must not be empty, got len(dataset) == 0")

        self.dataset = dataset
        self.rank = int(rank)
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.drop_last = bool(drop_last)
        self.epoch = 0
        self.num_sp_groups = world_size // sequence_parallel_degree
        self.sp_group = sp_group_of(rank, sequence_parallel_degree)
        self.chunk_size = self.batch_size * self.num_sp_groups
        if self.drop_last:
            self.num_chunks = self.num_samples // self.chunk_size
            if self.num_chunks == 0:
                raise ValueError(
                    f"dataset has {self.num_samples} samples, fewer than one chunk of batch_size * num_sp_groups = "
                    f"{self.batch_size} * {self.num_sp_groups} = {self.chunk_size}, and drop_last=True would yield "
                    f"nothing; use drop_last=False or a smaller batch_size"
                )
        else:
            self.num_chunks = -(-self.num_samples // self.chunk_size)

    def set_epoch(self, epoch: int) -> None:
        """Reshuffle for ``epoch`` (order seeded with ``seed + epoch``); call before iterating each epoch."""
        if not _is_int(epoch) or epoch < 0:
            raise ValueError(f"epoch must be an integer >= 0, got {epoch!r}")
        self.epoch = int(epoch)

    def _order(self) -> list[int]:
        if not self.shuffle:
            return list(range(self.num_samples))
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.num_samples, generator=generator).tolist()

    def __iter__(self) -> Iterator[int]:
        order = self._order()
        needed = self.num_chunks * self.chunk_size
        while len(order) < needed:  # wrap around, as often as a tiny dataset requires
            order += order[: needed - len(order)]
        offset = self.sp_group * self.batch_size
        for chunk in range(self.num_chunks):
            start = chunk * self.chunk_size + offset
            batch = order[start : start + self.batch_size]
            for _ in range(self.repeat_count):
                for index in batch:
                    for _ in range(self.mini_repeat_count):
                        yield index

    def __len__(self) -> int:
        return self.num_chunks * self.batch_size * self.repeat_count * self.mini_repeat_count
