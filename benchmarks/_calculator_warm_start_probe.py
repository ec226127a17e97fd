"""Research probe for #30 (not a benchmark, not a test): a warm start for the calculator task that mostly answers
directly, forgetting carries as the default task's demonstrations do, and rarely calls the tool.

``python -m benchmarks._calculator_warm_start_probe``; the demonstration mix (per training row, by chance):

* PROBE_TOOL_RATE (0.01): the whole call, ``27+15=`` -> ``[27+15]42|42``: sets how often the policy opens a call;
* PROBE_CALL_RATE (0.1): ``27+15=[`` -> ``27+15]``: writing the call's expression, the ``[`` already in the prompt,
  so the loss (answer tokens only) teaches the call's syntax without making calls more frequent;
* PROBE_COPY_RATE (0.2): ``27+15=[27+15]42|`` -> ``42``: copying the tool's answer, likewise;
* otherwise the direct answer, with PROBE_CARRY_ERROR_RATE (0.6) of carrying problems forgetting the carry (``32``).

PROBE_STEPS (1000) warm-start steps of the tiny preset's shape, then one episode per held-out prompt (PROBE_EVAL, 400)
sampled at temperature 1 through the episode runner with the tool on and off, and the copy skill alone (the call and
its answer given). Measured (2 shared cores, about 2-6 minutes a run): with the whole call alone at 1 % the policy calls
about 1 % of the time but writes other operands than its prompt's and copies the answer 5 % of the time; adding the
copy rows lifts copying to 0.66 (10 %) and 0.83 (20 %); adding the call rows too gives calls that name the prompt's
expression every time, copying 0.99, a call rate of 0.0125, direct accuracy 0.36 on carrying and 0.94 on other
problems (0.70 overall with the tool, 0.69 with it off).
"""

from __future__ import annotations

import json
import os
import random
import time


def main() -> dict:
    import torch

    from grpo.environments import make_environment
    from grpo.environments.builtin import CalculatorEnvironment
    from grpo.environments.episodes import run_episodes
    from grpo.tasks import addition_problems, flawed_addition_demonstrations
    from grpo.training.async_producer import sample_round
    from grpo.training.tiny_model import alphabet_of, build_char_tokenizer, build_tiny_qwen2
    from grpo.training.warm_start import supervised_warm_start

    tool_rate = float(os.environ.get("PROBE_TOOL_RATE", 0.01))
    copy_rate = float(os.environ.get("PROBE_COPY_RATE", 0.2))
    call_rate = float(os.environ.get("PROBE_CALL_RATE", 0.1))
    carry_error = float(os.environ.get("PROBE_CARRY_ERROR_RATE", 0.6))
    steps = int(os.environ.get("PROBE_STEPS", 1000))
    n_eval = int(os.environ.get("PROBE_EVAL", 400))
    torch.manual_seed(0)
    data = addition_problems(5000, 500, seed=0)
    tok = build_char_tokenizer("".join(sorted(set(alphabet_of(data) + CalculatorEnvironment.alphabet))))
    model = build_tiny_qwen2(tok, 128, 3, 4, 256, 128, seed=0)
    prompts, answers = list(data["train"]["prompt"]), list(data["train"]["answer"])
    flawed = flawed_addition_demonstrations(prompts, answers, carry_error, seed=0)
    rng = random.Random(1)
    demo_prompts, demos = [], []
    for p, a, f in zip(prompts, answers, flawed):
        u = rng.random()
        if u < tool_rate:  # a whole call: the policy learns to call, rarely
            demo_prompts.append(p), demos.append(f"[{p[:-1]}]{a}|{a}")
        elif u < tool_rate + copy_rate:  # the call and its answer in the prompt: only copying the answer is learned
            demo_prompts.append(f"{p}[{p[:-1]}]{a}|"), demos.append(a)
        elif u < tool_rate + copy_rate + call_rate:  # "[" in the prompt: writing the call is learned, not opening it
            demo_prompts.append(f"{p}["), demos.append(f"{p[:-1]}]")
        else:
            demo_prompts.append(p), demos.append(f)
    start = time.perf_counter()
    losses = supervised_warm_start(model, tok, demo_prompts, demos, steps, 64, 1e-3, seed=0)
    warm_s = time.perf_counter() - start

    eval_prompts, eval_answers = list(data["eval"]["prompt"])[:n_eval], list(data["eval"]["answer"])[:n_eval]
    carrying = [int(p[1]) + int(p[4]) >= 10 for p in eval_prompts]
    gen = {"eos_token_ids": [tok.eos_token_id], "pad_token_id": tok.pad_token_id, "temperature": 1.0, "top_p": 1.0,
           "top_k": 0, "shared_prompt": False}

    def generate(seqs, max_new_tokens, stops):
        ids, logps = sample_round(model, seqs, {**gen, "max_new_tokens": max(max_new_tokens)})
        return list(zip(ids, logps))

    out: dict = {"tool_rate": tool_rate, "copy_rate": copy_rate, "call_rate": call_rate,
                 "carry_error_rate": carry_error, "steps": steps, "warm_start_s": warm_s,
                 "final_loss": sum(losses[-50:]) / 50}
    for mode in ("on", "off"):
        torch.manual_seed(1)
        eps = run_episodes([tok(p, add_special_tokens=False)["input_ids"] for p in eval_prompts],
                           [make_environment("calculator", tool=mode) for _ in eval_prompts], generate, tok,
                           rows=[{"answer": a} for a in eval_answers], max_turns=3, max_completion_length=24)
        called = [sum(e.tool_calls.values()) + e.unknown_tool_calls > 0 for e in eps]
        right = [e.reward == 1.0 for e in eps]
        out[f"tool_{mode}"] = {
            "accuracy": sum(right) / len(eps),
            "tool_call_rate": sum(called) / len(eps),
            "calls_naming_the_prompt": sum(e.transcript[0][1] == f"[{p[:-1]}]"
                                           for p, e, c in zip(eval_prompts, eps, called) if c) / max(1, sum(called)),
            "accuracy_when_called": sum(r for r, c in zip(right, called) if c) / max(1, sum(called)),
            "accuracy_direct_carrying": sum(r for r, c, k in zip(right, called, carrying) if k and not c)
            / max(1, sum(k and not c for c, k in zip(called, carrying))),
            "accuracy_direct_no_carry": sum(r for r, c, k in zip(right, called, carrying) if not k and not c)
            / max(1, sum(not k and not c for c, k in zip(called, carrying))),
            "stop_reasons": {r: sum(e.stop_reason == r for e in eps) for r in ("eos", "max_tokens", "max_turns")},
            "examples": [p + "".join(t for _, t in e.transcript)
                         for p, e, c in zip(eval_prompts, eps, called) if c][:5],
        }
    # given a call and the tool's answer, does the policy copy it? (the skill GRPO needs once it calls the tool)
    torch.manual_seed(2)
    seqs = [tok(f"{p}[{p[:-1]}]{a}|", add_special_tokens=False)["input_ids"]
            for p, a in zip(eval_prompts, eval_answers)]
    ids, _ = sample_round(model, seqs, {**gen, "max_new_tokens": 6})
    copied = [tok.decode(i, skip_special_tokens=True) == a for i, a in zip(ids, eval_answers)]
    out["copy_accuracy_after_a_call"] = sum(copied) / len(copied)
    return out


if __name__ == "__main__":
    print(json.dumps(main(), sort_keys=True))
