"""Evaluation numbers against known answers: accuracy is the fraction of greedy completions scored >= 1, pass@k the
fraction of prompts with any of their k samples scored >= 1."""

from __future__ import annotations

import pytest

from grpo.training.evaluation import evaluate_policy, generate_completions
from grpo.training.tiny_model import build_char_tokenizer, build_tiny_qwen2

PROMPTS = ["12+34=", "5+6=", "70+8=", "9+9=", "1+1=", "23+45="]


@pytest.fixture(scope="module")
def policy():
    tokenizer = build_char_tokenizer("0123456789+=")
    model = build_tiny_qwen2(tokenizer, 32, 1, 2, 64, 32, seed=0)  # untrained: its completions are arbitrary
    return model, tokenizer


def test_accuracy_is_the_fraction_of_greedy_completions_scored_correct(policy):
    model, tokenizer = policy
    greedy = [c[0] for c in generate_completions(model, tokenizer, PROMPTS, 4, 4, do_sample=False)]
    # The answer equals the model's own greedy completion for prompts 0, 2, 5 only: those 3 of 6 are correct.
    answers = [g if i in (0, 2, 5) else g + "x" for i, g in enumerate(greedy)]
    seen_scores = []

    def same(prompts, completions, answer, **_):
        scores = [1.0 if c == a else 0.99 for c, a in zip(completions, answer)]  # 0.99 is not full marks
        seen_scores.append(scores)
        return scores

    result = evaluate_policy(model, tokenizer, PROMPTS, answers, same, max_new_tokens=4, batch_size=4)
    assert result.accuracy == pytest.approx(3 / 6) and result.pass_at_k is None
    assert [s["correct"] for s in result.samples] == [True, False, True, False, False, True]
    assert [s["completion"] for s in result.samples] == greedy  # batching (4 then 2) keeps the prompt order


def test_pass_at_k_counts_prompts_with_any_correct_sample(policy):
    model, tokenizer = policy
    k = 4
    calls = []

    def known_hits(prompts, completions, answer, **_):
        calls.append(len(completions))
        if len(completions) == len(PROMPTS):  # the greedy pass: nothing correct
            return [0.0] * len(completions)
        # Sampled pass: k completions per prompt, in prompt order; only sample 2 of prompts 1 and 4 is correct,
        # and prompt 3's samples score None (unscorable) except one 1.0.
        scores = []
        for i in range(len(PROMPTS)):
            for j in range(k):
                hit = (i in (1, 4) and j == 2) or (i == 3 and j == 0)
                scores.append(1.0 if hit else (None if i == 3 else 0.5))
        return scores

    result = evaluate_policy(model, tokenizer, PROMPTS, ["0"] * len(PROMPTS), known_hits, max_new_tokens=3,
                             batch_size=8, pass_k=k)
    assert calls == [len(PROMPTS), len(PROMPTS) * k]
    assert result.accuracy == 0.0 and result.pass_at_k == pytest.approx(3 / 6) and result.k == k
    assert result.as_metrics() == {"eval/accuracy": 0.0, f"eval/pass@{k}": pytest.approx(0.5)}


def test_generation_uses_the_kv_cache_though_the_trained_config_turns_it_off(policy):
    """transformers' Trainer sets ``config.use_cache = False`` for training, and the policy (evaluated in process, or
    copied to the async generator and saved) carries that flag. Evaluation and the generator pass ``use_cache=True``:
    after the prompt, every forward of the decoding loop takes one new token, not the whole sequence again (which
    made the generator 2-9x slower)."""
    from grpo.training.async_producer import sample_round

    model, tokenizer = policy
    model.config.use_cache = model.generation_config.use_cache = False
    widths: list[int] = []
    hook = model.register_forward_pre_hook(lambda _m, _a, kw: widths.append(kw["input_ids"].shape[1]), with_kwargs=True)
    try:
        generate_completions(model, tokenizer, PROMPTS[:2], 4, 2, do_sample=False)
        assert widths[0] == 6 and len(widths) > 1 and set(widths[1:]) == {1}, widths  # the prompt once, then 1 token
        widths.clear()
        ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS[:2]]
        gen = {"max_new_tokens": 4, "temperature": 1.0, "top_p": 1.0, "top_k": 0,
               "pad_token_id": tokenizer.pad_token_id, "eos_token_ids": [-1]}  # never ends early: 4 tokens each
        completions, logps = sample_round(model, ids, gen)
        assert widths == [6, 1, 1, 1], widths
        assert [len(c) for c in completions] == [4, 4] and [len(lp) for lp in logps] == [4, 4]
    finally:
        hook.remove()
        model.config.use_cache = model.generation_config.use_cache = True


def test_environment_episodes_stop_each_turn_where_it_ends_whatever_the_batches_do():
    """Evaluation's episode ``generate`` (sampled, as pass@k samples; batches of 4 of the 8 episodes): each row of a
    turn stops at its stop string (a digit) or its budget, so no more is generated than kept, and the episodes are
    those of the same seed sampled without stopping (no stop strings, every row to the batch's largest budget, the
    runner cutting it): where one batch stops does not move what the next batch or turn samples."""
    import torch

    from grpo.environments.builtin import GuessDigitEnvironment
    from grpo.environments.episodes import run_episodes
    from grpo.training.evaluation import episode_generator

    tokenizer = build_char_tokenizer("0123456789+=<>")
    model = build_tiny_qwen2(tokenizer, 32, 1, 2, 64, 128, seed=0)
    generate = episode_generator(model, tokenizer, do_sample=True, batch_size=4)
    prompts = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS[:4] for _ in range(2)]

    def episodes(fn):
        with torch.random.fork_rng():
            torch.manual_seed(0)
            return run_episodes(prompts, [GuessDigitEnvironment() for _ in prompts], fn, tokenizer,
                                rows=[{"answer": "7"}] * len(prompts), max_turns=4, max_completion_length=48)

    stopped = episodes(generate)
    full = episodes(lambda seqs, budgets, stops: generate(seqs, [max(budgets)] * len(seqs), ()))
    assert any(ep.turns > 2 for ep in stopped)
    assert stopped == full
    generated = [sum(ep.generated_tokens for ep in eps) for eps in (stopped, full)]
    assert generated[0] == sum(ep.model_tokens for ep in stopped) < generated[1] / 2, generated
