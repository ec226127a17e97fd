"""Episode statistics for training metrics and traces: one function, :func:`episode_metrics`, that every rollout path
(the sync trainer, the async generator, vLLM) and the tracking modules use, so a figure means the same everywhere.

Rates are per episode, so they compare across batch sizes and ranks:

=====================================  ==========================================================================
``env/tools/call_frequency``           tool calls per episode (an unknown tool name is a call, as in TRL's count)
``env/tools/failure_frequency``        failed calls (the tool raised, or no tool has that name) per call
``env/turns/mean``, ``env/turns/max``  model turns per episode
``env/samples/mean``                   samples (training rows) per episode: 1, plus one per history rewrite
``env/env_tokens/mean``                environment tokens per episode (not trained on, not completion length)
``env/generated_tokens/mean``          model tokens generated per episode, those cut off after a turn's end included
``env/generated_over_kept``            model tokens generated over those kept (1.0: every turn stopped where it ends)
``env/truncated_frac``                 episodes cut off by the turn or token budget
``env/errors``                         episodes ended by an environment error (reward NaN) per episode
``env/unknown_tool_calls``             calls naming no tool of the environment, per episode
``env/refused_calls``                  an agent's model calls the endpoint refused (HTTP error), per episode
``env/tools/<tool>/calls``             calls of that tool per episode
``env/tools/<tool>/failures``          its calls that raised, per episode
``env/tools/<tool>/latency_s``         its mean wall-clock seconds per call
``env/<environment>/reward_mean``      mean reward of that environment's scored episodes (NaN ones left out)
=====================================  ==========================================================================

Per-tool and per-environment entries appear for the tools called and the environments whose episodes were scored in
the batch, ``env/refused_calls`` for a batch with agent episodes (an agent's chat calls' OpenAI ``tool_calls`` are
its tool calls: a name its request's ``tools`` offered is a call, another an unknown one); no value is NaN (TRL
averages a logging step's values, and one NaN would hide the others).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from grpo.environments.episodes import Episode


def tool_metrics(totals: Mapping[str, Sequence[float]], episodes: int) -> dict[str, float]:
    """``env/tools/<tool>/calls|failures|latency_s`` from each tool's ``(calls, failures, seconds)`` over
    ``episodes`` episodes, in the order of ``totals``."""
    out: dict[str, float] = {}
    for name, (calls, failures, seconds) in totals.items():
        out[f"env/tools/{name}/calls"] = calls / max(1, episodes)
        out[f"env/tools/{name}/failures"] = failures / max(1, episodes)
        out[f"env/tools/{name}/latency_s"] = seconds / calls if calls else 0.0
    return out


def episode_metrics(episodes: Sequence[Episode]) -> dict[str, float]:
    """The statistics above for ``episodes`` (an empty batch gives an empty dict). An episode's environment name is
    its ``environment`` attribute (None: left out of the per-environment rewards)."""
    n = len(episodes)
    if n == 0:
        return {}
    calls: dict[str, int] = {}
    failures: dict[str, int] = {}
    seconds: dict[str, float] = {}
    for ep in episodes:
        for name, count in ep.tool_calls.items():
            calls[name] = calls.get(name, 0) + count
            seconds[name] = seconds.get(name, 0.0) + ep.tool_seconds.get(name, 0.0)
        for name, count in ep.tool_failures.items():
            failures[name] = failures.get(name, 0) + count
    unknown = sum(ep.unknown_tool_calls for ep in episodes)
    generated, kept = sum(ep.generated_tokens for ep in episodes), sum(ep.model_tokens for ep in episodes)
    all_calls = sum(calls.values()) + unknown
    out = {
        "env/tools/call_frequency": all_calls / n,
        "env/tools/failure_frequency": (sum(failures.values()) + unknown) / all_calls if all_calls else 0.0,
        "env/turns/mean": sum(ep.turns for ep in episodes) / n,
        "env/turns/max": float(max(ep.turns for ep in episodes)),
        "env/samples/mean": sum(1 + len(ep.samples) for ep in episodes) / n,
        "env/env_tokens/mean": sum(ep.env_tokens for ep in episodes) / n,
        "env/generated_tokens/mean": generated / n,
        "env/generated_over_kept": generated / kept if kept else 1.0,
        "env/truncated_frac": sum(ep.truncated for ep in episodes) / n,
        "env/errors": sum(ep.error is not None for ep in episodes) / n,
        "env/unknown_tool_calls": unknown / n,
    }
    if any(ep.model_calls for ep in episodes):
        out["env/refused_calls"] = sum("refused" in c for ep in episodes for c in ep.model_calls) / n
    out |= tool_metrics({name: (calls[name], failures.get(name, 0), seconds[name]) for name in sorted(calls)}, n)
    rewards: dict[str, list[float]] = {}
    for ep in episodes:
        name = getattr(ep, "environment", None)
        if name is not None and ep.reward is not None and not math.isnan(ep.reward):
            rewards.setdefault(name, []).append(ep.reward)
    for name in sorted(rewards):
        out[f"env/{name}/reward_mean"] = math.fsum(rewards[name]) / len(rewards[name])
    return out


__all__ = ["episode_metrics"]
