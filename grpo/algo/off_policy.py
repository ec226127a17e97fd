"""Importance-sampling weights for rollouts sampled by a lagging policy (async generation).

The generator's weights are up to ``async.max_staleness`` steps behind the trainer's, so its samples are slightly
off-policy. The per-token ratio ``pi_train / pi_generator`` corrects the policy-gradient term; its tail is bounded
by a cap ``C`` in one of four modes (``async.vllm_importance_sampling_mode``, TRL's names):

* ``token_truncate`` / ``sequence_truncate``: the ratio clamped at ``C`` (per token, or the sequence's ratio);
* ``token_mask`` / ``sequence_mask``: ratios above ``C`` get weight exactly 0, the token (or whole sequence) drops
  out of the gradient. (axolotl clamped these zeros back up to ``1/C``; here a masked weight stays 0.)
"""

from __future__ import annotations

import torch

MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def importance_weights(
    old_logps: torch.Tensor, sampling_logps: torch.Tensor, mask: torch.Tensor, mode: str, cap: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(ratio, weight, over_cap)``, each (rows, tokens): the IS ratio, the weight that multiplies each token's
    policy-gradient term, and where the ratio exceeds ``cap``. Padding (``mask`` 0) contributes nothing to a
    sequence ratio; NaN sampling log-probs (no generator value) count as 0."""
    if mode not in MODES:
        raise ValueError(f"importance sampling mode {mode!r}: valid modes are {', '.join(MODES)}")
    mask = mask.float()
    diff = (old_logps - torch.nan_to_num(sampling_logps, nan=0.0)) * mask
    ratio = diff.sum(1, keepdim=True).exp().expand_as(mask) if mode.startswith("sequence") else diff.exp()
    over = ratio > cap
    weight = ratio.clamp(max=cap) if mode.endswith("truncate") else torch.where(over, torch.zeros_like(ratio), ratio)
    return ratio, weight, over
