"""Shared fixtures. Tests run offline: HF_HUB_OFFLINE is set, and the tiny model cache lives in a temp dir."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

# Tests send Ctrl-C (SIGINT) to the processes they start. A shell starting pytest in the background (`make test &`,
# some CI runners) leaves SIGINT ignored, and an ignored signal stays ignored in every child: Ctrl-C would never
# reach them. Children of a process with a handler start with the default action.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# `make test` runs the suite on pytest-xdist workers side by side (2 cores here). Torch's OpenMP threads per worker
# (and per child process: the environment is inherited) would then outnumber the cores, and spinning OpenMP threads
# on an oversubscribed machine made an in-process training test 10x slower. One thread each.
if os.environ.get("PYTEST_XDIST_WORKER"):
    for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(_var, "1")

REPO = Path(__file__).resolve().parent.parent

# `make test` hands whole modules to the xdist workers (--dist loadfile), those with the most tests first (xdist's
# loadscope reorder), each to the first worker running low. These few-test modules take minutes on one worker, most
# of it waiting on a served deployment, a browser or a cron minute: handed out last, each ran alone at the end of the
# suite (the one-test schedule module for its last ~150 s). Handed out first, their waits overlap the CPU-bound
# modules. Only these: handing out every long module first ran all the server and browser modules at once and made
# the suite longer; handing out the signals module with them (it ends the suite alone for its last 30-60 s) put three
# modules' flow runs on the shared server at once, and an in-process sweep's flow run met its 503s for 2.5 minutes.
# The team workers' module (~10 minutes on one worker, its own servers, most of it waiting for a dead worker's run to
# be marked Crashed or for its held runs) goes first of all.
HANDED_OUT_FIRST = ("tests/test_team_workers.py", "tests/test_ui_runs.py", "tests/test_ui_schedule.py")


@pytest.hookimpl(optionalhook=True)  # xdist's hook: a run with `-p no:xdist` does not know it
def pytest_xdist_make_scheduler(config, log):
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class LongWaitingModulesFirst(LoadFileScheduling):
        def _assign_work_unit(self, node):
            for scope in reversed(HANDED_OUT_FIRST):
                if scope in self.workqueue:
                    self.workqueue.move_to_end(scope, last=False)
            super()._assign_work_unit(node)

    return LongWaitingModulesFirst(config, log)

# Real servers shared by the whole session (tests/servers.py): the ``mlflow_server`` fixture.
pytest_plugins = ["tests.servers"]


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache(tmp_path_factory):
    """One artefact cache per test session, so tests never reuse a developer's cache; shared by the session's xdist
    workers (each entry is built under its lock, grpo.paths.locked), so a warm-started model is built once per
    session, not once per worker. A test that must build its own sets GRPO_CACHE_DIR to a folder of its own."""
    if os.environ.get("PYTEST_XDIST_WORKER"):  # the workers' base folders share the session's
        cache = tmp_path_factory.getbasetemp().parent / "grpo-cache"
        cache.mkdir(exist_ok=True)
    else:
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


# A reward that records which prompts each call scored, for tests that check who trains on what. Passed to runs with
# ``--reward-module`` (so subprocesses and torchrun ranks load it); each call appends one JSON line to $PROMPT_LOG.
PROMPT_RECORDER = """
import json, os
from grpo.rewards import register_reward, exact_match

@register_reward("exact_match_recorded")
def exact_match_recorded(prompts, completions, answer, **kwargs):
    with open(os.environ["PROMPT_LOG"], "a") as f:
        f.write(json.dumps({"rank": int(os.environ.get("RANK", 0)), "prompts": list(prompts)}) + "\\n")
    return exact_match(completions, answer)
"""


def write_prompt_recorder(directory: Path) -> Path:
    """Write the recorder module into ``directory``; use ``grpo.reward_funcs=[exact_match_recorded]``."""
    module = Path(directory) / "prompt_recorder.py"
    module.write_text(PROMPT_RECORDER)
    return module


def recorded_calls(log: Path) -> list[dict]:
    """The recorder's calls in order: ``{"rank": int, "prompts": [...]}`` each."""
    import json

    return [json.loads(line) for line in Path(log).read_text().splitlines()]
