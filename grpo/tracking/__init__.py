"""The tracking wing: what a run records in MLflow and how it gets there.

- :mod:`.tracker`: ``MlflowTracker`` (one MLflow run), the tracker a config asks for, the trainer callback. The
  tracker is composed of :mod:`.run_lifecycle` (start, resume, close), :mod:`.batched_logging` (metrics through
  the on-disk :mod:`.spool` and its sender thread) and :mod:`.sync_logging` (tags, params, datasets, artifacts);
- :mod:`.model_logging`: the trained model (MLflow's transformers flavour);
- :mod:`.values` (what MLflow accepts: limits, keys, param values, redaction) and :mod:`.store` (where MLflow
  lives: URIs, UI links);
- :mod:`.run_tracking`: what one experiment run records, stage by stage; :mod:`.metric_keys`: how metrics are named;
- :mod:`.sweep_runs`: a sweep's trial runs and the model registry (find, mark failed or pruned, register the best).

It sits below the pipeline: the pipeline, the flows and the app import it, and it never imports them or Prefect
(tests/test_layers.py).
"""
