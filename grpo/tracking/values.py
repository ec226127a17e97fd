"""What MLflow accepts, and the values the tracker sends in that form: MLflow's size limits, metric keys and numbers,
param and tag values, with secrets masked before anything leaves the process."""

from __future__ import annotations

import json
import math
import numbers
import re
from collections.abc import Iterator, Mapping
from typing import Any

# MLflow's limits (mlflow.utils.validation in 3.x); read from MLflow when available, these are the fallbacks.
MAX_METRICS_PER_BATCH = 1000
MAX_PARAMS_TAGS_PER_BATCH = 100
MAX_PARAM_VAL_LENGTH = 6000
MAX_TAG_VAL_LENGTH = 8000
MAX_ENTITY_KEY_LENGTH = 250
try:  # pragma: no branch - the constants exist in every MLflow this project supports
    from mlflow.utils import validation as _mlflow_validation

    MAX_METRICS_PER_BATCH = _mlflow_validation.MAX_METRICS_PER_BATCH
    MAX_PARAMS_TAGS_PER_BATCH = _mlflow_validation.MAX_PARAMS_TAGS_PER_BATCH
    MAX_PARAM_VAL_LENGTH = _mlflow_validation.MAX_PARAM_VAL_LENGTH
    MAX_TAG_VAL_LENGTH = _mlflow_validation.MAX_TAG_VAL_LENGTH
    MAX_ENTITY_KEY_LENGTH = _mlflow_validation.MAX_ENTITY_KEY_LENGTH
except (ImportError, AttributeError):  # pragma: no cover
    pass

_TRUNCATED = "...[truncated]"
_BAD_KEY_CHARS = re.compile(r"[^/\w.\- :]")


def sanitize_metric_key(key: str) -> str:
    """A name MLflow accepts: ``eval/pass@8`` -> ``eval/pass_at_8``; other invalid characters become ``_``."""
    out = _BAD_KEY_CHARS.sub("_", str(key).replace("@", "_at_"))
    parts = [p for p in out.split("/") if p not in ("", ".", "..")]
    out = "/".join(parts) or "_"
    return out[:MAX_ENTITY_KEY_LENGTH]


_SECRET_KEY = re.compile(r"token|secret|passw|api_?key|credential|private_key", re.IGNORECASE)
REDACTED = "***"


def numeric_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The metrics MLflow can take, as floats: numbers and 0-d tensors / numpy scalars; booleans, other values and NaN
    are left out. The one place metric values are cleaned (every logging path goes through the tracker)."""
    clean: dict[str, float] = {}
    for key, value in metrics.items():
        if type(value) is float or type(value) is int:  # the trainer's logs: no ABC check per value on every step
            if value == value:
                clean[key] = float(value)
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            if not (hasattr(value, "item") and getattr(value, "ndim", 1) == 0):
                continue
            value = value.item()  # 0-d tensor / numpy scalar
        value = float(value)
        if not math.isnan(value):
            clean[key] = value
    return clean


def redact(key: str, value: Any) -> Any:
    """``value`` with secrets masked: a token/secret/password-like key's value, recursively inside mappings, so a
    ``grpo.extra.hub_token`` never reaches a tracking store in plain text."""
    if _SECRET_KEY.search(str(key).rsplit(".", 1)[-1]) and value not in (None, ""):
        return REDACTED
    if isinstance(value, Mapping):
        return {k: redact(str(k), v) for k, v in value.items()}
    return value


def param_value(value: Any) -> str:
    """MLflow param value: strings as is, scalars via ``str``, lists/dicts as compact JSON; cut at MLflow's limit."""
    if isinstance(value, str):
        text = value
    elif value is None or isinstance(value, (bool, int, float)):
        text = str(value)
    else:
        text = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    if len(text) > MAX_PARAM_VAL_LENGTH:
        text = text[: MAX_PARAM_VAL_LENGTH - len(_TRUNCATED)] + _TRUNCATED
    return text


def tag_value(value: Any) -> str:
    """A tag value: strings as is, lists/dicts as compact JSON (:func:`param_value`), other values via ``str``; cut at
    MLflow's limit."""
    text = value if isinstance(value, str) else param_value(value) if isinstance(value, (list, dict)) else str(value)
    if len(text) > MAX_TAG_VAL_LENGTH:
        text = text[: MAX_TAG_VAL_LENGTH - len(_TRUNCATED)] + _TRUNCATED
    return text


def in_chunks(items: list, size: int) -> Iterator[list]:
    for i in range(0, len(items), size):
        yield items[i : i + size]
