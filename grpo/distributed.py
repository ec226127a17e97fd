"""Multi-process runs (``torchrun`` / ``accelerate launch``): who does what, without deadlocks.

Rank 0 owns the run directory, evaluation and the summary; every rank trains. Decisions that can fail on user input
(does the run directory exist?) are made on rank 0 and broadcast, so a refusal stops every rank with the same
message instead of leaving the others waiting at a barrier.

A rank ends without Python's interpreter teardown. Its C++ threads (gloo's work loops and transport loop) outlive
the run: :func:`process_group` destroys the group, but once a model was wrapped in DDP the C++ group, and so its
threads, stay alive after that (on gloo ranks: DDP built and freed, then ``destroy_process_group``, threads still run).
When such a thread meets the teardown, a rank that finished its run can die with ``terminate called without an active
exception`` (SIGABRT, exit -6), and the launcher reports a finished run as failed, depending on timing. So
:func:`exit_rank` runs what an exit runs for Python code (non-daemon threads joined, ``atexit`` handlers: logging,
MLflow) and then ends the process with the CLI's exit code, skipping only the teardown.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, NoReturn, TypeVar

from grpo.errors import ConfigError, GRPOPlatformError

if TYPE_CHECKING:
    from grpo.config import ExperimentConfig

T = TypeVar("T")


def launched_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def is_main_process() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def init_process_group() -> None:
    """Initialise torch.distributed (gloo on CPU, nccl on GPU) through accelerate when launched with several ranks."""
    if launched_world_size() > 1:
        from accelerate import PartialState

        PartialState()


def destroy_process_group() -> None:
    """Tear down torch.distributed's groups now, while the interpreter is whole (a no-op when none is initialised)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@contextlib.contextmanager
def process_group() -> Iterator[None]:
    """The run's process group: initialised on entry, destroyed on the way out when every rank is leaving together.

    That is a finished run, a stop the ranks agreed on (the graceful stop's KeyboardInterrupt at the same step end)
    and a user-input error decided on rank 0 and raised on every rank. Any other exception may leave a peer inside a
    collective; the group is then left to the launcher, which stops the other ranks (destroying an NCCL group while
    a peer waits in a collective can hang).
    """
    init_process_group()
    try:
        yield
    except (KeyboardInterrupt, GRPOPlatformError):
        destroy_process_group()
        raise
    destroy_process_group()


def exit_rank(code: int | str | None) -> NoReturn:
    """End this rank of a multi-process run with ``code`` (``SystemExit.code``): non-daemon threads joined, ``atexit``
    handlers run and stdio flushed, as at any exit, then ``os._exit`` instead of the interpreter's teardown."""
    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code
    else:  # sys.exit("message"): printed, status 1, as Python does
        print(code, file=sys.stderr)
        status = 1
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()  # CPython's own exit step (the module's only way to run them); handlers run once
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing left to write to
            pass
    os._exit(status)


def decide_on_main(fn: Callable[[], T]) -> T:
    """Run ``fn`` on rank 0 only and give its result (or its user-input error) to every rank."""
    if launched_world_size() == 1:
        return fn()
    import torch.distributed as dist

    box: list = [None]
    failure: BaseException | None = None
    if is_main_process():
        try:
            box[0] = ("ok", fn())
        except GRPOPlatformError as err:
            box[0] = ("error", err)
        except Exception as err:  # not the user's input: rank 0 re-raises it, the others stop instead of waiting
            failure = err
            box[0] = ("error", RuntimeError(f"rank 0 failed: {type(err).__name__}: {err}"))
    dist.broadcast_object_list(box, src=0)
    if failure is not None:
        raise failure
    status, value = box[0]
    if status == "error":
        raise value
    return value


def barrier() -> None:
    if launched_world_size() > 1:
        import torch.distributed as dist

        dist.barrier()


def check_launch_matches_config(experiment: ExperimentConfig, launched: int) -> None:
    """The config's world size and SP degree must describe the processes actually launched."""
    sampling = experiment.sampling
    if sampling.world_size != launched:
        raise ConfigError(
            f"sampling.world_size is {sampling.world_size} but {launched} process(es) were launched; set "
            f"sampling.world_size={launched} or launch {sampling.world_size} (accelerate launch --num_processes N)"
        )
    if sampling.sequence_parallel_degree > 1:
        raise ConfigError(
            f"sampling.sequence_parallel_degree={sampling.sequence_parallel_degree} needs sequence-parallel "
            "attention (ring/Ulysses context parallelism on GPUs), which this backend does not provide: "
            "trl.GRPOTrainer rejects cp_size/sp_size > 1 and CPU training has no such kernels. Use 1; the sampler "
            "layout itself (grpo.algo.sampling.SequenceParallelRepeatRandomSampler) is ready for a GPU backend."
        )
