"""RewardWorkerPool: values equal in-process scoring, functions ship once, and raising, hanging or dying rewards cost
NaN for their shard only — the pool replaces the worker and the next batch is whole again."""

from __future__ import annotations

import asyncio
import functools
import math
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path

import psutil
import pytest

from grpo.rewards import exact_match, load_reward_module
from grpo.rewards.pool import RewardWorkerPool

# ----- reward functions: module level, so spawned workers import them by name ------------------------------------


def length_reward(completions, **kwargs):
    return [float(len(c)) for c in completions]


def maybe_none(completions, **kwargs):
    """None ("not applicable") for empty completions, as TRL allows."""
    return [None if c == "" else 1.0 for c in completions]


async def async_reward(completions, answer, **kwargs):
    await asyncio.sleep(0.01)
    return [float(c == a) * 2.0 for c, a in zip(completions, answer)]


def pid_reward(completions, **kwargs):
    return [float(os.getpid())] * len(completions)


def trouble(completions, **kwargs):
    """Misbehaves on marker completions: raise, hang far past any test timeout, or kill its own process."""
    if "raise" in completions:
        raise RuntimeError("reward bug")
    if "hang" in completions:
        time.sleep(600)
    if "exit" in completions:
        os._exit(3)
    if "slow" in completions:
        time.sleep(1.0)
    return [0.5] * len(completions)


UNPICKLED = 0  # in a worker: how often CountingReward was unpickled in that process
PICKLED = 0  # in the test process: how often it was pickled


def _load_counting() -> CountingReward:
    global UNPICKLED
    UNPICKLED += 1
    return CountingReward()


class CountingReward:
    """Returns, per sample, how many times its worker unpickled it: 1.0 iff functions were sent once."""

    __name__ = "counting"

    def __reduce__(self):
        global PICKLED
        PICKLED += 1
        return (_load_counting, ())

    def __call__(self, completions, **kwargs):
        return [float(UNPICKLED)] * len(completions)


def _refuse_to_load():
    raise ImportError("this reward's dependencies are missing in the worker")


class UnloadableReward:
    """Pickles fine here, fails to unpickle in a worker (like a module the workers can't import)."""

    def __reduce__(self):
        return (_refuse_to_load, ())

    def __call__(self, completions, **kwargs):
        return [0.0] * len(completions)


def _batch(completions, **columns):
    n = len(completions)
    return {"prompts": [f"p{i}" for i in range(n)], "completions": list(completions),
            "completion_ids": [[i] for i in range(n)], "columns": columns}


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# ----- tests ------------------------------------------------------------------------------------------------------


def test_values_match_in_process_scoring_and_shards_keep_groups_whole():
    completions = ["7", "", "12", "x", "7", "abc"] * 4  # 24 samples = 6 groups of 4
    answers = ["7"] * 24
    funcs = [length_reward, maybe_none, async_reward, exact_match, pid_reward]
    with RewardWorkerPool(funcs, num_workers=3, timeout=10) as pool:
        rows = pool.compute(**_batch(completions, answer=answers), group_size=4)
        assert pool.metrics["rewards/errors"] == 0 and pool.metrics["rewards/worker_restarts"] == 0
        worker_pids = set(pool.worker_pids)
    assert len(rows) == 24 and all(len(r) == 5 for r in rows)
    for row, c in zip(rows, completions):
        assert row[0] == len(c)
        assert math.isnan(row[1]) if c == "" else row[1] == 1.0
        assert row[2] == (2.0 if c == "7" else 0.0)
        assert row[3] == float(c == "7")
    pids = [r[4] for r in rows]
    assert {int(p) for p in pids} == worker_pids  # all three workers scored a shard
    assert all(len(set(pids[g : g + 4])) == 1 for g in range(0, 24, 4))  # no group split across workers
    assert sum(a != b for a, b in zip(pids, pids[1:])) == 2  # three contiguous shards


def test_unpicklable_reward_functions_are_rejected_at_start():
    def local_reward(completions, **kwargs):
        return [0.0] * len(completions)

    for fn, why in [(lambda completions, **kw: [0.0], "lambda"), (local_reward, "inside another function"),
                    (functools.partial(lambda x: x, 1), "cannot be pickled")]:
        with pytest.raises(ValueError, match=f"cannot be sent to reward worker processes: .*{why}.*module level"):
            RewardWorkerPool([length_reward, fn], num_workers=2, timeout=1)


def test_worker_that_cannot_load_the_functions_fails_at_construction():
    with pytest.raises(RuntimeError, match="could not load the reward functions:(?s:.*)dependencies are missing"):
        RewardWorkerPool([length_reward, UnloadableReward()], num_workers=2, timeout=5)


def test_functions_are_sent_once_per_worker_not_per_batch():
    global PICKLED
    PICKLED = 0
    with RewardWorkerPool([CountingReward(), length_reward], num_workers=2, timeout=5) as pool:
        for _ in range(3):
            rows = pool.compute(**_batch(["a", "bb", "c", "dd"]))
            assert [r[0] for r in rows] == [1.0] * 4  # each worker unpickled it exactly once
        os.kill(pool.worker_pids[0], signal.SIGKILL)  # dies between batches: replaced before the next one
        pool._workers[0].process.join(5)
        rows = pool.compute(**_batch(["a", "bb", "c", "dd"]))
        assert [r[0] for r in rows] == [1.0] * 4 and [r[1] for r in rows] == [1.0, 2.0, 1.0, 2.0]
        assert pool.metrics["rewards/worker_restarts"] == 1
    assert PICKLED == 1  # pickled once at construction; the same bytes start every worker, replacements included


def test_raising_reward_costs_only_its_own_column_on_its_shard():
    with RewardWorkerPool([trouble, length_reward], num_workers=2, timeout=5) as pool:
        rows = pool.compute(**_batch(["raise", "ok", "fine", "good"]), group_size=2)
        assert all(math.isnan(r[0]) for r in rows[:2]) and [r[0] for r in rows[2:]] == [0.5, 0.5]
        assert [r[1] for r in rows] == [5.0, 2.0, 4.0, 4.0]  # the other function still counts on the bad shard
        assert pool.metrics["rewards/errors"] == 2 and pool.metrics["rewards/worker_restarts"] == 0
        assert "RuntimeError: reward bug" in pool.last_errors[0]


def test_hung_reward_is_killed_at_the_deadline_and_the_pool_recovers():
    """The hung call sleeps 600 s: returning at all shows the deadline ended the wait, and not before the full
    configured timeout had passed (no speed assertion: a busy machine only makes it return later)."""
    timeout = 1.0
    with RewardWorkerPool([trouble, length_reward], num_workers=2, timeout=timeout) as pool:
        hung_pid = pool.worker_pids[1]
        start = time.monotonic()
        rows = pool.compute(**_batch(["ok", "fine", "hang", "x"]), group_size=2)
        assert time.monotonic() - start >= timeout
        assert rows[:2] == [[0.5, 2.0], [0.5, 4.0]]
        assert all(math.isnan(v) for r in rows[2:] for v in r)
        assert pool.metrics["rewards/errors"] == 4 and pool.metrics["rewards/worker_restarts"] == 1
        assert not _alive(hung_pid) and hung_pid not in pool.worker_pids
        rows = pool.compute(**_batch(["a", "bb", "ccc", "d"]), group_size=2)
        assert rows == [[0.5, 1.0], [0.5, 2.0], [0.5, 3.0], [0.5, 1.0]]
        assert pool.metrics["rewards/errors"] == 0 and pool.metrics["rewards/worker_restarts"] == 1


@pytest.mark.parametrize("how", ["killed", "os_exit"])
def test_worker_dying_mid_batch_is_detected_without_a_timeout(how):
    """timeout=None: only the process sentinel / pipe EOF can end the wait, so this also proves they do."""
    with RewardWorkerPool([trouble, length_reward], num_workers=2, timeout=None) as pool:
        victim = pool.worker_pids[0]
        if how == "killed":
            threading.Timer(0.3, os.kill, (victim, signal.SIGKILL)).start()
            completions = ["slow", "x", "ok", "y"]
        else:
            completions = ["exit", "x", "ok", "y"]
        rows = pool.compute(**_batch(completions), group_size=2)  # no timeout: a missed death would hang here
        assert all(math.isnan(v) for r in rows[:2] for v in r) and rows[2:] == [[0.5, 2.0], [0.5, 1.0]]
        assert pool.metrics["rewards/errors"] == 4 and pool.metrics["rewards/worker_restarts"] == 1
        assert victim not in pool.worker_pids
        assert pool.compute(**_batch(["a", "bb", "c", "dd"]), group_size=2) == [[0.5, 1.0], [0.5, 2.0], [0.5, 1.0],
                                                                                [0.5, 2.0]]
        assert pool.metrics["rewards/errors"] == 0


def test_stale_results_of_an_abandoned_batch_are_dropped():
    with RewardWorkerPool([length_reward], num_workers=2, timeout=5) as pool:
        # A batch whose collection never happened (e.g. the caller was interrupted): its results arrive late.
        pool._dispatch(["p"] * 4, ["stale-stale"] * 4, [[0]] * 4, {}, 1)
        assert pool.compute(**_batch(["a", "bb", "c", "dd"])) == [[1.0], [2.0], [1.0], [2.0]]
        assert pool.compute(**_batch(["xyz", "x"])) == [[3.0], [1.0]]


@pytest.fixture
def own_forkserver():
    """The process's forkserver, stopped afterwards. A process has one forkserver, whose preload is fixed by whoever
    starts it first: left running with this pool's (none), it made every async generator later started by this xdist
    worker import torch and transformers itself (16 generators, ~75 s of CPU per suite) instead of forking from the
    preloading forkserver that :mod:`grpo.training.async_producer` starts."""
    from multiprocessing import forkserver

    yield
    forkserver._forkserver._stop()


def test_forkserver_context_and_single_worker(own_forkserver):
    with RewardWorkerPool([trouble, length_reward], num_workers=1, timeout=5, mp_context="forkserver") as pool:
        rows = pool.compute(**_batch(["exit", "ab"]))
        assert all(math.isnan(v) for r in rows for v in r) and pool.metrics["rewards/worker_restarts"] == 1
        assert pool.compute(**_batch(["ok", "ab"])) == [[0.5, 2.0], [0.5, 2.0]]


def test_reward_module_file_functions_reach_the_workers(tmp_path):
    name = f"pool_file_reward_{uuid.uuid4().hex[:8]}"
    path = tmp_path / "my_rewards.py"
    path.write_text(textwrap.dedent(f"""
        from grpo.rewards import register_reward

        @register_reward("{name}")
        def file_reward(completions, **kwargs):
            return [len(c) * 10.0 for c in completions]
    """))
    load_reward_module(path)
    from grpo.rewards import get_reward

    with RewardWorkerPool([get_reward(name)], num_workers=2, timeout=10) as pool:
        assert pool.compute(**_batch(["a", "bb"])) == [[10.0], [20.0]]


def test_close_and_validation():
    pool = RewardWorkerPool([length_reward], num_workers=2, timeout=5)
    procs = [w.process for w in pool._workers]
    assert pool.compute(**_batch([])) == []
    with pytest.raises(ValueError, match="groups of group_size=4"):
        pool.compute(**_batch(["a", "b", "c"]), group_size=4)
    with pytest.raises(ValueError, match="answer has 1 entries for 2 prompts"):
        pool.compute(**_batch(["a", "b"], answer=["x"]))
    pool.close()
    assert not any(p.is_alive() for p in procs)
    with pytest.raises(RuntimeError, match="closed"):
        pool.compute(**_batch(["a"]))
    with pytest.raises(ValueError, match="spawn' or 'forkserver"):
        RewardWorkerPool([length_reward], num_workers=1, mp_context="fork")


def test_workers_exit_when_the_trainer_process_dies(tmp_path):
    """The parent hard-exits while its worker sleeps inside a reward: the worker notices and exits too."""
    script = tmp_path / "trainer.py"
    script.write_text(textwrap.dedent("""
        import os, threading, time
        from grpo.rewards.pool import RewardWorkerPool

        def sleepy(completions, **kwargs):
            time.sleep(600)

        if __name__ == "__main__":
            pool = RewardWorkerPool([sleepy], num_workers=1, timeout=None)
            print(pool.worker_pids[0], flush=True)
            threading.Timer(0.3, os._exit, (0,)).start()
            pool.compute(["p"], ["c"], [[1]])
    """))
    repo = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, env=env)
    pid = int(out.stdout.split()[0])
    deadline = time.monotonic() + 60  # a generous wait for the orphan's exit, not a speed limit
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pid)


def test_rows_keep_the_batch_order_whichever_worker_finishes_first(tmp_path, monkeypatch):
    """#28: the worker holding the first shard is made to finish after the other one, every batch (forced: it waits for
    the other's marker file, see tests/deterministic_rewards.py). The rows still come back in the batch's order,
    equal to in-process scoring."""
    from tests.deterministic_rewards import completion_length_slow_worker

    monkeypatch.setenv("SLOW_REWARD_DIR", str(tmp_path))
    completions = ["1", "22", "333", "4444", "55555", "666666", "7", "88"]  # 4 groups of 2: one shard per worker
    with RewardWorkerPool([completion_length_slow_worker], num_workers=2, timeout=300) as pool:
        first = pool.worker_pids[0]  # the worker that holds the first shard
        batches = [pool.compute(**_batch(completions[i:] + completions[:i]), group_size=2) for i in range(3)]
        assert pool.metrics["rewards/errors"] == 0
    slowed = {p.name: int(p.read_text()) for p in tmp_path.glob("slow-done-*")}
    assert slowed == {f"slow-done-{i}": first for i in (1, 2, 3)}, slowed  # the first shard came back last, each time
    for i, rows in enumerate(batches):
        assert [r[0] for r in rows] == [float(len(c)) for c in completions[i:] + completions[:i]]
