"""A config's sampler plan: where the config meets :mod:`grpo.algo.plan`, which takes plain numbers.

The config derives its batch layout (:attr:`grpo.config.ExperimentConfig.batch_layout`); the plan's spec is that
layout plus the run's length (``grpo.max_steps``), its order (``grpo.seed``, ``sampling.shuffle``,
``sampling.drop_last``) and its balancing settings (``sampling.seqlen_balancing``, ``balance_quadratic_coef``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from grpo.algo.plan import PlanSpec, PlanSummary, write_plan
from grpo.config import ExperimentConfig

__all__ = ["build_plan", "default_plan_dir", "plan_spec"]


def plan_spec(cfg: ExperimentConfig) -> PlanSpec:
    """Batch arithmetic of ``cfg``; a ConfigError naming the fields when it cannot work with the SP sampler."""
    g, s = cfg.grpo, cfg.sampling
    return PlanSpec.from_layout(cfg.batch_layout, max_steps=g.max_steps, seed=g.seed, shuffle=s.shuffle,
                                drop_last=s.drop_last, seqlen_balancing=s.seqlen_balancing,
                                balance_quadratic_coef=s.balance_quadratic_coef)


def build_plan(
    cfg: ExperimentConfig, prompt_lengths: Sequence[int] | np.ndarray, out_dir: Path, overwrite: bool = False
) -> PlanSummary:
    """Validate ``cfg`` against the dataset, then write its plan (:func:`grpo.algo.plan.write_plan`)."""
    return write_plan(plan_spec(cfg), prompt_lengths, out_dir, overwrite=overwrite)


def default_plan_dir(cfg: ExperimentConfig) -> Path:
    return Path(cfg.output_dir) / "plans" / cfg.name
