"""TRL's tool loop (protocol chat) as an environment of THE episode runner, for evaluation.

Training with ``environment.protocol: chat`` runs TRL's own loop. Evaluation runs the same conversations through
:func:`grpo.environments.episodes.run_episodes`, so it shares the runner's batching, concurrency, budgets and faults
instead of a second loop: :class:`ChatToolLoop` wraps one episode's TRL-style environment (``reset(**row)`` plus
public methods, which are its tools) and the standalone tools.

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

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from trl.chat_template_utils import add_response_schema, parse_response

from grpo.environments.base import StepResult, ToolCall
from grpo.environments.chat import chat_tools, tool_suffix_text
from grpo.environments.endpoint import set_chat_parser


def parse_assistant(tokenizer: Any, ids: list[int], tools: Sequence[Any] | None = None) -> dict[str, Any]:
    """An assistant turn's ids as a message (``content``, ``tool_calls`` with dict arguments), as TRL's tool loop
    parses it: the agent endpoint's chat completions (:func:`grpo.environments.endpoint.set_chat_parser`)."""
    if not (getattr(tokenizer, "response_template", None) or getattr(tokenizer, "response_schema", None)):
        add_response_schema(tokenizer)  # what trl.GRPOTrainer does at construction; raises for other templates
    return parse_response(tokenizer, list(ids), prefix=[], tools=list(tools or []))


set_chat_parser(parse_assistant)


class ChatToolLoop:
    """One chat-protocol episode for :func:`~grpo.environments.episodes.run_episodes`; see the module docstring.
    ``score(answer_text, row)`` gives the final answer's reward (None: not applicable)."""

    eos_ends_turn = True
    """The end-of-sequence token ends a model turn, not the episode: the turn is stepped, and the episode goes on
    while the model calls tools."""
    stop_strings: tuple[str, ...] = ()

    def __init__(self, tokenizer: Any, environment: Any, tools: Sequence[Callable[..., Any]],
                 score: Callable[[str, Mapping[str, Any]], float | None]) -> None:
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
