"""How the trainer's metrics are named in MLflow.

MLflow's run page groups metric charts by key prefix, sections in alphabetical order and unprefixed keys last. Under
TRL's own names the page opened on five all-zero ``clip_ratio`` charts, and ``reward`` sat in the last section. As
Hugging Face's W&B integration does, the trainer's metrics are logged as ``train/<TRL name>`` (``train/reward``,
``train/clip_ratio/low_mean``). The page then opens on ``eval`` (accuracy before and after), and the training curves
form one ``train`` section ahead of their diagnostics (``train/clip_ratio``, ``train/completions``, ...).
``metrics.jsonl`` in the run directory keeps TRL's names; readers of MLflow (the comparison dashboard) strip the
prefix.
"""

TRAIN_PREFIX = "train/"
