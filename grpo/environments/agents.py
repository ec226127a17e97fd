"""Agents by registered name: a user's agent, written against the ``openai`` SDK, trains as an environment.

An agent is a plain function (or a class with ``__call__``), sync or async, ``agent(client, row) -> float | None``:
``client`` is an ``openai.OpenAI`` (``openai.AsyncOpenAI`` for an async agent) bound to its episode's URL on the
process's endpoint (:mod:`grpo.environments.endpoint`), ``row`` the dataset row. It calls the model as it likes and
returns the episode's reward, or None for the run's reward functions to score its final completion. Optional
attributes of the agent: ``default_reward`` (an episode cut off by the token or turn budget; None: left to the reward
functions) and ``environment`` (the registered environment whose task it plays: the tiny model's alphabet and
warm-start demonstrations are that environment's). Agents register
like environments: ``register_agent("name")`` in a file given with ``--env-module`` (or ``GRPO_ENV_MODULES``), or the
``grpo.agents`` entry-point group; a config selects one with ``environment.agent``.

:class:`AgentEnvironment` (registered as the environment ``agent``) is how the episode runner runs one: ``reset``
starts the agent on its own thread and returns its first call's prompt (the episode's prompt), each runner turn
samples the waiting call in the runner's batched ``generate`` beside every other live episode, ``step`` answers
the call and returns the next call's appended text as environment tokens (``env_mask`` 0, log-prob
:data:`~grpo.environments.episodes.ENV_LOGPROB`), and the agent's return ends the episode with its reward. So an
episode whose calls extend each other is one sequence, masked as text-protocol episodes are; a call that does not
(the agent rewrote its history) starts the episode's next sample (:class:`~grpo.environments.base.Restart`), each
sample training as a row of its own with the episode's reward. Its faults are environment faults: an agent that
raises, or takes longer than ``environment.step_timeout`` to make its next call or return, gives its episode a NaN
reward and the round goes on. Its calls are the episode's turns (``env/turns/mean`` is calls per episode), a chat
answer's OpenAI ``tool_calls`` the episode's tool calls (``env/tools/*``), and each call, answered or refused, is
recorded in :attr:`AgentEnvironment.model_calls` for the episode's trace and ``env/refused_calls``.
"""

from __future__ import annotations

import asyncio
import inspect
import queue
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from grpo.environments import MODULES_ENV, register_environment
from grpo.environments.base import ConcurrencyLimit, Environment, Restart, StepResult, Tokens, ToolCall
from grpo.registry import Registry

AGENTS_ENTRY_POINT_GROUP = "grpo.agents"
Agent = Callable[..., Any]

AGENTS: Registry[Agent] = Registry(
    "agent", entry_point_group=AGENTS_ENTRY_POINT_GROUP, modules_env=MODULES_ENV,
    module_prefix="grpo_user_environments_",
)


def register_agent(name: str) -> Callable[[Agent], Agent]:
    """Decorator: make an agent function (or class) selectable by ``name`` as ``environment.agent``."""
    return AGENTS.register(name)


def available_agents() -> list[str]:
    return AGENTS.names()


def get_agent(name: str) -> Agent:
    """The agent registered as ``name``; an unknown name is a ConfigError naming the registered ones."""
    return AGENTS.get(name)


def task_environment(agent: str) -> str | None:
    """The environment whose task the agent ``agent`` plays (its ``environment`` attribute), if it names one."""
    return getattr(get_agent(agent), "environment", None)


def _is_async(agent: Any) -> bool:
    return inspect.iscoroutinefunction(agent) or inspect.iscoroutinefunction(getattr(agent, "__call__", None))


_LIMITS: dict[int, ConcurrencyLimit] = {}


class _AgentThreads:
    """The threads agents run on, kept between episodes and rounds, each with its own HTTP client (kept-alive
    connections to the endpoint). A thread is started only when none is idle, so every live agent runs at once (an
    agent waits in its call for the runner's turn: a bounded pool would deadlock the round). A hung agent keeps its
    thread, a daemon. Starting a thread, a client (its TLS context loads the CA bundle) and a connection for each
    episode cost more than the calls themselves; one pool shared by all agents serialised their calls on its lock."""

    def __init__(self) -> None:
        self.queue: queue.SimpleQueue[Callable[[Any], None]] = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.idle = 0

    def submit(self, fn: Callable[[Any], None]) -> None:
        with self.lock:
            if self.idle:
                self.idle -= 1
            else:
                threading.Thread(target=self._work, name="grpo-agent", daemon=True).start()
        self.queue.put(fn)

    def _work(self) -> None:
        import httpx

        with httpx.Client(verify=_ssl_context(), timeout=3600.0) as http:
            while True:
                self.queue.get()(http)
                with self.lock:
                    self.idle += 1


_THREADS = _AgentThreads()
_SSL: list[Any] = []
_SSL_LOCK = threading.Lock()


def _ssl_context() -> Any:
    """One TLS context for every agent client (building one loads the CA bundle, ~0.1 s of CPU)."""
    import ssl

    with _SSL_LOCK:
        if not _SSL:
            _SSL.append(ssl.create_default_context())
        return _SSL[0]


def _run_agent(agent: Agent, session: Any, row: dict[str, Any], http: Any) -> None:
    """An agent's episode, on one of the agent threads (``http``: the thread's client)."""
    import httpx
    import openai

    # no retries: a refused call (409 after its episode ended) is final, and the runner's step timeout bounds waits
    kwargs = {"base_url": session.base_url, "api_key": "grpo", "max_retries": 0}
    try:
        if _is_async(agent):
            async def main() -> Any:
                async with httpx.AsyncClient(verify=_ssl_context(), timeout=3600.0) as client_http:
                    async with openai.AsyncOpenAI(**kwargs, http_client=client_http) as client:
                        return await agent(client, row)
            result = asyncio.run(main())
        else:
            result = agent(openai.OpenAI(**kwargs, http_client=http), row)
        reward = None if result is None else float(result)
    except BaseException as err:  # noqa: BLE001 - the agent's failure is its episode's
        session.finish(error=f"agent raised {type(err).__name__}: {err}")
        return
    session.finish(reward=reward)


@register_environment("agent")
class AgentEnvironment(Environment):
    """Runs a registered agent's episodes (set by environment.agent); see grpo.environments.agents.

    ``agent``: the agent's registered name; ``max_sessions`` bounds the episodes live at once in a process (their
    agents' calls waiting on the endpoint), None: no bound; other ``options`` go to the agent's ``configure``
    method, which returns the agent bound to them (the ``verifiers`` agent's ``taskset``)."""

    replaces_prompt = True  # the agent's first prompt is the episode's prompt
    eos_ends_turn = True  # the agent, not the end-of-sequence token, ends its episode

    def __init__(self, agent: str, max_sessions: int | None = None, **options: Any) -> None:
        self.agent_name = agent
        self.agent = get_agent(agent)
        if options:  # the agent's own options (environment.kwargs beside agent): its ``configure`` binds them
            configure = getattr(self.agent, "configure", None)
            if configure is None:
                raise ValueError(f"agent {agent!r} takes no options; got {', '.join(sorted(options))}")
            self.agent = configure(**options)
        self.default_reward = getattr(self.agent, "default_reward", None)
        if max_sessions is not None and max_sessions < 1:
            raise ValueError(f"agent: max_sessions must be >= 1, got {max_sessions}")
        if max_sessions is not None:
            self.concurrency_limit = _LIMITS.setdefault(max_sessions, ConcurrencyLimit(max_sessions))
        self.tokenizer: Any = None
        self.sampling: dict[str, Any] | None = None
        self.session: Any = None
        self.model_calls: list[dict[str, Any]] = []  # the episode's calls, answered and refused (Episode.model_calls)
        self._answered: tuple[float, list[str], set[str]] | None = None  # the last answer's time and tool calls
        self._refused_seen = 0

    def use_runner(self, tokenizer: Any, generate: Any) -> None:
        """The runner's tokenizer (the endpoint tokenises what the agent appends with it) and its ``generate``'s
        sampling settings (``generate.sampling``: the values a call may repeat)."""
        self.tokenizer, self.sampling = tokenizer, getattr(generate, "sampling", None)

    @property
    def stop_strings(self) -> tuple[str, ...]:  # type: ignore[override]
        call = self.session.current if self.session is not None else None
        return call.stop if call is not None else ()

    @property
    def turn_budget(self) -> int | None:
        call = self.session.current if self.session is not None else None
        return call.max_tokens if call is not None else None

    def reset(self, **row: Any) -> Tokens:
        from grpo.environments.endpoint import endpoint

        if self.tokenizer is None:
            raise RuntimeError("agent: the runner gave no tokenizer (use_runner)")
        self.session = endpoint().open(self.tokenizer, self.sampling)
        self.model_calls, self._answered, self._refused_seen = [], None, 0
        _THREADS.submit(partial(_run_agent, self.agent, self.session, dict(row)))
        call = self.session.wait()
        if call is None:
            raise RuntimeError(self.session.error or f"agent {self.agent_name!r} returned without calling the model")
        return Tokens(call.prompt_text, call.prompt_ids)

    def record_turn(self, ids: Sequence[int], logprobs: Sequence[float] | None, ended: str | None) -> None:
        """Answer the call at once, in the runner's thread, so every agent of the turn gets its completion (and
        starts its tools) together, whatever the step pool's size; ``step`` then only waits for the next call. The
        call is recorded for the episode's trace (:attr:`model_calls`), and a chat answer's tool calls for ``step``."""
        text = self.tokenizer.decode(list(ids), skip_special_tokens=True)  # the runner's ``step`` text
        call, finish = self.session.current, "length" if ended in (None, "length") else "stop"
        message = self.session.complete(text, ids, logprobs, finish)
        if call is None:
            return
        self._take_refused()
        names = [str(c["function"]["name"]) for c in (message or {}).get("tool_calls", [])]
        offered = {str((t.get("function") or {}).get("name")) for t in call.tools or [] if isinstance(t, dict)}
        self.model_calls.append({
            "prompt_tokens": len(call.prompt_ids), "completion_tokens": len(ids), "finish_reason": finish,
            "route": "completions" if call.messages is None else "chat/completions", "max_tokens": call.max_tokens,
            "stop": list(call.stop), **(self.sampling or {}), "tool_calls": names,
            **({"restart": True} if call.restart else {})})
        self._answered = (time.time(), names, offered)

    def _take_refused(self) -> None:
        """The session's refused calls not yet recorded, in :attr:`model_calls` in the order they came."""
        refused = self.session.refused[self._refused_seen:]
        self._refused_seen += len(refused)
        self.model_calls.extend({"refused": message, "status": status, "time": at} for at, status, message in refused)

    def _tool_calls(self, call: Any) -> tuple[ToolCall, ...]:
        """The tool calls of the chat answer just given (OpenAI ``tool_calls``), as the episode's tool calls: a name
        the call's ``tools`` offered is ``ok``, another ``unknown``. The agent runs them, so the endpoint sees neither
        their failures nor their own latency: each takes an equal share of the time from the answer to the agent's
        next call (or its return)."""
        answered, self._answered = self._answered, None
        if answered is None or not answered[1]:
            return ()
        at, names, offered = answered
        share = max(0.0, (call.started if call is not None else time.time()) - at) / len(names)
        return tuple(ToolCall(name, "ok" if name in offered else "unknown", share) for name in names)

    def step(self, action: str) -> StepResult:
        call = self.session.wait()
        tool_calls = self._tool_calls(call)
        if call is not None:
            observation = (Restart if call.restart else Tokens)(call.suffix_text, call.suffix_ids)
            return StepResult(observation, False, None, tool_calls)
        if self.session.error is not None:
            raise RuntimeError(self.session.error)
        return StepResult(None, True, self.session.reward, tool_calls)

    def close(self) -> None:
        from grpo.environments.endpoint import endpoint

        if self.session is not None:
            endpoint().close(self.session)
            self._take_refused()


__all__ = ["AGENTS", "AGENTS_ENTRY_POINT_GROUP", "AgentEnvironment", "available_agents", "get_agent",
           "register_agent", "task_environment"]
