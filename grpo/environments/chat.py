"""The chat protocol outside TRL's trainer: TRL's tool loop as an environment of THE episode runner.

Training with ``environment.protocol: chat`` runs TRL's own loop (``environment_factory`` / ``tools``, unchanged).
Evaluation runs the same conversations through :func:`grpo.environments.episodes.run_episodes`, so it shares the
runner's batching, concurrency, budgets and faults instead of a second loop: :class:`ChatToolLoop` wraps one episode's
TRL-style environment (``reset(**row)`` plus public methods, which are its tools) and the standalone tools.

As in TRL's loop, a model turn ends at the end-of-sequence token (the template's end of turn, kept in the completion);
the turn's tool calls are parsed with TRL's ``parse_response`` (the response schema TRL sets for the templates it
recognises); each tool is called with the call's keyword arguments, a raising or unknown tool answering
``{'error': ...}``; the tool messages are appended as the chat template renders them after an assistant turn (TRL's
``_get_tool_suffix_ids``), tokenised on their own. A turn without a tool call is the answer, scored by the run's
correctness reward on that last assistant message.

TRL appends the text ``reset`` returns to the prompt's last user message before rendering it; evaluation renders the
prompts before the episodes start, so an environment whose ``reset`` returns text fails its evaluation episodes with
that reason (reward NaN) rather than being evaluated on a different prompt.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from grpo.environments.base import StepResult, ToolCall


def environment_tools(environment: Any) -> list[Callable[..., Any]]:
    """The tools TRL's ``environment_factory`` exposes for ``environment``: its public methods (listed on the class, so
    properties are not evaluated), except ``reset`` and ``get_reward``, bound to the instance, in name order."""
    return [getattr(environment, name) for name, _ in inspect.getmembers(type(environment), inspect.isfunction)
            if not name.startswith("_") and name not in ("reset", "get_reward")]


def chat_tools(environment: Any, tools: Sequence[Callable[..., Any]]) -> list[Callable[..., Any]]:
    """Every tool of a chat episode in TRL's order: the standalone ``tools``, then the environment's methods."""
    return [*tools, *(environment_tools(environment) if environment is not None else [])]


def tool_suffix_text(tokenizer: Any, tool_messages: Sequence[Mapping[str, Any]]) -> str:
    """What the chat template writes after an assistant turn (ended by its end-of-turn token) for ``tool_messages``,
    up to the next assistant header: TRL's ``_get_tool_suffix_ids``, as text."""
    calls = [{"type": "function", "function": {"name": tool_messages[0]["name"], "arguments": {}}}]
    dummy = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "", "tool_calls": calls}]
    prefix = tokenizer.apply_chat_template(dummy, add_generation_prompt=False, tokenize=False)
    full = tokenizer.apply_chat_template(dummy + list(tool_messages), add_generation_prompt=True, tokenize=False)
    eos = tokenizer.eos_token
    if eos and eos in prefix:
        prefix = prefix[: prefix.rindex(eos) + len(eos)]
    if not full.startswith(prefix):
        raise ValueError("the chat template renders an assistant turn differently with tool messages after it")
    return full[len(prefix):]


class ChatToolLoop:
    """One chat-protocol episode for :func:`~grpo.environments.episodes.run_episodes`; see the module docstring.
    ``score(answer_text, row)`` gives the final answer's reward (None: not applicable)."""

    eos_ends_turn = True
    """The end-of-sequence token ends a model turn, not the episode: the turn is stepped, and the episode goes on
    while the model calls tools."""
    stop_strings: tuple[str, ...] = ()

    def __init__(self, tokenizer: Any, environment: Any, tools: Sequence[Callable[..., Any]],
                 score: Callable[[str, Mapping[str, Any]], float | None]) -> None:
        from trl.chat_template_utils import add_response_schema

        if not (getattr(tokenizer, "response_template", None) or getattr(tokenizer, "response_schema", None)):
            add_response_schema(tokenizer)  # what trl.GRPOTrainer does at construction; raises for other templates
        self.tokenizer, self.environment, self.score = tokenizer, environment, score
        self.tools = {tool.__name__: tool for tool in chat_tools(environment, tools)}
        self.row: Mapping[str, Any] = {}

    @property
    def concurrency_limit(self) -> Any:
        return getattr(self.environment, "concurrency_limit", None)

    def reset(self, **row: Any) -> None:
        self.row = row
        text = self.environment.reset(**row) if self.environment is not None else None
        if text:
            raise ValueError("reset returned text, which TRL appends to the prompt's last user message; evaluation "
                             "renders prompts before episodes start and cannot show it")

    def step(self, action: str) -> StepResult:
        from trl.chat_template_utils import parse_response

        ids = self.tokenizer(action, add_special_tokens=False)["input_ids"]  # parsed only; the episode keeps its ids
        message = parse_response(self.tokenizer, ids, prefix=[], tools=list(self.tools.values()))
        calls = [c for c in message.get("tool_calls") or [] if isinstance(c, Mapping)]
        if not calls:
            return StepResult(None, True, self.score(str(message.get("content") or action), self.row))
        results, traced = [], []
        for call in calls:
            function = call.get("function") or {}
            name = str(function.get("name", "unknown"))
            tool = self.tools.get(name)
            start = time.perf_counter()
            if tool is None:
                content, status = {"error": f"Tool {name} not found"}, "unknown"
            else:
                try:
                    content, status = tool(**(function.get("arguments") or {})), "ok"
                except Exception as err:  # noqa: BLE001 - the tool's failure is the model's to read, as in TRL
                    content, status = {"error": str(err)}, "error"
            traced.append(ToolCall(name, status, time.perf_counter() - start))
            results.append({"role": "tool", "name": name, "content": str(content)})
        return StepResult(tool_suffix_text(self.tokenizer, results), False, None, tuple(traced))

    def close(self) -> None:
        close = getattr(self.environment, "close", None)
        if callable(close):
            close()


def config_chat_tools(env_cfg: Any) -> list[Callable[..., Any]] | None:
    """The tools TRL renders into the prompts of a run with this ``environment`` section (protocol chat: its
    ``tools``, then the methods of ``environment.name``'s environment); None for another protocol or no environment.
    The warm start, the plan's token counts and evaluation render prompts with them, as training does. Rows routed to
    another environment by an ``environment`` column get that environment's methods in training; these are the
    configured environment's."""
    if not (env_cfg.enabled and env_cfg.protocol == "chat"):
        return None
    from grpo.environments import get_tool, make_environment

    return chat_tools(make_environment(env_cfg.name, **env_cfg.kwargs), [get_tool(t) for t in env_cfg.tools]) or None
