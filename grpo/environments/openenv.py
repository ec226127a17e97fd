"""The ``openenv`` environment: episodes played against an environment in its own process, behind an OpenEnv server.

`OpenEnv <https://github.com/meta-pytorch/OpenEnv>`_ (``openenv-core``, the ``env-server`` extra) serves an
environment over a WebSocket per session (``/ws``): ``reset`` and ``step`` messages answered with ``{observation,
reward, done}``, one server-side environment instance per session, at most ``max_concurrent_envs`` sessions (the
server refuses more). Each episode here is one session, opened by ``reset`` and closed when the episode ends, through
OpenEnv's own client (``GenericEnvClient``: actions and observations as JSON dicts).

Text in and out: the model's turn is sent as the action ``{action_field: text}``, and the observation's
``observation_field`` is what the model sees next. Any OpenEnv server works whose actions take the turn as one text
field; :mod:`grpo.environments.openenv_server` serves the platform's own registered environments that way.

Concurrency: the environments of one server (one ``base_url``) share a :class:`ConcurrencyLimit`, so the episode
runner never keeps more episodes live than the server admits sessions. The limit is ``max_concurrent_envs`` when
given; otherwise it is read from the server's first refusal (OpenEnv reports "N/M sessions active"; that episode is
an environment error, the later ones are bounded). The limit counts this process's episodes: processes sharing one
server each pass their share.

Faults: every call has a timeout (connection ``connect_timeout_s``, each answer ``message_timeout_s``); a refused
connection, a server that dies or stops answering raises, so the runner ends that episode as an environment error
(NaN reward, ``error`` says why) and the others go on. A refusal for capacity while this process holds fewer sessions
than the limit (a just-closed session the server has not freed yet, or another process's) is retried until
``connect_timeout_s`` has passed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import re
import threading
import time
from collections.abc import Coroutine, Mapping, Sequence
from typing import Any

from grpo.environments import register_environment
from grpo.environments.base import ConcurrencyLimit, Environment, StepResult
from grpo.errors import ConfigError

_RETRY_S = 0.05

_loop_lock = threading.Lock()
_loop: tuple[int, asyncio.AbstractEventLoop] | None = None
_limits: dict[str, ConcurrencyLimit] = {}
_sessions: dict[str, int] = {}


def _event_loop() -> asyncio.AbstractEventLoop:
    """One event loop thread per process for every session's WebSocket (OpenEnv's client is async), started on first
    use and again in a forked child, which has the loop but not its thread."""
    global _loop
    with _loop_lock:
        if _loop is None or _loop[0] != os.getpid():
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="grpo-openenv-loop", daemon=True).start()
            _loop = (os.getpid(), loop)
        return _loop[1]


def _run(coro: Coroutine[Any, Any, Any], timeout: float, what: str) -> Any:
    future = asyncio.run_coroutine_threadsafe(coro, _event_loop())
    try:
        return future.result(timeout)
    except concurrent.futures.TimeoutError:
        future.cancel()
        raise TimeoutError(f"{what}: no answer within {timeout:g} s") from None


class ServerError(RuntimeError):
    """The server's error answer (OpenEnv's ``{"type": "error", "data": {"message", "code", ...}}``)."""

    def __init__(self, data: dict[str, Any]) -> None:
        self.data = data
        self.code = str(data.get("code", ""))
        super().__init__(f"{data.get('message', 'unknown error')} (code {self.code or 'none'})")


def _client_class() -> type:
    """OpenEnv's generic client, reading the server's answer even when sending failed: a server that refuses a
    session (at capacity) answers the connection with its error and closes it before the client's first message,
    and openenv-core 0.3's client reports only the closed connection."""
    from openenv.core.generic_client import GenericEnvClient
    from websockets.exceptions import ConnectionClosed

    class Client(GenericEnvClient):
        async def _send_and_receive(self, message: dict[str, Any]) -> dict[str, Any]:
            try:
                await self._send(message)
            except ConnectionClosed:
                pass  # what the server sent before closing is still to be read; nothing: _receive raises
            response = await self._receive()
            if response.get("type") == "error":
                raise ServerError(response.get("data") or {})
            return response

    return Client


def server_limit(base_url: str) -> ConcurrencyLimit:
    """The limit shared by this process's environments on the server at ``base_url``."""
    with _loop_lock:
        return _limits.setdefault(base_url.rstrip("/"), ConcurrencyLimit())


def _json_safe(row: Mapping[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(dict(row), default=str))


@register_environment("openenv")
class OpenEnvEnvironment(Environment):
    """An episode is a session on the OpenEnv server at ``base_url`` (``http://host:port`` or ``ws://``).

    ``action_field``: the action's field that carries the model's turn. ``observation_field``: the observation's field
    shown to the model (None or "" in it: nothing appended). ``reset_fields``: the dataset columns sent to the
    server's ``reset`` (None: every column; the server passes on those its ``reset`` takes). ``stop_strings``,
    ``alphabet``, ``default_reward``: as for any environment (:class:`~grpo.environments.base.Environment`): the
    server's text protocol is its own, so the config states it. ``max_concurrent_envs``: the server's session limit
    (None: learnt from its first refusal). Timeouts in seconds.
    """

    def __init__(
        self,
        base_url: str,
        action_field: str = "message",
        observation_field: str = "text",
        reset_fields: Sequence[str] | None = None,
        stop_strings: Sequence[str] = (),
        alphabet: str = "",
        default_reward: float | None = None,
        max_concurrent_envs: int | None = None,
        connect_timeout_s: float = 30.0,
        message_timeout_s: float = 60.0,
    ) -> None:
        try:
            client_cls = _client_class()
        except ImportError as err:
            raise ConfigError("environment 'openenv' needs openenv-core: pip install 'grpo-platform[env-server]' "
                              f"({err})") from None
        if not isinstance(base_url, str) or not re.match(r"^(https?|wss?)://", base_url):
            raise ConfigError(f"environment.kwargs.base_url: an http(s):// or ws(s):// URL, got {base_url!r}")
        if max_concurrent_envs is not None and max_concurrent_envs < 1:
            raise ConfigError(f"environment.kwargs.max_concurrent_envs: >= 1 or null, got {max_concurrent_envs}")
        self._client_cls = client_cls
        self.base_url = base_url.rstrip("/")
        self.action_field, self.observation_field = action_field, observation_field
        self.reset_fields = None if reset_fields is None else list(reset_fields)
        self.stop_strings = tuple(stop_strings)
        self.alphabet = alphabet
        self.default_reward = default_reward
        self.connect_timeout_s, self.message_timeout_s = connect_timeout_s, message_timeout_s
        self.concurrency_limit = server_limit(self.base_url)
        if max_concurrent_envs is not None:
            self.concurrency_limit.value = max_concurrent_envs
        self._client: Any = None
        self._holds = False  # counted in _sessions: a session the server accepted

    def _text(self, result: Any) -> str | None:
        observation = result.observation if isinstance(result.observation, dict) else {}
        if self.observation_field not in observation:
            raise ValueError(f"the server's observation has no field {self.observation_field!r} "
                             f"(fields: {', '.join(sorted(observation)) or 'none'}); set observation_field")
        value = observation[self.observation_field]
        return None if value in (None, "") else str(value)

    def _open(self, kwargs: dict[str, Any]) -> Any:
        """A new session, reset with ``kwargs``; retried while the server refuses it for capacity although this
        process holds fewer sessions than the limit (see the module docstring)."""
        deadline = time.monotonic() + self.connect_timeout_s
        while True:
            client = self._client_cls(base_url=self.base_url, connect_timeout_s=self.connect_timeout_s,
                                      message_timeout_s=self.message_timeout_s)
            self._client = client
            try:
                result = _run(client.reset(**kwargs), self.connect_timeout_s + self.message_timeout_s,
                              f"OpenEnv server {self.base_url} reset")
            except ServerError as err:
                if err.code != "CAPACITY_REACHED":
                    raise
                self.close()
                with _loop_lock:
                    limit, held = self.concurrency_limit.value, _sessions.get(self.base_url, 0)
                    if limit is None:
                        limit = self.concurrency_limit.value = int(err.data.get("max_sessions") or 1)
                        raise RuntimeError(f"{err}; the later episodes are limited to {limit} (max_concurrent_envs)") \
                            from None
                if held >= limit:
                    raise RuntimeError(f"{err}; this process holds {held} of its {limit}") from None
                if time.monotonic() >= deadline:
                    raise RuntimeError(f"refused a session for {self.connect_timeout_s:g} s: {err}") from None
                time.sleep(_RETRY_S)
                continue
            with _loop_lock:
                _sessions[self.base_url] = _sessions.get(self.base_url, 0) + 1
            self._holds = True
            return result

    def reset(self, **row: Any) -> str | None:
        self.close()  # a session left open by an episode that did not end through the runner
        data = _json_safe(row)
        if self.reset_fields is not None:
            data = {k: data[k] for k in self.reset_fields if k in data}
        try:
            result = self._open(data)
        except TimeoutError:
            raise TimeoutError(f"OpenEnv server {self.base_url} reset: no answer within "
                               f"{self.connect_timeout_s + self.message_timeout_s:g} s") from None
        except Exception as err:  # noqa: BLE001 - a refused connection, a dead server: said with the server's address
            raise ConnectionError(f"OpenEnv server {self.base_url} reset: {type(err).__name__}: {err}") from None
        return self._text(result)

    def step(self, action: str) -> StepResult:
        if self._client is None:
            raise RuntimeError("step before reset: no session")
        try:
            result = _run(self._client.step({self.action_field: action}), self.message_timeout_s + 5.0,
                          f"OpenEnv server {self.base_url} step")
        except TimeoutError:
            raise TimeoutError(f"OpenEnv server {self.base_url} step: no answer within {self.message_timeout_s:g} s") \
                from None
        except Exception as err:  # noqa: BLE001 - as in reset
            raise ConnectionError(f"OpenEnv server {self.base_url} step: {type(err).__name__}: {err}") from None
        return StepResult(self._text(result), bool(result.done),
                          None if result.reward is None else float(result.reward))

    def close(self) -> None:
        """Close the session (the server frees its slot); a dead server's session is already gone."""
        client, self._client = self._client, None
        if self._holds:
            self._holds = False
            with _loop_lock:
                _sessions[self.base_url] -= 1
        if client is not None:
            try:
                _run(client.disconnect(), self.message_timeout_s, f"OpenEnv server {self.base_url} close")
            except Exception:  # noqa: BLE001 - nothing left to give back
                pass
