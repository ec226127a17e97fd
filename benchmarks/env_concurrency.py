"""``python -m benchmarks env_concurrency``: a round of multi-turn episodes with a slow tool, environment steps
concurrent (the episode runner's pool) versus one at a time.

A round of BENCH_EPISODES (64) episodes, each calling a tool that sleeps BENCH_TOOL_S (0.2 s) in each of its
BENCH_TURNS (3) tool turns, then answering. Generation is the tiny preset's policy shape sampling BENCH_GEN_TOKENS (4)
tokens for every live episode each turn, one batched call per turn (``sample_round``, the async generator's); the
turns' text is scripted (``[k]`` then ``v<eos>``) so that every episode makes every call whatever an untrained model
samples. Target (#30): the concurrent round takes <= 1.5 x (turns x tool seconds + generation seconds); serially it
takes episodes x turns x tool seconds more (about 38 s at the defaults). Both runs must give identical episodes.

Then stopping each turn where it ends (#48): a round of BENCH_EPISODES ``guess_digit`` episodes (every digit ends a
turn, at most 4 turns) sampled by the same policy through the episode generator of the sync trainer and the CPU
generator (``sampling_generate``) with a budget of BENCH_STOP_BUDGET (96) tokens, a turn being a few: each row of a
turn's batch stopped at its stop string or its own budget, against the same round sampled as every turn was before:
no stop strings, every row to the batch's largest budget left, cut by the runner. Reported per side: the round's
time, tokens generated and kept (the model's, over the round's episodes) and ``generated_over_kept`` (target <= 1.05);
both sides must give identical episodes (token ids and log-probs) for the same seed.

``--smoke``: 8 episodes, 2 tool turns, a 0.02 s tool, a budget of 32.
"""

from __future__ import annotations

import os
import time

from benchmarks._sizes import size
from benchmarks._tool_task import tool_task


def main(smoke: bool = False) -> dict:
    episodes = size("BENCH_EPISODES", 64, 8, smoke)
    turns = size("BENCH_TURNS", 3, 2, smoke)
    tool_s = size("BENCH_TOOL_S", 0.2, 0.02, smoke)
    gen_tokens = size("BENCH_GEN_TOKENS", 4, 2, smoke)
    stop_budget = size("BENCH_STOP_BUDGET", 96, 32, smoke)
    if min(episodes, turns, gen_tokens, stop_budget) < 1 or tool_s < 0:
        raise ValueError("BENCH_EPISODES, BENCH_TURNS, BENCH_GEN_TOKENS and BENCH_STOP_BUDGET must be >= 1, "
                         "BENCH_TOOL_S >= 0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from grpo.environments import ToolEnvironment
    from grpo.environments.builtin import GuessDigitEnvironment
    from grpo.environments.episodes import run_episodes
    from grpo.training.async_producer import sample_round, sampling_generate

    task = tool_task(gen_tokens, tool_s)
    tok, model, gen, call, k_id, answer, lookup = (task.tokenizer, task.model, task.gen, task.call, task.k_id,
                                                   task.answer, task.lookup)

    def run(max_workers: int) -> tuple[float, float, list]:
        generate_s = 0.0

        def generate(seqs, max_new_tokens, stop_strings):
            nonlocal generate_s
            start = time.perf_counter()
            sample_round(model, seqs, {**gen, "max_new_tokens": min(gen_tokens, max(max_new_tokens))})
            generate_s += time.perf_counter() - start
            out = []
            for s in seqs:  # an episode calls the tool until its sequence holds ``turns`` calls ("k" is in none else)
                ids = call if s.count(k_id) < turns else answer
                out.append((ids, [0.0] * len(ids)))
            return out

        torch.manual_seed(0)
        prompts = [tok(f"{i:02d}=", add_special_tokens=False)["input_ids"] for i in range(episodes)]
        start = time.perf_counter()
        result = run_episodes(prompts, [ToolEnvironment([lookup]) for _ in prompts], generate, tok,
                              max_turns=turns + 1, max_completion_length=8 * (turns + 1), max_workers=max_workers,
                              step_timeout=None)
        return time.perf_counter() - start, generate_s, result

    def stop_round(stop: bool) -> tuple[dict, list]:
        sample = sampling_generate(model, gen, tok)
        # before: no stop strings, and every row of a turn sampled to the batch's largest budget
        generate = sample if stop else (lambda seqs, budgets, stops: sample(seqs, [max(budgets)] * len(seqs), ()))
        prompts = [f"{i // 4:02d}=" for i in range(episodes)]  # GRPO groups of 4 copies of a prompt
        torch.manual_seed(0)
        start = time.perf_counter()
        result = run_episodes([tok(p, add_special_tokens=False)["input_ids"] for p in prompts],
                              [GuessDigitEnvironment() for _ in prompts], generate, tok,
                              rows=[{"prompt": p} for p in prompts], max_turns=4, max_completion_length=stop_budget)
        seconds = time.perf_counter() - start
        generated, kept = sum(ep.generated_tokens for ep in result), sum(ep.model_tokens for ep in result)
        return {"round_s": seconds, "generated_tokens": generated, "kept_tokens": kept,
                "generated_over_kept": generated / kept, "turns": sum(ep.turns for ep in result)}, result

    concurrent_s, concurrent_gen_s, concurrent = run(max_workers=episodes)
    serial_s, serial_gen_s, serial = run(max_workers=1)
    bound = turns * tool_s + concurrent_gen_s
    stopped, stopped_eps = stop_round(stop=True)
    full, full_eps = stop_round(stop=False)
    return {
        "episodes": episodes,
        "turns": turns,
        "tool_s": tool_s,
        "tool_calls": sum(ep.tool_calls.get("lookup", 0) for ep in concurrent),
        "episodes_identical": concurrent == serial,
        "concurrent_round_s": concurrent_s,
        "concurrent_generate_s": concurrent_gen_s,
        "serial_round_s": serial_s,
        "serial_generate_s": serial_gen_s,
        "ratio_concurrent_over_turns_x_tool_plus_generation": concurrent_s / bound if bound > 0 else None,
        "target_ratio": 1.5,
        "speedup_serial_over_concurrent": serial_s / concurrent_s,
        "turn_stop": {"budget": stop_budget, "stop_at_turn_end": stopped, "full_budget": full,
                      "episodes_identical": stopped_eps == full_eps,  # logprobs included: Episode compares them
                      "target_generated_over_kept": 1.05,
                      "speedup_full_budget_over_stop": full["round_s"] / stopped["round_s"]},
    }
