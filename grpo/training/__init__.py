"""The training layer: the extension of ``trl.GRPOTrainer`` (:mod:`.trainer`, its TRL overrides listed in
``TRL_HOOKS``), config → TRL arguments and the training loop (:mod:`.train`), the policy (:mod:`.policy`, the tiny
model and its warm start), async rollouts (:mod:`.async_producer`), replay and re-roll (:mod:`.replay`) and
evaluation (:mod:`.evaluation`). It never imports the pipeline, the app, Prefect or MLflow (tests/test_layers.py)."""
