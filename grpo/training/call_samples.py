"""Per-call samples (#47): an episode's earlier samples as rows of their own in the generation batch.

An agent whose call does not extend its previous call's prompt and completion (it rewrote its history) starts its
episode's next sample (:class:`~grpo.environments.base.Restart`, ``Episode.samples``; Agent Lightning's per-call
transitions). TRL's batch holds one completion per row: ``rollout_func`` returns each episode's last sample, which the
reward functions score and whose group gives the advantages. After scoring (and replay, which reads rewards per
row), :meth:`CallSamples._append_call_samples` appends each earlier sample of an episode as one more row with its
episode's advantage, every field filled as TRL fills its own rows: the ids as the runner recorded them (never
re-tokenised), ``tool_mask`` from the sample's ``env_mask`` (its non-sampled tokens carry no gradient),
``sampling_per_token_logps`` from its recorded log-probs, ``old_per_token_logps`` / ``ref_per_token_logps`` /
``importance_sampling_ratio`` (where the batch holds them) with TRL's forward and formula; ``num_items_in_batch``
(the loss tokens over every rank) is counted again. A failed episode's samples, and those of a group replay
replaced, are left out (their row no longer stands for them).

Ranks: every rank appends as many rows, the most any rank has, a rank with fewer topped up with zero-weight filler
rows (a one-token prompt, its completion masked out, advantage 0), so each micro-batch holds as many rows on every
rank (TRL's loss all-gathers per-row metrics). The rows are cut into ``steps_per_generation`` micro-batches of
near-equal size, each recording its row count under ``BALANCED_ROWS``: the loss types that average over a
micro-batch's rows (``grpo``, ``dr_grpo``, ...) are weighted by ``rows / per_device_train_batch_size``
(:meth:`~grpo.training.seqlen_balancing.SeqlenBalancing._balanced_weight`), so every sample weighs what one row of an
episode weighs; the token-normalised ones (``dapo``, the default) need no weight. A batch without earlier samples on
any rank is TRL's, unchanged. With ``sampling.seqlen_balancing`` the episodes' rows are exchanged between ranks as
before and the appended rows stay on their rank.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from grpo.algo.group_balancing import BALANCED_ROWS, concat_rows, per_sample_keys
from grpo.environments.episodes import Sample
from grpo.training.off_policy import loss_mask
from grpo.training.padding import padded, padded_rows

Batch = dict[str, Any]

# The per-row fields the appended rows fill (any other is refused: a batch this module does not know how to extend).
_FILLED = frozenset({"prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages", "tool_mask",
                     "sampling_per_token_logps", "old_per_token_logps", "ref_per_token_logps",
                     "importance_sampling_ratio"})


def sample_rows(samples: list[Sample], advantages: list[float], fillers: int, pad_token_id: int,
                fields: set[str]) -> Batch:
    """The rows of ``samples`` (each with its advantage) and ``fillers`` zero-weight rows, as TRL's tensors:
    ``prompt_ids``/``prompt_mask`` left-padded, ``completion_ids``/``completion_mask`` right-padded, ``advantages``,
    and, when in ``fields``, ``tool_mask`` (the samples' ``env_mask``) and ``sampling_per_token_logps`` (their
    recorded log-probs; NaN where a sample has none: no correction, as TRL reads a missing one)."""
    filler = Sample([pad_token_id], [pad_token_id], [1], [0.0])
    rows = [*samples, *[filler] * fillers]
    prompt_ids, prompt_mask = padded_rows([s.prompt_ids for s in rows], pad_token_id, "left")
    out = {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": padded([s.completion_ids for s in rows], pad_token_id, "right", torch.long),
        "completion_mask": padded([[int(i < len(samples))] * len(s.completion_ids) for i, s in enumerate(rows)], 0,
                                  "right", torch.long),
        "advantages": torch.tensor([*advantages, *[0.0] * fillers], dtype=torch.float32),
    }
    if "tool_mask" in fields:
        out["tool_mask"] = padded([s.env_mask for s in rows], 1, "right", torch.long)
    if "sampling_per_token_logps" in fields:
        out["sampling_per_token_logps"] = padded(
            [s.logprobs if s.logprobs is not None else [math.nan] * len(s.completion_ids) for s in rows], 0.0, "right",
            torch.float32)
    return out


def append_rows(batch: Batch, extra: Batch, pad_token_id: int) -> Batch:
    """``batch`` with the rows of ``extra`` after its own (every per-row field; the rest is ``batch``'s)."""
    keys = per_sample_keys(batch)
    out = dict(batch)
    out.update(concat_rows([{k: batch[k] for k in keys}, {k: extra[k].to(batch[k].device, batch[k].dtype)
                                                           for k in keys}], keys, pad_token_id))
    return out


def split_rows(batch: Batch, parts: int) -> list[Batch]:
    """TRL's shuffle-and-split into ``parts`` micro-batches, for a row count ``parts`` may not divide: sizes differ
    by at most one (the same on every rank for the same row count), each recording its rows under ``BALANCED_ROWS``
    (no row is dropped, as TRL's equal split would drop the remainder)."""
    keys = per_sample_keys(batch)
    n = batch["completion_ids"].shape[0]
    order = torch.randperm(n)  # TRL's shuffle_sequence_dict
    batch = {k: (v[order.to(v.device)] if k in keys else v) for k, v in batch.items()}
    bounds = [round(i * n / parts) for i in range(parts + 1)]
    out = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        micro = {k: (v[lo:hi] if k in keys else v) for k, v in batch.items()}
        micro[BALANCED_ROWS] = hi - lo
        out.append(micro)
    return out


class CallSamples:
    """Mixin of :class:`grpo.training.trainer.GRPOTrainer`; see the module docstring."""

    _episode_samples: list[list[Sample]] | None = None  # per local row of the last rollout: its earlier samples
    _call_sample_rows = 0  # rows appended to the generation batch being trained (fillers included; every rank's)

    def _append_call_samples(self, batch: Batch, replaced: list[slice]) -> Batch:
        """Append the episodes' earlier samples to ``batch`` (training; see the module docstring). A collective on
        every rank of a run whose rollouts are episodes (each rank's row count), whether or not it has samples."""
        samples, self._episode_samples = self._episode_samples, None
        self._call_sample_rows = 0
        if samples is None:
            return batch
        dropped = {r for rows in replaced for r in range(rows.start, rows.stop)}
        picked = [(row, s) for row, row_samples in enumerate(samples) if row not in dropped for s in row_samples]
        device = batch["completion_ids"].device
        most = len(picked)
        if self.accelerator.num_processes > 1:
            most = int(self.accelerator.gather(torch.tensor([most], device=device)).max())
        if most == 0:
            return batch
        unknown = sorted(set(per_sample_keys(batch)) - _FILLED)
        if unknown:
            raise RuntimeError(f"per-call samples: the batch holds {unknown}, which the appended rows can not fill")
        advantages = batch["advantages"].detach().cpu()
        pad_token_id = self._tokenizer.pad_token_id
        extra = sample_rows([s for _, s in picked], [float(advantages[row]) for row, _ in picked],
                            most - len(picked), pad_token_id, set(batch))
        extra = {k: v.to(device) for k, v in extra.items()}
        self._sample_logps(batch, extra)
        batch = append_rows(batch, extra, pad_token_id)
        tokens = loss_mask(batch).sum().float().reshape(1)  # TRL's count: environment tokens left out
        batch["num_items_in_batch"] = self.accelerator.reduce(tokens, reduction="sum").squeeze(0)
        self._call_sample_rows = most
        return batch

    def _sample_logps(self, batch: Batch, extra: Batch) -> None:
        """The appended rows' ``old_per_token_logps``, ``ref_per_token_logps`` and ``importance_sampling_ratio``,
        where ``batch`` holds them, computed as TRL computes its rows' (the same forward, models and formula)."""
        wanted = [k for k in ("old_per_token_logps", "ref_per_token_logps") if k in batch]
        if "importance_sampling_ratio" in batch and "old_per_token_logps" not in batch:
            raise RuntimeError("per-call samples: importance_sampling_ratio without old_per_token_logps")
        if not wanted:
            return
        from trl.models.utils import disable_gradient_checkpointing
        from trl.trainer.utils import use_adapter

        ids = torch.cat([extra["prompt_ids"], extra["completion_ids"]], 1)
        attention = torch.cat([extra["prompt_mask"], extra["completion_mask"]], 1)
        keep = extra["completion_ids"].shape[1]
        size = self.args.per_device_train_batch_size

        def logps(model: Any) -> torch.Tensor:
            return self._get_per_token_logps_and_entropies(model, ids, attention, keep, batch_size=size)[0]

        with torch.no_grad(), disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs):
            if "old_per_token_logps" in wanted:
                extra["old_per_token_logps"] = logps(self.model)
            if "ref_per_token_logps" in wanted:
                if self.ref_model is not None:
                    extra["ref_per_token_logps"] = logps(self.ref_model)
                else:  # a PEFT adapter: its base (or the "ref" copy), as TRL's reference
                    model = self.accelerator.unwrap_model(self.model)
                    with use_adapter(model, adapter_name="ref" if "ref" in model.peft_config else None):
                        extra["ref_per_token_logps"] = logps(self.model)
        if "importance_sampling_ratio" in batch:
            extra["importance_sampling_ratio"] = self._sample_is_ratio(extra)

    def _sample_is_ratio(self, extra: Batch) -> torch.Tensor:
        """TRL's vLLM importance-sampling ratio (``vllm_importance_sampling_mode``, its clip bounds) of the appended
        rows, from their old and sampling log-probs."""
        mask = loss_mask(extra)
        diff = torch.nan_to_num((extra["old_per_token_logps"] - extra["sampling_per_token_logps"]) * mask, nan=0.0)
        mode = self.vllm_importance_sampling_mode
        if mode.startswith("sequence"):
            diff = diff.sum(dim=-1, keepdim=True)
        ratio = torch.exp(diff)
        low = self.vllm_importance_sampling_clip_min
        high = self.vllm_importance_sampling_clip_max
        if mode.endswith("truncate"):
            return torch.clamp(ratio, min=low, max=high)
        low = -math.inf if low is None else low
        high = math.inf if high is None else high
        return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


__all__ = ["CallSamples", "append_rows", "sample_rows", "split_rows"]
