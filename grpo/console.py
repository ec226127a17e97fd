"""What a run prints: library noise off, real warnings kept.

Every run prints the same known-harmless lines otherwise: transformers' deprecation of ``gradient_checkpointing``
(raised by TRL's own calls, twice per checkpoint), MLflow's notes on GPU metrics, model licenses and new stores, and a
progress bar for each tiny model load/save and each artifact transfer. The run's own progress is
:class:`grpo.training.train.ConsoleProgress`'s one line per logged step.
"""

from __future__ import annotations

import logging
import os
import warnings

# (message regex, category): warnings that fire on every run and that a user can do nothing about.
HARMLESS_WARNINGS = [
    (r"`(is_)?gradient_checkpointing` is deprecated", FutureWarning),  # transformers 5 renaming, used by TRL
]

# (logger, message start): log records of the same kind. transformers sorts checkpoints by mtime and says so when two
# were saved within a second, which every short run does; it then sorts them by step, which is right.
# MLflow says on every run of a CPU machine that it skips GPU metrics, on every model it logs that the model card's
# license is not a known one (the card is written locally, see grpo.tracking.model_logging.log_model), and on a new
# local store that it creates its tables.
HARMLESS_LOG_RECORDS = [("transformers.trainer_utils", "mtime may not be reliable"),
                        ("mlflow.system_metrics.system_metrics_monitor", "Skip logging GPU metrics"),
                        ("mlflow.transformers", "Unable to find license information"),
                        ("mlflow.store.db.utils", "Creating initial MLflow database tables"),
                        ("mlflow.store.db.utils", "Updating database tables"),
                        # model.lora: how MLflow stores a peft model (adapter, base referenced), said per logged model
                        ("mlflow.transformers", "Overriding save_pretrained to False for PEFT models"),
                        ("mlflow.transformers", "Using local base model path"),
                        ("mlflow.transformers", "Saving only pipeline components"),
                        # `grpo run` without a Prefect server: Prefect starts and stops a temporary one around the
                        # run, an internal detail (the docs call it embedded), said at the start and after the result
                        ("prefect", "Starting temporary server"),
                        ("prefect", "Stopping temporary server")]


class _DropRecords(logging.Filter):
    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


# What Prefect's engine logs when a flow run's exception leaves it, after the run has ended, with the traceback: an
# error (Exception), or anything else (a signal's TerminationSignal, KeyboardInterrupt).
ENGINE_RELOGS = ("Engine execution exited with unexpected exception", "Engine execution interrupted by base exception")


def mark_reported(err: BaseException) -> BaseException:
    """Mark ``err`` as told to the person already, in the flow run's own words and state (a stop signal the flow
    turned into its Cancelled state, with the step saved and how to resume): Prefect's engine does not log it again
    with its traceback (:class:`_ReportedError`)."""
    err.grpo_reported = True
    return err


class _ReportedError(logging.Filter):
    """Prefect's engine logs a flow run's exception once more, with its traceback, after the run has ended
    (:data:`ENGINE_RELOGS`). For two kinds that has been said in one line by then, as the state's message: a platform
    error (a bad value, a changed config on resume), and a stop the flow marked reported (:func:`mark_reported`).

    A stop's re-log is an ERROR with a ~90-line ``TerminationSignal`` traceback after "Finished in state Cancelled",
    on every Cancel of a served run while it trains: Prefect's runner acknowledges a cancel with the flow-run process
    only while Prefect's own SIGTERM handler is in place, training has its own there (to finish the step and save
    it, grpo.training.graceful_stop), so the runner sends a plain SIGTERM and the engine takes it for an unannounced
    kill. Any other exception keeps its traceback (a crash: "Engine execution exited with unexpected exception")."""

    def filter(self, record: logging.LogRecord) -> bool:
        from grpo.errors import GRPOPlatformError

        error = record.exc_info[1] if record.exc_info else None
        said = isinstance(error, GRPOPlatformError) or getattr(error, "grpo_reported", False)
        return not (said and str(record.msg).startswith(ENGINE_RELOGS))


# Environment settings of the same kind, for this process and the ones it starts (unless the user set them): MLflow's
# progress bars of artifact uploads and downloads (one per logged model, one per dashboard of a sweep), and its "View
# run" / "View experiment" lines at each run's end, whose links open MLflow's GenAI view (the CLI prints the run's
# link to the training view instead: grpo.tracking.store.mlflow_ui_url). TRL's "experimental" warnings for the
# arguments the platform passes by design are filtered where it passes them (grpo.training.trainer).
QUIET_ENV = {"MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false", "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true"}


def quiet_library_noise() -> None:
    """Silence :data:`HARMLESS_WARNINGS`, :data:`HARMLESS_LOG_RECORDS`, :data:`QUIET_ENV` and the per-file model
    load/save progress bars. Idempotent."""
    for name, value in QUIET_ENV.items():
        os.environ.setdefault(name, value)
    for message, category in HARMLESS_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
    for name, prefix in HARMLESS_LOG_RECORDS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropRecords) and f.prefix == prefix for f in logger.filters):
            logger.addFilter(_DropRecords(prefix))
    flow_runs = logging.getLogger("prefect.flow_runs")
    if not any(isinstance(f, _ReportedError) for f in flow_runs.filters):
        flow_runs.addFilter(_ReportedError())
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
