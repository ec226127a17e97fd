"""The chat protocol's pieces that need no training stack: which tools TRL's loop offers, what the chat template
writes after a tool call, and the per-tool record of the calls TRL makes.

Training with ``environment.protocol: chat`` runs TRL's own loop (``environment_factory`` / ``tools``, unchanged);
:class:`ToolLedger` wraps the tools it is given so the platform logs the per-tool metrics TRL does not. Evaluation
runs the same conversations through THE episode runner (:class:`grpo.training.chat_loop.ChatToolLoop`), with the
prompts rendered with :func:`config_chat_tools` and the tool messages of :func:`tool_suffix_text`.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any


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
    return _after_assistant_turn(tokenizer, {"role": "assistant", "content": "", "tool_calls": calls}, tool_messages,
                                 {}, "tool messages")


def turn_suffix_text(tokenizer: Any, messages: Sequence[Mapping[str, Any]], tools: Sequence[Any] | None = None) -> str:
    """What the chat template writes after an assistant turn (ended by its end-of-turn token) for ``messages`` (tool
    results, a user's next message), through the next assistant header: :func:`tool_suffix_text` for any messages."""
    extra = {"tools": list(tools)} if tools else {}
    return _after_assistant_turn(tokenizer, {"role": "assistant", "content": "dummy"}, messages, extra, "messages")


def _after_assistant_turn(tokenizer: Any, assistant: Mapping[str, Any], messages: Sequence[Mapping[str, Any]],
                          extra: dict[str, Any], what: str) -> str:
    """The text the chat template writes for ``messages`` after a dummy user turn and ``assistant`` (cut after its
    end-of-turn token), through the next assistant header."""
    dummy = [{"role": "user", "content": "dummy"}, dict(assistant)]
    prefix = tokenizer.apply_chat_template(dummy, add_generation_prompt=False, tokenize=False, **extra)
    full = tokenizer.apply_chat_template(dummy + list(messages), add_generation_prompt=True, tokenize=False, **extra)
    eos = tokenizer.eos_token
    if eos and eos in prefix:
        prefix = prefix[: prefix.rindex(eos) + len(eos)]
    if not full.startswith(prefix):
        raise ValueError(f"the chat template renders an assistant turn differently with {what} after it")
    return full[len(prefix):]


def config_chat_tools(env_cfg: Any) -> list[Callable[..., Any]] | None:
    """The tools TRL renders into the prompts of a run with this ``environment`` section (protocol chat: its
    ``tools``, then the methods of ``environment.name``'s environment); None for another protocol or no environment.
    The warm start, the plan's token counts and evaluation render prompts with them, as training does. Rows routed to
    another environment by an ``environment`` column get that environment's methods in training; these are the
    configured environment's."""
    if not env_cfg.is_chat:
        return None
    from grpo.environments import get_tool, make_environment

    return chat_tools(make_environment(env_cfg.name, **env_cfg.kwargs), [get_tool(t) for t in env_cfg.tools]) or None


class ToolLedger:
    """Calls, failures and seconds of each tool TRL's loop calls (protocol chat), for the same per-tool metrics the
    text protocol logs: TRL counts calls and failures over all tools only. :meth:`wrap` returns a tool with the
    wrapped one's name, signature and docstring (TRL builds the tool's schema from them), recording each call; a call
    that raises still raises (TRL answers the model with its error text) and counts as a failure."""

    def __init__(self) -> None:
        self.stats: dict[str, list[float]] = {}  # tool name -> [calls, failures, seconds], in the order wrapped

    def wrap(self, tool: Callable[..., Any]) -> Callable[..., Any]:
        import functools

        name = tool.__name__
        self.stats.setdefault(name, [0, 0, 0.0])

        def record(start: float, failed: bool) -> None:
            entry = self.stats[name]
            entry[0] += 1
            entry[1] += failed
            entry[2] += time.perf_counter() - start

        if inspect.iscoroutinefunction(tool):
            @functools.wraps(tool)
            async def recorded_async(*args: Any, **kwargs: Any) -> Any:
                start, failed = time.perf_counter(), True
                try:
                    result = await tool(*args, **kwargs)
                    failed = False
                    return result
                finally:
                    record(start, failed)

            return recorded_async

        @functools.wraps(tool)
        def recorded(*args: Any, **kwargs: Any) -> Any:
            start, failed = time.perf_counter(), True
            try:
                result = tool(*args, **kwargs)
                failed = False
                return result
            finally:
                record(start, failed)

        return recorded

    def instrumented(self, factory: Callable[[], Any]) -> Callable[[], Any]:
        """``factory`` whose environments' tool methods are recorded: each is shadowed by an instance attribute,
        which is what TRL reads (it lists the class's methods, then takes them from the instance)."""

        def make() -> Any:
            environment = factory()
            for method in environment_tools(environment):
                setattr(environment, method.__name__, self.wrap(method))
            return environment

        return make

    def take(self) -> dict[str, list[float]]:
        """Each tool's ``[calls, failures, seconds]`` since the last take; counting starts afresh."""
        taken, self.stats = self.stats, {name: [0, 0, 0.0] for name in self.stats}
        return taken

    def metrics(self, episodes: int) -> dict[str, float]:
        """:meth:`take`, as ``env/tools/<name>/...`` per episode (:func:`grpo.environments.metrics.tool_metrics`)."""
        from grpo.environments.metrics import tool_metrics

        return tool_metrics(self.take(), episodes)
