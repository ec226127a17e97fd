"""How the trainer's metrics are named in MLflow.

MLflow's run page groups metric charts by key prefix (everything before the last ``/``), sections in alphabetical
order and unprefixed keys last, and within a section orders the charts alphabetically too; the layout is kept only in
the browser (localStorage, per run), so the names are the one way to choose what a person sees first. Under TRL's own
names the page opened on five all-zero ``clip_ratio`` charts, and ``reward`` sat in the last section. As Hugging
Face's W&B integration does, the trainer's metrics are logged under ``train/`` (``train/reward``,
``train/clip_ratio/low_mean``), and the page then opens on ``eval`` (accuracy before and after training, one line).
Within ``train`` the reward alone (``train/reward``, ``train/reward_std``) leads: TRL's other top-level figures
(``loss``, ``kl``, ``entropy``, ``grad_norm``, ``learning_rate``, ...) all sort before ``reward`` and pushed it to the
third row of charts, so they are logged one level down, ``train/aux/<name>``, a section of their own that follows
(only ``train/async`` sorts between them). The names TRL nests itself keep their sections (``train/clip_ratio``,
``train/completions``, ``train/rewards/<function>``): :func:`train_key`.
``metrics.jsonl`` in the run directory keeps TRL's names; readers of MLflow (the comparison dashboard) get them back
with :func:`trainer_name`.
"""

from __future__ import annotations

import re
from typing import Any

TRAIN_PREFIX = "train/"
AUX_PREFIX = "train/aux/"
HEADLINE = ("reward", "reward_std")
"""The trainer's figures that stay directly under ``train/``, the first charts of the section."""


def train_key(name: str) -> str:
    """The MLflow key of the trainer's metric ``name`` (TRL's): ``train/reward``, ``train/clip_ratio/low_mean``,
    ``train/aux/loss``."""
    return f"{TRAIN_PREFIX}{name}" if "/" in name or name in HEADLINE else f"{AUX_PREFIX}{name}"


def trainer_name(key: str) -> str:
    """TRL's name of an MLflow key :func:`train_key` made (``train/aux/loss`` -> ``loss``); keys of runs logged before
    ``train/aux/`` (``train/loss``) or before ``train/`` (``loss``) read the same. Other keys come back as they are."""
    name = key.removeprefix(TRAIN_PREFIX)
    rest = name.removeprefix("aux/")
    return rest if key.startswith(AUX_PREFIX) and "/" not in rest else name


def _other_naming(key: str) -> str | None:
    """The same trainer metric under the naming before or after ``train/aux/`` (``train/loss`` <-> ``train/aux/loss``),
    or None for a key that has no other."""
    if not key.startswith(TRAIN_PREFIX):
        return None
    name = trainer_name(key)
    return next((other for other in (train_key(name), f"{TRAIN_PREFIX}{name}") if other != key), None)


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
    sweep's ``--metric eval/accuracy_after`` means the same on runs of either naming; likewise ``train/loss`` and
    ``train/aux/loss``."""
    metrics = client.get_run(run_id).data.metrics
    if key in metrics:
        return metrics[key]
    other = _other_naming(key)
    if other in metrics:
        return metrics[other]
    tagged = _EVAL_TAGGED.fullmatch(key)
    if tagged is None or tagged.group(1) not in metrics:
        return None
    by_step = {m.step: m.value for m in sorted(client.get_metric_history(run_id, tagged.group(1)),
                                                 key=lambda m: (m.step, m.timestamp))}
    return eval_before_after(tagged.group(1), sorted(by_step.items())).get(key)
