"""``python -m benchmarks agent_concurrency``: a round of agents, each an ``openai``-SDK function with a slow tool,
against the endpoint the episode runner serves (#47 §3).

BENCH_EPISODES (64) agents each make BENCH_TURNS (3) tool calls, each a completion that ends with ``[k]`` followed
by a tool that sleeps BENCH_TOOL_S (0.2 s) and appends ``v|``, then a last call for the answer. Generation is the
tiny preset's policy shape sampling BENCH_GEN_TOKENS (4) tokens for every waiting call each turn, one batched call
per turn (``sample_round``, the async generator's); the turns' text is scripted (``[k]`` then ``v<eos>``) so that
every agent makes every call whatever an untrained model samples, as ``env_concurrency`` scripts its episodes. A first
agent round runs untimed (``warm_up_round_s``: importing ``openai``, starting the endpoint, torch's first passes).
Target (#47): the round takes <= 1.5 x (turns x tool seconds + generation seconds). The same round as a text-protocol
tool environment (``env_concurrency``'s) is timed beside it, and both must give the same episodes (token ids and
environment masks): the agent's appended ``v|`` is the tool environment's answer.

``--smoke``: 8 agents, 2 tool turns, a 0.02 s tool.
"""

from __future__ import annotations

import os
import time

from benchmarks._sizes import size
from benchmarks._tool_task import tool_task

_SETTINGS: dict[str, float] = {}


def bench_agent(client, row: dict) -> float:
    """Call the model, run the tool its ``[k]`` asks for (a sleep), append the tool's answer, call again."""
    text = row["prompt"]
    for _ in range(int(_SETTINGS["turns"])):
        piece = client.completions.create(model="policy", prompt=text, stop=["]"]).choices[0].text
        time.sleep(_SETTINGS["tool_s"])
        text += piece + "v|"
    client.completions.create(model="policy", prompt=text, stop=["]"])
    return 1.0


def main(smoke: bool = False) -> dict:
    episodes = size("BENCH_EPISODES", 64, 8, smoke)
    turns = size("BENCH_TURNS", 3, 2, smoke)
    tool_s = size("BENCH_TOOL_S", 0.2, 0.02, smoke)
    gen_tokens = size("BENCH_GEN_TOKENS", 4, 2, smoke)
    if min(episodes, turns, gen_tokens) < 1 or tool_s < 0:
        raise ValueError("BENCH_EPISODES, BENCH_TURNS and BENCH_GEN_TOKENS must be >= 1, BENCH_TOOL_S >= 0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from grpo.environments import ToolEnvironment, make_environment
    from grpo.environments.agents import AGENTS
    from grpo.environments.endpoint import sampling_params
    from grpo.environments.episodes import run_episodes
    from grpo.training.async_producer import sample_round

    _SETTINGS.update(turns=turns, tool_s=tool_s)
    if "bench_agent" not in AGENTS.names():
        AGENTS.register("bench_agent")(bench_agent)
    task = tool_task(gen_tokens, tool_s)
    tok, model, gen, call, k_id, answer, lookup = (task.tokenizer, task.model, task.gen, task.call, task.k_id,
                                                   task.answer, task.lookup)

    def run(agents: bool) -> tuple[float, float, int, list]:
        generate_s, calls = 0.0, 0

        def generate(seqs, max_new_tokens, stop_strings):
            nonlocal generate_s, calls
            start = time.perf_counter()
            sample_round(model, seqs, {**gen, "max_new_tokens": min(gen_tokens, max(max_new_tokens))})
            generate_s += time.perf_counter() - start
            calls += 1
            out = []
            for s in seqs:  # a tool call until the sequence holds ``turns`` calls ("k" is in none else), then answer
                ids = call if s.count(k_id) < turns else answer
                out.append((ids, [0.0] * len(ids)))
            return out

        generate.sampling = sampling_params(1.0)
        torch.manual_seed(0)
        prompts = [f"{i:02d}=" for i in range(episodes)]
        envs = ([make_environment("agent", agent="bench_agent") for _ in prompts] if agents
                else [ToolEnvironment([lookup]) for _ in prompts])
        start = time.perf_counter()
        result = run_episodes([tok(p, add_special_tokens=False)["input_ids"] for p in prompts], envs, generate, tok,
                              rows=[{"prompt": p} for p in prompts], max_turns=turns + 1,
                              max_completion_length=8 * (turns + 1), max_workers=episodes, step_timeout=60.0)
        return time.perf_counter() - start, generate_s, calls, result

    start = time.perf_counter()
    run(agents=True)  # once untimed: the process's one-time costs (openai's import, the endpoint's start, torch's)
    warm_up_s = time.perf_counter() - start
    text_s, text_gen_s, _, text_eps = run(agents=False)
    agent_s, agent_gen_s, agent_turns, agent_eps = run(agents=True)
    bound = turns * tool_s + agent_gen_s
    return {
        "episodes": episodes,
        "turns": turns,
        "tool_s": tool_s,
        "calls_per_agent": turns + 1,
        "runner_turns": agent_turns,
        "agent_errors": sum(ep.error is not None for ep in agent_eps),
        "agent_rewards": sum(ep.reward or 0.0 for ep in agent_eps),
        "episodes_match_text_protocol": [(ep.prompt_ids, ep.completion_ids, ep.env_mask) for ep in agent_eps]
        == [(ep.prompt_ids, ep.completion_ids, ep.env_mask) for ep in text_eps],
        "warm_up_round_s": warm_up_s,
        "agent_round_s": agent_s,
        "agent_generate_s": agent_gen_s,
        "text_protocol_round_s": text_s,
        "text_protocol_generate_s": text_gen_s,
        "ratio_agent_round_over_turns_x_tool_plus_generation": agent_s / bound if bound > 0 else None,
        "ratio_agent_over_text_protocol": agent_s / text_s,
        "target_ratio": 1.5,
    }
