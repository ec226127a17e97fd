"""The environment interface and the text protocol's tool environment.

An environment is any object with

* ``reset(**row) -> str | None``: start an episode from a dataset row (its columns as keyword arguments); a string
  is appended to the prompt, as TRL appends ``reset``'s return value to the last user message;
* ``step(action: str) -> StepResult``: the model's turn as text (its stop string included) in, ``(observation,
  done, reward)`` out. A plain ``(observation, done, reward)`` tuple is accepted too.

and optionally the attributes of :class:`Environment` (``stop_strings``, ``alphabet``, ``default_reward``,
``concurrency_limit``) and ``close()``. One instance serves one episode at a time; the episode runner
(:mod:`grpo.environments.episodes`) calls ``step``
from a worker thread, so ``step`` may block (a tool call, a server round trip).

The text protocol works for any tokenizer, a character-level one included: a model turn ends at one of the
environment's stop strings (or the end-of-sequence token, which ends the episode), the observation is tokenised on
its own and appended, and the model continues after it.
"""

from __future__ import annotations

import ast
import inspect
import re
import time
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple


@dataclass(frozen=True)
class ToolCall:
    """One tool call of a step: the tool's name as written, and whether it answered (``ok``), raised (``error``) or
    named no tool of the environment (``unknown``). ``seconds`` is wall-clock time, left out of comparisons."""

    name: str
    status: Literal["ok", "error", "unknown"]
    seconds: float = field(default=0.0, compare=False)


@dataclass(eq=False)
class ConcurrencyLimit:
    """How many episodes may be live at once on one shared resource, such as an environment server's sessions.

    The environments that draw on one resource share one instance (the runner groups episodes by its identity);
    ``value`` None means no limit. ``value`` may change between admissions (a server tells its limit when it refuses
    a session): the runner reads it each time it admits episodes.
    """

    value: int | None = None


class Tokens(NamedTuple):
    """An observation already tokenised: the runner appends ``ids`` as they are (an agent's prompt, tokenised once
    by the endpoint that received it), and the transcript shows ``text``."""

    text: str
    ids: Sequence[int]

    def __str__(self) -> str:
        return self.text


class Restart(NamedTuple):
    """An observation that starts the episode's next sample: the sequence so far (prompt, completion, masks and
    log-probs as recorded) is kept whole as an earlier sample of the episode, and the episode goes on from ``ids``,
    its new prompt, appended as given. An agent whose call does not extend its previous call's prompt and completion
    (it rewrote its history) continues this way: each such call is a sample of its own with the episode's reward."""

    text: str
    ids: Sequence[int]

    def __str__(self) -> str:
        return self.text


class StepResult(NamedTuple):
    """What ``step`` returns: the text appended for the model (None or "" for nothing), whether the episode is over,
    this step's reward (None: no reward from this step; an episode's rewards are summed), and the tool calls the step
    made (for the tool metrics)."""

    observation: str | Tokens | None
    done: bool
    reward: float | None = None
    tool_calls: tuple[ToolCall, ...] = ()


class Environment:
    """Base class of the built-in environments; subclassing is optional (the runner reads these attributes with
    these defaults from any object)."""

    stop_strings: tuple[str, ...] = ()
    """Strings that end a model turn (the end-of-sequence token always ends the episode)."""
    alphabet: str = ""
    """Characters the environment writes or parses, so a character-level tokenizer built for a task can encode its
    observations and the model can write its syntax."""
    default_reward: float | None = None
    """The episode's reward when no step gave one (a truncated episode). None means "not applicable", which the
    group statistics leave out (TRL's None); an environment that scores its episodes sets it to its failure score, so
    an episode cut off by a budget counts as a failure instead of vanishing from its group."""

    concurrency_limit: ConcurrencyLimit | None = None
    """Shared with the other environments that draw on the same resource: the runner starts (``reset``) an episode
    only while fewer than ``concurrency_limit.value`` of theirs are live, and the rest wait for an episode to end.
    None: no limit."""

    def reset(self, **row: Any) -> str | None:
        return None

    def step(self, action: str) -> StepResult:
        raise NotImplementedError

    def close(self) -> None:
        """Called once when an episode ends, whatever ended it (done, a budget, an error), so an environment that holds
        a resource per episode (a server session) gives it back before the next episode starts. The instance may be
        reset again afterwards."""


def _convert(text: str, annotation: Any) -> Any:
    """A raw argument as the single parameter's annotated type (str, int, float or bool)."""
    if annotation in (int, float):
        return annotation(text.strip())
    if annotation is bool:
        return text.strip().lower() in ("true", "1", "yes")
    return text


class ToolEnvironment(Environment):
    """Tools for the text protocol. The model calls a tool by ending its turn with ``[args]`` (the first tool, the
    environment's default) or ``[name(args)]``; the answer comes back as ``result|`` (or ``error: message|`` when the
    tool raises) and the model continues. A turn that ends otherwise (the end-of-sequence token) is the final answer,
    scored by :meth:`score`.

    Arguments: a tool with one parameter gets the raw text between the brackets or parentheses, converted to its
    annotated type (``[27+15]`` calls ``calculator("27+15")``); a tool with several parameters gets Python literals
    separated by commas (``[lookup("x", 2)]``), never evaluated as code. Tools are typed functions with a docstring
    (see :func:`grpo.environments.tool_schema`); registered tool names may be given instead of functions.
    """

    stop_strings = ("]",)
    alphabet = "".join(sorted(set("[]|(),error: unknown tool no")))
    """The call syntax and the fixed words of its error answers; a tool's own error messages are its own (an
    observation the tokenizer cannot encode ends the episode as an environment error)."""
    result_format = "{result}|"
    error_format = "error: {error}|"
    _CALL = re.compile(r"\[([^\[\]]*)\]$")
    _NAMED = re.compile(r"([A-Za-z_]\w*)\((.*)\)", re.S)

    def __init__(self, tools: Sequence[Callable[..., Any] | str] = ()) -> None:
        from grpo.environments import get_tool  # the registry imports this module

        funcs = [get_tool(t) if isinstance(t, str) else t for t in tools]
        self.tools: dict[str, Callable[..., Any]] = {f.__name__: f for f in funcs}
        self.row: Mapping[str, Any] = {}

    def reset(self, **row: Any) -> str | None:
        self.row = row
        return None

    def score(self, answer: str) -> float | None:
        """The final answer's reward; None here (reward functions score it)."""
        return None

    def parse_call(self, action: str) -> tuple[str | None, str] | None:
        """``(tool name or None for the default tool, argument text)`` of the call that ends ``action``, or None
        when ``action`` ends with a closing bracket without an opening one (a malformed call)."""
        m = self._CALL.search(action)
        if m is None:
            return None
        named = self._NAMED.fullmatch(m.group(1).strip())
        return (named.group(1), named.group(2)) if named else (None, m.group(1))

    def call_tool(self, tool: Callable[..., Any], args: str) -> Any:
        params = list(inspect.signature(tool).parameters.values())
        if len(params) == 1:
            hints = typing.get_type_hints(tool)
            return tool(_convert(args, hints.get(params[0].name, str)))
        values = ast.literal_eval(f"({args},)") if args.strip() else ()
        return tool(*values)

    def step(self, action: str) -> StepResult:
        if not action.endswith("]"):
            return StepResult(None, True, self.score(action))
        call = self.parse_call(action)
        if call is None:
            return self._answer("", "unknown", None, "no [")
        name = call[0] if call[0] is not None else next(iter(self.tools), "")
        tool = self.tools.get(name)
        if tool is None:
            return self._answer(name, "unknown", None, f"unknown tool {name}")
        start = time.perf_counter()
        try:
            result = self.call_tool(tool, call[1])
        except Exception as err:  # the tool's failure is the model's to see and recover from
            return self._answer(name, "error", time.perf_counter() - start, str(err))
        return self._answer(name, "ok", time.perf_counter() - start, result)

    def _answer(self, name: str, status: Literal["ok", "error", "unknown"], seconds: float | None,
                text: Any) -> StepResult:
        observation = self.result_format.format(result=text) if status == "ok" else self.error_format.format(error=text)
        return StepResult(observation, False, None, (ToolCall(name, status, seconds or 0.0),))
