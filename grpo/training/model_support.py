"""Which of the exact speed features apply to a model: one answer per (feature, model), used by every feature.

The speed features are exact by construction, but each rests on something the model must offer:

- ``async.shared_prompt_forward`` (the training log-prob forward and generation's prefill) runs each distinct prompt
  once and hands its key/value cache to the rows that share it (``batch_select_indices`` on every cache layer). A cache
  layer with a recurrent state (Mamba / SSM, linear attention: transformers' ``LinearAttentionLayer`` family, in
  Nemotron-H, Falcon-H1, Qwen3-Next, LFM2) has no such operation for that state (a hybrid layer's selects its
  keys/values only), and a cache the model cannot build from its config is unknown ground: TRL's forward runs. MoE
  routers are reproduced (the prompt's router logits are indexed out to its rows like its keys/values, so TRL's
  load-balancing aux loss sees every row's tokens), and sliding-window layers keep their own window over the cached
  prompt (transformers' chunked-prefill masking), so both stay exact.
- ``async.compact_zero_advantage`` drops zero-advantage rows from the loss forward. A MoE router's load-balancing aux
  loss (TRL adds it when the config has ``output_router_logits`` and a non-zero ``router_aux_loss_coef``) is a mean
  over every token of the micro-batch, so dropping rows changes it: the whole micro-batch runs.
- DDP's ``find_unused_parameters`` (several processes): the search for parameters a forward left without a gradient
  costs a traversal of the autograd graph in every backward, and where it finds none PyTorch prints a warning on every
  rank. It is on only for a model whose forward leaves some out (:func:`parameters_left_out`); transformers' own
  choice stands under activation checkpointing and where ``ddp_find_unused_parameters`` is set.
- ``generation KV cache`` (``use_cache=True`` in evaluation and the CPU async generator): transformers builds the
  model's own cache class per layer (key/value, sliding window, recurrent state), so it applies to any model whose
  config has ``use_cache``; without it generation recomputes the whole sequence per token.

:func:`unsupported` says why a feature cannot run for a model (``None`` where it applies); :func:`applies` answers
the same and logs the reason once per model, feature and reason, naming what runs instead.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

_log = logging.getLogger(__name__)

SHARED_PROMPT_FORWARD = "async.shared_prompt_forward"
COMPACT_ZERO_ADVANTAGE = "async.compact_zero_advantage"
GENERATION_KV_CACHE = "generation KV cache"

# What runs where a feature does not apply, for the log line.
_INSTEAD = {
    SHARED_PROMPT_FORWARD: "TRL's forward runs",
    COMPACT_ZERO_ADVANTAGE: "every completion is computed (TRL's loss)",
    GENERATION_KV_CACHE: "generation runs without a KV cache",
}


def causal_lm(model) -> Any:
    """The transformers causal LM under DDP / accelerate / PEFT wrappers."""
    while hasattr(model, "module"):
        model = model.module
    if hasattr(model, "get_base_model"):  # peft: LoRA layers are in place inside the base model
        model = model.get_base_model()
    return model


def backbone(model) -> Any:
    """The decoder stack under the causal LM's head (``base_model``), or ``None`` for a model without one."""
    lm = causal_lm(model)
    stack = getattr(lm, "base_model", None)
    return None if stack is lm else stack


def _prompt_cache_problem(lm) -> str | None:
    """Why a prompt's cache cannot be handed to the rows sharing it, or ``None``: the cache transformers builds for
    ``lm`` from its config (the one its forward creates) must be made of key/value layers that select rows."""
    from transformers.cache_utils import DynamicCache, LinearAttentionCacheLayerMixin

    try:
        cache = DynamicCache(config=lm.config.get_text_config(decoder=True))
    except Exception as error:  # noqa: BLE001 -- any failure means the cache is not the one this feature knows
        return f"its cache cannot be built from the config ({type(error).__name__}: {error})"
    recurrent = sorted({type(layer).__name__ for layer in cache.layers
                        if isinstance(layer, LinearAttentionCacheLayerMixin)})
    if recurrent:
        return (f"its cache has recurrent-state layers ({', '.join(recurrent)}: Mamba / linear attention), whose state "
                "is not a per-token key/value cache that the completions can share")
    missing = sorted({type(layer).__name__ for layer in cache.layers if not hasattr(layer, "batch_select_indices")})
    if missing:
        return f"its cache layers ({', '.join(missing)}) cannot select rows"
    return None


# Per model, the shared prompt's answer ("" where it applies): it depends on the model's classes and config only.
_cache_reasons: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def unsupported(feature: str, model, *, router_aux_loss: bool = False) -> str | None:
    """Why ``feature`` cannot run exactly for ``model`` (any wrapper), or ``None`` where it applies.

    ``router_aux_loss``: TRL adds a MoE router's load-balancing loss to this model's loss (the trainer's
    ``aux_loss_enabled``).
    """
    lm = causal_lm(model)
    if feature == SHARED_PROMPT_FORWARD:  # asked on every forward: the answer is the model class's, kept per model
        known = _cache_reasons.get(lm)
        if known is None:
            known = _cache_reasons[lm] = ("it has no separate backbone under its LM head" if backbone(model) is None
                                          else _prompt_cache_problem(lm)) or ""
        return known or None
    if feature == COMPACT_ZERO_ADVANTAGE:
        return "a router auxiliary loss (over every token)" if router_aux_loss else None
    if feature == GENERATION_KV_CACHE:
        config = getattr(lm, "config", None)
        if config is None or not hasattr(config.get_text_config(decoder=True), "use_cache"):
            return "its config has no use_cache (it keeps no KV cache)"
        return None
    raise ValueError(f"unknown feature {feature!r}: one of {', '.join(_INSTEAD)}")


# Per model, the (feature, reason) pairs already logged (weak keys: a model's entry goes with the model).
_said: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def say_once(feature: str, model, reason: str) -> None:
    """Log once per model (under its wrappers), feature and reason that ``feature`` falls back, and why: the
    training forward and generation's prefill ask on every call, and the log says it once."""
    lm = causal_lm(model)
    said = _said.setdefault(lm, set())
    if (feature, reason) not in said:
        said.add((feature, reason))
        _log.info("%s: %s for %s (%s)", feature, _INSTEAD[feature], type(lm).__name__, reason)


def applies(feature: str, model, *, router_aux_loss: bool = False) -> bool:
    """Whether ``feature`` runs for ``model`` (:func:`unsupported` is ``None``); where it does not, the reason is
    logged once (:func:`say_once`)."""
    reason = unsupported(feature, model, router_aux_loss=router_aux_loss)
    if reason is not None:
        say_once(feature, model, reason)
    return reason is None


def parameters_left_out(model) -> list[str]:
    """The trainable parameters of ``model`` that a one-token forward does not reach, found by walking the forward's
    autograd graph (no backward, no gradient memory). Experts a router did not pick for that token are what a forward
    leaves out; transformers' MoE models keep each layer's experts in one fused tensor, which every forward reaches,
    while a model with one module per expert (remote code, older MoE classes) leaves the unpicked ones out."""
    import torch

    names = {p: name for name, p in model.named_parameters() if p.requires_grad}
    if not names:
        return []
    device = next(iter(names)).device
    training = model.training
    model.eval()  # no dropout or router jitter: the probe draws nothing from the run's random streams
    try:
        with torch.enable_grad():
            out = model(input_ids=torch.zeros((1, 1), dtype=torch.long, device=device), use_cache=False)
    finally:
        model.train(training)
    reached, seen = set(), set()
    stack = [out.logits.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # an AccumulateGrad node: the leaf tensor it accumulates into
        if variable is not None:
            reached.add(variable)
        stack.extend(child for child, _ in node.next_functions)
    return [name for p, name in names.items() if p not in reached]


__all__ = ["COMPACT_ZERO_ADVANTAGE", "GENERATION_KV_CACHE", "SHARED_PROMPT_FORWARD", "applies", "backbone",
           "causal_lm", "parameters_left_out", "say_once", "unsupported"]
