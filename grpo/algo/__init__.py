"""The algorithms, free of the training stack (numpy/torch only; no TRL, transformers, MLflow or Prefect): the
prompt sampler (:mod:`.sampling`), sequence-length balancing (:mod:`.balance`, :mod:`.group_balancing`), the batch
layout every consumer derives its sizes from (:mod:`.batch_layout`), replay/re-roll buffers and group advantages
(:mod:`.replay`) and importance-sampling weights for off-policy rollouts (:mod:`.off_policy`).
``tests/test_layers.py`` checks the import rule."""
