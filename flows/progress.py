"""Training progress in the Prefect UI: a trainer callback keeping a progress artifact on the train subflow's run and
on the pipeline's own run.

Its own module because it subclasses ``transformers.TrainerCallback``: :mod:`flows.pipeline` imports it when the
train subflow runs, so importing the flows (``grpo serve``, ``grpo deploy``) imports no transformers.
"""

from __future__ import annotations

import time

from prefect.artifacts import ProgressArtifact, create_progress_artifact, update_progress_artifact
from transformers import TrainerCallback


class PrefectProgress(TrainerCallback):
    """Keeps a Prefect progress artifact at the fraction of optimizer steps done, on the train subflow's run and on
    the pipeline's own run (``parent_flow_run_id``: where a person looks first); its description says the step, the
    last logged reward and the accuracy before training (``eval_before``), e.g.
    ``step 20/150 · reward 0.412 ±0.31 · eval accuracy before 0.725``.

    The Trainer calls ``on_step_end`` before ``on_log`` for the same step, so the artifact is updated after the log
    too: a logging step's description carries that step's reward, not the previous one's.

    Between logging steps the artifact is updated at most every ``min_interval_s`` seconds: each update is a
    synchronous API call (about 11 ms of the training loop and 10 ms of the server's CPU), and a step of the tiny
    preset takes about 0.1 s, so one per step (two artifacts) slowed training by a fifth while the UI shows a change
    every few seconds. A logging step, the last step and the end of training (a signal's checkpoint included) are
    always written, so what the page ends on does not depend on timing."""

    def __init__(self, eval_before: dict | None = None, parent_flow_run_id: str | None = None,
                 min_interval_s: float = 2.0) -> None:
        self.artifact_ids: list = []
        self.before = eval_before
        self.parent = parent_flow_run_id
        self.logged: dict = {}
        self.min_interval_s = min_interval_s
        self._last_update = float("-inf")

    def describe(self, step: int, max_steps: int) -> str:
        parts = [f"step {step}/{max_steps}"]
        if isinstance(self.logged.get("reward"), (int, float)):
            std = self.logged.get("reward_std")
            parts.append(f"reward {self.logged['reward']:.3f}"
                         + (f" ±{std:.2f}" if isinstance(std, (int, float)) else ""))
        if self.before and self.before.get("accuracy") is not None:
            parts.append(f"eval accuracy before {self.before['accuracy']:.3f}")
        return " · ".join(parts)

    @staticmethod
    def _progress(state) -> float:
        return 100.0 * state.global_step / state.max_steps if state.max_steps else 0.0

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            description = self.describe(state.global_step, state.max_steps)
            self.artifact_ids = [create_progress_artifact(progress=self._progress(state), key="training-progress",
                                                          description=description)]
            if self.parent:
                self.artifact_ids.append(ProgressArtifact(
                    progress=self._progress(state), key="run-training-progress", description=description,
                    flow_run_id=self.parent).create().id)

    def _update(self, state, always: bool = True) -> None:
        now = time.monotonic()
        if not state.max_steps or (not always and now - self._last_update < self.min_interval_s):
            return
        self._last_update = now
        for artifact_id in self.artifact_ids:
            update_progress_artifact(artifact_id, progress=self._progress(state),
                                     description=self.describe(state.global_step, state.max_steps))

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs:
            self.logged.update({k: v for k, v in logs.items() if k in ("reward", "reward_std")})
            self._update(state)

    def on_step_end(self, args, state, control, **kwargs):
        self._update(state, always=state.global_step >= state.max_steps)

    def on_train_end(self, args, state, control, **kwargs):
        self._update(state)


__all__ = ["PrefectProgress"]
