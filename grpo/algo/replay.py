"""Replay buffer and deferred re-roll: two ways to keep learning signal in batches where groups carry none.

A GRPO group whose completions all get the same reward has zero advantages and teaches nothing. Two remedies
(the "fast async" toolkit; config names as in axolotl's ``trl:`` block):

* **Replay** (``replay_buffer_size``): groups *with* reward variance are kept in a bounded buffer, ranked by
  ``sum |advantage| x reward std``; a zero-signal group of a later batch is replaced by a sampled buffered group.
* **Deferred re-roll** (``reroll_start_fraction``, ``reroll_max_groups``): prompts whose whole group *failed* are
  kept (bounded; the oldest dropped and counted) and put back into later batches once training is far enough
  along that the policy may now solve them. They are really re-injected: the prompts are generated for again.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(order=True)
class _Entry:
    score: float
    seq: int
    group: dict[str, Any] = field(compare=False)


class ReplayBuffer:
    """At most ``max_size`` groups, the highest-scoring kept; sampling is proportional to score."""

    def __init__(self, max_size: int, seed: int = 0) -> None:
        if max_size < 1:
            raise ValueError(f"replay_buffer_size must be >= 1 to use a replay buffer, got {max_size}")
        self.max_size = max_size
        self._heap: list[_Entry] = []  # min-heap on score: the weakest entry is evicted first
        self._seq = itertools.count()
        self._gen = torch.Generator().manual_seed(seed)

    def __len__(self) -> int:
        return len(self._heap)

    def add(self, score: float, group: dict[str, Any]) -> bool:
        """Keep ``group`` if there is room or it beats the weakest entry; returns whether it was kept."""
        if not score > 0:
            return False
        entry = _Entry(float(score), next(self._seq), group)
        if len(self._heap) < self.max_size:
            heapq.heappush(self._heap, entry)
            return True
        if entry.score > self._heap[0].score:
            heapq.heapreplace(self._heap, entry)
            return True
        return False

    def sample(self, k: int) -> list[dict[str, Any]]:
        """``k`` groups drawn with replacement, probability proportional to score (none if the buffer is empty)."""
        if not self._heap or k <= 0:
            return []
        weights = torch.tensor([e.score for e in self._heap], dtype=torch.float64)
        picks = torch.multinomial(weights, k, replacement=True, generator=self._gen).tolist()
        return [self._heap[i].group for i in picks]


class RerollBuffer:
    """FIFO of prompt rows whose whole group failed; bounded, dropping (and counting) the oldest."""

    def __init__(self, max_size: int) -> None:
        if max_size < 1:
            raise ValueError(f"re-roll buffer size must be >= 1, got {max_size}")
        self._rows: deque[dict[str, Any]] = deque()
        self.max_size = max_size
        self.dropped = 0

    def __len__(self) -> int:
        return len(self._rows)

    def add(self, row: dict[str, Any]) -> None:
        if len(self._rows) == self.max_size:
            self._rows.popleft()
            self.dropped += 1
        self._rows.append(row)

    def take(self, n: int) -> list[dict[str, Any]]:
        return [self._rows.popleft() for _ in range(min(n, len(self._rows)))]


def nan_std(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Bessel-corrected std along ``dim`` over the non-NaN entries, NaN where fewer than two (TRL's ``nanstd``)."""
    count = (~torch.isnan(x)).sum(dim=dim, keepdim=True)
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    variance = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=True) * count / (count - 1).clamp(min=1)
    return torch.where(count > 1, variance.sqrt(), torch.full_like(variance, float("nan"))).squeeze(dim)


def group_reward_std(grouped: torch.Tensor) -> torch.Tensor:
    """Per-row std of a (groups, G) reward matrix over its scorable (non-NaN) rewards; 0 where fewer than two are
    scorable. A row with std 0 has no learning signal: TRL gives it all-zero advantages."""
    return torch.nan_to_num(nan_std(grouped, dim=1), nan=0.0)


def group_advantages(rewards: torch.Tensor, scale: str, batch_std: float | None = None) -> torch.Tensor:
    """GRPO advantages of one group's rewards as TRL computes them: centred on the group mean, divided by the group
    std (``scale_rewards: group``), the current batch's std (``batch``) or nothing (``none``). Unscorable completions
    (NaN: every reward function abstained) are left out of the mean and std and get advantage 0, so the baseline is
    not biased towards 0."""
    if torch.isnan(rewards).all():
        return torch.zeros_like(rewards)
    centred = rewards - torch.nanmean(rewards)
    if scale != "none":
        std = group_reward_std(rewards.view(1, -1))[0] if scale == "group" else torch.tensor(batch_std or 0.0)
        centred = centred / (std + 1e-4)
    return torch.nan_to_num(centred, nan=0.0)


def inject_rerolls(inputs: list[dict[str, Any]], rerolls: list[dict[str, Any]], num_generations: int) -> list[dict]:
    """Replace the last ``len(rerolls)`` prompt groups of a generation batch's rows with the re-roll prompts."""
    out = list(inputs)
    groups = len(out) // num_generations
    for i, row in enumerate(rerolls[:groups]):
        start = (groups - 1 - i) * num_generations
        out[start : start + num_generations] = [dict(row) for _ in range(num_generations)]
    return out


def _fit(t: torch.Tensor, width: int, left: bool, value: float) -> torch.Tensor:
    """Pad (or cut) dim 1 of ``t`` to ``width``; prompts are aligned right (left padding), completions left."""
    have = t.shape[1]
    if have == width:
        return t
    if have > width:
        return t[:, have - width :] if left else t[:, :width]
    pad = t.new_full((t.shape[0], width - have, *t.shape[2:]), value)
    return torch.cat([pad, t], 1) if left else torch.cat([t, pad], 1)


def _completion_aligned(name: str) -> bool:
    """Per-token tensors laid out like the completion (right-padded) besides ``completion_*``."""
    return name.endswith("per_token_logps") or name == "tool_mask"


def _pad_value(name: str, pad_token_id: int) -> int:
    if name.endswith("_ids"):
        return pad_token_id
    return 1 if name == "tool_mask" else 0  # TRL pads tool_mask with 1 (masked by completion_mask anyway)


def place_group(batch: dict[str, Any], rows: slice, group: dict[str, torch.Tensor], pad_token_id: int) -> None:
    """Write a buffered group into ``batch[rows]``, widening the batch's prompt/completion tensors if needed."""
    for key, left in (("prompt", True), ("completion", False)):
        width = max(batch[f"{key}_ids"].shape[1], group[f"{key}_ids"].shape[1])
        for name, tensor in list(batch.items()):
            if not isinstance(tensor, torch.Tensor) or tensor.dim() < 2:
                continue
            if name.startswith(key) or (key == "completion" and _completion_aligned(name)):
                batch[name] = _fit(tensor, width, left, _pad_value(name, pad_token_id))
        names = [f"{key}_ids", f"{key}_mask"]
        if key == "completion":
            names += [n for n in group if n.endswith("per_token_logps") and n in batch]
            if "tool_mask" in batch:  # an episode's environment tokens stay out of the loss when replayed
                tool_mask = group.get("tool_mask")
                if tool_mask is None:  # a single-turn group: every token is the model's
                    tool_mask = torch.ones_like(group["completion_mask"])
                batch["tool_mask"][rows] = _fit(tool_mask.to(batch["tool_mask"].device), width, left, 1)
        for name in names:
            batch[name][rows] = _fit(group[name].to(batch[name].device), width, left, _pad_value(name, pad_token_id))
