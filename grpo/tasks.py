"""The embedded tasks, generated locally: small-integer addition with exact answers (``synthetic:addition``, the
default), and the same problems answered with their column-by-column work (``synthetic:addition_cot``).

Deterministic for a given (seed, sizes): the same problems on every machine, no download. Train and eval problems
are disjoint, so eval accuracy measures generalisation, not memorisation.

``addition_cot`` is the reasoning-style variant: a completion is about 17 tokens instead of 3 ("27+15=" ->
"7+5=12;2+1+1=4;42"), so generation -- one decoding step per token -- is the larger share of a step, as in
reasoning RL, while the answer stays exactly checkable (``exact_match`` rewards the right work and result).
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from datasets import DatasetDict


TASKS = ("addition", "addition_cot")
"""The names after ``synthetic:`` in ``data.source``."""


def worked_addition(a: int, b: int, width: int, forget_first_carry: bool = False) -> str:
    """The column-by-column work of ``a+b`` then the result: ``worked_addition(27, 15, 2) == "7+5=12;2+1+1=4;42"``.

    Each column (ones first) reads ``x+y=s`` or, with an incoming carry, ``x+y+1=s``. ``forget_first_carry`` writes
    the flawed work of a demonstration that drops the carry out of the ones column (and its result, ``a+b-10``).
    """
    steps, carry, total = [], 0, 0
    for i in range(width):
        x, y = (a // 10**i) % 10, (b // 10**i) % 10
        col = x + y + carry
        steps.append(f"{x}+{y}+1={col}" if carry else f"{x}+{y}={col}")
        total += (col % 10) * 10**i
        carry = col // 10
        if i == 0 and forget_first_carry:
            carry = 0
    total += carry * 10**width
    return ";".join(steps) + f";{total}"


def addition_problems(num_train: int, num_eval: int, max_operand: int = 99, seed: int = 0,
                      worked: bool = False) -> DatasetDict:
    """``a+b=`` prompts with answer ``str(a+b)`` for ``0 <= a, b <= max_operand``; disjoint train/eval splits.
    ``worked``: the answer is the column-by-column work then the result (:func:`worked_addition`).

    Operands are zero-padded to a fixed width ("07+45="), so every prompt has the same token length. Prompts are
    then never left-padded, and the positions the policy sees while sampling equal those of the log-prob pass.
    """
    from datasets import Dataset, DatasetDict

    total = (max_operand + 1) ** 2
    if num_train < 1 or num_eval < 1:
        raise ValueError(f"num_train and num_eval must be >= 1, got {num_train} and {num_eval}")
    if num_train + num_eval > total:
        raise ValueError(
            f"num_train + num_eval = {num_train + num_eval} exceeds the {total} distinct problems with "
            f"max_operand={max_operand}"
        )
    rng = random.Random(seed)
    picks = rng.sample(range(total), num_train + num_eval)

    def rows(ids: list[int]) -> dict[str, list[str]]:
        pairs = [divmod(i, max_operand + 1) for i in ids]
        width = len(str(max_operand))
        answers = [worked_addition(a, b, width) if worked else str(a + b) for a, b in pairs]
        return {"prompt": [f"{a:0{width}d}+{b:0{width}d}=" for a, b in pairs], "answer": answers}

    return DatasetDict(
        train=Dataset.from_dict(rows(picks[:num_train])),
        eval=Dataset.from_dict(rows(picks[num_train:])),
    )


def flawed_addition_demonstrations(
    prompts: list[str], answers: list[str], carry_error_rate: float, seed: int = 0, worked: bool = False
) -> list[str]:
    """Warm-start answers in which a fraction of carrying problems forget the carry (``27+15=`` -> ``32``, or with
    ``worked`` the work that forgets it: ``7+5=12;2+1=3;32``).

    Real SFT data is imperfect, and fixing what demonstrations got wrong is what a verifiable reward is for. With
    a systematic flaw the warm-started policy puts real probability on both the right and the flawed answer, so
    GRPO groups have reward variance and the correction shows up in a few hundred steps on a CPU.
    """
    if not 0.0 <= carry_error_rate <= 1.0:
        raise ValueError(f"carry_error_rate must be in [0, 1], got {carry_error_rate}")
    rng = random.Random(seed)
    out = []
    for prompt, answer in zip(prompts, answers):
        a_text, b_text = prompt.rstrip("=").split("+")
        a, b = int(a_text), int(b_text)
        carries = (a % 10) + (b % 10) >= 10
        if carries and rng.random() < carry_error_rate:
            out.append(worked_addition(a, b, len(a_text), forget_first_carry=True) if worked else str(a + b - 10))
        else:
            out.append(answer)
    return out
