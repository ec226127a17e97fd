"""How fast training goes and how long is left: one reckoning for the console's progress line
(:class:`grpo.training.train.ConsoleProgress`) and the Prefect UI's progress artifact (``flows/progress.py``).

Both count from the step this training started at: 0 for a new run, the checkpoint's step for a resumed one. The steps
before a resume ran in an earlier process, whose time this one never saw; counting them as done in this process's time
makes a step look many times faster than it is, and the time left many times shorter.
"""

from __future__ import annotations

import time
from typing import Callable

from grpo.formatting import count


class Pace:
    """Seconds per optimizer step over the steps this training has run, and the time the steps left take at that pace.
    ``clock`` is read when training starts and at each question (``time.monotonic``; a test gives its own)."""

    def __init__(self, step: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.started_step = step
        self.started_at = clock()

    def seconds_per_step(self, step: int) -> float | None:
        """None until a step of this training has ended."""
        if step <= self.started_step:
            return None
        return (self.clock() - self.started_at) / (step - self.started_step)

    def eta(self, step: int, max_steps: int, per_step: float | None = None) -> str | None:
        """``ETA 3m20s (100 steps left)``: None until a step of this training has ended, or when none is left.
        ``per_step``: :meth:`seconds_per_step` when the caller has it already (one clock reading per line)."""
        per_step = self.seconds_per_step(step) if per_step is None else per_step
        if per_step is None or max_steps <= step:
            return None
        left = max_steps - step
        return f"ETA {duration(per_step * left)} ({count(left, 'step')} left)"


def duration(seconds: float) -> str:
    """``45s``, ``3m20s``."""
    seconds = int(round(seconds))
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"
