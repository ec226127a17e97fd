"""verifiers tasksets (Prime Intellect's ``verifiers`` 0.4, its v1 API) trained as agents: the ``verifiers`` agent.

``environment: {agent: verifiers, kwargs: {taskset: ID}}`` plays each episode as verifiers plays one: its
``SingleAgentEnv`` over the taskset ``ID`` (an installed taskset package, any importable module exporting its
``Taskset`` subclass in ``__all__``, or such a module's ``.py`` file), the task the row names (``task_idx``: its
position in the taskset's ``load()``; :func:`taskset_rows` writes a taskset as the run's data), its harness
(``null``, verifiers' chat loop, by default) in the ``subprocess`` runtime, its interception server in between, and
its model client pointed at the episode's URL on the endpoint (:mod:`grpo.environments.endpoint`). Every model call
therefore reaches the endpoint, which samples it in the run's batched ``generate`` and records its tokens (nothing is
re-tokenised: the chat template renders the conversation and only the text after the previous completion is
tokenised, as for any agent). The task's rubric (its ``@vf.reward`` functions, weighted) scores the trace after the
harness ends, and that score, ``trace.reward``, is the episode's reward; an episode verifiers reports as failed
(``episode.ok`` False: a harness that crashed, a refused call) gets NaN with verifiers' errors.

Offline: verifiers launches its chat program as a PEP 723 script whose packages ``uv`` would download into a
separate environment before the first rollout. Here the script runs with this process's interpreter, which has them
all (the ``verifiers`` extra pins them), so nothing is downloaded (:func:`_local_chat_program`).
"""

from __future__ import annotations

import json
import sys
from functools import cache
from pathlib import Path
from typing import Any

from grpo.environments.agents import register_agent

INSTALL_HINT = "install the 'verifiers' extra (pip install -e '.[verifiers]')"
HARNESSES = ("null", "bash")
"""The harnesses that run on this machine without a container (verifiers' own chat loops): ``null`` answers in
text, ``bash`` also gives the model a bash tool in the episode's working directory."""


def _vf() -> Any:
    try:
        import verifiers.v1 as vf
    except ImportError:
        raise ValueError(f"verifiers is not installed: {INSTALL_HINT}") from None
    return vf


def _taskset_id(taskset: str) -> str:
    """The id verifiers imports for ``taskset``: itself, or for a ``.py`` file the file's module (imported here under
    its name, as an installed taskset package would be)."""
    if not taskset.endswith(".py"):
        return taskset
    import importlib.util

    path = Path(taskset).resolve()
    if not path.is_file():
        raise ValueError(f"taskset {taskset!r}: no such file")
    if path.stem not in sys.modules:
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        sys.modules[path.stem] = module
        try:
            spec.loader.exec_module(module)  # type: ignore[union-attr]
        except BaseException:
            del sys.modules[path.stem]
            raise
    return path.stem


@cache
def _tasks(taskset: str) -> tuple[Any, ...]:
    """The taskset's tasks in ``load()`` order (its ``idx``), loaded once a process; an id verifiers cannot load is
    a ValueError with its reason on one line."""
    vf = _vf()
    try:
        loaded = vf.load_taskset(vf.TasksetConfig(id=_taskset_id(taskset)))
    except Exception as err:  # noqa: BLE001 - any failure to load is the config's taskset
        reason = " ".join(str(err).split())
        raise ValueError(f"taskset {taskset!r} cannot be loaded: {type(err).__name__}: {reason}") from None
    if not loaded.bounded:
        raise ValueError(f"taskset {taskset!r} is infinite; give a bounded one")
    return tuple(loaded)


def taskset_rows(taskset: str) -> list[dict[str, Any]]:
    """The run's data rows for ``taskset``: each task's prompt text, its ``answer`` field (empty when it has
    none: the task's rubric scores, not the answer column) and ``task_idx``, the task the ``verifiers`` agent
    plays for that row. Write them as a .jsonl file and give it as ``data.source``."""
    return [{"prompt": task.data.prompt_text, "answer": str(getattr(task.data, "answer", "") or ""),
             "task_idx": task.data.idx} for task in _tasks(taskset)]


@cache
def _local_chat_program() -> None:
    """Register verifiers' chat program (the ``null`` and ``bash`` harnesses' PEP 723 script) as prepared with this
    interpreter, so the subprocess runtime runs it here instead of ``uv sync``-ing (downloading) its packages.
    The runtime keys prepared scripts by their content-addressed path and keeps them in a class-wide table."""
    import hashlib

    from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE
    from verifiers.v1.runtimes.subprocess import SubprocessRuntime

    path = Path(SubprocessRuntime.scripts_dir) / f"{hashlib.sha256(CHAT_PROGRAM_SOURCE.encode()).hexdigest()}.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists() or path.read_text() != CHAT_PROGRAM_SOURCE:
        path.write_text(CHAT_PROGRAM_SOURCE)
    SubprocessRuntime._interpreters[str(path)] = sys.executable


class _TasksetAgent:
    """One taskset's episodes: ``agent(client, row)`` runs verifiers' episode of the row's task against the
    client's URL and returns the task's rubric score."""

    def __init__(self, taskset: str, harness: str, max_tokens: int | None) -> None:
        self.taskset, self.harness, self.max_tokens = taskset, harness, max_tokens

    async def __call__(self, client: Any, row: dict[str, Any]) -> float:
        from grpo.environments.endpoint import SERVED_MODEL

        vf = _vf()
        tasks = _tasks(self.taskset)
        idx = row.get("task_idx")
        if not isinstance(idx, int) or not 0 <= idx < len(tasks):
            raise ValueError(f"row's task_idx {idx!r} names no task of taskset {self.taskset!r} ({len(tasks)} tasks): "
                             "write the data with grpo.environments.verifiers_tasksets.taskset_rows")
        _local_chat_program()
        # One env per episode: an env's serving resources (its interception server) live on this episode's loop.
        env = vf.load_environment(vf.resolve_env_config({
            "taskset": {"id": _taskset_id(self.taskset)},
            "agent": {"harness": {"id": self.harness}, "runtime": {"type": "subprocess"}}}))
        # the run's sampling parameters are the endpoint's: verifiers sets none but the call's token cap
        endpoint = vf.EvalClientConfig(base_url=str(client.base_url), api_key_var="GRPO_ENDPOINT_API_KEY")
        ctx = vf.ModelContext(model=SERVED_MODEL, client=endpoint, sampling=vf.Sampling(max_tokens=self.max_tokens))
        async with env.serving():
            episode = await env.run_episode(tasks[idx], ctx)
        if not episode.ok:  # verifiers' own errors (the episode's, then its traces'), on one line
            errors = [*episode.errors, *(e for trace in episode.traces for e in trace.errors)]
            reasons = "; ".join(f"{e.type}: {' '.join(str(e.message).split())}" for e in errors) or "not ok"
            raise RuntimeError(f"verifiers episode failed: {reasons}")
        return float(sum(trace.reward for trace in episode.traces))


class VerifiersAgent:
    """A verifiers taskset's episodes (environment.kwargs.taskset), its rubric the reward; needs the verifiers extra.

    ``environment.kwargs.taskset`` (required) names the taskset, ``harness`` the verifiers harness its episodes run
    (``null`` by default; see :data:`HARNESSES`), ``max_tokens`` each model call's token cap (verifiers'
    ``sampling.max_tokens``; unset: the episode's tokens left). A call cut by its cap still ends in the harness and
    is scored by the rubric; an episode cut by the run's ``max_completion_length`` ends in the runner first and gets
    no reward (it is left out of its group's statistics)."""

    async def __call__(self, client: Any, row: dict[str, Any]) -> float:
        raise ValueError("the verifiers agent needs environment.kwargs.taskset: the verifiers taskset it plays")

    def configure(self, taskset: str | None = None, harness: str = "null",
                  max_tokens: int | None = None) -> _TasksetAgent:
        """The agent for ``taskset``, checked now (verifiers installed, the taskset loadable, a known harness) so a
        config's mistake is one line at load."""
        if not taskset or not isinstance(taskset, str):
            raise ValueError("the verifiers agent needs taskset: the id of the verifiers taskset it plays")
        if harness not in HARNESSES:
            raise ValueError(f"harness {harness!r}: one of {', '.join(HARNESSES)} (harnesses that need a container "
                             "do not run here)")
        if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
            raise ValueError(f"max_tokens {max_tokens!r}: a positive integer (each model call's token cap)")
        _tasks(taskset)
        return _TasksetAgent(taskset, harness, max_tokens)


register_agent("verifiers")(VerifiersAgent())


def write_taskset_rows(taskset: str, path: str | Path) -> Path:
    """:func:`taskset_rows` written as a .jsonl file at ``path`` (the run's ``data.source``)."""
    path = Path(path)
    path.write_text("".join(json.dumps(row) + "\n" for row in taskset_rows(taskset)))
    return path


__all__ = ["HARNESSES", "INSTALL_HINT", "VerifiersAgent", "taskset_rows", "write_taskset_rows"]
