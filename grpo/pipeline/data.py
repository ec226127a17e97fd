"""The one data reader: the rows every caller trains, plans and evaluates on.

Reading a source (the synthetic task, a local file, a hub dataset), validating it, quarantining bad rows and wrapping
chat prompts happen once, in the prep stage (:mod:`grpo.pipeline.prep`). :func:`load_data` returns that stage's output
for a config: prepared once into its content-addressed cache directory (:func:`grpo.pipeline.cache_dirs.prep_dir_for`,
the one the Prefect pipeline uses too) and reused after. So ``grpo plan``, ``grpo run``, tests and benchmarks all see
the same ``DatasetDict`` with ``train`` and ``eval`` splits, the columns ``prompt`` and ``answer`` (plus the source's
other columns), in the same order; a source that cannot be read fails with a :class:`DataError` naming it.
"""

from __future__ import annotations

from pathlib import Path

from datasets import DatasetDict

from grpo.config import ExperimentConfig
from grpo.pipeline.prep import load_prepared


def load_data(cfg: ExperimentConfig) -> DatasetDict:
    """The prepared ``train`` and ``eval`` splits for ``cfg``: the prep stage's output in its cache directory
    (:func:`grpo.pipeline.stages.cached_prep`, which ``grpo run`` and ``grpo plan`` use too), prepared first if it is
    not there yet. The content hash is checked, so a prepared directory edited since is refused, not read."""
    # lazy: grpo.pipeline.stages imports grpo.training.policy, which imports this module
    from grpo.pipeline.stages import cached_prep

    return load_prepared(Path(cached_prep(cfg)["data_dir"]))
