"""Supervised warm start: a few hundred steps of next-token training on (prompt, answer) pairs.

GRPO only learns from groups whose completions differ in reward. A randomly initialised policy almost never
produces a correct answer, so every group would score zero; the warm start lifts it to a success rate where
group-relative advantages carry signal.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase


def supervised_warm_start(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str],
    answers: list[str],
    steps: int,
    batch_size: int,
    learning_rate: float,
    seed: int,
    on_step: Callable[[int, float], None] | None = None,
) -> list[float]:
    """Train on ``prompt + answer + eos`` with the loss on answer tokens only; returns the loss curve."""
    if steps <= 0:
        return []
    gen = torch.Generator().manual_seed(seed)
    encoded_prompts = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    encoded_answers = tokenizer(answers, add_special_tokens=False)["input_ids"]
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / max(1, steps // 10)) * 0.5 * (1 + math.cos(math.pi * s / steps))
    )
    model.train()
    losses: list[float] = []
    n = len(prompts)
    for step in range(steps):
        idx = torch.randint(n, (batch_size,), generator=gen).tolist()
        seqs = [encoded_prompts[i] + encoded_answers[i] + [eos] for i in idx]
        width = max(map(len, seqs))
        input_ids = torch.full((batch_size, width), pad)
        labels = torch.full((batch_size, width), -100)
        attention = torch.zeros((batch_size, width), dtype=torch.long)
        for row, (i, seq) in enumerate(zip(idx, seqs)):
            input_ids[row, : len(seq)] = torch.tensor(seq)
            attention[row, : len(seq)] = 1
            start = len(encoded_prompts[i])
            labels[row, start : len(seq)] = torch.tensor(seq[start:])
        loss = model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if on_step is not None:
            on_step(step, losses[-1])
    model.eval()
    return losses
