"""Chunked backward (``grpo.num_generations_chunks``): one micro-batch's completions in chunks, each with its own
forward and backward, so activation memory is bounded by a chunk while advantages still come from whole groups.
The chunk losses are weighted so the summed gradient equals the unchunked one for every loss type and TRL's
entropy options (``tests/test_loss_extensions.py``).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch


class ChunkedLoss:
    """Mixin of :class:`grpo.training.trainer.GRPOTrainer`, called from ``compute_policy_loss``."""

    def _chunked_loss(self, model, inputs: dict[str, torch.Tensor | Any], chunks: int, scale: float = 1.0
                      ) -> torch.Tensor:
        """Backward every chunk but the last here; return the last chunk's loss for the trainer's own backward.

        Each chunk is TRL's loss on its rows, weighted so the chunks sum to the micro-batch's loss: the policy term by
        the chunk's share of the loss type's normaliser, TRL's entropy options by their micro-batch meaning. The
        high-entropy token mask (``top_entropy_quantile``) comes from one quantile over the whole micro-batch (all
        ranks), computed by a no-grad forward pass per chunk before the backward passes (one extra forward); the
        entropy bonus (``entropy_coef``, a token mean over the micro-batch) is rescaled per chunk to the chunk's
        share of that mean. (``use_adaptive_entropy`` is refused with chunks at load.) ``scale`` multiplies the
        whole micro-batch loss (see :meth:`_balanced_weight`).

        DDP decides at forward time whether a backward all-reduces, so the earlier chunks run forward *and* backward
        under ``no_sync``: gradients are synchronised once, by the last chunk, and only on the micro-step where the
        trainer synchronises at all.
        """
        n = inputs["completion_ids"].shape[0]
        bounds = [round(i * n / chunks) for i in range(chunks + 1)]
        spans = [(lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:]) if hi > lo]
        per_sample = [k for k, v in inputs.items() if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == n]
        mask = inputs["completion_mask"]
        if "tool_mask" in inputs:  # TRL's loss mask: tool-call tokens do not count
            mask = mask * inputs["tool_mask"]
        chunk_inputs = [{k: (v[lo:hi] if k in per_sample else v) for k, v in inputs.items()} for lo, hi in spans]

        entropy_mask = None
        if self.top_entropy_quantile < 1.0:
            entropies = torch.cat([self._chunk_entropies(model, chunk) for chunk in chunk_inputs])
            entropy_mask = super().get_high_entropy_mask(entropies, mask, 1 - self.top_entropy_quantile)
        bonus_mask = mask if entropy_mask is None else mask * entropy_mask
        bonus_tokens = float(bonus_mask.sum())
        total_tokens = float(mask.sum())
        coef = self.entropy_coef
        logged_coefs = self._metrics["train"]["entropy_coef"]
        logged_before = len(logged_coefs)

        done = torch.zeros((), device=mask.device)
        loss = done
        try:
            for i, ((lo, hi), chunk) in enumerate(zip(spans, chunk_inputs)):
                if self.loss_type == "bnpo":  # normalised by the micro-batch's token count
                    weight = float(mask[lo:hi].sum()) / total_tokens if total_tokens else 0.0
                elif self.loss_type in ("cispo", "dapo", "vespo"):  # normalised by the generation batch's token count
                    weight = 1.0
                else:  # grpo, sapo, dr_grpo, luspo: means over sequences
                    weight = (hi - lo) / n
                if self._entropy_bonus_enabled:
                    # TRL subtracts coef x (this chunk's entropy mean); after the weight it must be coef x (this
                    # chunk's entropy sum / the micro-batch's bonus tokens). (weight 0: no tokens, nothing to scale)
                    share = float(bonus_mask[lo:hi].sum()) / bonus_tokens if bonus_tokens else 0.0
                    self.entropy_coef = coef * share / weight if weight > 0 else coef
                self._entropy_mask_override = None if entropy_mask is None else entropy_mask[lo:hi]
                last = i == len(spans) - 1
                with contextlib.nullcontext() if last else self.accelerator.no_sync(model):
                    loss = super()._compute_loss(model, chunk) * (weight * scale)
                    if not last:
                        self.accelerator.backward(loss)
                        done = done + loss.detach()
        finally:
            self.entropy_coef = coef
            self._entropy_mask_override = None
        if len(logged_coefs) > logged_before:  # TRL logged the per-chunk coefficients: log the real one, once
            del logged_coefs[logged_before:]
            logged_coefs.append(coef)
        # the caller backpropagates the returned tensor: only the last chunk's graph is still attached
        return loss + done

    _entropy_mask_override: torch.Tensor | None = None

    def get_high_entropy_mask(self, entropies: torch.Tensor, mask: torch.Tensor, threshold: float) -> torch.Tensor:
        """TRL's mask, except inside a chunked loss, where the chunk's rows of the micro-batch's mask are used."""
        if self._entropy_mask_override is not None:
            return self._entropy_mask_override
        return super().get_high_entropy_mask(entropies, mask, threshold)

    @torch.no_grad()
    def _chunk_entropies(self, model, chunk: dict[str, torch.Tensor | Any]) -> torch.Tensor:
        """Per-token entropies of one chunk, computed exactly as TRL's loss computes them (no graph kept)."""
        ids = torch.cat([chunk["prompt_ids"], chunk["completion_ids"]], dim=1)
        attention = torch.cat([chunk["prompt_mask"], chunk["completion_mask"]], dim=1)
        multimodal = ("pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes",
                      "num_tiles", "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids")
        _, entropies, _ = self._get_per_token_logps_and_entropies(
            model, ids, attention, chunk["completion_ids"].size(1), compute_entropy=True,
            **{k: chunk.get(k) for k in multimodal},
        )
        return entropies

