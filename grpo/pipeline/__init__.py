"""The pipeline layer: the one recipe (:mod:`.recipe`) and its stages (:mod:`.stages`), the one data reader
(:mod:`.data` over the prep stage, :mod:`.prep`), content-addressed caches (:mod:`.cache_dirs`), MLflow tracking
(:mod:`.tracking`, :mod:`.run_tracking`), the in-process runner (:mod:`.experiment`), sweep spaces and path
confinement. It imports MLflow, never Prefect (tests/test_layers.py)."""
