"""An agent that rewrites its history, for the trainer's per-call samples (tests/test_agents.py loads this file as an
``--env-module``, so the CPU generator process imports it as well)."""

from __future__ import annotations

from grpo.environments.agents import register_agent


@register_agent("test_retrying_agent")
def retrying_agent(client, row: dict) -> float:
    """Two tries at the row: the first try is a call and a second call extending it after the agent's ``1|``
    (environment tokens); the retry sends the first call's prompt again, as the token ids the endpoint returned, which
    drops the first try (a history rewrite). So every episode is two samples: the first try, then the retry (the
    episode's row). A row's ``retries`` (default 1) sets how many retries it makes, each a sample of its own, so a
    batch's episodes can hold different numbers of earlier samples (0 for none). Reward: the share of digits in the
    last answer."""
    first = client.completions.create(model="policy", prompt=row["prompt"], max_tokens=6)
    prompt_ids = first.model_dump()["choices"][0]["prompt_token_ids"]
    last = client.completions.create(model="policy", prompt=row["prompt"] + first.choices[0].text + "1|",
                                     max_tokens=6).choices[0].text
    for _ in range(row.get("retries", 1)):
        last = client.completions.create(model="policy", prompt=prompt_ids, max_tokens=6).choices[0].text
    return sum(c.isdigit() for c in last) / 6


retrying_agent.environment = "calculator"  # the tiny model's alphabet (digits, "|") is calculator's
