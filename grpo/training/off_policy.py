"""Off-policy correction of async rollouts (``async.vllm_importance_sampling_correction``,
``async.vllm_importance_sampling_mode``, ``async.vllm_importance_sampling_cap``, ``async.off_policy_mask_threshold``).

The trainer side: it finds the trainer's and the generator's log-probs and folds the weights of
:func:`grpo.algo.off_policy.importance_weights` into the per-token advantages (TRL's loss accepts (B, T) advantages;
a weight >= 0 scales each token's policy-gradient term). The maths lives in ``grpo/algo/off_policy.py``.

Where the trainer's log-probs come from: TRL computes them at generation time (``old_per_token_logps``) when the
policy changes between generation and loss (``num_iterations > 1`` or several optimizer steps per generation batch);
otherwise they equal the training forward's own log-probs, so the weights are applied inside the loss, from that
forward (no extra log-prob pass over the batch, which cost about a fifth of an async step on CPU). With
``sampling.seqlen_balancing`` (rows move between ranks after scoring) the extra pass is kept.
"""

from __future__ import annotations

from typing import Any

import torch

from grpo.algo.off_policy import importance_weights


def loss_mask(batch: dict[str, Any]) -> torch.Tensor:
    """TRL's loss mask: the completion's tokens less the environment's (``tool_mask`` 0: tool results, an
    environment's observations), which carry no gradient, no IS ratio and no share of the normaliser."""
    mask = batch["completion_mask"]
    return mask * batch["tool_mask"] if "tool_mask" in batch else mask


class OffPolicyCorrection:
    """Mixin of :class:`grpo.training.trainer.GRPOTrainer`."""

    _deferred_is: dict[str, Any] | None = None  # the loss inputs whose weights the next training forward sets

    def _correct_off_policy(self, batch: dict[str, Any], replayed: list[slice]) -> None:
        """Importance-sampling correction between generator and trainer, and the OPSM fraction.

        ``*_truncate`` modes clamp the ratio pi_train / pi_generator at the cap; ``*_mask`` modes give tokens (or
        whole sequences) above the cap weight exactly 0 -- not a clamped 1/C. Replayed rows had their log-probs
        recomputed for the current policy, so their weight is 1.
        """
        a = self.experiment.async_
        if not a.vllm_importance_sampling_correction and a.off_policy_mask_threshold is None:
            return  # nothing to correct or log
        weight_one = torch.zeros(batch["completion_ids"].shape[0], dtype=torch.bool,
                                 device=batch["completion_ids"].device)
        for rows in replayed:
            weight_one[rows] = True
        if "old_per_token_logps" in batch:
            self._apply_importance_weights(batch, batch["old_per_token_logps"], weight_one)
        elif not self._balancing:
            batch["is_weight_one"] = weight_one  # per row, so it follows the rows through shuffling and splitting
        else:
            ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
            attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
            with torch.no_grad():
                old, _, _ = super()._get_per_token_logps_and_entropies(self.model, ids, attention,
                                                                       batch["completion_ids"].shape[1])
            self._apply_importance_weights(batch, old, weight_one)

    def _compute_loss(self, model, inputs):
        """TRL's loss; on a batch whose weights wait for the training forward, that forward sets them first."""
        if "is_weight_one" not in inputs or not torch.is_grad_enabled():
            return super()._compute_loss(model, inputs)
        self._deferred_is = inputs
        try:
            return super()._compute_loss(model, inputs)
        finally:
            self._deferred_is = None

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, pixel_values=None,
                                           image_grid_thw=None, num_images=None, pixel_attention_mask=None,
                                           spatial_shapes=None, num_tiles=None, image_sizes=None, token_type_ids=None,
                                           mm_token_type_ids=None, image_position_ids=None):
        out = super()._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, compute_aux_loss,
            pixel_values=pixel_values, image_grid_thw=image_grid_thw, num_images=num_images,
            pixel_attention_mask=pixel_attention_mask, spatial_shapes=spatial_shapes, num_tiles=num_tiles,
            image_sizes=image_sizes, token_type_ids=token_type_ids, mm_token_type_ids=mm_token_type_ids,
            image_position_ids=image_position_ids)
        inputs, self._deferred_is = self._deferred_is, None  # the first forward inside the loss: the policy's
        if inputs is not None:
            self._apply_importance_weights(inputs, out[0].detach(), inputs["is_weight_one"])
        return out

    def _apply_importance_weights(self, batch: dict[str, Any], old: torch.Tensor, weight_one: torch.Tensor) -> None:
        """Scale ``batch["advantages"]`` per token by the IS weight of trainer log-probs ``old`` against the
        generator's; log the ratio's range and the clamped/masked fraction (and the OPSM fraction)."""
        a = self.experiment.async_
        mask = loss_mask(batch).float()  # environment tokens: no sampling log-prob of the policy, no weight
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
        weight[weight_one] = 1.0
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
