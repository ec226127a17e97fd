"""The training layer: the extension of ``trl.GRPOTrainer`` (:mod:`.trainer`, its TRL overrides listed in
``TRL_HOOKS``; one mixin module per feature: :mod:`.async_rollouts`, :mod:`.off_policy`, :mod:`.reward_scoring`,
:mod:`.replay`, :mod:`.seqlen_balancing`, :mod:`.zero_advantage`, :mod:`.shared_prompt`,
:mod:`.chunked_loss`), config → TRL arguments and
the training loop (:mod:`.train`), the policy (:mod:`.policy`, the tiny model and its warm start), the async
generator process (:mod:`.async_producer`) and evaluation (:mod:`.evaluation`). It never imports the pipeline, the
app, Prefect or MLflow (tests/test_layers.py)."""
