"""Sizes of a benchmark run: the full default, a tiny one for ``--smoke``, and a ``BENCH_*`` variable over both."""

from __future__ import annotations

import os


def size(name: str, full, smoke_value, smoke: bool):
    """``$name`` when set (converted to the type of ``full``), else ``smoke_value`` in smoke mode, else ``full``."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return smoke_value if smoke else full
    if isinstance(full, bool):
        return raw not in ("0", "false", "False", "no")
    return type(full)(raw)


# Smoke runs of the default task (the tiny preset): a short warm start, 8 prompts x 8 completions per step instead of
# 32 x 8, a small eval set. The same for every benchmark, so one test session builds the warm start once (its cache key
# covers the warm-start settings).
TINY_SMOKE_OVERRIDES = ["model.warm_start.steps=40", "grpo.per_device_train_batch_size=64", "evaluation.num_prompts=32"]
