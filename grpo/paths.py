"""Where the platform keeps what belongs to no single run: the cache root, and the lock its entries are built under.

Below every layer (it imports nothing from ``grpo``): the training layer caches the warm-started tiny model there and
the pipeline its prepared data and sampler plans (:mod:`grpo.pipeline.cache_dirs`), and training never imports the
pipeline (tests/test_layers.py).
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def cache_root() -> Path:
    """``$GRPO_CACHE_DIR`` or ``.cache/grpo`` in the working directory (the project folder)."""
    return Path(os.environ.get("GRPO_CACHE_DIR", ".cache/grpo"))


@contextmanager
def locked(entry: Path) -> Iterator[None]:
    """Hold an exclusive lock on a cache entry (a sibling ``.lock`` file) across processes, so two runs that need the
    same cached output (parallel tests, sweep trials, ranks) compute it once and never read it half-written."""
    lock_file = entry.with_name(entry.name + ".lock")
    lock_file.parent.mkdir(parents=True, exist_ok=True)
    with lock_file.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
