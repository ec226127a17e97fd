"""Token rows as padded tensors in one copy, not one indexed assignment per row: what TRL's ``pad`` and every
hand-written padding loop do row by row, a few microseconds of host time per row, every step (see
:mod:`grpo.training.host_batching`). The one place the trainer, the episode runner's ``generate`` and the per-call
sample rows pad."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def padded(rows: Sequence[Sequence[float]], value: float, side: str, dtype: torch.dtype = torch.long,
           pad_to_multiple_of: int | None = None) -> torch.Tensor:
    """Python rows as one tensor, each padded with ``value`` on the ``side`` ("left" or "right") to the longest
    (rounded up to ``pad_to_multiple_of``), built from lists in one call."""
    width = _multiple(max(map(len, rows)), pad_to_multiple_of)
    if side == "left":
        return torch.tensor([[value] * (width - len(row)) + list(row) for row in rows], dtype=dtype)
    return torch.tensor([list(row) + [value] * (width - len(row)) for row in rows], dtype=dtype)


def padded_rows(rows: Sequence[Sequence[int]], padding_value: int, padding_side: str,
                pad_to_multiple_of: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists as one padded ``(ids, attention_mask)`` pair of long tensors: what TRL builds with a tensor per row
    and its ``pad``."""
    return (padded(rows, padding_value, padding_side, torch.long, pad_to_multiple_of),
            padded([[1] * len(row) for row in rows], 0, padding_side, torch.long, pad_to_multiple_of))


def pad(tensors: list[torch.Tensor], padding_value: int = 0, padding_side: str = "right",
        pad_to_multiple_of: int | None = None) -> torch.Tensor:
    """``trl.trainer.utils.pad`` (same arguments and result) for 1-D tensors on one device, with one copy of every
    row instead of one indexed assignment per row. Anything else (more dimensions, mixed devices, an empty list, an
    unknown side) goes to TRL's, which raises where it raises."""
    if (not tensors or padding_side not in ("left", "right") or any(t.dim() != 1 for t in tensors)
            or len({t.device for t in tensors}) > 1):
        from trl.trainer.utils import pad as trl_pad  # here: the episode runner's processes pad without TRL

        return trl_pad(tensors, padding_value, padding_side, pad_to_multiple_of)
    first = tensors[0]
    lengths = torch.tensor([t.shape[0] for t in tensors])
    width = _multiple(int(lengths.max()), pad_to_multiple_of)
    out = torch.full((len(tensors), width), padding_value, dtype=first.dtype, device=first.device)
    total = int(lengths.sum())
    if total:
        rows = torch.repeat_interleave(torch.arange(len(tensors)), lengths)
        starts = torch.cumsum(lengths, 0) - lengths  # where each row begins in the concatenation
        cols = torch.arange(total) - torch.repeat_interleave(starts, lengths)
        if padding_side == "left":
            cols += torch.repeat_interleave(width - lengths, lengths)
        # each row cast to the first's dtype on its own, as TRL's assignment casts it: ``torch.cat`` would promote
        # the rows to a common dtype first (a row of ids beside an empty completion, ``torch.tensor([])``, is
        # float32: ids above 2**24 rounded)
        same = all(t.dtype == first.dtype for t in tensors)
        out[rows.to(first.device), cols.to(first.device)] = torch.cat(
            tensors if same else [t.to(first.dtype) for t in tensors])
    return out


def _multiple(width: int, multiple: int | None) -> int:
    return width if not multiple else -(-width // multiple) * multiple


__all__ = ["pad", "padded", "padded_rows"]
