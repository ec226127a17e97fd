"""Held-out evaluation: greedy accuracy and pass@k with sampling.

A completion counts as correct when the task's correctness reward gives it full marks (>= 1.0), so evaluation and
training agree on what "right" means. With an environment (``environment.name``) an episode counts as correct when
the environment's own reward gives it full marks: :func:`evaluate_environment` runs the held-out episodes through
THE episode runner (:func:`grpo.environments.episodes.run_episodes`) with a plain ``generate`` of the model, and
reports the environment's figures besides accuracy and pass@k (turns, tool calls, sampled success, and the same
figures for variants of the environment's options, e.g. the calculator's tool switched off).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase, StoppingCriteriaList

from grpo.training.model_support import GENERATION_KV_CACHE, applies
from grpo.training.prompts import prompt_texts


@dataclass
class EvalResult:
    accuracy: float
    pass_at_k: float | None
    k: int
    num_prompts: int
    samples: list[dict]  # a few (prompt, completion, answer, correct) rows for inspection
    env: dict[str, float] = field(default_factory=dict)
    """The environment's figures (:func:`evaluate_environment`), e.g. ``turns_mean``, ``tool_off/accuracy``."""

    def as_metrics(self, prefix: str = "eval") -> dict[str, float]:
        out = {f"{prefix}/accuracy": self.accuracy}
        if self.pass_at_k is not None:
            out[f"{prefix}/pass@{self.k}"] = self.pass_at_k
        out.update({f"{prefix}/env/{k}": v for k, v in self.env.items()})
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
                # A trained policy's config says false (transformers' Trainer turns it off); the cache is
                # the model's own
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


# ---------------------------------------------------------------- environments (multi-turn episodes)


def episode_generator(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, *, do_sample: bool,
                      temperature: float = 1.0, batch_size: int = 256) -> Callable[..., list]:
    """A plain ``generate`` for :func:`~grpo.environments.episodes.run_episodes`: left-padded batches of at most
    ``batch_size`` sequences, each row stopped at its turn's stop strings, the end-of-sequence token or its budget,
    greedy or sampled (each batch under :func:`~grpo.training.turn_sampling.turn_random_state`, so where a batch
    stops does not move what the next one samples); no log-probs (evaluation needs none)."""
    from grpo.training.padding import padded_rows
    from grpo.training.turn_sampling import TurnStop, trim, turn_random_state

    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id

    @torch.no_grad()
    def generate(sequences: list[list[int]], max_new_tokens: list[int], stops: tuple[str, ...]) -> list:
        model.eval()
        out: list[tuple[list[int], None]] = []
        for start in range(0, len(sequences), batch_size):
            batch, limits = sequences[start : start + batch_size], list(max_new_tokens[start : start + batch_size])
            ids, mask = padded_rows(batch, pad, "left")
            width = ids.shape[1]
            stop = TurnStop.needed(tokenizer, stops, width, limits, [eos])
            with turn_random_state(model.device) if do_sample else contextlib.nullcontext():
                gen = model.generate(
                    input_ids=ids.to(model.device), attention_mask=mask.to(model.device),
                    max_new_tokens=max(limits), do_sample=do_sample, temperature=temperature if do_sample else None,
                    top_p=None, top_k=None, pad_token_id=pad, eos_token_id=eos,
                    use_cache=applies(GENERATION_KV_CACHE, model),
                    stopping_criteria=StoppingCriteriaList([stop]) if stop is not None else None,
                )
            rows = gen[:, width:].tolist()
            out.extend((row[:end], None) for row, end in zip(rows, trim(rows, stop, [eos])))
        return out

    from grpo.environments.endpoint import sampling_params

    generate.sampling = sampling_params(temperature if do_sample else 0.0)  # what an agent's call may repeat

    return generate


def episode_figures(episodes: Sequence[Any]) -> dict[str, float]:
    """Per-episode rates of a set of episodes: ``accuracy`` (reward >= 1: the environment's success),
    ``turns_mean`` (model turns), ``tool_call_rate`` (episodes with at least one tool call, unknown tools
    included), ``truncated_frac`` (cut off by the turn or token budget)."""
    n = max(1, len(episodes))
    return {
        "accuracy": sum(_success(ep) for ep in episodes) / n,
        "turns_mean": sum(ep.turns for ep in episodes) / n,
        "tool_call_rate": sum(sum(ep.tool_calls.values()) + ep.unknown_tool_calls > 0 for ep in episodes) / n,
        "truncated_frac": sum(ep.truncated for ep in episodes) / n,
    }


def _success(episode: Any) -> bool:
    return episode.reward is not None and not math.isnan(episode.reward) and episode.reward >= 1.0


def evaluate_environment(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str] | list[list[dict[str, str]]],
    rows: Sequence[Mapping[str, Any]],
    environment: str,
    *,
    kwargs: Mapping[str, Any] | None = None,
    variants: Mapping[str, Mapping[str, Any]] | None = None,
    max_turns: int,
    max_completion_length: int,
    batch_size: int = 256,
    pass_k: int = 0,
    pass_k_temperature: float = 1.0,
    seed: int = 0,
    step_timeout: float | None = 60.0,
    max_workers: int = 16,
    num_samples_to_keep: int = 16,
    generate_with: Callable[[bool, float], Callable[..., list]] | None = None,
    protocol: str = "text",
    tools: Sequence[str] = (),
    correctness: Callable[..., list[float]] | None = None,
) -> EvalResult:
    """One greedy episode per prompt in ``environment`` (a registered name, built with ``kwargs``; a row's
    ``environment`` column routes it elsewhere, with that environment's defaults): accuracy is the fraction the
    environment rewards with full marks; ``env`` holds ``turns_mean``, ``tool_call_rate``, ``truncated_frac``. With
    ``pass_k > 0``, k sampled episodes per prompt give pass@k and ``env["sampled_success"]`` (the mean success of
    single sampled episodes: the rate GRPO's groups see). Each of ``variants`` (name -> kwargs overrides, e.g.
    ``{"tool_off": {"tool": "off"}}``) runs the greedy episodes again with ``kwargs | overrides``:
    ``env["<name>/accuracy"]``, ``env["<name>/turns_mean"]``, ... . ``generate_with(do_sample, temperature)``
    gives the episode runner's ``generate`` (default: :func:`episode_generator` of ``model``; another rollout
    engine can evaluate through its own). ``protocol`` ``chat`` runs TRL's tool loop instead
    (:class:`grpo.training.chat_loop.ChatToolLoop`, with the registered ``tools`` besides the environment's methods):
    an episode's success is ``correctness`` (a reward function) giving its last assistant message full marks."""
    from grpo.environments import ROUTING_COLUMN, get_tool, make_environment
    from grpo.environments.chat import chat_tools
    from grpo.environments.episodes import run_episodes
    from grpo.training.chat_loop import ChatToolLoop

    rows = [dict(r) for r in rows]
    base = dict(kwargs or {})
    standalone = [get_tool(t) for t in tools]

    def env_name(row: Mapping[str, Any]) -> str:
        return row.get(ROUTING_COLUMN) or environment

    def build(row: Mapping[str, Any], options: Mapping[str, Any]) -> Any:
        name = env_name(row)
        return make_environment(name, **options) if name == environment else make_environment(name)

    if protocol == "chat":
        if correctness is None:
            raise ValueError("evaluate_environment: protocol 'chat' needs a correctness reward")

        def score(answer: str, row: Mapping[str, Any]) -> float | None:
            columns = {k: [v] for k, v in row.items() if k not in ("prompt", "completion", "completions")}
            return correctness(prompts=[row.get("prompt")], completions=[[{"role": "assistant", "content": answer}]],
                               **columns)[0]

        # the tools rendered into a prompt, by the environment its row runs in (one instance each, not one a row)
        schemas = {name: chat_tools(build(row, base), standalone) for name, row in
                   {env_name(row): row for row in rows}.items()}
        texts = [prompt_texts([p], tokenizer, schemas[env_name(row)])[0] for p, row in zip(prompts, rows)]
    else:
        texts = prompt_texts(prompts, tokenizer)
    prompt_ids = [list(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]

    def episodes(options: Mapping[str, Any], generate: Callable[..., list], repeat: int = 1) -> list:
        def env_for(row: Mapping[str, Any]) -> Any:
            if protocol == "chat":
                return ChatToolLoop(tokenizer, build(row, options), standalone, score)
            return build(row, options)

        reps = [i for i in range(len(rows)) for _ in range(repeat)]
        return run_episodes([prompt_ids[i] for i in reps], [env_for(rows[i]) for i in reps], generate, tokenizer,
                            rows=[rows[i] for i in reps], max_turns=max_turns,
                            max_completion_length=max_completion_length, step_timeout=step_timeout,
                            max_workers=max_workers)

    if generate_with is None:
        def generate_with(do_sample: bool, temperature: float) -> Callable[..., list]:
            return episode_generator(model, tokenizer, do_sample=do_sample, temperature=temperature,
                                     batch_size=batch_size)

    greedy_gen = generate_with(False, 1.0)
    greedy = episodes(base, greedy_gen)
    figures = episode_figures(greedy)
    accuracy = figures.pop("accuracy")
    env = dict(figures)
    pass_at_k = None
    if pass_k > 0:
        sampled_gen = generate_with(True, pass_k_temperature)
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            sampled = episodes(base, sampled_gen, repeat=pass_k)
        hits = [any(_success(ep) for ep in sampled[i * pass_k : (i + 1) * pass_k]) for i in range(len(rows))]
        pass_at_k = sum(hits) / max(1, len(rows))
        env["sampled_success"] = sum(map(_success, sampled)) / max(1, len(sampled))
    for name, overrides in (variants or {}).items():
        for key, value in episode_figures(episodes(base | dict(overrides), greedy_gen)).items():
            env[f"{name}/{key}"] = value
    samples = [
        {"prompt": t, "completion": "".join(text for _, text in ep.transcript), "answer": row.get("answer"),
         "correct": _success(ep), "turns": ep.turns, "stop_reason": ep.stop_reason}
        for t, ep, row in list(zip(texts, greedy, rows))[:num_samples_to_keep]
    ]
    return EvalResult(accuracy=accuracy, pass_at_k=pass_at_k, k=pass_k, num_prompts=len(rows), samples=samples,
                      env=env)
