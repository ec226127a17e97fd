"""Replay buffer and deferred re-roll (``async.replay_buffer_size``, ``async.replay_recompute_logps``,
``async.reroll_start_fraction``, ``async.reroll_max_groups``, ``async.reroll_buffer_size``): the trainer side.

Groups whose completions all scored the same teach nothing. Re-roll keeps the prompts of wholly failed groups and
puts them back into a later generation batch (they are generated for again); replay swaps a zero-signal group for
a buffered group that had signal. The buffers and the group maths live in :mod:`grpo.algo.replay`.
"""

from __future__ import annotations

from typing import Any

import torch

from grpo.algo.replay import ReplayBuffer, RerollBuffer, group_advantages, group_reward_std, inject_rerolls, place_group
from grpo.training.off_policy import loss_mask


class ReplayAndReroll:
    """Mixin of :class:`grpo.training.trainer.GRPOTrainer`, called from ``assemble_generation_batch``."""

    def _init_replay(self) -> None:
        a = self.experiment.async_ if self.experiment is not None else None
        self._replay = ReplayBuffer(a.replay_buffer_size, seed=self.args.seed) if a and a.replay_buffer_size else None
        self._reroll = RerollBuffer(a.reroll_buffer_size) if a and a.reroll_start_fraction < 1.0 else None

    def _inject_rerolls(self, inputs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        a = self.experiment.async_
        start_step = int(a.reroll_start_fraction * self.args.max_steps)
        taken = self._reroll.take(a.reroll_max_groups) if self.state.global_step >= start_step else []
        self._record("reroll_injected", float(len(taken)))
        return inject_rerolls(inputs, taken, self.num_generations) if taken else inputs

    def _buffer_failed_groups(self, inputs: list[dict[str, Any]], rewards: torch.Tensor) -> None:
        grouped = torch.nan_to_num(rewards, nan=0.0).view(-1, self.num_generations)
        failed = (grouped.max(dim=1).values <= 0) & (grouped.std(dim=1) == 0)
        for g in failed.nonzero().flatten().tolist():
            self._reroll.add(inputs[g * self.num_generations])
        self._record("reroll_buffered", float(failed.sum()))
        self._record("reroll_buffer_size", float(len(self._reroll)))
        self._record("reroll_dropped", float(self._reroll.dropped))

    # ---- replay buffer

    def _apply_replay(self, batch: dict[str, Any], rewards: torch.Tensor) -> list[slice]:
        """Replace zero-signal groups by buffered ones, then buffer this batch's groups that have signal."""
        G = self.num_generations
        grouped = rewards.view(-1, G)  # NaN where unscorable: kept, so replayed advantages leave them out as TRL does
        std = group_reward_std(grouped)
        advantages = batch["advantages"].detach().cpu().view(-1, G)
        pad = getattr(self.processing_class, "pad_token_id", 0) or 0
        per_token = [k for k in batch if k.endswith("per_token_logps") and isinstance(batch[k], torch.Tensor)]

        zero = (std == 0).nonzero().flatten().tolist()
        batch_std = None
        if self.scale_rewards == "batch":  # TRL scales by the std of the whole (gathered) batch
            from trl.trainer.utils import nanstd

            rpf = self._last_rewards_per_func
            all_rewards = (rpf * self.reward_weights.to(rpf.device).unsqueeze(0)).nansum(dim=1)
            all_rewards[torch.isnan(rpf).all(dim=1)] = torch.nan
            batch_std = float(nanstd(all_rewards))
        replaced = []
        for g, group in zip(zero, self._replay.sample(len(zero))):
            rows = slice(g * G, (g + 1) * G)
            place_group(batch, rows, group, pad)
            batch["advantages"][rows] = group_advantages(group["rewards"], self.scale_rewards, batch_std).to(
                batch["advantages"].device, batch["advantages"].dtype
            )
            replaced.append(rows)
        if replaced:
            self._refresh_replayed(batch, replaced)
        # Recount the tokens the loss is normalised by on every rank, whether or not it replaced a group: a
        # collective joined only by the ranks that replaced one would wait forever for the others.
        tokens = loss_mask(batch).sum().float().reshape(1)  # TRL's count: environment tokens left out
        batch["num_items_in_batch"] = self.accelerator.reduce(tokens, reduction="sum").squeeze(0)

        for g in (std > 0).nonzero().flatten().tolist():
            rows = slice(g * G, (g + 1) * G)
            score = float(advantages[g].abs().sum() * std[g])
            stored = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", *per_token,
                      *(("tool_mask",) if "tool_mask" in batch else ()))  # episodes keep their environment mask
            group = {k: batch[k][rows].detach().cpu().clone() for k in stored}
            group["rewards"] = grouped[g].clone()
            self._replay.add(score, group)
        self._record("replay_buffer_replacements", float(len(replaced)))
        self._record("replay_buffer_size", float(len(self._replay)))
        return replaced

    def _refresh_replayed(self, batch: dict[str, Any], replaced: list[slice]) -> None:
        """Replayed groups were sampled by an older policy: recompute their old (and reference) log-probs for the
        current one when asked."""
        if self.experiment.async_.replay_recompute_logps:
            logits_to_keep = batch["completion_ids"].shape[1]
            models = {"old_per_token_logps": self.model}
            if self.beta != 0.0 and self.ref_model is not None:
                models["ref_per_token_logps"] = self.ref_model
            with torch.no_grad():
                for key, model in models.items():
                    if key not in batch:
                        continue
                    for rows in replaced:
                        ids = torch.cat([batch["prompt_ids"][rows], batch["completion_ids"][rows]], 1)
                        mask = torch.cat([batch["prompt_mask"][rows], batch["completion_mask"][rows]], 1)
                        logps, _, _ = self._get_per_token_logps_and_entropies(model, ids, mask, logits_to_keep)
                        batch[key][rows] = logps
        if "importance_sampling_ratio" in batch:  # the generator's ratio does not apply to replayed rows
            for rows in replaced:
                batch["importance_sampling_ratio"][rows] = 1.0
