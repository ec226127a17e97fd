"""The recipe (:mod:`grpo.pipeline.recipe`) run in this process, stage by stage as plain calls: what every rank runs
under ``torchrun`` / ``accelerate launch``, and what tests and benchmarks run. ``grpo run`` and the Prefect UI run
the same recipe with Prefect subflows (``flows/pipeline.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from grpo.config import ExperimentConfig
from grpo.pipeline import stages
from grpo.pipeline.recipe import run_recipe
from grpo.pipeline.run_context import RunContext
from grpo.runs import RunDir
from grpo.tracking.tracker import MlflowTracker

__all__ = ["LocalStages", "run_experiment"]


class LocalStages:
    """Each stage as a direct call into :mod:`grpo.pipeline.stages` (prep, plan and the tiny policy through their
    caches)."""

    def started(self, run: RunDir, tracker: MlflowTracker | None) -> None:
        pass

    def prep(self, cfg: ExperimentConfig) -> dict[str, Any]:
        return stages.cached_prep(cfg)

    def plan(self, cfg: ExperimentConfig, data_dir: str, content_hash: str) -> dict[str, Any]:
        return stages.cached_plan(cfg, data_dir, content_hash)

    def policy(self, cfg: ExperimentConfig, data_dir: str, log: Callable[[str], None]) -> dict[str, Any]:
        return stages.cached_policy(cfg, data_dir, log=log)

    def evaluate(self, cfg: ExperimentConfig, model: str, data_dir: str, out_file: str, tag: str) -> dict[str, Any]:
        return stages.evaluate_model(cfg, model, data_dir, out_file)

    def train(self, cfg: ExperimentConfig, run: RunDir, data_dir: str, plan_path: str, resume: bool,
              context: RunContext, log: Callable[[str], None]) -> dict[str, Any]:
        callbacks = [*context.callbacks, *context.tracking_callbacks()]
        return stages.train_stage(cfg, run, data_dir, plan_path, resume, callbacks=callbacks, log=log)

    def finished(self, summary: dict[str, Any]) -> None:
        pass


def run_experiment(cfg: ExperimentConfig, run: RunDir, resume: bool = False, log: Callable[[str], None] = print,
                   callbacks: Sequence[Any] = ()) -> dict[str, Any] | None:
    """Run every stage into ``run`` and return the summary (rank 0; other ranks return None); ``callbacks`` are
    extra trainer callbacks."""
    return run_recipe(cfg, run, LocalStages(), context=RunContext(callbacks=list(callbacks)), resume=resume, log=log)
