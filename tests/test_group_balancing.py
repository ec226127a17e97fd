"""Token-budget micro-batches: always the requested count, balanced, and zero-weight fillers when too few rows."""

from __future__ import annotations

import torch

from grpo.algo.group_balancing import split_by_token_budget


def make_batch(completion_lengths: list[int], width: int = 6) -> dict:
    n = len(completion_lengths)
    mask = torch.zeros(n, width, dtype=torch.long)
    for i, length in enumerate(completion_lengths):
        mask[i, :length] = 1
    return {
        "prompt_ids": torch.ones(n, 3, dtype=torch.long), "prompt_mask": torch.ones(n, 3, dtype=torch.long),
        "completion_ids": torch.arange(n * width).view(n, width), "completion_mask": mask,
        "advantages": torch.arange(1, n + 1, dtype=torch.float), "num_items_in_batch": torch.tensor(float(mask.sum())),
    }


def test_split_balances_tokens_and_keeps_every_row_once():
    lengths = [6, 1, 1, 5, 2, 6, 1, 2]
    parts = split_by_token_budget(make_batch(lengths), 2)
    assert len(parts) == 2
    rows = sorted(int(a) for p in parts for a in p["advantages"])
    assert rows == list(range(1, 9))
    loads = [int(p["prompt_mask"].sum() + p["completion_mask"].sum()) for p in parts]
    assert max(loads) - min(loads) <= 2  # 36 tokens in all: an 18/18 split exists
    assert all(p["num_items_in_batch"] == 24 for p in parts)  # the global normaliser is not per micro-batch


def test_too_few_rows_get_zero_weight_fillers_so_every_rank_runs_the_same_passes():
    parts = split_by_token_budget(make_batch([3, 2]), 4)
    assert len(parts) == 4
    real = [p for p in parts if p["completion_mask"].sum() > 0]
    fillers = [p for p in parts if p["completion_mask"].sum() == 0]
    assert len(real) == 2 and len(fillers) == 2
    for f in fillers:
        assert f["completion_ids"].shape[0] == 1 and float(f["advantages"].abs().sum()) == 0.0
