"""Reward functions in persistent worker processes (``async.reward_num_workers``, ``async.reward_timeout``).

CPU-bound Python rewards hold the GIL, so scoring a GRPO batch in-process is serial. The pool shards each batch into
contiguous, group-aligned slices, scores them in parallel processes and returns TRL's layout: one row per sample, one
column per reward function, NaN where a function returned None or failed. A reward that raises, hangs past the
deadline or kills its process costs NaN for its shard, never the run, and never a deadlock:

* the reward functions are pickled once (by reference) and handed to each worker at start, never per batch;
* every message carries the batch id, so a late result from an abandoned batch is dropped, not read as the current one;
* every wait has a deadline (``timeout``) or a process sentinel; a worker that misses the deadline is killed and
  replaced, one that dies is detected at once and replaced;
* sends run in helper threads, so a busy worker with a full pipe can't block the parent past the deadline.

Messages, all tuples whose first item is the kind::

    parent -> worker   ("batch", batch_id, kwargs)    ("stop",)
    worker -> parent   ("ready", pid)    ("init_error", traceback)    ("result", batch_id, values, errors)

Not thread-safe: one caller at a time (the trainer's reward step).
"""

from __future__ import annotations

import asyncio
import importlib.machinery
import importlib.util
import inspect
import logging
import multiprocessing as mp
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.reduction import ForkingPickler
from typing import Any

log = logging.getLogger(__name__)

NAN = float("nan")
PARENT_POLL_SECONDS = 1.0  # how often a busy worker checks that the trainer process still exists
_TERMINATE_GRACE_SECONDS = 1.0  # SIGTERM -> SIGKILL escalation
_DEAD = object()  # _drain's verdict for a worker whose process or pipe is gone


# ----------------------------------------------------------------------------------------------------------- worker


def _exit_with_parent(ppid: int) -> None:
    """A worker stuck in a reward never reads its pipe's EOF; reparenting is the sign that the trainer died."""
    while True:
        time.sleep(PARENT_POLL_SECONDS)
        if os.getppid() != ppid:
            os._exit(1)


def _import_file_module(name: str, path: str) -> None:
    """Load a ``--reward-module`` file under the parent's module name, so its functions unpickle by reference."""
    if name in sys.modules:
        return
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import reward module {name} from {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)


def _floats(output: Any, n: int, fn: Callable) -> list[float]:
    values = [NAN if r is None else float(r) for r in output]
    if len(values) != n:
        raise ValueError(f"reward {_name(fn)!r} returned {len(values)} rewards for {n} completions (one per "
                         "completion expected)")
    return values


async def _gather(awaitables: list) -> list:
    return await asyncio.gather(*awaitables, return_exceptions=True)


def score_rewards(
    funcs: Sequence[Callable], kwargs: dict, loop: asyncio.AbstractEventLoop | None = None, raise_errors: bool = False,
) -> tuple[list[list[float]], list[str | None], asyncio.AbstractEventLoop | None]:
    """Run every function on one shard with TRL's keyword arguments; coroutine rewards run concurrently on ``loop``
    (created when None and returned for reuse). Returns values per function (None -> NaN) and a traceback per
    function that failed. A failing function costs only its own column, unless ``raise_errors``: then its exception
    propagates, as in TRL's in-process scoring."""
    n = len(kwargs["completions"])
    values: list[list[float]] = [[NAN] * n for _ in funcs]
    errors: list[str | None] = [None] * len(funcs)
    pending: dict[int, Any] = {}
    for i, fn in enumerate(funcs):
        try:
            out = fn(**kwargs)
            if inspect.isawaitable(out):
                pending[i] = out
            else:
                values[i] = _floats(out, n, fn)
        except Exception:
            if raise_errors:
                raise
            errors[i] = traceback.format_exc()
    if pending:
        loop = loop or asyncio.new_event_loop()
        for i, out in zip(pending, loop.run_until_complete(_gather(list(pending.values())))):
            try:
                if isinstance(out, BaseException):
                    raise out
                values[i] = _floats(out, n, funcs[i])
            except BaseException:
                if raise_errors:
                    raise
                errors[i] = traceback.format_exc()
    return values, errors, loop


def _worker_main(conn: Connection, payload: list[bytes], file_modules: list[tuple[str, str]]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C belongs to the trainer, which then closes the pool
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    try:
        for name, path in file_modules:
            _import_file_module(name, path)
        funcs = [pickle.loads(blob) for blob in payload]
    except BaseException:
        conn.send(("init_error", traceback.format_exc()))
        return
    conn.send(("ready", os.getpid()))
    loop = None  # one event loop per worker, created on the first coroutine reward
    try:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):  # the trainer closed the pool or died
                return
            if msg[0] != "batch":
                return
            _, batch_id, kwargs = msg
            values, errors, loop = score_rewards(funcs, kwargs, loop)
            try:
                conn.send(("result", batch_id, values, errors))
            except OSError:
                return
    finally:
        if loop is not None:
            loop.close()


# ----------------------------------------------------------------------------------------------------------- parent


def _name(fn: Callable) -> str:
    return getattr(fn, "__name__", None) or type(fn).__name__


def _pickle_by_reference(funcs: Sequence[Callable]) -> list[bytes]:
    """Pickle each function once, here, so an unusable one fails at start with its name instead of in a worker."""
    blobs = []
    for fn in funcs:
        qualname = getattr(fn, "__qualname__", "") or ""
        why = None
        if "<lambda>" in qualname:
            why = "it is a lambda"
        elif "<locals>" in qualname:
            why = "it is defined inside another function (a closure or local function)"
        else:
            try:
                blobs.append(pickle.dumps(fn))
            except Exception as e:
                why = f"it cannot be pickled ({type(e).__name__}: {e})"
        if why:
            raise ValueError(
                f"reward function {_name(fn)!r} cannot be sent to reward worker processes: {why}. Workers import "
                "reward functions by name: define it at module level in an importable module, or in a file passed "
                "with --reward-module and registered with @register_reward."
            )
    return blobs


def _file_modules(funcs: Sequence[Callable]) -> list[tuple[str, str]]:
    """Modules a fresh interpreter can't import by name (``--reward-module`` files): workers load them by path."""
    out: dict[str, str] = {}
    for fn in funcs:
        name = getattr(fn, "__module__", None) or type(fn).__module__
        module = sys.modules.get(name)
        path = getattr(module, "__file__", None)
        if name == "__main__" or "." in name or path is None or name in sys.builtin_module_names:
            continue
        if importlib.machinery.PathFinder.find_spec(name, sys.path) is None:
            out[name] = path
    return sorted(out.items())


def _shards(n: int, group_size: int, workers: int) -> list[tuple[int, int]]:
    """Contiguous (start, end) sample ranges, as equal as whole groups allow; at most one per worker."""
    groups = n // group_size
    k = min(workers, groups)
    bounds, start = [], 0
    for i in range(k):
        size = (groups // k + (i < groups % k)) * group_size
        bounds.append((start, start + size))
        start += size
    return bounds


def _send_quietly(conn: Connection, buf: Any) -> None:
    try:
        conn.send_bytes(buf)
    except Exception:  # the worker died or was killed (EPIPE, closed handle); its sentinel reports it
        pass


@dataclass
class _Worker:
    process: Any  # multiprocessing.context.SpawnProcess / ForkServerProcess
    conn: Connection
    ready: bool = False
    sender: threading.Thread | None = None


class RewardWorkerPool:
    """Persistent reward worker processes; :meth:`compute` scores one batch. Use as a context manager or call
    :meth:`close`. ``metrics`` holds the last call's counters, named like TRL's logged metrics."""

    def __init__(
        self,
        reward_funcs: Sequence[Callable],
        num_workers: int,
        timeout: float | None = None,
        mp_context: str = "spawn",
        startup_timeout: float = 60.0,
    ) -> None:
        if not reward_funcs:
            raise ValueError("RewardWorkerPool needs at least one reward function")
        if num_workers < 1:
            raise ValueError(f"reward_num_workers must be >= 1, got {num_workers}")
        if timeout is not None and timeout <= 0:
            raise ValueError(f"reward_timeout must be > 0 seconds or None, got {timeout}")
        if mp_context not in ("spawn", "forkserver"):
            raise ValueError(f"mp_context must be 'spawn' or 'forkserver' (fork is unsafe with torch): {mp_context!r}")
        self.names = [_name(fn) for fn in reward_funcs]
        self.timeout = timeout
        self.startup_timeout = startup_timeout
        self._payload = _pickle_by_reference(reward_funcs)
        self._file_modules = _file_modules(reward_funcs)
        self._ctx = mp.get_context(mp_context)
        self._batch_id = 0
        self._restarts = 0
        self._closed = False
        self.metrics: dict[str, float] = {"rewards/errors": 0, "rewards/worker_restarts": 0, "rewards/pool_seconds": 0}
        self.last_errors: list[str] = []  # human-readable reasons for the last call's NaNs
        self._workers: list[_Worker] = []
        try:
            self._workers = [self._start_worker() for _ in range(num_workers)]
            self._await_ready()
        except BaseException:
            self.close()
            raise

    # -- lifecycle --------------------------------------------------------------------------------------------------

    def _start_worker(self) -> _Worker:
        parent_conn, child_conn = self._ctx.Pipe()
        process = self._ctx.Process(
            target=_worker_main, args=(child_conn, self._payload, self._file_modules), daemon=True, name="reward-worker"
        )
        process.start()
        child_conn.close()  # so the worker's death reads as EOF here
        return _Worker(process, parent_conn)

    def _replace(self, index: int) -> None:
        """Start the successor first (its startup overlaps the rest of the batch), then end the old process."""
        old = self._workers[index]
        self._workers[index] = self._start_worker()
        self._restarts += 1
        self._stop([old])

    @staticmethod
    def _stop(workers: list[_Worker]) -> None:
        """terminate, then kill; every join is bounded."""
        for w in workers:
            if w.process.is_alive():
                w.process.terminate()
        deadline = time.monotonic() + _TERMINATE_GRACE_SECONDS
        for w in workers:
            w.process.join(max(0.0, deadline - time.monotonic()))
            if w.process.is_alive():
                w.process.kill()
                w.process.join(5.0)
            if w.sender is not None:  # its blocked send fails with EPIPE now that the process is gone
                w.sender.join(1.0)
            w.conn.close()

    def _await_ready(self) -> None:
        """Wait (bounded by ``startup_timeout``) until new workers have loaded the reward functions."""
        deadline = time.monotonic() + self.startup_timeout
        while pending := [w for w in self._workers if not w.ready]:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RuntimeError(f"{len(pending)} reward worker(s) did not start within {self.startup_timeout} s")
            wait([w.conn for w in pending] + [w.process.sentinel for w in pending], remaining)
            for w in pending:
                msg = self._drain(w, batch_id=None)
                if msg is _DEAD:
                    raise RuntimeError(f"reward worker {w.process.pid} exited with code {w.process.exitcode} at start")
                if msg is not None and msg[0] == "init_error":
                    raise RuntimeError(f"reward worker could not load the reward functions:\n{msg[1]}")

    def close(self) -> None:
        """Ask idle workers to stop, then terminate whatever is left."""
        if self._closed:
            return
        self._closed = True
        for w in self._workers:
            if w.process.is_alive() and (w.sender is None or not w.sender.is_alive()):
                _send_quietly(w.conn, ForkingPickler.dumps(("stop",)))
        deadline = time.monotonic() + _TERMINATE_GRACE_SECONDS
        for w in self._workers:
            w.process.join(max(0.0, deadline - time.monotonic()))
        self._stop(self._workers)
        self._workers = []

    def __enter__(self) -> RewardWorkerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def worker_pids(self) -> list[int]:
        return [w.process.pid for w in self._workers]

    # -- scoring ----------------------------------------------------------------------------------------------------

    def compute(
        self,
        prompts: Sequence,
        completions: Sequence,
        completion_ids: Sequence,
        columns: dict[str, Sequence] | None = None,
        group_size: int = 1,
    ) -> list[list[float]]:
        """Rewards as rows (samples) x columns (reward functions); NaN for None, exceptions, timeouts and crashes.

        ``columns`` are the per-sample dataset columns TRL passes as keyword arguments; shards never split a group of
        ``group_size`` consecutive samples (GRPO's num_generations)."""
        start = time.perf_counter()
        batch_id, jobs = self._dispatch(prompts, completions, completion_ids, columns or {}, group_size)
        rows = [[NAN] * len(self.names) for _ in range(len(prompts))]
        errors = 0
        self.last_errors = []
        for (lo, hi), result in self._collect(batch_id, jobs).items():
            if isinstance(result, str):  # the whole shard was lost
                errors += (hi - lo) * len(self.names)
                self.last_errors.append(result)
                log.warning("%s", result)
                continue
            values, func_errors = result
            for f, (column, err) in enumerate(zip(values, func_errors)):
                if err is not None:
                    errors += hi - lo
                    self.last_errors.append(f"reward {self.names[f]!r} raised on samples {lo}:{hi}:\n{err}")
                    log.warning("%s", self.last_errors[-1])
                for j, value in enumerate(column):
                    rows[lo + j][f] = value
        self.metrics = {
            "rewards/errors": errors,
            "rewards/worker_restarts": self._restarts,
            "rewards/pool_seconds": time.perf_counter() - start,
        }
        return rows

    def _dispatch(self, prompts, completions, completion_ids, columns, group_size) -> tuple[int, dict[int, tuple]]:
        """Send each worker its shard; returns the batch id and {worker index: (start, end)}."""
        if self._closed:
            raise RuntimeError("RewardWorkerPool is closed")
        n = len(prompts)
        if group_size < 1 or n % group_size:
            raise ValueError(f"{n} samples do not split into groups of group_size={group_size}")
        for key, col in {"completions": completions, "completion_ids": completion_ids, **columns}.items():
            if len(col) != n:
                raise ValueError(f"{key} has {len(col)} entries for {n} prompts")
        for i, w in enumerate(self._workers):  # died while idle (OOM killer, ...): replace before use
            if not w.process.is_alive():
                log.warning("reward worker %s died between batches (exit code %s); replaced", w.process.pid,
                            w.process.exitcode)
                self._replace(i)
        self._await_ready()
        self._batch_id += 1
        jobs = {}
        for i, (lo, hi) in enumerate(_shards(n, group_size, len(self._workers))):
            kwargs = {
                "prompts": list(prompts[lo:hi]),
                "completions": list(completions[lo:hi]),
                "completion_ids": list(completion_ids[lo:hi]),
                **{key: list(col[lo:hi]) for key, col in columns.items()},
            }
            buf = ForkingPickler.dumps(("batch", self._batch_id, kwargs))  # here, so pickling errors reach the caller
            w = self._workers[i]
            w.sender = threading.Thread(target=_send_quietly, args=(w.conn, buf), daemon=True, name="reward-send")
            w.sender.start()
            jobs[i] = (lo, hi)
        return self._batch_id, jobs

    def _drain(self, w: _Worker, batch_id: int | None) -> Any:
        """Read what has arrived: this batch's result (or a startup message when ``batch_id`` is None), None if
        nothing relevant yet, _DEAD if the worker is gone. Results of other batches are dropped."""
        try:
            while w.conn.poll(0):
                msg = w.conn.recv()
                if msg[0] == "ready":
                    w.ready = True
                if batch_id is None and msg[0] in ("ready", "init_error"):
                    return msg
                if msg[0] == "result" and msg[1] == batch_id:
                    return msg
                if msg[0] == "result":
                    log.info("dropped a stale reward result of batch %s (current %s)", msg[1], batch_id)
        except (EOFError, OSError):
            return _DEAD
        return _DEAD if not w.process.is_alive() else None

    def _collect(self, batch_id: int, jobs: dict[int, tuple]) -> dict[tuple, Any]:
        """{(start, end): (values, errors) or a reason string}; waits until all shards report, die, or the deadline."""
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        pending = dict(jobs)
        out: dict[tuple, Any] = {}
        while pending:
            remaining = None if deadline is None else deadline - time.monotonic()
            overdue = remaining is not None and remaining <= 0
            if overdue:  # one last non-blocking look: results that landed right at the deadline still count
                ready = set(pending)
            else:
                handles = {}
                for i in pending:
                    handles[self._workers[i].conn] = i
                    handles[self._workers[i].process.sentinel] = i
                ready = {handles[h] for h in wait(list(handles), remaining)}
            for i in ready:
                w = self._workers[i]
                msg = self._drain(w, batch_id)
                if msg is None:
                    continue
                lo, hi = pending.pop(i)
                if msg is _DEAD:
                    out[(lo, hi)] = (f"reward worker {w.process.pid} died (exit code {w.process.exitcode}) while "
                                     f"scoring samples {lo}:{hi}; they score NaN and the worker was replaced")
                    self._replace(i)
                else:
                    out[(lo, hi)] = (msg[2], msg[3])
            if overdue:
                break
        if pending:  # deadline passed
            late = [self._workers[i] for i in pending]
            for i, (lo, hi) in pending.items():
                out[(lo, hi)] = (f"reward worker {self._workers[i].process.pid} missed the {self.timeout} s "
                                 f"deadline on samples {lo}:{hi}; they score NaN and the worker was replaced")
                self._workers[i] = self._start_worker()
                self._restarts += 1
            self._stop(late)
        return out
