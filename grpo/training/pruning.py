"""A sweep trial's pruning hook on the trainer: the pruner sees the trial's metric at every logging step and may stop
its training there. Optuna-free: the sweep (:mod:`grpo.pipeline.sweep`) gives it ``report``, which tells the trial
and asks its pruner."""

from __future__ import annotations

from collections.abc import Callable

from transformers import TrainerCallback


class ReportIntermediate(TrainerCallback):
    """At every logging step, ``report(step, value)`` gets the logged ``metric``; when it answers True (prune),
    training stops at the end of this step as if it had reached ``max_steps`` (the run then saves its model,
    evaluates and ends as usual). ``stopped_at`` is that step."""

    def __init__(self, metric: str, report: Callable[[int, float], bool]) -> None:
        self.metric, self.report = metric, report
        self.stopped_at: int | None = None

    def on_log(self, args, state, control, logs=None, **kwargs):
        value = (logs or {}).get(self.metric)
        if (self.stopped_at is None and state.is_world_process_zero and isinstance(value, (int, float))
                and not isinstance(value, bool) and value == value and abs(value) != float("inf")):
            if self.report(state.global_step, float(value)):
                self.stopped_at = state.global_step
                control.should_training_stop = True
        return control
