"""The tracking wing: what a run records in MLflow and how it gets there.

:mod:`.tracker` (``MlflowTracker``: one MLflow run; the trainer callback), :mod:`.spool` (the generic on-disk spool
and its sender thread), :mod:`.run_tracking` (what one experiment run records, stage by stage) and
:mod:`.metric_keys` (how the trainer's metrics are named). It imports MLflow, never the pipeline, the app, the flows
or Prefect (tests/test_layers.py): the pipeline and the flows call it.
"""
