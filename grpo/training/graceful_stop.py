"""Ctrl-C or SIGTERM during training: finish the optimizer step, save a checkpoint there, then stop.

Without this an interrupted run (a Ctrl-C, a preempted spot instance, ``kubectl delete pod``: SIGTERM first) loses
every step since the last ``save_steps`` multiple. With it, ``--resume`` continues from the step it stopped at. The
signal is then delivered again to the handler that was there before (the CLI's: the run ends KILLED, its flow runs
Cancelled, exit 130/143), so nothing above the trainer changes. A second signal while the step finishes goes straight
to that handler: stop at once, as before.

Signals reach the main thread only. Sweep trials train in threads of one process: when the sweep is interrupted its
main thread calls :func:`request_stop`, and every training in the process saves and stops at its step end the same
way. Ranks of a multi-process run could see a signal at different steps (one would then wait for the others at the
next all-reduce), so there a signal stops training at once and the run resumes from its last checkpoint.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator

from transformers import TrainerCallback

from grpo import distributed

SIGNALS = (signal.SIGINT, signal.SIGTERM)
_STOP_REQUESTED = threading.Event()


def request_stop() -> None:
    """Every training in this process saves a checkpoint at its step end and raises KeyboardInterrupt."""
    _STOP_REQUESTED.set()


def clear_stop_request() -> None:
    _STOP_REQUESTED.clear()


def stop_requested() -> bool:
    return _STOP_REQUESTED.is_set()


class StopAtStepEnd(TrainerCallback):
    """Asks the trainer to save and stop at the end of the step during which a signal arrived."""

    def __init__(self) -> None:
        self.signum: int | None = None

    def on_step_end(self, args, state, control, **kwargs):
        if self.signum is not None or _STOP_REQUESTED.is_set():
            control.should_log = True  # the steps since the last logging_steps multiple, which resume will not re-run
            control.should_save = True
            control.should_training_stop = True
        return control


@contextlib.contextmanager
def stop_at_step_end(callback: StopAtStepEnd) -> Iterator[None]:
    """While training runs: the first SIGINT/SIGTERM only sets ``callback.signum``; on leaving, the signal is raised
    again under the previous handlers (so the caller stops as it would have)."""
    if distributed.launched_world_size() > 1 or threading.current_thread() is not threading.main_thread():
        yield
        if _STOP_REQUESTED.is_set():
            raise KeyboardInterrupt
        return
    previous = {s: signal.getsignal(s) for s in SIGNALS if signal.getsignal(s) is not signal.SIG_IGN}

    def on_signal(signum: int, frame) -> None:
        if callback.signum is not None:  # a second signal: the previous behaviour, now
            _restore(previous)
            signal.raise_signal(signum)
            return
        callback.signum = signum
        # os.write, not a logger: a signal handler may run while the main thread holds a logging lock
        os.write(2, f"{signal.Signals(signum).name}: saving a checkpoint at the end of this step, then stopping "
                    "(send it again to stop at once)\n".encode())

    for s in previous:
        signal.signal(s, on_signal)
    try:
        yield
    finally:
        _restore(previous)
    if callback.signum is not None:
        signal.raise_signal(callback.signum)
    if _STOP_REQUESTED.is_set():
        raise KeyboardInterrupt


def _restore(handlers: dict[int, object]) -> None:
    for s, handler in handlers.items():
        signal.signal(s, handler if handler is not None else signal.SIG_DFL)
