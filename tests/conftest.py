"""Shared fixtures. Tests run offline: HF_HUB_OFFLINE is set, and the tiny model cache lives in a temp dir."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

REPO = Path(__file__).resolve().parent.parent

# Real servers shared by the whole session (tests/servers.py): the ``mlflow_server`` fixture.
pytest_plugins = ["tests.servers"]


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache(tmp_path_factory):
    """One artefact cache per test session, so tests never reuse a developer's cache (or each other's by accident)."""
    cache = tmp_path_factory.mktemp("grpo-cache")
    old = os.environ.get("GRPO_CACHE_DIR")
    os.environ["GRPO_CACHE_DIR"] = str(cache)
    yield cache
    if old is None:
        os.environ.pop("GRPO_CACHE_DIR", None)
    else:
        os.environ["GRPO_CACHE_DIR"] = old


MICRO = REPO / "tests" / "micro.yaml"


def micro_overrides(output_dir: Path, **extra: object) -> list[str]:
    """--set overrides on top of tests/micro.yaml (use with ``load_config(MICRO, ...)`` / ``--config MICRO``)."""
    base = {"output_dir": str(output_dir), **extra}
    return [f"{k}={v}" for k, v in base.items()]
