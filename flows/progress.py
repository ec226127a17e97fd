"""Training progress in the Prefect UI: a trainer callback keeping a progress artifact on the train subflow's run and
on the pipeline's own run.

Its own module because it subclasses ``transformers.TrainerCallback``: :mod:`flows.pipeline` imports it when the
train subflow runs, so importing the flows (``grpo serve``, ``grpo deploy``) imports no transformers.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from prefect.artifacts import ProgressArtifact, create_progress_artifact, update_progress_artifact
from transformers import TrainerCallback

from grpo.training.pace import Pace


def _skipped(err: Exception) -> None:
    """A progress update the Prefect server did not take: training goes on (the page is a view of it, and the
    server's outage is not the run's), one warning says why."""
    logging.getLogger(__name__).warning(f"progress artifact not updated ({type(err).__name__}: {err}); "
                                        "training goes on")


class PrefectProgress(TrainerCallback):
    """Keeps a Prefect progress artifact at the fraction of optimizer steps done, on the train subflow's run and on
    the pipeline's own run (``parent_flow_run_id``: where a person looks first); its description says the step, the
    last logged reward, the accuracy before training (``eval_before``) and the time left, e.g.
    ``step 20/150 · reward 0.412 ±0.31 · eval accuracy before 0.725 · ETA 3m20s (130 steps left)``: the time left at
    the pace of the steps since training started here, a resumed run's since its checkpoint
    (:class:`~grpo.training.pace.Pace`, as the console line).

    The Trainer calls ``on_step_end`` before ``on_log`` for the same step, so the artifact is updated after the log
    too: a logging step's description carries that step's reward, not the previous one's.

    Between logging steps the artifact is updated at most every ``min_interval_s`` seconds: each update is a
    synchronous API call (about 11 ms of the training loop and 10 ms of the server's CPU), and a step of the tiny
    preset takes about 0.1 s, so one per step (two artifacts) slowed training by a fifth while the UI shows a change
    every few seconds. A logging step, the last step and the end of training (a signal's checkpoint included) are
    always written, so what the page ends on does not depend on timing."""

    def __init__(self, eval_before: dict | None = None, parent_flow_run_id: str | None = None,
                 min_interval_s: float = 2.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.artifacts = RunProgress("training-progress", parent_flow_run_id)
        self.before = eval_before
        self.logged: dict = {}
        self.min_interval_s = min_interval_s
        self.clock = clock
        self.pace: Pace | None = None
        self._last_update = float("-inf")

    def describe(self, step: int, max_steps: int) -> str:
        parts = [f"step {step}/{max_steps}"]
        if isinstance(self.logged.get("reward"), (int, float)):
            std = self.logged.get("reward_std")
            parts.append(f"reward {self.logged['reward']:.3f}"
                         + (f" ±{std:.2f}" if isinstance(std, (int, float)) else ""))
        if self.before and self.before.get("accuracy") is not None:
            parts.append(f"eval accuracy before {self.before['accuracy']:.3f}")
        eta = self.pace.eta(step, max_steps) if self.pace is not None else None
        if eta is not None:
            parts.append(eta)
        return " · ".join(parts)

    @property
    def artifact_ids(self) -> list:
        return self.artifacts.artifact_ids

    @staticmethod
    def _progress(state) -> float:
        return 100.0 * state.global_step / state.max_steps if state.max_steps else 0.0

    def on_train_begin(self, args, state, control, **kwargs):
        self.pace = Pace(state.global_step, self.clock)
        if state.is_world_process_zero:  # the other ranks keep none: their updates below do nothing
            self.artifacts(self._progress(state), self.describe(state.global_step, state.max_steps))

    def _update(self, state, always: bool = True) -> None:
        now = self.clock()
        if not self.artifact_ids or not state.max_steps or (not always
                                                            and now - self._last_update < self.min_interval_s):
            return
        self._last_update = now
        self.artifacts(self._progress(state), self.describe(state.global_step, state.max_steps))

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs:
            self.logged.update({k: v for k, v in logs.items() if k in ("reward", "reward_std")})
            self._update(state)

    def on_step_end(self, args, state, control, **kwargs):
        self._update(state, always=state.global_step >= state.max_steps)

    def on_train_end(self, args, state, control, **kwargs):
        self._update(state)


class RunProgress:
    """A progress artifact on this flow run (``key``) and the same on the pipeline's run (``run-<key>``, given its
    ``parent_flow_run_id``: where a person looks first), created at the first call and updated at each one after: the
    ``policy`` stage's warm start reports through it (:class:`grpo.training.warm_start.WarmStartProgress`, a line at
    each tenth of its steps), and :class:`PrefectProgress` keeps training's. An update the server does not take is a
    warning (the server down or its database restarting: the next update catches up), never a failed stage."""

    def __init__(self, key: str, parent_flow_run_id: str | None = None) -> None:
        self.key, self.parent = key, parent_flow_run_id
        self.artifact_ids: list = []

    def __call__(self, progress: float, description: str) -> None:
        if self.artifact_ids:
            for artifact_id in self.artifact_ids:
                try:
                    update_progress_artifact(artifact_id, progress=progress, description=description)
                except Exception as err:  # see the class docstring
                    _skipped(err)
            return
        self.artifact_ids = [create_progress_artifact(progress=progress, key=self.key, description=description)]
        if self.parent:
            self.artifact_ids.append(ProgressArtifact(progress=progress, key=f"run-{self.key}", description=description,
                                                      flow_run_id=self.parent).create().id)


__all__ = ["PrefectProgress", "RunProgress"]
