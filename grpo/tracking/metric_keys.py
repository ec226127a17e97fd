"""How the trainer's metrics are named in MLflow.

MLflow's run page groups metric charts by key prefix, sections in alphabetical order and unprefixed keys last. Under
TRL's own names the page opened on five all-zero ``clip_ratio`` charts, and ``reward`` sat in the last section. As
Hugging Face's W&B integration does, the trainer's metrics are logged as ``train/<TRL name>`` (``train/reward``,
``train/clip_ratio/low_mean``). The page then opens on ``eval`` (accuracy before and after training, one line), and
the training curves form one ``train`` section ahead of their diagnostics (``train/clip_ratio``,
``train/completions``, ...).
``metrics.jsonl`` in the run directory keeps TRL's names; readers of MLflow (the comparison dashboard) strip the
prefix.
"""

from __future__ import annotations

import re
from typing import Any

TRAIN_PREFIX = "train/"

EVAL_PREFIX = "eval/"
EVAL_ACCURACY = "eval/accuracy"
"""Greedy accuracy on the held-out split: logged at step 0 (before training) and at the last step (after), so
``eval/accuracy`` is one chart of two points. Runs logged before this naming have ``eval/accuracy_before`` and
``eval/accuracy_after`` (one point each); :func:`eval_before_after` reads both."""

_EVAL_SUFFIXES = ("_before", "_after")


def is_eval_curve(key: str) -> bool:
    """``eval/accuracy`` or ``eval/pass_at_<k>``: an evaluation metric under the before/after-as-steps naming."""
    return key.startswith(EVAL_PREFIX) and not key.endswith(_EVAL_SUFFIXES)


def eval_before_after(key: str, history: list[tuple[int, float]]) -> dict[str, float]:
    """``{key + "_before": ..., key + "_after": ...}`` from an eval metric's (step, value) history: before is the
    point at step 0, after the last point at a later step (either is left out when not logged)."""
    out = {}
    if history and history[0][0] == 0:
        out[f"{key}_before"] = history[0][1]
    if history and history[-1][0] > 0:
        out[f"{key}_after"] = history[-1][1]
    return out


_EVAL_TAGGED = re.compile(r"(eval/.+)_(before|after)")


def read_run_metric(client: Any, run_id: str, key: str) -> float | None:
    """The run's latest value of ``key`` in MLflow (``client`` an ``MlflowClient``), None when it has none. The
    earlier names ``eval/<name>_before`` / ``_after`` are also read from a run logged under ``eval/<name>``, so a
    sweep's ``--metric eval/accuracy_after`` means the same on runs of either naming."""
    metrics = client.get_run(run_id).data.metrics
    if key in metrics:
        return metrics[key]
    tagged = _EVAL_TAGGED.fullmatch(key)
    if tagged is None or tagged.group(1) not in metrics:
        return None
    by_step = {m.step: m.value for m in sorted(client.get_metric_history(run_id, tagged.group(1)),
                                                 key=lambda m: (m.step, m.timestamp))}
    return eval_before_after(tagged.group(1), sorted(by_step.items())).get(key)
