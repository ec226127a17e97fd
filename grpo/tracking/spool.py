"""A disk spool with a background sender: append JSON lines now, deliver them later, exactly once, in order.

Generic (no MLflow in here; the tracker's batched logging, :mod:`grpo.tracking.batched_logging`, is its user). Why
hand-written: MLflow's own async logging keeps the queue in memory and retries for minutes inside the training
process; this keeps every point on disk until the backend acknowledged it, so an outage or a crash loses nothing and
blocks nothing.

* ``append(record)`` writes one line ``json.dumps(record)`` to ``<directory>/metrics.jsonl`` and returns.
* A thread reads the lines between the *sent cursor* (a byte offset at a line boundary, persisted in
  ``<directory>/state.json``) and the written end, turns them into items with ``parse(record)``, sends them in
  batches of at most ``max_batch`` items and moves the cursor only after ``send`` returned. A transient error
  (anything ``is_permanent`` says is not) leaves the lines in place and backs off exponentially up to
  ``max_backoff``; a permanent one hands the batch to ``on_reject`` and moves on.
* After a crash, :meth:`recover` finds the cursor and the last complete line (a torn tail is dropped), so the
  next owner sends what is left before anything new.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

_log = logging.getLogger(__name__)

SPOOL_FILE = "metrics.jsonl"
STATE_FILE = "state.json"


class Spool:
    """See the module docstring. ``send`` is set by :meth:`start` (or passed to :meth:`send_pending`)."""

    def __init__(
        self,
        directory: Path,
        *,
        parse: Callable[[dict], list],
        is_permanent: Callable[[BaseException], bool],
        on_reject: Callable[[list, BaseException], None],
        max_batch: int,
        flush_interval: float = 1.0,
        batch_trigger: int = 500,
        max_backoff: float = 30.0,
        name: str = "spool-sender",
    ) -> None:
        self.directory = Path(directory)
        self.parse, self.is_permanent, self.on_reject = parse, is_permanent, on_reject
        self.max_batch = max_batch
        self.flush_interval, self.batch_trigger, self.max_backoff = flush_interval, batch_trigger, max_backoff
        self.name = name
        self.last_error: str | None = None
        self.send: Callable[[list], None] | None = None

        self._lock = threading.Lock()  # file handle and offsets
        self._sent_cond = threading.Condition(self._lock)
        self._wake = threading.Event()  # new data waiting
        self._urgent = threading.Event()  # flush/stop requested: skip the backoff wait
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._fh = None
        self._written = 0  # byte offset of the end of the last complete line
        self._sent = 0  # byte offset up to which every line is delivered (persisted)
        self._pending_items = 0

    # ------------------------------------------------------------------ files and persisted state

    @property
    def file(self) -> Path:
        return self.directory / SPOOL_FILE

    @property
    def state_file(self) -> Path:
        return self.directory / STATE_FILE

    def read_state(self) -> dict:
        return read_state(self.directory)

    def write_state(self, **updates: Any) -> None:
        """Merge ``updates`` into state.json atomically (the owner keeps its own keys there too)."""
        state = self.read_state()
        state.update(updates)
        tmp = self.state_file.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(state, sort_keys=True))
        tmp.replace(self.state_file)

    def recover(self) -> bool:
        """Read the cursor and the spool's complete end; True when lines are waiting to be sent."""
        self.directory.mkdir(parents=True, exist_ok=True)
        self._sent = int(self.read_state().get("offset", 0))
        size = self.file.stat().st_size if self.file.is_file() else 0
        if self._sent > size:  # crashed between compaction and the cursor write
            self._sent = 0
        self._written = self._complete_lines_end(size)
        return self._written > self._sent

    def _complete_lines_end(self, size: int) -> int:
        """Offset just after the last newline (a torn last line from a crash is ignored and overwritten)."""
        if size == 0:
            return 0
        with self.file.open("rb") as f:
            pos = size
            while pos > 0:
                step = min(4096, pos)
                f.seek(pos - step)
                block = f.read(step)
                nl = block.rfind(b"\n")
                if nl >= 0:
                    return pos - step + nl + 1
                pos -= step
        return 0

    def compact(self) -> None:
        """Empty the spool (everything in it is sent, or belongs to a destination that is gone)."""
        with self._lock:
            if self._fh is not None:
                self._fh.close()
                self._fh = None
            self.directory.mkdir(parents=True, exist_ok=True)
            with self.file.open("wb"):
                pass
            self._written = self._sent = 0
            self.write_state(offset=0)

    def open(self) -> None:
        with self._lock:
            if self._fh is None:
                fh = self.file.open("r+b" if self.file.exists() else "w+b")
                fh.truncate(self._written)  # drop a torn last line
                fh.seek(self._written)
                self._fh = fh

    @property
    def is_open(self) -> bool:
        return self._fh is not None

    # ------------------------------------------------------------------ writing

    def append(self, record: dict, items: int) -> None:
        """Write one line; ``items`` is how many items ``parse`` will make of it (for ``batch_trigger``)."""
        data = (json.dumps(record) + "\n").encode()
        with self._lock:
            if self._fh is None:
                return
            self._fh.write(data)
            self._fh.flush()
            self._written += len(data)
            self._pending_items += items
            trigger = self._pending_items >= self.batch_trigger
        if trigger:
            self._wake.set()

    # ------------------------------------------------------------------ sending

    def _read_unsent(self) -> list[tuple[int, list]]:
        """Lines between the sent cursor and the written end, as (end offset of the line, items)."""
        with self._lock:
            start, end = self._sent, self._written
        if end <= start:
            return []
        with self.file.open("rb") as f:
            f.seek(start)
            raw = f.read(end - start)
        out = []
        pos = start
        for line in raw.split(b"\n")[:-1]:
            pos += len(line) + 1
            try:
                items = self.parse(json.loads(line))
            except (ValueError, KeyError, TypeError):
                _log.warning("tracking: skipping a corrupt spool line at offset %d", pos - len(line) - 1)
                items = []
            out.append((pos, items))
        return out

    @staticmethod
    def batches(lines: list[tuple[int, list]], max_batch: int) -> Iterator[tuple[int | None, list]]:
        """Batches of at most ``max_batch`` items, each with the offset the cursor may move to after it.

        The cursor only moves to line ends: a line with more items than fit in one batch is split, and its first
        parts carry ``None`` (resent whole after a crash; the receiver must ignore exact duplicates).
        """
        batch: list = []
        batch_end: int | None = None
        for end, items in lines:
            if len(batch) + len(items) <= max_batch:
                batch.extend(items)
                batch_end = end
                continue
            if batch:
                yield batch_end, batch
            while len(items) > max_batch:
                yield None, items[:max_batch]
                items = items[max_batch:]
            batch, batch_end = list(items), end
        if batch or batch_end is not None:
            yield batch_end, batch

    def send_pending(self, send: Callable[[list], None] | None = None, raise_transient: bool = False) -> bool:
        """Send everything between the cursor and the written end; False when a transient error stopped it."""
        send = send or self.send
        for end, batch in self.batches(self._read_unsent(), self.max_batch):
            if batch:
                try:
                    send(batch)
                except Exception as err:
                    if not self.is_permanent(err):
                        self.last_error = str(err)
                        if raise_transient:
                            raise
                        return False
                    self.on_reject(batch, err)
            self._advance(end, len(batch))
        return True

    def _advance(self, offset: int | None, items: int) -> None:
        with self._lock:
            self._pending_items = max(0, self._pending_items - items)
            if offset is None or offset <= self._sent:
                return
            self._sent = offset
            self.write_state(offset=offset)
            self._sent_cond.notify_all()

    def _loop(self) -> None:
        backoff = 0.0
        while True:
            if backoff:
                self._urgent.wait(backoff)  # new data does not cut a backoff short; flush/stop does
            else:
                self._wake.wait(self.flush_interval)
            stopping = self._stop.is_set()
            self._wake.clear()
            self._urgent.clear()
            try:
                ok = self.send_pending()
            except Exception as err:  # pragma: no cover - defensive: the thread must survive anything
                _log.warning("tracking: sender error: %s", err)
                ok = False
            if ok:
                if backoff:
                    _log.info("tracking: backend reachable again, spool sent")
                backoff = 0.0
            else:
                if not backoff:
                    _log.warning("tracking: backend unreachable (%s); buffering metrics in %s", self.last_error,
                                 self.file)
                backoff = min(max(backoff * 2, 0.5), self.max_backoff)
            if stopping:
                return

    def start(self, send: Callable[[list], None]) -> None:
        """Open the spool for appending and start the sender thread."""
        self.send = send
        self.open()
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread is not None

    def pending(self) -> int:
        """Bytes of the spool not yet delivered."""
        with self._lock:
            return self._written - self._sent

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until everything appended so far is delivered (True) or ``timeout`` seconds pass (False)."""
        if self._thread is None:
            return True
        deadline = time.monotonic() + timeout
        with self._lock:
            target = self._written
        self._urgent.set()
        self._wake.set()
        with self._sent_cond:
            while self._sent < target:
                left = deadline - time.monotonic()
                if left <= 0 or not self._thread.is_alive():
                    return False
                self._sent_cond.wait(min(left, 0.5))
                if self._sent < target:
                    self._urgent.set()  # retry now rather than after the backoff
                    self._wake.set()
        return True

    def stop(self, join_timeout: float) -> None:
        """Stop the sender (after one last attempt) and close the file; unsent lines stay for the next owner."""
        self._stop.set()
        self._urgent.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=join_timeout)
        self._thread = None
        with self._lock:
            if self._fh is not None:
                self._fh.close()
                self._fh = None


def read_state(directory: Path) -> dict:
    """The state.json of a spool directory ({} when there is none or it is unreadable)."""
    try:
        return json.loads((Path(directory) / STATE_FILE).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}
