"""The algorithms, free of the training stack (numpy/torch only; no TRL, transformers, MLflow or Prefect): the
prompt sampler (:mod:`.sampling`), sequence-length balancing (:mod:`.balance`, :mod:`.group_balancing`) and the
batch layout every consumer derives its sizes from (:mod:`.batch_layout`). ``tests/test_layers.py`` checks it."""
