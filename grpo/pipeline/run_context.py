"""The live objects a run needs besides its config: one typed context, made by whoever starts the run.

A run's config and paths travel as JSON (Prefect flow parameters, ``summary.json``); a few things cannot: the MLflow
tracker the recipe started, trainer callbacks added by the run's starter (a sweep's pruning hook), and the list of
Prefect flow runs started on the starter's behalf (``grpo run`` / ``grpo sweep`` cancel them on Ctrl-C or SIGTERM).
:class:`RunContext` holds them. Who owns what:

* the starter creates it (the CLI, a sweep for each trial, :func:`grpo.pipeline.experiment.run_experiment`; a flow run
  nobody in this process started, such as a served deployment's, makes its own) and passes it to the recipe;
* :func:`grpo.pipeline.recipe.run_recipe` sets ``tracker`` for as long as it runs (it starts and closes it);
* the flows append their flow-run ids to ``flow_runs``; a sweep's trials share their sweep's list.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:  # the tracker imports MLflow and transformers: `grpo serve` imports this module without them
    from grpo.tracking.tracker import MlflowTracker


@dataclass(eq=False)
class RunContext:
    """See the module docstring.

    Where a Prefect flow starts a run's next part in this process (``grpo run`` -> the ``grpo-pipeline`` flow, a
    sweep's trial -> its pipeline subflow, the pipeline -> its ``grpo-train`` subflow), the context cannot be an
    argument: a flow's parameters are its deployment's run form and Prefect records them as JSON, so a live tracker or
    callback there would change the deployments' parameter schemas and be turned into text. For these hand-offs, and
    only these, the starter registers the context under the run directory (:meth:`registered`) for the duration of
    the call and the flow looks it up by its own run directory (:meth:`for_run_dir`), which every such flow gets as
    a parameter anyway. The registry is this class's one process-global table; everything else passes the context.
    """

    callbacks: list[Any] = field(default_factory=list)
    """Extra trainer callbacks (``transformers.TrainerCallback``) for this run's training: a sweep's pruning hook."""
    flow_runs: list[str] = field(default_factory=list)
    """Ids of the Prefect flow runs started for this context's owner (the CLI cancels them when stopped)."""
    tracker: MlflowTracker | None = None
    """The run's MLflow tracker while :func:`grpo.pipeline.recipe.run_recipe` runs (rank 0, tracking on)."""

    _registry: ClassVar[dict[str, RunContext]] = {}
    _registry_lock: ClassVar[threading.Lock] = threading.Lock()

    def for_trial(self, callbacks: list[Any] | None = None) -> RunContext:
        """The context of a run started on this one's behalf (a sweep's trial): its own callbacks and tracker, the
        same flow-run list, so the CLI that started the sweep also cancels the trials' flow runs."""
        return RunContext(callbacks=list(callbacks or []), flow_runs=self.flow_runs)

    def tracking_callbacks(self) -> list[Any]:
        """The trainer callback that logs training to this run's MLflow run (none without a tracker)."""
        from grpo.tracking.tracker import MlflowCallback

        return [MlflowCallback(self.tracker)] if self.tracker is not None else []

    @contextmanager
    def registered(self, run_dir: str | Path) -> Iterator[RunContext]:
        """Make this context the one :meth:`for_run_dir` finds for ``run_dir`` during the block (the one before it,
        if any, again afterwards)."""
        key = _key(run_dir)
        with self._registry_lock:
            before = self._registry.get(key)
            self._registry[key] = self
        try:
            yield self
        finally:
            with self._registry_lock:
                if before is None:
                    self._registry.pop(key, None)
                else:
                    self._registry[key] = before

    @classmethod
    def for_run_dir(cls, run_dir: str | Path) -> RunContext:
        """The context registered for ``run_dir``, or a new one when nobody in this process registered one (a flow run
        started by a Prefect worker or a served deployment: it owns its context itself)."""
        with cls._registry_lock:
            found = cls._registry.get(_key(run_dir))
        return found if found is not None else cls()


def _key(run_dir: str | Path) -> str:
    return str(Path(run_dir).resolve())
