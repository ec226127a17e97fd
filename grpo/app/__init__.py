"""The application layer: the ``grpo`` command (:mod:`grpo.app.cli`), ``grpo serve`` / ``grpo deploy``
(:mod:`grpo.app.serve`), ``grpo ui`` (:mod:`grpo.app.ui`) and process supervision (:mod:`grpo.app.procguard`).

The only part of ``grpo`` that may import ``flows/`` (Prefect) and ``dashboards/``; ``tests/test_layers.py`` checks
the import direction of every layer.
"""
