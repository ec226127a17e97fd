"""The embedded tasks, generated locally: small-integer addition with exact answers (``synthetic:addition``, the
default), the same problems answered with their column-by-column work (``synthetic:addition_cot``), and hidden
digits for the ``guess_digit`` environment (``synthetic:guess_digit``). The warm-start demonstrations of the
embedded environments are here too: :func:`calculator_demonstrations`, :func:`guess_digit_demonstrations`.

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


TASKS = ("addition", "addition_cot", "guess_digit")
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


def guess_digit_problems(num_train: int, num_eval: int, seed: int = 0) -> DatasetDict:
    """Rows for the ``guess_digit`` environment: the prompt ``0421?`` is a row id (distinct ids, so prep keeps every
    row; disjoint train/eval ids), the answer the hidden digit the environment's ``reset`` reads from the row.
    The prompt says nothing about the digit: what the policy learns is how to search from the feedback."""
    from datasets import Dataset, DatasetDict

    if num_train < 1 or num_eval < 1:
        raise ValueError(f"num_train and num_eval must be >= 1, got {num_train} and {num_eval}")
    if num_train + num_eval > GUESS_DIGIT_IDS:
        raise ValueError(f"num_train + num_eval = {num_train + num_eval} exceeds the {GUESS_DIGIT_IDS} distinct "
                         "guess_digit rows")
    rng = random.Random(seed)
    ids = rng.sample(range(GUESS_DIGIT_IDS), num_train + num_eval)
    digits = [str(rng.randrange(10)) for _ in ids]

    def rows(lo: int, hi: int) -> dict[str, list[str]]:
        return {"prompt": [f"{i:04d}?" for i in ids[lo:hi]], "answer": digits[lo:hi]}

    return DatasetDict(train=Dataset.from_dict(rows(0, num_train)),
                       eval=Dataset.from_dict(rows(num_train, num_train + num_eval)))


GUESS_DIGIT_IDS = 10_000
"""Distinct ``guess_digit`` prompts (four-digit row ids)."""


def calculator_demonstrations(
    prompts: list[str], answers: list[str], carry_error_rate: float, seed: int = 0, *,
    tool_rate: float = 0.01, call_rate: float = 0.1, copy_rate: float = 0.2,
) -> tuple[list[str], list[str]]:
    """Warm-start (prompt, completion) pairs for the ``calculator`` environment on the addition task: a policy that
    answers directly (forgetting carries as :func:`flawed_addition_demonstrations` does) and rarely calls its tool,
    but knows how to call it and how to use its answer, so GRPO can discover that calling pays.

    Per row, by chance: ``tool_rate`` the whole call (``27+15=`` -> ``[27+15]42|42``: sets how often the policy opens
    a call); ``call_rate`` the call's expression with ``[`` already in the prompt (``27+15=[`` -> ``27+15]``: the
    loss covers completion tokens only, so the syntax is learned without making calls more frequent); ``copy_rate``
    the call and its answer in the prompt (``27+15=[27+15]42|`` -> ``42``: copying the tool's answer); otherwise the
    direct, flawed answer. Without the two partial kinds the policy calls with other operands than its prompt's and
    rarely copies the tool's answer (``benchmarks/_calculator_warm_start_probe.py``)."""
    if min(tool_rate, call_rate, copy_rate) < 0 or tool_rate + call_rate + copy_rate > 1:
        raise ValueError(f"tool_rate, call_rate, copy_rate must be >= 0 and sum to <= 1, got {tool_rate}, "
                         f"{call_rate}, {copy_rate}")
    flawed = flawed_addition_demonstrations(prompts, answers, carry_error_rate, seed=seed)
    rng = random.Random(seed + 1)
    out_prompts, out_answers = [], []
    for prompt, answer, direct in zip(prompts, answers, flawed):
        expression, u = prompt.removesuffix("="), rng.random()
        if u < tool_rate:
            pair = (prompt, f"[{expression}]{answer}|{answer}")
        elif u < tool_rate + call_rate:
            pair = (f"{prompt}[", f"{expression}]")
        elif u < tool_rate + call_rate + copy_rate:
            pair = (f"{prompt}[{expression}]{answer}|", answer)
        else:
            pair = (prompt, direct)
        out_prompts.append(pair[0])
        out_answers.append(pair[1])
    return out_prompts, out_answers


def guess_digit_demonstrations(answers: list[str], ignore_feedback_rate: float = 0.1, seed: int = 0,
                               max_guesses: int = 4) -> list[str]:
    """Warm-start episodes for ``guess_digit`` (``5>2<3=``, the environment's feedback included): each guess is a
    random digit the feedback so far allows, or with ``ignore_feedback_rate`` any digit. Such a policy finds the
    digit within 4 guesses about 72 % of the time at 0.1 (76 % at 0: random consistent guessing), short of binary
    search's 100 %, so GRPO groups differ in reward and the search improves."""
    if not 0.0 <= ignore_feedback_rate <= 1.0:
        raise ValueError(f"ignore_feedback_rate must be in [0, 1], got {ignore_feedback_rate}")
    rng = random.Random(seed)
    out = []
    for answer in answers:
        digit, lo, hi, episode = int(answer), 0, 9, ""
        for _ in range(max_guesses):
            guess = rng.randint(0, 9) if rng.random() < ignore_feedback_rate else rng.randint(lo, hi)
            if guess == digit:
                episode += f"{guess}="
                break
            episode += f"{guess}{'<' if guess < digit else '>'}"
            lo, hi = (max(lo, guess + 1), hi) if guess < digit else (lo, min(hi, guess - 1))
        out.append(episode)
    return out
