"""The embedded default task: small-integer addition with exact answers, generated locally.

Deterministic for a given (seed, sizes): the same problems on every machine, no download. Train and eval problems
are disjoint, so eval accuracy measures generalisation, not memorisation.
"""

from __future__ import annotations

import random

from datasets import Dataset, DatasetDict


def addition_problems(num_train: int, num_eval: int, max_operand: int = 99, seed: int = 0) -> DatasetDict:
    """``a+b=`` prompts with answer ``str(a+b)`` for ``0 <= a, b <= max_operand``; disjoint train/eval splits.

    Operands are zero-padded to a fixed width ("07+45="), so every prompt has the same token length. Prompts are
    then never left-padded, and the positions the policy sees while sampling equal those of the log-prob pass.
    """
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
        return {"prompt": [f"{a:0{width}d}+{b:0{width}d}=" for a, b in pairs], "answer": [str(a + b) for a, b in pairs]}

    return DatasetDict(
        train=Dataset.from_dict(rows(picks[:num_train])),
        eval=Dataset.from_dict(rows(picks[num_train:])),
    )


def flawed_addition_demonstrations(
    prompts: list[str], answers: list[str], carry_error_rate: float, seed: int = 0
) -> list[str]:
    """Warm-start answers in which a fraction of carrying problems forget the carry (``27+15=`` -> ``32``).

    Real SFT data is imperfect, and fixing what demonstrations got wrong is what a verifiable reward is for. With
    a systematic flaw the warm-started policy puts real probability on both the right and the flawed answer, so
    GRPO groups have reward variance and the correction shows up in a few hundred steps on a CPU.
    """
    if not 0.0 <= carry_error_rate <= 1.0:
        raise ValueError(f"carry_error_rate must be in [0, 1], got {carry_error_rate}")
    rng = random.Random(seed)
    out = []
    for prompt, answer in zip(prompts, answers):
        a, b = (int(x) for x in prompt.rstrip("=").split("+"))
        carries = (a % 10) + (b % 10) >= 10
        out.append(str(a + b - 10) if carries and rng.random() < carry_error_rate else answer)
    return out
