"""Held-out evaluation: greedy accuracy and pass@k with sampling.

A completion counts as correct when the task's correctness reward gives it full marks (>= 1.0), so evaluation and
training agree on what "right" means.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from grpo.training.model_support import GENERATION_KV_CACHE, applies
from grpo.training.prompts import prompt_texts


@dataclass
class EvalResult:
    accuracy: float
    pass_at_k: float | None
    k: int
    num_prompts: int
    samples: list[dict]  # a few (prompt, completion, answer, correct) rows for inspection

    def as_metrics(self, prefix: str = "eval") -> dict[str, float]:
        out = {f"{prefix}/accuracy": self.accuracy}
        if self.pass_at_k is not None:
            out[f"{prefix}/pass@{self.k}"] = self.pass_at_k
        return out


@torch.no_grad()
def generate_completions(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str] | list[list[dict[str, str]]],
    max_new_tokens: int,
    batch_size: int,
    do_sample: bool,
    temperature: float = 1.0,
    num_return_sequences: int = 1,
) -> list[list[str]]:
    """Completions per prompt (``num_return_sequences`` each), decoded without special tokens. Conversational
    prompts are rendered with the chat template first, as in training."""
    prompts = prompt_texts(prompts, tokenizer)
    model.eval()
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    out: list[list[str]] = []
    try:
        for start in range(0, len(prompts), batch_size):
            batch = prompts[start : start + batch_size]
            enc = tokenizer(batch, return_tensors="pt", padding=True, add_special_tokens=False)
            enc = {k: v.to(model.device) for k, v in enc.items()}
            gen = model.generate(
                **enc,
                max_new_tokens=max_new_tokens,
                do_sample=do_sample,
                temperature=temperature if do_sample else None,
                top_p=None,
                top_k=None,
                num_return_sequences=num_return_sequences,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
                # A trained policy's config says false (transformers' Trainer turns it off); the cache is the model's own
                use_cache=applies(GENERATION_KV_CACHE, model),
            )
            texts = tokenizer.batch_decode(gen[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
            for i in range(len(batch)):
                out.append(texts[i * num_return_sequences : (i + 1) * num_return_sequences])
    finally:
        tokenizer.padding_side = side
    return out


def evaluate_policy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str] | list[list[dict[str, str]]],
    answers: list[str],
    correctness: Callable[..., list[float]],
    max_new_tokens: int,
    batch_size: int = 256,
    pass_k: int = 0,
    pass_k_temperature: float = 1.0,
    seed: int = 0,
    num_samples_to_keep: int = 16,
) -> EvalResult:
    """Greedy accuracy over all prompts, then pass@k (k sampled completions, any correct) when ``pass_k > 0``."""
    greedy = [c[0] for c in generate_completions(model, tokenizer, prompts, max_new_tokens, batch_size, False)]
    scores = correctness(prompts=prompts, completions=greedy, answer=answers)
    correct = [s is not None and s >= 1.0 for s in scores]
    pass_at_k = None
    if pass_k > 0:
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            sampled = generate_completions(
                model, tokenizer, prompts, max_new_tokens, max(1, batch_size // pass_k), True,
                pass_k_temperature, pass_k,
            )
        flat_prompts = [p for p in prompts for _ in range(pass_k)]
        flat_answers = [a for a in answers for _ in range(pass_k)]
        flat = [c for cs in sampled for c in cs]
        flat_scores = correctness(prompts=flat_prompts, completions=flat, answer=flat_answers)
        hits = [
            any(s is not None and s >= 1.0 for s in flat_scores[i * pass_k : (i + 1) * pass_k])
            for i in range(len(prompts))
        ]
        pass_at_k = sum(hits) / len(prompts)
    samples = [
        {"prompt": p, "completion": c, "answer": a, "correct": ok}
        for p, c, a, ok in list(zip(prompts, greedy, answers, correct))[:num_samples_to_keep]
    ]
    return EvalResult(
        accuracy=sum(correct) / len(prompts), pass_at_k=pass_at_k, k=pass_k, num_prompts=len(prompts), samples=samples
    )
