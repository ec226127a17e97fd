"""Chunked backward (``grpo.num_generations_chunks``) and zero-advantage skipping, on the real trainer."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
from trl.trainer.utils import split_tensor_dict

from grpo.algo.group_balancing import split_by_token_budget
from grpo.training.trainer import GRPOTrainer
from tests.trainers import micro_trainer


def make_trainer(tmp_path, **extra) -> GRPOTrainer:
    return micro_trainer(tmp_path, {"model.warm_start.steps": 200, **extra})


def gradients(trainer: GRPOTrainer, batch) -> torch.Tensor:
    trainer.model.zero_grad(set_to_none=True)
    loss = trainer.compute_loss(trainer.model, batch)
    trainer.accelerator.backward(loss)
    return torch.cat([p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None]), loss.detach()


LOSS_TYPES = ["dapo", "grpo", "bnpo", "dr_grpo", "cispo", "sapo", "luspo", "vespo"]


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """One trainer and one scored batch (16 rows, 2 groups of 8) for every gradient comparison below; the loss
    options are switched on the trainer's attributes, which is where TRL's loss reads them."""
    trainer = make_trainer(tmp_path_factory.mktemp("loss"), **{"grpo.per_device_train_batch_size": 16,
                                                             "grpo.num_generations": 8, "grpo.temperature": 1.5})
    torch.manual_seed(0)
    rows = [trainer.train_dataset[i] for i in range(2) for _ in range(8)]
    batch = trainer.assemble_generation_batch(rows)
    if float(batch["advantages"].abs().sum()) == 0:
        batch["advantages"] = torch.linspace(-1, 1, batch["advantages"].numel())  # make sure there is signal
    with torch.no_grad():  # an older policy's log-probs, so ratios differ from 1 and clipping/IS weights matter
        ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
        mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
        logps, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask,
                                                                 batch["completion_ids"].shape[1])
    batch["old_per_token_logps"] = logps + 0.05 * torch.randn(logps.shape, generator=torch.Generator().manual_seed(1))
    return trainer, batch


def configure(trainer: GRPOTrainer, loss_type: str, entropy_coef: float = 0.0, top_entropy_quantile: float = 1.0):
    trainer.loss_type = loss_type
    trainer.importance_sampling_level = "sequence" if loss_type == "luspo" else "token"
    trainer.entropy_coef = entropy_coef
    trainer._entropy_bonus_enabled = entropy_coef != 0.0
    trainer.top_entropy_quantile = top_entropy_quantile
    trainer.experiment.grpo.num_generations_chunks = 1


def relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("entropy", [{}, {"entropy_coef": 0.5}, {"top_entropy_quantile": 0.5},
                                     {"entropy_coef": 0.5, "top_entropy_quantile": 0.5}], ids=str)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_chunked_backward_gradients_equal_unchunked(shared, loss_type, entropy):
    """Every loss type, with and without TRL's entropy bonus and high-entropy token mask: chunked backward gives the
    unchunked gradient (and loss)."""
    trainer, batch = shared
    configure(trainer, loss_type, **entropy)
    full, full_loss = gradients(trainer, batch)
    assert full.abs().sum() > 0
    for chunks in (2, 8):  # 8 chunks of 16 rows: two completions per chunk
        trainer.experiment.grpo.num_generations_chunks = chunks
        chunked, chunked_loss = gradients(trainer, batch)
        rel = relative_difference(chunked, full)
        assert rel < 1e-5, (chunks, rel)
        assert torch.allclose(chunked_loss, full_loss, rtol=1e-5, atol=1e-7)
    configure(trainer, "dapo")


def test_zero_advantage_micro_batch_is_skipped_and_counted(tmp_path):
    trainer = make_trainer(tmp_path, **{"async.skip_zero_advantage_batches": "true"})
    torch.manual_seed(0)
    rows = [trainer.train_dataset[i] for i in range(4) for _ in range(4)]
    batch = trainer.assemble_generation_batch(rows)
    batch["advantages"] = torch.zeros_like(batch["advantages"])
    grads, loss = gradients(trainer, batch)
    assert float(loss) == 0.0 and float(grads.abs().sum()) == 0.0
    assert trainer._metrics["train"]["skipped_zero_adv_batches"][-1] == 1.0
    assert "entropy" not in trainer._metrics["train"] or len(trainer._metrics["train"]["entropy"]) == 0  # no forward

    batch["advantages"][0] = 1.0
    grads, _ = gradients(trainer, batch)
    assert float(grads.abs().sum()) > 0
    assert trainer._metrics["train"]["skipped_zero_adv_batches"][-1] == 0.0


def rows_of(batch, index) -> dict:
    """The rows ``index`` of a scored batch (per-sample tensors sliced, everything else shared)."""
    n = batch["completion_ids"].shape[0]
    index = torch.as_tensor(index)
    return {k: (v.index_select(0, index) if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == n else v)
            for k, v in batch.items()}


def step_gradient(trainer: GRPOTrainer, ranks: list[list[dict]]) -> torch.Tensor:
    """One optimizer step's gradient over emulated DDP ranks: each rank accumulates its micro-batches, then the
    ranks' gradients are averaged (what DDP's all-reduce does)."""
    total = None
    for micro_batches in ranks:
        trainer.model.zero_grad(set_to_none=True)
        trainer.current_gradient_accumulation_steps = len(micro_batches)
        for micro in micro_batches:
            trainer.accelerator.backward(trainer.compute_loss(trainer.model, micro))
        grad = torch.cat([p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None])
        total = grad if total is None else total + grad
    trainer.current_gradient_accumulation_steps = 1
    return total / len(ranks)


@contextlib.contextmanager
def token_budget_scenario(trainer: GRPOTrainer, advantages: torch.Tensor) -> Iterator[tuple[list, list]]:
    """Two emulated ranks of sampling.seqlen_balancing: a generation batch of 4 groups of 8 with ``advantages``, three
    long rows per group and five of two tokens (last prompt token + first completion token), so token budgets split a
    rank's rows unequally. Yields ``(unbalanced, balanced)`` micro-batches per rank (2 micro-batches of 8 rows each
    unbalanced; balanced, one rank holds three groups and the other one), with the trainer's batch arguments set to
    match for the duration."""
    torch.manual_seed(2)
    rows = [trainer.train_dataset[i] for i in range(2, 6) for _ in range(8)]
    batch = trainer.assemble_generation_batch(rows)
    batch["advantages"] = advantages
    short = torch.tensor([False] * 3 + [True] * 5).repeat(4)
    batch["prompt_mask"][short, :-1] = 0
    batch["completion_mask"][short, 1:] = 0
    args = trainer.args
    saved = args.per_device_train_batch_size, args.steps_per_generation
    args.per_device_train_batch_size, args.steps_per_generation = 8, 2
    try:
        unbalanced = [split_tensor_dict(rows_of(batch, range(r * 16, r * 16 + 16)), 2) for r in range(2)]
        balanced = [split_by_token_budget(rows_of(batch, range(0, 24)), 2),
                    split_by_token_budget(rows_of(batch, range(24, 32)), 2)]
        yield unbalanced, balanced
    finally:
        args.per_device_train_batch_size, args.steps_per_generation = saved


@pytest.mark.parametrize("loss_type, chunks",
                         [(t, 1) for t in LOSS_TYPES if t != "bnpo"] + [("grpo", 2), ("dr_grpo", 4)])
def test_token_budget_micro_batches_give_the_unbalanced_gradient(shared, loss_type, chunks):
    """sampling.seqlen_balancing: two ranks, 2 micro-batches of 8 rows each when unbalanced; balanced, one rank holds
    three groups and the other one, and token budgets give micro-batches of unequal row counts. Same gradient."""
    trainer, _ = shared
    configure(trainer, loss_type)
    trainer.experiment.grpo.num_generations_chunks = chunks
    advantages = torch.linspace(-1, 1, 32)[torch.randperm(32, generator=torch.Generator().manual_seed(3))]
    try:
        with token_budget_scenario(trainer, advantages) as (unbalanced, balanced):
            counts = [[m["completion_ids"].shape[0] for m in rank] for rank in balanced]
            assert sum(map(sum, counts)) == 32 and all(len(set(c)) == 2 for c in counts), counts
            reference = step_gradient(trainer, unbalanced)
            got = step_gradient(trainer, balanced)
    finally:
        configure(trainer, "dapo")
    assert reference.abs().sum() > 0
    rel = relative_difference(got, reference)
    assert rel < 1e-5, (counts, rel)


def test_token_budget_filler_micro_batch_has_no_weight(shared):
    """A rank with fewer rows than micro-batches gets zero-weight filler copies: they add nothing to the gradient."""
    trainer, batch = shared
    configure(trainer, "grpo")
    parts = split_by_token_budget(rows_of(batch, [0]), 3)
    assert [p["balanced_rows"] for p in parts] == [1, 0, 0]
    args = trainer.args
    saved = args.per_device_train_batch_size
    args.per_device_train_batch_size = 1
    try:
        with_fillers = step_gradient(trainer, [parts])
        alone = step_gradient(trainer, [parts[:1]]) / 3  # same accumulation (1/3), without the fillers
    finally:
        args.per_device_train_batch_size = saved
        configure(trainer, "dapo")
    assert relative_difference(with_fillers, alone) < 1e-6
