"""Rewards for the determinism tests (#28), at module level so reward worker processes import them by name.

``completion_length`` differs within nearly every group of the micro run, so every step has non-zero advantages and
moves the policy (a run whose policy never moves can not show that a schedule or an order is wrong).
``completion_length_slow_worker`` is the same reward with one worker process made slow on purpose: with
``$SLOW_REWARD_DIR`` set, the reward pool's first worker (the earliest started of the trainer's spawned workers: the
one that always gets the batch's first shard) waits, for each shard it scores, until the other worker has finished
its shard of the same batch (a marker file), so the first shard always arrives last -- forced, not left to timing.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from grpo.rewards import register_reward

_SLOW: bool | None = None  # whether this process is the slowed one (decided on its first call)
_CALLS = 0  # calls scored by this process: the n-th call of each worker belongs to the same pool batch


def _length(completions) -> list[float]:
    return [float(len(c if isinstance(c, str) else c[-1]["content"])) for c in completions]


@register_reward("completion_length")
def completion_length(completions, **kwargs) -> list[float]:
    return _length(completions)


def _is_the_slow_process() -> bool:
    """Whether this process is the earliest started of its parent's spawned children (the pool starts its workers in
    order, and worker 0 gets shard 0)."""
    global _SLOW
    if _SLOW is None:
        import psutil

        workers = [p for p in psutil.Process(os.getppid()).children() if "spawn_main" in " ".join(p.cmdline())]
        _SLOW = min(workers, key=lambda p: (p.create_time(), p.pid)).pid == os.getpid()
    return _SLOW


@register_reward("completion_length_slow_worker")
def completion_length_slow_worker(completions, **kwargs) -> list[float]:
    """``completion_length``; with ``$SLOW_REWARD_DIR``, use with two workers and batches of two shards or more."""
    global _CALLS
    values = _length(completions)
    directory = os.environ.get("SLOW_REWARD_DIR")
    if not directory:
        return values
    directory = Path(directory)
    _CALLS += 1
    if _is_the_slow_process():
        other = directory / f"done-{_CALLS}"
        deadline = time.monotonic() + 120
        while not other.exists():  # the other worker's shard of this batch is scored first
            if time.monotonic() > deadline:
                raise TimeoutError(f"no other reward worker finished its shard of batch {_CALLS}")
            time.sleep(0.01)
        (directory / f"slow-done-{_CALLS}").write_text(str(os.getpid()))
    else:
        (directory / f"done-{_CALLS}").touch()
    return values
