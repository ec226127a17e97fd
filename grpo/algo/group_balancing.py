"""Group-level sequence-length balancing across data-parallel ranks, applied to a scored generation batch.

After generation every rank holds its own groups. Completion lengths vary a lot, so equal group counts give
unequal token loads, and the slowest rank sets the pace of every DDP step. Here all ranks exchange their groups,
compute the same balanced assignment (whole groups stay together, so group statistics are unchanged; counts
differ by at most one), and each keeps its share. Micro-batches within a rank are then cut by balanced token
budgets, always ``steps_per_generation`` of them, so every rank runs the same number of forward/backward passes.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from grpo.algo.balance import balance_groups, balanced_micro_batches, group_workloads, imbalance_metrics

Batch = dict[str, Any]

# Key of a token-budget micro-batch holding its number of real rows (not a tensor: never split or gathered).
BALANCED_ROWS = "balanced_rows"


def per_sample_keys(batch: Batch) -> list[str]:
    """The keys of ``batch`` holding one entry per row (tensors whose first dimension is the row count)."""
    n = batch["completion_ids"].shape[0]
    return [k for k, v in batch.items() if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == n]


def _pad_to(t: torch.Tensor, width: int, left: bool, value: float) -> torch.Tensor:
    if t.dim() < 2 or t.shape[1] == width:
        return t
    pad = t.new_full((t.shape[0], width - t.shape[1], *t.shape[2:]), value)
    return torch.cat([pad, t], 1) if left else torch.cat([t, pad], 1)


def concat_rows(parts: list[Batch], keys: list[str], pad_token_id: int) -> Batch:
    """The rows of ``parts`` one after another (their ``keys``, per-row tensors), each width padded as TRL pads it:
    prompts on the left, completions and per-token values on the right."""
    out: Batch = {}
    for k in keys:
        tensors = [p[k] for p in parts]
        if tensors[0].dim() >= 2:
            width = max(t.shape[1] for t in tensors)
            left = k.startswith("prompt")  # prompts are left-padded, completions and per-token values right-padded
            value = pad_token_id if k.endswith("_ids") else 0
            tensors = [_pad_to(t, width, left, value) for t in tensors]
        out[k] = torch.cat(tensors, 0)
    return out


def rebalance_groups(
    batch: Batch, num_generations: int, rank: int, world_size: int, pad_token_id: int,
    quadratic_coef: float | None = None,
) -> tuple[Batch, dict[str, float]]:
    """Exchange groups between ranks so each holds a balanced token load; returns this rank's batch and metrics."""
    keys = per_sample_keys(batch)
    local = {k: batch[k].detach().cpu() for k in keys}
    gathered: list[Batch | None] = [None] * world_size
    dist.all_gather_object(gathered, local)
    full = concat_rows(gathered, keys, pad_token_id)

    prompt_len = full["prompt_mask"].sum(1).numpy()
    completion_len = full["completion_mask"].sum(1).numpy()
    loads = group_workloads(prompt_len, completion_len, num_generations, quadratic_coef)
    groups_per_rank = [p["completion_ids"].shape[0] // num_generations for p in gathered]
    starts = [sum(groups_per_rank[:r]) for r in range(world_size)]
    unbalanced = [float(sum(loads[s : s + n])) for s, n in zip(starts, groups_per_rank)]

    assignment = balance_groups(loads, world_size, equal_count=True)
    balanced = [float(sum(loads[g] for g in groups)) for groups in assignment]
    mine = assignment[rank]
    rows = torch.tensor([g * num_generations + j for g in mine for j in range(num_generations)], dtype=torch.long)

    device = batch["completion_ids"].device
    out = dict(batch)
    for k in keys:
        out[k] = full[k].index_select(0, rows).to(device)
    return out, imbalance_metrics(balanced, unbalanced)


def split_by_token_budget(batch: Batch, num_micro_batches: int) -> list[Batch]:
    """``num_micro_batches`` micro-batches with balanced token counts (never empty: a rank too small for that many
    gets zero-weight copies, so it still runs the same number of forward/backward passes as the others). Row counts
    differ between micro-batches (and ranks); each records its real rows under ``BALANCED_ROWS`` so the loss can
    weight it like the equal-row micro-batches of the unbalanced step."""
    keys = per_sample_keys(batch)
    tokens = (batch["prompt_mask"].sum(1) + batch["completion_mask"].sum(1)).tolist()
    parts = balanced_micro_batches(tokens, num_micro_batches) if len(tokens) >= num_micro_batches else (
        [[i] for i in range(len(tokens))] + [[] for _ in range(num_micro_batches - len(tokens))]
    )
    out = []
    for idx in parts:
        micro = dict(batch)
        if idx:
            sel = torch.tensor(idx, dtype=torch.long, device=batch["completion_ids"].device)
            for k in keys:
                micro[k] = batch[k].index_select(0, sel)
        else:  # zero-weight filler: one sequence with its completion masked out and zero advantage
            for k in keys:
                micro[k] = batch[k][:1].clone()
            micro["completion_mask"] = torch.zeros_like(micro["completion_mask"])
            micro["advantages"] = torch.zeros_like(micro["advantages"])
        micro[BALANCED_ROWS] = len(idx)  # real rows (0 for a filler): the trainer reweights the loss by it
        out.append(micro)
    return out
