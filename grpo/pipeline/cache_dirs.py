"""Where the cached stage outputs live: content-addressed directories under the cache root.

Prepared data and sampler plans are keyed on the stage's own inputs (not the whole config) plus the source code that
computes them, so a changed training field reuses them, an edited data file or prep code lands in a new directory,
and every path (``grpo run``, the Prefect UI, torchrun ranks, benchmarks) finds the same output in the same place.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
from pathlib import Path
from types import ModuleType
from typing import Any

from grpo.config import ExperimentConfig
from grpo.paths import cache_root

# The modules whose source is part of each stage's key (imported lazily: grpo.pipeline.stages imports this module).
PREP_CODE = ("grpo.pipeline.prep", "grpo.tasks", "grpo.pipeline.stages")
PLAN_CODE = ("grpo.algo.plan", "grpo.algo.batch_layout", "grpo.pipeline.plans", "grpo.pipeline.stages",
             "grpo.training.prompts")


def _code_hash(modules: tuple[str, ...]) -> str:
    sources = (inspect.getsource(importlib.import_module(m) if isinstance(m, str) else m) for m in modules)
    return hashlib.sha256("".join(sources).encode()).hexdigest()[:16]


def stage_key(kind: str, payload: dict[str, Any], modules: tuple[str | ModuleType, ...]) -> str:
    """``kind-<hash>`` of a JSON payload and the source of ``modules``."""
    blob = json.dumps(payload, sort_keys=True, default=str) + _code_hash(modules)
    return f"{kind}-{hashlib.sha256(blob.encode()).hexdigest()[:20]}"


def prep_dir_for(cfg: ExperimentConfig) -> Path:
    """Content-addressed location of prepared data: the same data config, source contents and code always land in
    one place, and an edited source file lands in a new one."""
    from grpo.environments import routable_environments
    from grpo.pipeline.prep import source_fingerprint

    payload = {**cfg.data.model_dump(mode="json"), "source_fingerprint": source_fingerprint(cfg.data)}
    if (environments := routable_environments(cfg.environment)) is not None:  # a new name re-validates the rows
        payload["environments"] = environments
    return cache_root() / "prepared" / stage_key("prep", payload, PREP_CODE)


def plan_dir_for(cfg: ExperimentConfig, data_hash: str) -> Path:
    """Content-addressed location of the sampler plan: the prepared data's hash, the batch layout (however its
    fields were set), the run length, the sampler's order and balancing fields and the tokenizer."""
    payload = {"data": data_hash, "layout": cfg.batch_layout.cache_key_payload(),
               "sampling": cfg.sampling.model_dump(mode="json"),
               "grpo": {"max_steps": cfg.grpo.max_steps, "seed": cfg.grpo.seed},
               "tokenizer": tokenizer_fingerprint(cfg.model.name_or_path), **_chat_template_key(cfg),
               **_chat_tools_key(cfg)}
    return cache_root() / "plans" / stage_key("plan", payload, PLAN_CODE)


def _chat_template_key(cfg) -> dict[str, str]:
    """The plan's key part for ``model.chat_template`` (none when unset, so earlier plans keep their keys)."""
    text = cfg.model.chat_template_text()
    return {"chat_template": hashlib.sha256(text.encode()).hexdigest()[:16]} if text else {}


def _chat_tools_key(cfg) -> dict[str, Any]:
    """The plan's key part for protocol chat, whose prompts carry the tools' schemas (none otherwise, so earlier plans
    keep their keys)."""
    env = cfg.environment
    if not env.is_chat:
        return {}
    return {"chat_tools": {"name": env.name, "kwargs": env.kwargs, "tools": env.tools}}


def tokenizer_fingerprint(name_or_path: str) -> str:
    """What the plan's token counts depend on: a local model folder's tokenizer files by content (a retrained
    tokenizer or a new chat template in the same folder plans again), otherwise the name (hub id or 'tiny')."""
    folder = Path(name_or_path)
    if not folder.is_dir():
        return name_or_path
    digest = hashlib.sha256()
    for path in sorted(folder.iterdir()):
        if path.is_file() and (path.name.startswith("tokenizer") or path.name in {
                "chat_template.jinja", "vocab.json", "merges.txt", "special_tokens_map.json"}):
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return f"{folder.resolve()}:{digest.hexdigest()[:16]}"
