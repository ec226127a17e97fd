"""Zero-advantage compaction (``async.compact_zero_advantage``, issue #13 section 1), on the real trainer.

Every gradient here is compared with TRL's uncompacted one (the same trainer with the option off) to 1e-5
relative, in fp32, on the micro tiny model: every loss type, with chunks, with the platform's seqlen-balancing
weights, with the per-row off-policy options, with a micro-batch where every advantage is 0, and in the cases where
compaction falls back to the full micro-batch.
"""

from __future__ import annotations

import logging

import pytest
import torch
import trl

from grpo.config import load_config
from grpo.training.zero_advantage import normaliser_share, rows_to_keep
from tests.conftest import MICRO, micro_overrides
from tests.test_loss_extensions import (
    LOSS_TYPES,
    configure,
    make_trainer,
    relative_difference,
    step_gradient,
    token_budget_scenario,
)

REL = 1e-5

# Advantage pattern of the 16-row batch (2 groups of 8): 7 of 16 rows zero, the rest of both signs.
PATTERN = torch.tensor([0.9, 0.0, -0.4, 0.0, 0.0, 1.3, -1.1, 0.0, 0.0, 0.0, 0.6, -0.2, 0.0, 0.7, 0.0, -0.8])
ZEROS = int((PATTERN == 0).sum())


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """One trainer (compaction on: the default) and one scored batch of 16 rows with unequal completion lengths, so a
    wrong row or token share shows in the gradient."""
    trainer = make_trainer(tmp_path_factory.mktemp("compaction"), **{"grpo.per_device_train_batch_size": 16,
                                                                   "grpo.num_generations": 8, "grpo.temperature": 1.5})
    assert trainer.experiment.async_.compact_zero_advantage  # on by default
    torch.manual_seed(0)
    rows = [trainer.train_dataset[i] for i in range(2) for _ in range(8)]
    batch = trainer.assemble_generation_batch(rows)
    batch["advantages"] = PATTERN.clone()
    width = batch["completion_mask"].shape[1]
    assert width >= 4
    for i in range(16):  # completion lengths 1..width, in an order unrelated to the advantages
        batch["completion_mask"][i, (i * 5) % width + 1:] = 0
    with torch.no_grad():  # an older policy's log-probs, so ratios differ from 1 and clipping/IS weights matter
        ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
        mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
        logps, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask,
                                                                 batch["completion_ids"].shape[1])
    batch["old_per_token_logps"] = logps + 0.05 * torch.randn(logps.shape, generator=torch.Generator().manual_seed(1))
    return trainer, batch


class Forwards:
    """Counts TRL's loss calls and the rows each one computed (spy on ``trl.GRPOTrainer._compute_loss``)."""

    def __init__(self, monkeypatch) -> None:
        self.rows: list[int] = []
        original = trl.GRPOTrainer._compute_loss

        def spy(trainer, model, inputs):
            self.rows.append(int(inputs["completion_ids"].shape[0]))
            return original(trainer, model, inputs)

        monkeypatch.setattr(trl.GRPOTrainer, "_compute_loss", spy)


def gradient(trainer, batch, compact: bool):
    trainer.experiment.async_.compact_zero_advantage = compact
    trainer.model.zero_grad(set_to_none=True)
    try:
        loss = trainer.compute_loss(trainer.model, batch)
        trainer.accelerator.backward(loss)
    finally:
        trainer.experiment.async_.compact_zero_advantage = True
    return torch.cat([p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None]), loss.detach()


def last(trainer, name: str) -> float:
    return trainer._metrics["train"][name][-1]


def assert_same_gradient(trainer, batch):
    full, full_loss = gradient(trainer, batch, compact=False)
    compact, compact_loss = gradient(trainer, batch, compact=True)
    assert full.abs().sum() > 0
    rel = relative_difference(compact, full)
    assert rel < REL, rel
    assert torch.allclose(compact_loss, full_loss, rtol=1e-5, atol=1e-7), (compact_loss, full_loss)


@pytest.mark.parametrize("chunks", [1, 2])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_compaction_gives_the_uncompacted_gradient(shared, monkeypatch, loss_type, chunks):
    """Every loss type, unchunked and in 2 chunks: the zero-advantage rows are not computed, and the loss rescaled
    to the full micro-batch's normaliser gives TRL's gradient (and loss)."""
    trainer, batch = shared
    configure(trainer, loss_type)
    trainer.experiment.grpo.num_generations_chunks = chunks
    try:
        assert_same_gradient(trainer, batch)
        assert last(trainer, "compaction/rows_skipped_frac") == ZEROS / 16
        assert last(trainer, "compaction/saved_s") > 0
        forwards = Forwards(monkeypatch)
        gradient(trainer, batch, compact=True)
        assert sum(forwards.rows) == 16 - ZEROS and len(forwards.rows) == chunks
    finally:
        configure(trainer, "dapo")


@pytest.mark.parametrize("option", ["off_policy_mask", "delta", "sequence_level", "vllm_is_ratio", "tool_mask"])
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dapo", "vespo"])
def test_per_row_loss_options_stay_exact(shared, loss_type, option):
    """TRL's options that act row by row (OPSM, two-sided clipping, sequence-level ratios, vLLM's IS correction, a
    tool-call mask in the normaliser) are compacted and stay exact."""
    trainer, batch = shared
    configure(trainer, loss_type)
    batch = dict(batch)
    g = torch.Generator().manual_seed(4)
    saved = (trainer.off_policy_mask_threshold, trainer.args.delta, trainer.use_vllm,
             trainer.vllm_importance_sampling_correction)
    try:
        if option == "off_policy_mask":
            trainer.off_policy_mask_threshold = 0.0  # negative-advantage rows with sampling KL > 0 are dropped
            batch["sampling_per_token_logps"] = batch["old_per_token_logps"] + 0.1 * torch.randn(
                batch["old_per_token_logps"].shape, generator=g)
        elif option == "delta":
            trainer.args.delta = 1.01
        elif option == "sequence_level":
            trainer.importance_sampling_level = "sequence"
        elif option == "vllm_is_ratio":
            trainer.use_vllm, trainer.vllm_importance_sampling_correction = True, True  # read by the loss only
            batch["importance_sampling_ratio"] = torch.rand(batch["completion_mask"].shape, generator=g) + 0.5
        else:
            batch["tool_mask"] = (torch.rand(batch["completion_mask"].shape, generator=g) > 0.3).long()
        assert_same_gradient(trainer, batch)
        assert last(trainer, "compaction/rows_skipped_frac") == ZEROS / 16
    finally:
        (trainer.off_policy_mask_threshold, trainer.args.delta, trainer.use_vllm,
         trainer.vllm_importance_sampling_correction) = saved
        configure(trainer, "dapo")


@pytest.mark.parametrize("chunks", [1, 2])
def test_all_zero_micro_batch_computes_the_fewest_rows_with_zero_gradient(shared, monkeypatch, chunks):
    """Nothing left to compute (skip off): one row per chunk still runs (as many loss calls as without compaction,
    so a rank with no signal takes part in the same collectives and in DDP's all-reduce), and the gradient is 0."""
    trainer, batch = shared
    configure(trainer, "grpo")
    trainer.experiment.grpo.num_generations_chunks = chunks
    batch = {**batch, "advantages": torch.zeros(16)}
    try:
        forwards = Forwards(monkeypatch)
        grads, loss = gradient(trainer, batch, compact=True)
        assert forwards.rows == [1] * chunks
        assert float(loss) == 0.0 and float(grads.abs().sum()) == 0.0
        assert last(trainer, "compaction/rows_skipped_frac") == (16 - chunks) / 16
    finally:
        configure(trainer, "dapo")


@pytest.mark.parametrize("chunks", [1, 2])
def test_every_rank_computes_as_many_rows_as_the_rank_with_most_signal(shared, monkeypatch, chunks):
    """Another rank has 12 rows with signal (emulated: the count exchanged between ranks): this rank tops its 9 up
    with 3 zero-advantage rows, so both make the same loss calls with the same row counts (TRL's loss all-gathers
    per-row metrics), and the gradient is still exact."""
    trainer, batch = shared
    configure(trainer, "bnpo")
    trainer.experiment.grpo.num_generations_chunks = chunks
    exchanged = []
    monkeypatch.setattr(trainer, "_rows_with_signal_everywhere", lambda local: exchanged.append(local) or 12)
    try:
        assert_same_gradient(trainer, batch)
        forwards = Forwards(monkeypatch)
        gradient(trainer, batch, compact=True)
        assert exchanged[-1] == 16 - ZEROS and sum(forwards.rows) == 12 and len(forwards.rows) == chunks
        assert last(trainer, "compaction/rows_skipped_frac") == 4 / 16
    finally:
        configure(trainer, "dapo")


def test_skip_takes_precedence_over_compaction(shared, monkeypatch):
    """With skip_zero_advantage_batches, an all-zero micro-batch is skipped (no loss call at all); a batch with
    signal is then compacted."""
    trainer, batch = shared
    configure(trainer, "grpo")
    trainer.experiment.async_.skip_zero_advantage_batches = True
    try:
        forwards = Forwards(monkeypatch)
        grads, _ = gradient(trainer, {**batch, "advantages": torch.zeros(16)}, compact=True)
        assert forwards.rows == [] and float(grads.abs().sum()) == 0.0
        assert last(trainer, "skipped_zero_adv_batches") == 1.0
        assert_same_gradient(trainer, batch)
        assert forwards.rows[-1] == 16 - ZEROS
    finally:
        trainer.experiment.async_.skip_zero_advantage_batches = False
        configure(trainer, "dapo")


@pytest.mark.parametrize("fallback", ["beta", "entropy_coef", "top_entropy_quantile"])
@pytest.mark.parametrize("chunks", [1, 2])
def test_fallback_computes_the_full_batch_and_says_so_once(shared, monkeypatch, caplog, fallback, chunks):
    """Where a zero-advantage row still moves the loss (KL term, entropy bonus, entropy quantile), the whole
    micro-batch is computed (rows_skipped_frac 0), the gradient is TRL's, and the log says why, once."""
    trainer, batch = shared
    configure(trainer, "grpo", **{"entropy_coef": 0.5} if fallback == "entropy_coef" else
              {"top_entropy_quantile": 0.5} if fallback == "top_entropy_quantile" else {})
    trainer.experiment.grpo.num_generations_chunks = chunks
    batch = dict(batch)
    if fallback == "beta":
        trainer.beta = 0.04
        batch["ref_per_token_logps"] = batch["old_per_token_logps"] - 0.1
    trainer._compaction_fallback_logged = False
    try:
        forwards = Forwards(monkeypatch)
        with caplog.at_level(logging.INFO, logger="grpo.training.zero_advantage"):
            assert_same_gradient(trainer, batch)
            gradient(trainer, batch, compact=True)
        assert last(trainer, "compaction/rows_skipped_frac") == 0.0
        assert sum(forwards.rows[-chunks:]) == 16
        lines = [r.getMessage() for r in caplog.records if "compact_zero_advantage" in r.getMessage()]
        assert len(lines) == 1 and fallback.split("_")[0] in lines[0], lines
    finally:
        trainer.beta = 0.0
        configure(trainer, "dapo")


@pytest.mark.parametrize("loss_type, chunks", [("grpo", 1), ("dr_grpo", 2), ("luspo", 1), ("dapo", 2), ("sapo", 1)])
def test_compaction_composes_with_token_budget_weights(shared, loss_type, chunks):
    """sampling.seqlen_balancing, two emulated ranks (as in test_loss_extensions): token-budget micro-batches with
    zero-advantage rows, compacted, give the unbalanced uncompacted step's gradient."""
    trainer, _ = shared
    configure(trainer, loss_type)
    trainer.experiment.grpo.num_generations_chunks = chunks
    advantages = torch.linspace(-1, 1, 32)[torch.randperm(32, generator=torch.Generator().manual_seed(3))]
    advantages[torch.randperm(32, generator=torch.Generator().manual_seed(5))[:14]] = 0.0
    try:
        with token_budget_scenario(trainer, advantages) as (unbalanced, balanced):
            trainer.experiment.async_.compact_zero_advantage = False
            reference = step_gradient(trainer, unbalanced)
            trainer.experiment.async_.compact_zero_advantage = True
            before = len(trainer._metrics["train"]["compaction/rows_skipped_frac"])
            got = step_gradient(trainer, balanced)
            skipped = trainer._metrics["train"]["compaction/rows_skipped_frac"][before:]
    finally:
        trainer.experiment.async_.compact_zero_advantage = True
        configure(trainer, "dapo")
    assert reference.abs().sum() > 0 and len(skipped) == 4 and sum(skipped) > 0
    rel = relative_difference(got, reference)
    assert rel < REL, rel


def test_the_rows_are_found_without_waiting_for_the_device_once_counted():
    """With the count of rows with signal known on the host (the micro-step's one wait), picking the rows waits for
    nothing: on CUDA each ``int(t)`` or ``nonzero`` drains the stream (counted here on the CPU, see
    benchmarks/_syncs.py; the old selection waited three times)."""
    from benchmarks._syncs import SyncCounter

    advantages = torch.tensor([0.0, 1.0, 0.0, -2.0, 0.0, 0.5])
    with SyncCounter() as counter:
        keep = rows_to_keep(advantages, 5, signal_rows=3)
    assert keep.tolist() == [0, 1, 2, 3, 5]
    assert counter.total == 0, counter.by_origin


def test_row_selection_and_normaliser_shares():
    advantages = torch.tensor([0.0, 1.0, 0.0, -2.0, 0.0])
    assert rows_to_keep(advantages, 1).tolist() == [1, 3]
    assert rows_to_keep(advantages, 4).tolist() == [0, 1, 2, 3]  # topped up with zero rows, in order
    assert rows_to_keep(torch.zeros(3), 2).tolist() == [0, 1]
    assert rows_to_keep(torch.zeros(2), 5).tolist() == [0, 1]
    assert rows_to_keep(torch.tensor([[0.0, 0.0], [0.0, 3.0], [float("nan"), 0.0]]), 1).tolist() == [1, 2]
    # the caller's count of rows with signal gives the same rows
    for min_rows in range(7):
        assert rows_to_keep(advantages, min_rows, signal_rows=2).tolist() == rows_to_keep(advantages, min_rows).tolist()
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0], [0, 0, 0], [1, 0, 0]])
    keep = torch.tensor([1, 3])
    for loss_type in ("grpo", "sapo", "dr_grpo", "luspo"):
        assert normaliser_share(loss_type, mask, keep) == 2 / 5
    assert normaliser_share("bnpo", mask, keep) == 1 / 7
    for loss_type in ("dapo", "cispo", "vespo"):
        assert normaliser_share(loss_type, mask, keep) == 1.0
    assert normaliser_share("new_loss", mask, keep) is None


def test_on_by_default_and_can_be_turned_off(tmp_path):
    assert load_config(MICRO, micro_overrides(tmp_path)).async_.compact_zero_advantage is True
    off = load_config(MICRO, micro_overrides(tmp_path, **{"async.compact_zero_advantage": "false"}))
    assert off.async_.compact_zero_advantage is False
