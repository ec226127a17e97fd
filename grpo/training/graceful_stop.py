"""Ctrl-C or SIGTERM during training: finish the optimizer step, save a checkpoint there, then stop.

Without this an interrupted run (a Ctrl-C, a preempted spot instance, ``kubectl delete pod``: SIGTERM first) loses
every step since the last ``save_steps`` multiple. With it, ``--resume`` continues from the step it stopped at. The
signal is then delivered again to the handler that was there before (the CLI's: the run ends KILLED, its flow runs
Cancelled, exit 130/143), so nothing above the trainer changes. A second signal while the step finishes goes straight
to that handler: stop at once, as before.

Signals reach the main thread only. Sweep trials train in threads of one process: when the sweep is interrupted its
main thread calls :func:`request_stop`, and every training in the process saves and stops at its step end the same
way.

Ranks of a multi-process run (``torchrun``, ``accelerate launch``) see a signal at different moments, or only one of
them sees it (``kill`` of one rank, a preempted node). So at every step end the ranks all-reduce a stop flag (MAX:
one rank's signal is enough) and all stop at the same step, all save that checkpoint (every rank writes its own RNG
state into it), and the ranks that got no signal raise KeyboardInterrupt, so the whole run ends as interrupted and
``--resume`` continues from that step on every rank. A rank's later signals are not escalated to "stop at once":
with Ctrl-C to the terminal each rank gets the signal twice (from the terminal and forwarded by the launcher, which
cannot be told apart), and when one rank exits the launcher sends SIGTERM to the others, still saving. The launcher
is the hard stop: it kills ranks still running ``--shutdown_timeout`` seconds (30 by default) after it forwarded a
signal.
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
    """Asks the trainer to save and stop at the end of the step during which a signal arrived (on any rank)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.stopped_by_another_rank = False
        self._several_ranks: bool | None = None  # a launch's constant: looked up at the first step end only

    def on_step_end(self, args, state, control, **kwargs):
        here = self.signum is not None or _STOP_REQUESTED.is_set()
        if self._several_ranks is None:
            self._several_ranks = _several_ranks()
        # Every rank all-reduces at every step end, its own flag set or not (a rank that skipped it would hang the
        # others); a single process just reads its flag.
        anywhere = _any_rank(here, args.device) if self._several_ranks else here
        if anywhere:
            self.stopped_by_another_rank = not here
            control.should_log = True  # the steps since the last logging_steps multiple, which resume will not re-run
            control.should_save = True
            control.should_training_stop = True
        return control


def _several_ranks() -> bool:
    """Whether this process is one of several in an initialised process group (the step end's all-reduce is needed)."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _any_rank(flag: bool, device) -> bool:
    """Whether ``flag`` is set on any rank of several: one all-reduce of one number at the step end, on every rank
    alike (so the ranks stop at the same step)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


@contextlib.contextmanager
def stop_at_step_end(callback: StopAtStepEnd) -> Iterator[None]:
    """While training runs: the first SIGINT/SIGTERM only sets ``callback.signum``; on leaving, the signal is raised
    again under the previous handlers (so the caller stops as it would have). A rank stopped by another rank's
    signal raises KeyboardInterrupt on leaving."""
    if threading.current_thread() is not threading.main_thread():
        yield
        if _STOP_REQUESTED.is_set():
            raise KeyboardInterrupt
        return
    several_ranks = distributed.launched_world_size() > 1
    previous = {s: signal.getsignal(s) for s in SIGNALS if signal.getsignal(s) is not signal.SIG_IGN}

    def on_signal(signum: int, frame) -> None:
        if several_ranks and callback.stopped_by_another_rank:  # stopping already: the launcher's SIGTERM
            return
        if callback.signum is not None:
            if several_ranks:  # the launcher's forward of the same Ctrl-C, or its SIGTERM once a rank has exited
                return
            _restore(previous)  # a second signal: the previous behaviour, now
            signal.raise_signal(signum)
            return
        callback.signum = signum
        again = ("the launcher stops the ranks after its --shutdown_timeout" if several_ranks
                 else "send it again to stop at once")
        # os.write, not a logger: a signal handler may run while the main thread holds a logging lock
        os.write(2, f"{signal.Signals(signum).name}: saving a checkpoint at the end of this step, then stopping "
                    f"({again})\n".encode())

    for s in previous:
        signal.signal(s, on_signal)
    try:
        yield
        if several_ranks and (callback.signum is not None or callback.stopped_by_another_rank):
            # No rank exits before every rank has written its part of the checkpoint: torchrun stops the others as
            # soon as one exits. The handlers stay in place until then.
            distributed.barrier()
    finally:
        _restore(previous)
    if callback.signum is not None:
        signal.raise_signal(callback.signum)
    if _STOP_REQUESTED.is_set() or callback.stopped_by_another_rank:
        raise KeyboardInterrupt


def _restore(handlers: dict[int, object]) -> None:
    for s, handler in handlers.items():
        signal.signal(s, handler if handler is not None else signal.SIG_DFL)
