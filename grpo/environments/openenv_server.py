"""Serve a registered environment in its own process, behind an OpenEnv server (openenv-core's ``create_app``).

    python -m grpo.environments.openenv_server guess_digit --port 8000 --max-concurrent-envs 8

Each session (``/ws``) gets its own instance of the environment; the model's turn arrives as the action
``{"message": text}`` and the environment's observation leaves as ``{"text": ...}`` with OpenEnv's ``reward`` and
``done``: the defaults of the ``openenv`` environment (:mod:`grpo.environments.openenv`), which plays the episodes
from the trainer's side. ``--kwargs`` (JSON) are the environment's options, ``--env-module`` a file registering more
environments, as for ``grpo run``. The server refuses sessions beyond ``--max-concurrent-envs``.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from openenv.core.env_server import Action, Observation, State, create_fastapi_app
from openenv.core.env_server import Environment as OpenEnvEnvironment

from grpo.environments import load_environment_module, make_environment
from grpo.environments.base import StepResult


class TextAction(Action):
    """The model's turn as text."""

    message: str


class TextObservation(Observation):
    """What the model sees next (None: nothing), with OpenEnv's ``done`` and ``reward``."""

    text: str | None = None


def served_environment(name: str, kwargs: dict[str, Any] | None = None) -> type[OpenEnvEnvironment]:
    """An OpenEnv environment class whose instances each hold one instance of the registered environment ``name``."""
    options = dict(kwargs or {})

    class Served(OpenEnvEnvironment):
        SUPPORTS_CONCURRENT_SESSIONS = True  # one instance per session, nothing shared

        def __init__(self) -> None:
            super().__init__()
            self.env = make_environment(name, **options)
            self._state = State(step_count=0)

        def reset(self, seed: int | None = None, episode_id: str | None = None, **row: Any) -> TextObservation:
            self._state = State(episode_id=episode_id, step_count=0)
            if seed is not None:
                row["seed"] = seed
            return TextObservation(text=self.env.reset(**row))

        def step(self, action: TextAction, timeout_s: float | None = None, **_: Any) -> TextObservation:
            result = StepResult(*self.env.step(action.message))
            self._state.step_count += 1
            return TextObservation(text=result.observation or None, done=result.done, reward=result.reward)

        @property
        def state(self) -> State:
            return self._state

    Served.__name__ = Served.__qualname__ = f"Served_{name}"
    return Served


def create_server_app(name: str, kwargs: dict[str, Any] | None = None, max_concurrent_envs: int = 1) -> Any:
    """The FastAPI app serving the registered environment ``name`` (OpenEnv's HTTP and WebSocket routes)."""
    return create_fastapi_app(served_environment(name, kwargs), TextAction, TextObservation,
                              max_concurrent_envs=max_concurrent_envs)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m grpo.environments.openenv_server", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("environment", help="a registered environment name (grpo environments lists them)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-concurrent-envs", type=int, default=8, help="sessions served at once")
    parser.add_argument("--kwargs", default="{}", help="the environment's options as a JSON object")
    parser.add_argument("--env-module", action="append", default=[], help="a file registering environments")
    args = parser.parse_args(argv)
    for path in args.env_module:
        load_environment_module(path)
    try:
        options = json.loads(args.kwargs)
        if not isinstance(options, dict):
            raise ValueError("not an object")
        make_environment(args.environment, **options)  # an unknown name or option fails here, not per session
    except Exception as err:  # noqa: BLE001 - one line, exit 2, as the CLI does
        parser.exit(2, f"error: {args.environment} --kwargs {args.kwargs}: {err}\n")

    import uvicorn

    uvicorn.run(create_server_app(args.environment, options, args.max_concurrent_envs), host=args.host,
                port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
