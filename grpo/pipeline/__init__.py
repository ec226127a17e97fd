"""The pipeline layer: the one recipe (:mod:`.recipe`) and its stages (:mod:`.stages`), a run's live objects
(:mod:`.run_context`), the one data reader (:mod:`.data` over the prep stage, :mod:`.prep`), content-addressed caches
(:mod:`.cache_dirs`), the in-process runner (:mod:`.experiment`), sweep spaces and path confinement. MLflow tracking
is :mod:`grpo.tracking`, below this layer. It never imports Prefect (tests/test_layers.py)."""
