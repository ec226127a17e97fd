"""The shared-prompt forward (``async.shared_prompt_forward``), on the real trainer and the micro tiny model.

Each group's prompt runs once and its completions run on the prompt's cached keys/values. Compared with the
repeated forward (the option off, which is TRL's own forward): log-probs and entropies, and the gradient of every
loss type, unchunked and in chunks, with compaction on and off, to 1e-5 relative in fp32; the backbone really sees
one row per distinct prompt; where it cannot apply it runs TRL's forward and says why once.
"""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch

from grpo.training import model_support
from grpo.training.shared_prompt import shared_prompt_prefill
from tests.test_loss_extensions import LOSS_TYPES, configure, gradients, make_trainer, relative_difference

REL = 1e-5
GROUPS, SIZE = 3, 6


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """One trainer and one scored batch of 3 groups of 6, prompts of unequal length (left padding), completions of
    unequal length, an older policy's log-probs, and advantages of both signs with zeros (so compaction drops rows)."""
    trainer = make_trainer(tmp_path_factory.mktemp("shared-prompt"), **{
        "grpo.per_device_train_batch_size": GROUPS * SIZE, "grpo.num_generations": SIZE, "grpo.temperature": 1.5})
    assert trainer.experiment.async_.shared_prompt_forward  # on by default
    torch.manual_seed(0)
    batch = trainer.assemble_generation_batch([trainer.train_dataset[i] for i in range(GROUPS) for _ in range(SIZE)])
    # The task's prompts all have one length: the first group's becomes one token shorter, left-padded as TRL pads.
    batch["prompt_ids"][:SIZE, 0] = trainer.processing_class.pad_token_id
    batch["prompt_mask"][:SIZE, 0] = 0
    width = batch["completion_mask"].shape[1]
    for i in range(GROUPS * SIZE):
        batch["completion_mask"][i, (i * 5) % width + 1:] = 0
    batch["advantages"] = torch.tensor([0.9, 0.0, -0.4, 0.0, 1.3, -1.1] * GROUPS) * torch.arange(1, 19) / 9
    with torch.no_grad():
        old, _ = logps(trainer, batch, shared_prompt=False)
    batch["old_per_token_logps"] = old + 0.05 * torch.randn(old.shape, generator=torch.Generator().manual_seed(1))
    return trainer, batch


def logps(trainer, batch, shared_prompt: bool):
    trainer.experiment.async_.shared_prompt_forward = shared_prompt
    try:
        ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
        mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
        out, entropy, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, ids, mask, batch["completion_ids"].shape[1], compute_entropy=True)
        return out, entropy
    finally:
        trainer.experiment.async_.shared_prompt_forward = True


def gradient(trainer, batch, shared_prompt: bool):
    trainer.experiment.async_.shared_prompt_forward = shared_prompt
    try:
        return gradients(trainer, batch)
    finally:
        trainer.experiment.async_.shared_prompt_forward = True


def test_log_probs_and_entropies_equal_the_repeated_forward(shared):
    trainer, batch = shared
    with torch.no_grad():
        full, full_entropy = logps(trainer, batch, shared_prompt=False)
        ours, our_entropy = logps(trainer, batch, shared_prompt=True)
    mask = batch["completion_mask"].bool()
    assert relative_difference(ours[mask], full[mask]) < REL
    assert relative_difference(our_entropy[mask], full_entropy[mask]) < REL


@pytest.mark.parametrize("compact", [True, False], ids=["compacted", "full-batch"])
@pytest.mark.parametrize("chunks", [1, 2])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_gradient_equals_the_repeated_forward(shared, loss_type, chunks, compact):
    trainer, batch = shared
    configure(trainer, loss_type)
    trainer.experiment.grpo.num_generations_chunks = chunks
    trainer.experiment.async_.compact_zero_advantage = compact
    try:
        full, full_loss = gradient(trainer, batch, shared_prompt=False)
        ours, our_loss = gradient(trainer, batch, shared_prompt=True)
    finally:
        configure(trainer, "dapo")
        trainer.experiment.async_.compact_zero_advantage = True
    assert full.abs().sum() > 0
    assert relative_difference(ours, full) < REL
    assert torch.allclose(our_loss, full_loss, rtol=1e-5, atol=1e-7), (our_loss, full_loss)


def test_the_gradient_is_the_same_bits_every_time(shared):
    """Two runs of one seed must train alike. The prompt's keys/values were indexed out to the rows by advanced
    indexing, whose backward on the CPU sums a prompt's completions' gradients in the order its threads finish: the
    same batch gave gradients differing in their last bits from one backward to the next, and runs of one preset
    drifted apart. The fixture's batch tiled 16 times (288 rows on 3 prompts) gives the threads work to share."""
    trainer, batch = shared
    big = {k: (torch.cat([v] * 16) if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == GROUPS * SIZE else v)
           for k, v in batch.items()}
    first, _ = gradient(trainer, big, shared_prompt=True)
    for _ in range(5):
        again, _ = gradient(trainer, big, shared_prompt=True)
        assert torch.equal(again, first), (again - first).abs().max()


def test_the_backbone_runs_each_prompt_once(shared, monkeypatch):
    """Rows through the backbone: 3 prompts + 18 completions shared, 18 prompt + completion rows repeated."""
    trainer, batch = shared
    backbone = trainer.model.base_model
    seen: list[tuple[int, int]] = []
    hook = backbone.get_input_embeddings().register_forward_pre_hook(lambda _m, args: seen.append(tuple(args[0].shape)))
    try:
        with torch.no_grad():
            logps(trainer, batch, shared_prompt=True)
            shared_calls, seen[:] = list(seen), []
            logps(trainer, batch, shared_prompt=False)
    finally:
        hook.remove()
    prompt_width, completion_width = batch["prompt_ids"].shape[1], batch["completion_ids"].shape[1]
    assert shared_calls == [(GROUPS, prompt_width), (GROUPS * SIZE, completion_width)]
    assert seen == [(GROUPS * SIZE, prompt_width + completion_width)]
    assert "forward" not in vars(backbone)  # the swap ends with the call
    gradient(trainer, batch, shared_prompt=True)  # compaction (on) computes the non-zero-advantage rows only
    kept = int((batch["advantages"] != 0).sum())
    assert kept < GROUPS * SIZE
    assert trainer._metrics["train"]["shared_prompt/prompt_forwards_frac"][-1] == pytest.approx(GROUPS / kept)


def test_without_a_repeated_prompt_the_forward_is_trls(shared):
    trainer, batch = shared
    one_per_group = {k: (v[::SIZE] if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == GROUPS * SIZE else v)
                     for k, v in batch.items()}
    with torch.no_grad():
        full, _ = logps(trainer, one_per_group, shared_prompt=False)
        ours, _ = logps(trainer, one_per_group, shared_prompt=True)
    assert torch.equal(ours, full)


def test_gradient_checkpointing_runs_the_full_forward_and_says_so_once(shared, caplog):
    trainer, batch = shared
    trainer.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model_support._said.pop(model_support.causal_lm(trainer.model), None)  # said once per model: forget earlier lines
    try:
        with caplog.at_level(logging.INFO, logger="grpo.training.model_support"):
            ours, _ = gradient(trainer, batch, shared_prompt=True)
            gradient(trainer, batch, shared_prompt=True)
        full, _ = gradient(trainer, batch, shared_prompt=False)
    finally:
        trainer.model.gradient_checkpointing_disable()
    said = [r.getMessage() for r in caplog.records if "shared_prompt_forward" in r.getMessage()]
    assert said == ["async.shared_prompt_forward: TRL's forward runs for Qwen2ForCausalLM (gradient checkpointing "
                    "keeps no cache while training)"]
    assert torch.equal(ours, full)


@pytest.mark.parametrize("padded", [True, False], ids=["left-padded", "no-padding"])
def test_generation_prefills_each_prompt_once_and_samples_the_same(shared, padded):
    """transformers' generate inside ``shared_prompt_prefill``: the first forward sees one row per distinct prompt,
    the logits equal the repeated prefill's, and the same seed samples the same completions. Without padding
    transformers passes no attention mask."""
    trainer, batch = shared
    groups = GROUPS if padded else GROUPS - 1
    if not padded:  # the groups after the first (the left-padded one), their padding column dropped
        batch = {k: batch[k][SIZE:, 1:] for k in ("prompt_ids", "prompt_mask")}
    model = trainer.model.eval()
    seen: list[tuple[int, int]] = []
    hook = model.base_model.get_input_embeddings().register_forward_pre_hook(
        lambda _m, args: seen.append(tuple(args[0].shape)))

    def sample(share: bool):
        seen.clear()
        torch.manual_seed(3)
        with shared_prompt_prefill(model) if share else contextlib.nullcontext(), torch.no_grad():
            out = model.generate(input_ids=batch["prompt_ids"], attention_mask=batch["prompt_mask"], do_sample=True,
                                 max_new_tokens=4, temperature=1.5, output_logits=True, return_dict_in_generate=True,
                                 pad_token_id=trainer.processing_class.pad_token_id, use_cache=True)
        return out.sequences, torch.stack(out.logits, 1), list(seen)

    try:
        full, full_logits, full_seen = sample(False)
        ours, our_logits, our_seen = sample(True)
    finally:
        hook.remove()
        model.train()
    assert full_seen[0] == (groups * SIZE, batch["prompt_ids"].shape[1])
    assert our_seen[0] == (groups, batch["prompt_ids"].shape[1]) and our_seen[1:] == full_seen[1:]
    assert relative_difference(our_logits, full_logits) < REL
    assert torch.equal(ours, full)
    assert "forward" not in vars(model.base_model)
