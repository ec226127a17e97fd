"""Streaming partial-batch scoring (``async.streaming_partial_batch``, ``async.streaming_min_groups``).

TRL scores a generation batch after its log-prob passes (old and reference log-probs), so reward time adds to the
step. Here the batch is cut into chunks of ``streaming_min_groups`` whole prompt groups as soon as its completions
exist; a background thread scores chunk after chunk (in the reward worker pool when ``reward_num_workers > 1``,
otherwise in-process) while the trainer runs the log-prob passes. Advantages are computed only after every chunk
is back, over the whole batch, so ``scale_rewards: batch`` still uses whole-batch statistics.

Only the scoring is off the main thread: nothing here touches torch.distributed (the trainer gathers afterwards).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from grpo.rewards.pool import score_rewards

ChunkScorer = Callable[[int, int], list[list[float]]]


def chunk_bounds(n: int, group_size: int, min_groups: int) -> list[tuple[int, int]]:
    """Sample ranges of ``min_groups`` whole groups each (the last chunk may hold fewer)."""
    if group_size < 1 or n % group_size:
        raise ValueError(f"{n} completions do not split into groups of {group_size}")
    if min_groups < 1:
        raise ValueError(f"streaming_min_groups must be >= 1, got {min_groups}")
    step = group_size * min_groups
    return [(lo, min(lo + step, n)) for lo in range(0, n, step)]


def score_in_process(
    funcs: Sequence[Callable], prompts: Sequence, completions: Sequence, completion_ids: Sequence,
    columns: dict[str, Sequence], extra_kwargs: dict[str, Any],
) -> list[list[float]]:
    """Rows (samples) x columns (reward functions), scored in this process by the reward pool's own routine.
    Exceptions propagate, as in TRL's own scoring: the trainer re-raises them on the main thread."""
    kwargs = {"prompts": list(prompts), "completions": list(completions), "completion_ids": list(completion_ids),
              **{k: list(v) for k, v in columns.items()}, **extra_kwargs}
    values, _, loop = score_rewards(funcs, kwargs, raise_errors=True)
    if loop is not None:
        loop.close()
    return [list(row) for row in zip(*values)]


class StreamingScorer:
    """Scores ``chunks`` one after another in a daemon thread; :meth:`result` waits for all and returns the rows
    (samples x reward functions) in order. An exception in a chunk is re-raised by :meth:`result`."""

    def __init__(self, score_chunk: ChunkScorer, chunks: list[tuple[int, int]]) -> None:
        self._score_chunk = score_chunk
        self.chunks = chunks
        self._rows: dict[tuple[int, int], list[list[float]]] = {}
        self._error: BaseException | None = None
        self._busy_s = 0.0
        self._thread = threading.Thread(target=self._run, daemon=True, name="streaming-rewards")
        self._thread.start()

    def _run(self) -> None:
        start = time.perf_counter()
        try:
            for lo, hi in self.chunks:
                self._rows[(lo, hi)] = self._score_chunk(lo, hi)
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread
            self._error = exc
        finally:
            self._busy_s = time.perf_counter() - start

    def result(self) -> tuple[list[list[float]], dict[str, float]]:
        """All rows, and the metrics ``streaming/chunks``, ``streaming/reward_s`` (scoring time) and
        ``streaming/reward_wait_s`` (how long the trainer still waited for rewards after its log-prob passes)."""
        waited = time.perf_counter()
        self._thread.join()
        waited = time.perf_counter() - waited
        if self._error is not None:
            raise self._error
        rows = [row for bounds in self.chunks for row in self._rows[bounds]]
        return rows, {"streaming/chunks": float(len(self.chunks)), "streaming/reward_s": self._busy_s,
                      "streaming/reward_wait_s": waited}
