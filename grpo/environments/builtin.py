"""The embedded environments and tools, sized for the tiny character-level policy: short syntax, one-character
feedback, observations of a few tokens.

* ``calculator`` (tool and environment): integer ``+``, ``-``, ``*`` evaluated by a small parser (never ``eval``).
  On the addition task the policy may write ``[27+15]``, the tool answers ``42|``, the policy writes ``42``.
* ``calculator_agent`` (an agent, :mod:`grpo.environments.agents`): the calculator task as a plain ``openai``-SDK
  agent on ``/v1/completions``: it calls the model, parses ``[expr]``, computes, appends the answer, calls again.
* ``guess_digit``: a hidden digit, at most 4 guesses, each answered ``<`` (the guess is below it), ``>`` (above) or
  ``=``; reward 1 on ``=``, else 0 (success@4). A guess is one digit, and every digit is a stop string, so an
  episode reads ``5>2<3=``.
"""

from __future__ import annotations

import hashlib
import re
import string
from typing import Any

from grpo.environments import register_environment, register_tool
from grpo.environments.agents import register_agent
from grpo.environments.base import Environment, StepResult, ToolEnvironment

MAX_EXPRESSION_CHARS = 64
MAX_MAGNITUDE = 10**18
_TOKEN = re.compile(r"\s*(?:(\d+)|(.))")


def evaluate_integer_expression(expression: str) -> int:
    """``expression`` with integers (leading zeros allowed: prompts are zero-padded), ``+``, ``-``, ``*``, unary
    minus and parentheses, by recursive descent: nothing but arithmetic can run, and sizes are bounded."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError("too long")
    tokens: list[int | str] = []
    for number, other in _TOKEN.findall(expression):
        if number:
            tokens.append(int(number))
        elif other.strip():
            if other not in "+-*()":
                raise ValueError("bad expression")
            tokens.append(other)
    pos = 0

    def peek() -> int | str | None:
        return tokens[pos] if pos < len(tokens) else None

    def take() -> int | str | None:
        nonlocal pos
        pos += 1
        return tokens[pos - 1] if pos <= len(tokens) else None

    def bounded(value: int) -> int:
        if abs(value) > MAX_MAGNITUDE:
            raise ValueError("too large")
        return value

    def factor() -> int:
        tok = take()
        if tok == "-":
            return -factor()
        if tok == "(":
            value = expr()
            if take() != ")":
                raise ValueError("bad expression")
            return value
        if isinstance(tok, int):
            return bounded(tok)
        raise ValueError("bad expression")

    def term() -> int:
        value = factor()
        while peek() == "*":
            take()
            value = bounded(value * factor())
        return value

    def expr() -> int:
        value = term()
        while peek() in ("+", "-"):
            op = take()
            value = bounded(value + term() if op == "+" else value - term())
        return value

    value = expr()
    if pos != len(tokens):
        raise ValueError("bad expression")
    return value


@register_tool("calculator")
def calculator(expression: str) -> str:
    """Evaluate integer arithmetic with +, - and * (parentheses allowed).

    Args:
        expression: integers joined by +, - or *, e.g. 27+15
    """
    return str(evaluate_integer_expression(expression))


_ERRORS = "bad expression too large long off"


@register_environment("calculator")
class CalculatorEnvironment(ToolEnvironment):
    """Answer with a calculator tool at hand: [27+15] -> 42|, then the answer; reward 1 when it is the row's answer.

    ``tool``: ``on``; ``off`` (every call answers ``error: off|``: the policy's skill without its tool); ``broken``
    (answers one more than the truth: a tool the policy should learn to distrust).
    """

    alphabet = "".join(sorted(set(ToolEnvironment.alphabet + string.digits + "+-*" + "calculator" + _ERRORS)))
    default_reward = 0.0

    def __init__(self, tool: str | bool = "on") -> None:
        if isinstance(tool, bool):  # YAML reads an unquoted on / off as true / false
            tool = "on" if tool else "off"
        if tool not in ("on", "off", "broken"):
            raise ValueError(f"calculator: tool must be one of on, off, broken; got {tool!r}")
        super().__init__([calculator])
        self.mode = tool

    def call_tool(self, tool, args: str) -> Any:
        if self.mode == "off":
            raise RuntimeError("off")
        result = super().call_tool(tool, args)
        return str(int(result) + 1) if self.mode == "broken" else result

    def score(self, answer: str) -> float | None:
        want = self.row.get("answer")
        return None if want is None else float(answer.strip() == str(want).strip())


@register_environment("guess_digit")
class GuessDigitEnvironment(Environment):
    """Find a hidden digit in at most 4 guesses from </>/= feedback; reward 1 on = (success@4), else 0."""

    stop_strings = tuple(string.digits)
    alphabet = string.digits + "<>="
    default_reward = 0.0

    def __init__(self, max_guesses: int = 4) -> None:
        if max_guesses < 1:
            raise ValueError(f"guess_digit: max_guesses must be >= 1, got {max_guesses}")
        self.max_guesses = max_guesses
        self.digit = 0
        self.guesses = 0

    def reset(self, **row: Any) -> str | None:
        """The hidden digit is the row's ``answer`` when it is one digit, else derived from its prompt (stable
        across processes: every copy of a prompt in a GRPO group hides the same digit)."""
        answer = str(row.get("answer", ""))
        if len(answer) == 1 and answer.isdigit():
            self.digit = int(answer)
        else:
            self.digit = hashlib.sha256(str(row.get("prompt", "")).encode()).digest()[0] % 10
        self.guesses = 0
        return None

    def step(self, action: str) -> StepResult:
        if not action or not action[-1].isdigit():  # the model ended without a guess
            return StepResult(None, True, 0.0)
        self.guesses += 1
        guess = int(action[-1])
        if guess == self.digit:
            return StepResult("=", True, 1.0)
        feedback = "<" if guess < self.digit else ">"
        return StepResult(feedback, self.guesses >= self.max_guesses, 0.0)


@register_environment("tool_use")
class ToolUseEnvironment:
    """Protocol chat: the conversation itself, with no state of its own, as ``trl.GRPOTrainer(tools=...)`` trains:
    the model may call the ``environment.tools`` between its turns (TRL's tool loop), and the run's reward functions
    score its last message. Not an ``Environment``: it has no ``step``, so the text protocol refuses it at load."""

    def reset(self, **row: Any) -> None:
        return None


@register_agent("calculator_agent")
def calculator_agent(client: Any, row: dict[str, Any]) -> float:
    """The ``calculator`` environment's episode written as an agent: each completion that ends with ``]`` is a
    call, answered as the environment answers it (its parser, tool and ``result|`` syntax), appended to the text,
    and the model is called again; the first completion that is not a call is the answer (reward 1 when right).
    At most three calls, as ``tiny-calculator``'s two tool iterations and the answer."""
    env = CalculatorEnvironment()
    env.reset(**row)
    text = str(row["prompt"])
    for _ in range(3):
        piece = client.completions.create(model="policy", prompt=text, stop=list(env.stop_strings)).choices[0].text
        result = env.step(piece)
        if result.done:
            return float(result.reward or 0.0)
        text += piece + (result.observation or "")
    return 0.0


calculator_agent.environment = "calculator"  # its task's alphabet and warm-start demonstrations are calculator's
calculator_agent.default_reward = 0.0  # an episode cut off by the token budget failed, as calculator's does
