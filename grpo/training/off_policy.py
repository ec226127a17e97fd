"""Off-policy correction of async rollouts (``async.vllm_importance_sampling_correction``,
``async.vllm_importance_sampling_mode``, ``async.vllm_importance_sampling_cap``, ``async.off_policy_mask_threshold``).

The trainer side: it finds the trainer's and the generator's log-probs in the scored batch and folds the weights
of :func:`grpo.algo.off_policy.importance_weights` into the per-token advantages (TRL's loss accepts (B, T)
advantages; a weight >= 0 scales each token's policy-gradient term). The maths lives in ``grpo/algo/off_policy.py``.
"""

from __future__ import annotations

from typing import Any

import torch

from grpo.algo.off_policy import importance_weights


class OffPolicyCorrection:
    """Mixin of :class:`grpo.training.trainer.GRPOTrainer`."""

    def _correct_off_policy(self, batch: dict[str, Any], replayed: list[slice]) -> None:
        """Importance-sampling correction between generator and trainer, and the OPSM fraction.

        ``*_truncate`` modes clamp the ratio pi_train / pi_generator at the cap; ``*_mask`` modes give tokens (or
        whole sequences) above the cap weight exactly 0 -- not a clamped 1/C. Replayed rows had their log-probs
        recomputed for the current policy, so their weight is 1.
        """
        a = self.experiment.async_
        if not a.vllm_importance_sampling_correction and a.off_policy_mask_threshold is None:
            return  # nothing to correct or log: skip the extra log-prob pass
        mask = batch["completion_mask"].float()
        if "old_per_token_logps" not in batch:
            ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
            attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
            with torch.no_grad():
                old, _, _ = self._get_per_token_logps_and_entropies(self.model, ids, attention,
                                                                    batch["completion_ids"].shape[1])
        else:
            old = batch["old_per_token_logps"]

        if a.off_policy_mask_threshold is not None:  # TRL applies the mask in its loss; this logs its first-pass size
            sampling = torch.nan_to_num(batch["sampling_per_token_logps"], nan=0.0)
            seq_kl = ((sampling - old) * mask).sum(1) / mask.sum(1).clamp(min=1.0)
            masked = (batch["advantages"] < 0) & (seq_kl > a.off_policy_mask_threshold)
            self._record("sampling/opsm_frac_masked", masked.float().mean().item())
        if not a.vllm_importance_sampling_correction:
            return
        mode = a.vllm_importance_sampling_mode
        ratio, weight, over = importance_weights(old, batch["sampling_per_token_logps"], mask, mode,
                                                 a.vllm_importance_sampling_cap)
        for rows in replayed:
            weight[rows] = 1.0
        valid = mask.bool()
        r = ratio[valid]
        if r.numel():
            self._record("sampling/importance_sampling_ratio/min", r.min().item())
            self._record("sampling/importance_sampling_ratio/mean", r.mean().item())
            self._record("sampling/importance_sampling_ratio/max", r.max().item())
        frac = over[valid].float().mean().item() if r.numel() else 0.0
        self._record("sampling/is_frac_clamped" if mode.endswith("truncate") else "sampling/is_frac_masked", frac)
        advantages = batch["advantages"]
        batch["advantages"] = (advantages.unsqueeze(1) if advantages.dim() == 1 else advantages) * weight * mask
