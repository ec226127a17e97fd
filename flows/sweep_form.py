"""How the sweep's parameters read in the Prefect UI's run form (the ``grpo-sweep`` deployments).

Plain titles and complete help for every field, no ``X | None`` type toggles (an optional field starts empty and
means its default, as in the pipeline's form, :mod:`flows.run_form`), and a field that shortens every trial.
Help text keeps placeholders in code spans: the UI renders descriptions as markdown, where a bare ``<output_dir>``
is an HTML tag and disappears.
"""

from __future__ import annotations

from typing import Any

from flows.run_form import _form

SpaceField = _form({
    "type": "object", "title": "Search space",
    "description": "The config fields to vary and how: `{\"sampler\": \"grid\", \"params\": {\"grpo.learning_rate\": "
                   "[5e-5, 1e-4, 2e-4]}}`, or `\"sampler\": \"tpe\"` / `\"random\"` with `\"n_trials\"` and "
                   "distributions (`{\"loguniform\": [1e-5, 1e-3]}`, `uniform`, `int`, `choice`), and an optional "
                   "`\"pruner\": {\"type\": \"median\"}`. Space presets: grpo/presets/spaces/.",
}, dict)
TrialStepsField = _form({
    "type": "integer", "exclusiveMinimum": 0, "title": "Training steps per trial",
    "description": "`grpo.max_steps` of every trial, so a sweep finishes in minutes; a space that varies "
                   "`grpo.max_steps` sets it per trial. Empty: the preset's value (tiny: 150).",
})
ConcurrencyField = _form({
    "type": "integer", "minimum": 1, "title": "Trials at once",
    "description": "How many trials train at the same time (each asks Optuna for its values when it starts).",
}, int)
MetricField = _form({
    "type": "string", "title": "Metric to optimise",
    "description": "A key of the trials' summary (`eval_accuracy_after`, `eval_pass_at_k_after`, `reward_last`) or a "
                   "metric the trials log to MLflow.",
}, str)
DirectionField = _form({
    "type": "string", "enum": ["maximize", "minimize"], "title": "Direction",
    "description": "Whether the best trial has the largest or the smallest metric.",
}, str)
SweepNameField = _form({
    "type": "string", "title": "Sweep name",
    "description": "The sweep's folder under the output directory and its MLflow parent run. Empty: "
                   "`<config name>-sweep-<time>`. An existing sweep is never overwritten.",
})
StudyNameField = _form({
    "type": "string", "title": "Optuna study",
    "description": "The study to create or continue. Empty: `<config name>-<deployment name>` for a deployment's "
                   "runs (every scheduled run adds its trials to one study), else a new study named as the sweep.",
})
StorageField = _form({
    "type": "string", "title": "Optuna storage",
    "description": "Any Optuna RDB URL. Empty: `sqlite:///<output_dir>/optuna.db`.",
})
RegisteredModelField = _form({
    "type": "string", "title": "Registered model name",
    "description": "The MLflow registered model that gets the best trial's model, with the alias `best`. Empty: "
                   "`<config name>-grpo`.",
})
UseDeploymentField = _form({
    "type": "string", "title": "Run trials on a deployment",
    "description": "Run each trial as a flow run of this pipeline deployment on its work pool (e.g. "
                   "`grpo-pipeline/gpu`) instead of in this flow run's process. Such trials are not pruned. Empty: "
                   "here.",
})
TrialTimeoutField = _form({
    "type": "number", "exclusiveMinimum": 0, "title": "Trial timeout (seconds)",
    "description": "With a deployment: seconds a trial may take before it is cancelled and counts as failed. "
                   "Empty: no limit.",
})

__all__: list[Any] = ["SpaceField", "TrialStepsField", "ConcurrencyField", "MetricField", "DirectionField",
                      "SweepNameField", "StudyNameField", "StorageField", "RegisteredModelField", "UseDeploymentField",
                      "TrialTimeoutField"]
