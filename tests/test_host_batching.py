"""The generation batch built per batch (``grpo.training.host_batching``): TRL's tensors and tokens exactly, with a
number of host tensor operations that does not grow with the batch's rows."""

from __future__ import annotations

import collections
import random

import pytest
import torch
import trl
from torch.overrides import TorchFunctionMode
from trl.trainer.utils import pad as trl_pad

from grpo.training.host_batching import cut_at_eos
from grpo.training.padding import pad, padded, padded_rows
from tests.trainers import micro_trainer


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.device == b.device and a.shape == b.shape and torch.equal(a.nan_to_num(-7),
                                                                                              b.nan_to_num(-7))


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("multiple", [None, 1, 3, 8])
def test_pad_is_trls_pad(side, multiple):
    rng = random.Random(f"{side}{multiple}")
    for trial in range(30):
        lengths = [rng.randint(0, 9) for _ in range(rng.randint(1, 12))]
        if trial % 3 == 0:
            rows = [torch.tensor([rng.choice([0.5, -1.25, float("nan")]) for _ in range(n)]) for n in lengths]
            value = 0.0
        else:
            rows = [torch.randint(0, 50, (n,)) for n in lengths]
            value = rng.choice([0, 1, 7])
        assert _same(pad(rows, value, side, multiple), trl_pad(rows, value, side, multiple)), (lengths, trial)
    mixed = [torch.ones(2, dtype=torch.long), torch.tensor([0.7, 2.9])]  # TRL casts every row to the first's dtype
    assert _same(pad(mixed, 0, side, multiple), trl_pad(mixed, 0, side, multiple))
    images = [torch.ones(2, 3), torch.ones(1, 3)]  # more than one dimension: TRL's own
    assert _same(pad(images, 0, side, multiple), trl_pad(images, 0, side, multiple))


def test_pad_casts_each_row_to_the_first_rows_dtype_as_trl_does():
    """TRL casts each row to the first's dtype on its own; a common dtype first (``torch.cat``'s promotion) rounds ids
    beside an empty completion (``torch.tensor([])`` is float32) or a half-precision row."""
    ids = torch.tensor([2**24 + 1, 5])
    for rows in ([ids, torch.tensor([])], [torch.tensor([]), ids], [ids, torch.tensor([0.5], dtype=torch.half)]):
        for side in ("left", "right"):
            assert _same(pad(rows, 0, side), trl_pad(rows, 0, side)), (rows, side)


def test_padded_rows_and_cut_at_eos_are_trls_per_row_tensors():
    rng = random.Random(0)
    rows = [[rng.randint(3, 40) for _ in range(rng.randint(1, 9))] for _ in range(20)]
    for side in ("left", "right"):
        for multiple in (None, 4):
            ids, mask = padded_rows(rows, 2, side, multiple)
            tensors = [torch.tensor(r) for r in rows]
            assert _same(ids, trl_pad(tensors, 2, side, multiple))
            assert _same(mask, trl_pad([torch.ones_like(t) for t in tensors], 0, side, multiple))
            logps = [[-0.5 * k, float("nan")][: 1 + k % 2] for k in range(7)]  # log-probs with NaN, as recorded
            assert _same(padded(logps, 0.0, side, torch.float32, multiple),
                         trl_pad([torch.tensor(r) for r in logps], 0.0, side, multiple))
    eos = [1, 2]
    completions = torch.tensor([[5, 6, 1, 7], [2, 9, 9, 9], [5, 5, 5, 5], [4, 2, 1, 1], [1, 1, 1, 1]])
    is_eos = torch.isin(completions, torch.tensor(eos))
    first = torch.where(is_eos.any(1), is_eos.int().argmax(1), completions.size(1))
    trls = [c[torch.arange(c.size(0)) <= n].tolist() for c, n in zip(completions, first, strict=True)]
    assert cut_at_eos(completions, eos) == trls == [[5, 6, 1], [2], [5, 5, 5, 5], [4, 2], [1]]


class _RowOps(TorchFunctionMode):
    """Counts the per-row operations of TRL's batch building: a tensor made from a row, a mask like it, an indexed
    assignment, a boolean index."""

    NAMES = {"tensor", "ones_like", "__setitem__", "__getitem__"}

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in self.NAMES:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


# prompts of different lengths (the dataset's are all "ab+cd="), so that they need padding; groups of 4
ROWS = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in
        [(1, 2), (35, 4), (60, 71), (7, 99), (3, 3), (12, 40), (5, 88), (90, 9)] for _ in range(4)]


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    return micro_trainer(tmp_path_factory.mktemp("host-batching"), {
        "grpo.per_device_train_batch_size": 32, "grpo.num_generations": 4, "grpo.max_completion_length": 6,
        "grpo.extra": "{pad_to_multiple_of: 4}", "grpo.temperature": 1.5, "async.shared_prompt_forward": "false",
        "async.compact_zero_advantage": "false"})


@pytest.mark.integration
@pytest.mark.parametrize("chat", [False, True], ids=["text", "chat"])
def test_each_group_prompt_is_tokenised_once(trainer, chat):
    """TRL's token ids for every row, from one tokenisation (chat template included) per run of equal prompts."""
    tokenizer = trainer.processing_class
    prompts = [row["prompt"] for row in ROWS] + ["1+2=", "5+5=", "1+2="]  # runs of 4, then single prompts
    if chat:
        prompts = [[{"role": "user", "content": p}] for p in prompts]
    texts: list[int] = []

    class Counting(type(tokenizer)):  # records how many prompts each tokenisation is given
        def __call__(self, *args, **kwargs):
            if not chat:  # (a chat template's rendering calls this too, with its text)
                texts.append(len(kwargs["text"]))
            return super().__call__(*args, **kwargs)

        def apply_chat_template(self, conversation, *args, **kwargs):
            texts.append(len(conversation))
            return super().apply_chat_template(conversation, *args, **kwargs)

    original, template = type(tokenizer), tokenizer.chat_template
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tokenizer.__class__ = Counting
    try:
        ours = trainer._tokenize_prompts(prompts)
        counted, texts[:] = list(texts), []
        theirs = trl.GRPOTrainer._tokenize_prompts(trainer, prompts)
    finally:
        tokenizer.__class__, tokenizer.chat_template = original, template
    assert ours == theirs and len(ours[0]) == 35 and ours[0][0] != ours[0][4]
    assert counted == [8 + 3] and texts == [35]
    ours[0][0].append(99)  # rows are lists of their own, as TRL's are
    assert ours[0][1] == theirs[0][1]


@pytest.mark.integration
def test_prompts_equal_but_rendered_apart_are_tokenised_each(trainer):
    """``==`` holds for dicts in another key order (a tool call's arguments) and for 1, 1.0 and True, which a chat
    template renders apart: each is tokenised as TRL tokenises it; equal reprs still share one tokenisation."""
    tokenizer = trainer.processing_class
    contents = [{"a": 1, "b": 2}, {"b": 2, "a": 1}, 1, 1.0, True, True]
    prompts = [[{"role": "user", "content": c}] for c in contents]
    template = tokenizer.chat_template  # renders "12", "21", "1", "3", "4", "4" (the tiny vocabulary has digits)
    tokenizer.chat_template = ("{% for m in messages %}{% if m.content is mapping %}{% for k in m.content %}"
                               "{{ m.content[k] }}{% endfor %}{% else %}{{ m.content|string|length }}{% endif %}"
                               "{% endfor %}")
    try:
        ours, theirs = trainer._tokenize_prompts(prompts), trl.GRPOTrainer._tokenize_prompts(trainer, prompts)
    finally:
        tokenizer.chat_template = template
    assert ours == theirs and len(set(map(tuple, ours[0]))) == 5


@pytest.mark.integration
def test_generation_and_scoring_are_trls_with_per_batch_host_work(trainer):
    """The trainer's generation samples TRL's completions for the same seed, and its scoring step returns TRL's
    tensors; TRL's make many tensor operations per row, the trainer's the four its scoring code makes of each row."""
    rows = ROWS
    prompt_ids, _, _ = trainer._tokenize_prompts([r["prompt"] for r in rows])
    assert len({len(p) for p in prompt_ids}) > 1  # the prompts need padding

    def generate(generate_single_turn):
        torch.manual_seed(5)
        return generate_single_turn(prompt_ids, None, {}, 4)

    ours = generate(trainer._generate_single_turn)
    assert ours == generate(lambda *a: trl.GRPOTrainer._generate_single_turn(trainer, *a))
    assert any(ids[-1] not in trainer.eos_token_ids for ids in ours[0])  # some rows run to the budget,
    assert any(ids[-1] in trainer.eos_token_ids and len(ids) < 6 for ids in ours[0])  # others stop early

    def score(step, n):
        torch.manual_seed(5)
        with _RowOps() as ops:
            batch = step(rows[:n])
        return batch, sum(ops.counts.values())

    ours, ops_32 = score(trainer._generate_and_score_completions, 32)
    theirs, trl_ops_32 = score(lambda r: trl.GRPOTrainer._generate_and_score_completions(trainer, r), 32)
    assert ours.keys() == theirs.keys()
    for key, value in ours.items():
        assert _same(value, theirs[key]) if isinstance(value, torch.Tensor) else value == theirs[key], key
    assert ours["prompt_ids"].size(1) % 4 == 0 and ours["completion_ids"].size(1) % 4 == 0
    _, ops_8 = score(trainer._generate_and_score_completions, 8)
    _, trl_ops_8 = score(lambda r: trl.GRPOTrainer._generate_and_score_completions(trainer, r), 8)
    # per row: ours, the 4 tensors TRL's scoring code makes of each row before it pads them; TRL's, many more
    assert ops_32 - ops_8 == 4 * 24, (ops_8, ops_32)
    assert trl_ops_32 - trl_ops_8 >= 3 * 4 * 24, (trl_ops_8, trl_ops_32)
