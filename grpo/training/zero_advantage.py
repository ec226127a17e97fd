"""Zero-advantage completions: skipping (``async.skip_zero_advantage_batches``) and compaction
(``async.compact_zero_advantage``).

A micro-batch whose advantages are all zero on every rank has no policy-gradient signal (with ``beta = 0``): its
forward and backward are skipped on all ranks together, so DDP never waits on a rank that skipped alone.

Compaction goes further, row by row: a completion with advantage exactly 0 contributes exactly zero to every loss
type's policy term (each per-token loss is a product with its advantage), so, where nothing else in the loss reads
it, the micro-batch's forward and backward run on its non-zero-advantage completions only, and the loss is rescaled
by the kept rows' share of the loss type's normaliser (:func:`normaliser_share`), which gives TRL's uncompacted
gradient (``tests/test_compaction.py``, every loss type, with chunks and balancing weights).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from typing import Any

import torch

from grpo.training.model_support import COMPACT_ZERO_ADVANTAGE, unsupported

_log = logging.getLogger(__name__)

# Per loss type (TRL 1.16's ``_compute_loss``), what the micro-batch's policy loss is divided by:
# a mean over the micro-batch's sequences (grpo and sapo: a mean of per-sequence token means; luspo: a mean of
# per-sequence sums; dr_grpo: the row count x max_completion_length) ...
ROW_COUNT_NORMALISED = ("grpo", "sapo", "dr_grpo", "luspo")
# ... the micro-batch's loss-token count (bnpo) ...
TOKEN_COUNT_NORMALISED = ("bnpo",)
# ... or ``num_items_in_batch``, the generation batch's global token count, which no selection of rows changes.
GLOBAL_TOKEN_NORMALISED = ("dapo", "cispo", "vespo")

# Inputs that are not split by rows (TRL splits images by grid, not by completion): compaction leaves these batches
# whole rather than guess how to select their rows.
_MULTIMODAL = ("pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes", "num_tiles",
               "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids")

# The loss call measured for ``compaction/saved_s`` is a forward pass (the trainer backpropagates its result later).
# A backward pass costs about two forward passes, so forward + backward is about 3x the forward.
FORWARD_BACKWARD_PER_FORWARD = 3.0


def rows_with_signal(advantages: torch.Tensor) -> torch.Tensor:
    """Whether each row has a non-zero advantage (for (B, T) advantages: anywhere in the row). NaN counts as signal:
    a NaN row is left to TRL's loss, whatever that makes of it."""
    nonzero = advantages != 0
    return nonzero.reshape(nonzero.shape[0], -1).any(dim=1)


def rows_to_keep(advantages: torch.Tensor, min_rows: int, signal_rows: int | None = None) -> torch.Tensor:
    """Indices (ascending) of the rows with signal, topped up with the first zero-advantage rows to ``min_rows``
    (capped at the batch size): a zero-advantage row adds exactly zero, and the top-up keeps the number of loss calls
    and their row counts (and so TRL's metric collectives) the same on every rank.

    ``signal_rows`` is the count of rows with signal when the caller has it. The index's length is then known on the
    host, so the rows are found with ``nonzero_static`` and the device is not waited for; without it, counting them
    is the one wait."""
    signal = rows_with_signal(advantages)
    count = int(signal.sum()) if signal_rows is None else signal_rows
    size = max(count, min(min_rows, signal.numel()))
    if size > count:  # the first (size - count) zero-advantage rows join, in order
        signal = signal | (torch.cumsum(~signal, 0) <= size - count)
    return torch.nonzero_static(signal, size=size).flatten()


def normaliser_share(loss_type: str, mask: torch.Tensor, keep: torch.Tensor) -> float | None:
    """The factor that turns TRL's loss on the rows ``keep`` into the micro-batch's loss (the same gradient), or
    ``None`` where no factor does.

    TRL divides the summed per-token loss by a normaliser: for the row-count losses the kept loss is divided by
    ``len(keep)`` instead of the micro-batch's ``n`` rows, so the share is ``len(keep) / n``; for bnpo by the kept
    rows' loss tokens instead of all of them, so the share is their ratio; the global-token-count losses need none.
    (When the kept rows have no loss token, their loss is 0 and any factor is exact.)
    """
    n = mask.shape[0]
    if loss_type in ROW_COUNT_NORMALISED:
        return len(keep) / n if n else 1.0
    if loss_type in TOKEN_COUNT_NORMALISED:
        total = float(mask.sum())
        return float(mask[keep].sum()) / total if total > 0 else 1.0
    if loss_type in GLOBAL_TOKEN_NORMALISED:
        return 1.0
    return None


def select_rows(inputs: dict[str, torch.Tensor | Any], keep: torch.Tensor) -> dict[str, torch.Tensor | Any]:
    """The rows ``keep`` of a micro-batch: per-sample tensors (first dimension = the row count) are indexed, the
    rest (``num_items_in_batch``, ``balanced_rows``, ...) is shared."""
    n = inputs["completion_ids"].shape[0]
    index = keep.to(inputs["completion_ids"].device)
    return {k: (v.index_select(0, index) if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == n else v)
            for k, v in inputs.items()}


class ZeroAdvantageSkip:
    """Mixin of :class:`grpo.training.trainer.GRPOTrainer`, called from ``compute_policy_loss``."""

    def _zero_loss(self, model, inputs: dict[str, torch.Tensor | Any]) -> torch.Tensor:
        """A zero loss whose backward gives every parameter a zero gradient, for a skipped micro-batch.

        DDP decides in its forward whether the next backward all-reduces. On the micro-step that synchronises (the
        last of an accumulation window) the zero must therefore come out of the DDP module's forward, or the
        gradients accumulated under ``no_sync`` in the window's earlier micro-steps are never averaged and the ranks
        step apart. One row is enough. Elsewhere a zero built from the parameters costs no forward at all.
        """
        if self.accelerator.num_processes > 1 and self.accelerator.sync_gradients:
            ids = torch.cat([inputs["prompt_ids"][:1], inputs["completion_ids"][:1]], 1)
            mask = torch.cat([inputs["prompt_mask"][:1], inputs["completion_mask"][:1]], 1)
            return model(input_ids=ids, attention_mask=mask).logits.sum() * 0.0
        return sum(p.sum() for p in model.parameters() if p.requires_grad) * 0.0

    @property
    def _skip_zero_advantage(self) -> bool:
        return bool(self.experiment and self.experiment.async_.skip_zero_advantage_batches)

    def _no_signal_anywhere(self, advantages: torch.Tensor) -> bool:
        has_signal = (advantages != 0).any().float().reshape(1)
        return bool(self.accelerator.reduce(has_signal, reduction="sum").item() == 0)

    # ------------------------------------------------------------ compaction

    @property
    def _compact_zero_advantage(self) -> bool:
        return bool(self.experiment and self.experiment.async_.compact_zero_advantage)

    def _compaction_fallback_reason(self, inputs: dict[str, torch.Tensor | Any]) -> str | None:
        """Why compaction would not be exact for this trainer/micro-batch, or ``None`` where it is.

        A dropped zero-advantage row still changes TRL's loss through: the KL term (``beta > 0``: its gradient does
        not vanish with the advantage), the entropy bonus (``entropy_coef``, ``use_adaptive_entropy``: a token mean
        over every row, and the adaptive controller's entropy window), the high-entropy token mask
        (``top_entropy_quantile < 1``: one quantile over every row of every rank), what the model adds over every
        token (a MoE router's auxiliary loss: :func:`grpo.training.model_support.unsupported`), and images (split by
        grid, not by row). A loss type outside TRL 1.16's eight has no known normaliser. Everything else TRL's loss
        reads is per row and exact: the importance-sampling ratio (token or sequence level, ``delta``), the off-policy
        sequence mask (OPSM), vLLM's importance-sampling correction, VESPO's gamma weights, the platform's off-policy
        weights.
        """
        if self.beta != 0.0:
            return "grpo.beta > 0 (the KL term has a gradient on every completion)"
        if self._entropy_bonus_enabled:
            return "entropy_coef / use_adaptive_entropy (the entropy bonus is a mean over every completion)"
        if self.top_entropy_quantile < 1.0:
            return "top_entropy_quantile < 1 (the entropy threshold is a quantile over every completion)"
        model_reason = unsupported(COMPACT_ZERO_ADVANTAGE, self.model,
                                   router_aux_loss=getattr(self, "aux_loss_enabled", False))
        if model_reason is not None:
            return model_reason
        if self.loss_type not in (*ROW_COUNT_NORMALISED, *TOKEN_COUNT_NORMALISED, *GLOBAL_TOKEN_NORMALISED):
            return f"loss_type {self.loss_type!r} (no known normaliser)"
        if any(inputs.get(k) is not None for k in _MULTIMODAL):
            return "multimodal inputs (not split by completion)"
        return None

    def _rows_with_signal_everywhere(self, local: int) -> int:
        """The most rows with signal any rank holds in this micro-step: every rank computes that many (topped up with
        its zero-advantage rows), because TRL's loss all-gathers per-row metrics (``clip_ratio/low_min``,
        ``high_max``), and ranks gathering different row counts fail (gloo) or hang (NCCL). One scalar gather."""
        if self.accelerator.num_processes == 1:
            return local
        counts = self.accelerator.gather(torch.tensor([local], device=self.accelerator.device))
        return int(counts.max().item())

    @contextlib.contextmanager
    def _compaction(self, inputs: dict[str, torch.Tensor | Any], chunks: int = 1
                    ) -> Iterator[tuple[dict[str, torch.Tensor | Any], float]]:
        """``async.compact_zero_advantage``: yields ``(rows, share)``, the micro-batch's rows to compute and the
        factor for their loss, so that TRL's loss on ``rows`` x ``share`` has the full micro-batch's gradient.

        The rows are those with a non-zero advantage (:func:`rows_to_keep`), topped up with zero-advantage rows (which
        add exactly zero) to the same count on every rank (:meth:`_rows_with_signal_everywhere`), and to at least
        ``min(n, chunks)``: every rank then makes as many loss calls (one per chunk), with as many rows each, and so
        the same collectives inside TRL's loss (metric reductions and gathers) as the others, and a rank left with no
        signal still computes a (zero) row, so its forward goes through DDP and takes part in the gradient
        all-reduce of the synchronising micro-step.
        ``share`` is :func:`normaliser_share`: composed with the seqlen-balancing weight and, in chunks, with each
        chunk's share of the compacted rows, the weights multiply to the uncompacted ones.

        Where compaction is not exact (:meth:`_compaction_fallback_reason`) the whole micro-batch is yielded with
        share 1, and the reason is logged once. TRL's diagnostics computed inside its loss (``entropy``,
        ``clip_ratio/*``) then cover the computed completions only.

        Metrics (with the option on): ``compaction/rows_skipped_frac``, the fraction of the micro-batch's rows not
        computed; ``compaction/saved_s``, an estimate of the forward + backward time saved: the wall time of the
        loss call over the compacted rows, per computed row, x the rows skipped, x the ratio of a forward + backward
        to what the call ran (a forward only: 3, :data:`FORWARD_BACKWARD_PER_FORWARD`; with c chunks the call also
        backpropagates c - 1 chunks). TRL's loss ends in ``.item()`` metric reductions, so on a GPU the wall time
        includes the device work.
        """
        if not self._compact_zero_advantage:
            yield inputs, 1.0
            return
        n = inputs["completion_ids"].shape[0]
        reason = self._compaction_fallback_reason(inputs)
        keep = None
        if reason is None:
            local = int(rows_with_signal(inputs["advantages"]).sum())  # the micro-step's one wait for the device
            signal = self._rows_with_signal_everywhere(local)
            keep = rows_to_keep(inputs["advantages"], max(signal, min(n, max(chunks, 1))), signal_rows=local)
        if keep is not None and len(keep) < n:
            mask = inputs["completion_mask"]
            if "tool_mask" in inputs:  # TRL's loss mask: tool-call tokens do not count
                mask = mask * inputs["tool_mask"]
            share = normaliser_share(self.loss_type, mask, keep.to(mask.device))
        else:
            share = 1.0
        if reason is not None and not getattr(self, "_compaction_fallback_logged", False):
            self._compaction_fallback_logged = True
            if self.accelerator.is_main_process:
                _log.info("async.compact_zero_advantage: computing every completion (no compaction) with %s", reason)
        if keep is None or len(keep) == n:
            self._record("compaction/rows_skipped_frac", 0.0)
            self._record("compaction/saved_s", 0.0)
            yield inputs, 1.0
            return
        rows = select_rows(inputs, keep)
        start = time.perf_counter()
        yield rows, share
        elapsed = time.perf_counter() - start
        chunks = min(max(chunks, 1), len(keep))
        forward_backward_share = (1.0 + 2.0 * (chunks - 1) / chunks) / FORWARD_BACKWARD_PER_FORWARD
        self._record("compaction/rows_skipped_frac", (n - len(keep)) / n)
        self._record("compaction/saved_s", elapsed / len(keep) * (n - len(keep)) / forward_backward_share)
