"""Where the platform keeps what belongs to no single run: the cache root.

Below every layer (it imports nothing from ``grpo``): the training layer caches the warm-started tiny model there and
the pipeline its prepared data and sampler plans (:mod:`grpo.pipeline.cache_dirs`), and training never imports the
pipeline (tests/test_layers.py).
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """``$GRPO_CACHE_DIR`` or ``.cache/grpo`` in the working directory (the project folder)."""
    return Path(os.environ.get("GRPO_CACHE_DIR", ".cache/grpo"))
