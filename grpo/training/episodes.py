"""Multi-turn rollouts in the trainer (the ``environment`` section): the sync path.

Protocol ``text`` (any tokenizer): the trainer hands TRL ``rollout_func=self._rollout_episodes``. For each
generation batch it gets the batch's rows (the dataset's columns; :meth:`assemble_generation_batch` keeps them), builds
one environment per row from the registry (``environment.name`` with ``environment.kwargs``, or the environment a
row's ``environment`` column names; ``environment.tools`` join a :class:`~grpo.environments.ToolEnvironment`'s own),
and runs THE episode runner (:func:`grpo.environments.episodes.run_episodes`) with an in-process ``generate``: the
current policy sampling with the config's temperature / top-p / top-k, returning each token's sampling log-prob.
TRL receives ``prompt_ids``, ``completion_ids``, ``logprobs``, ``env_mask`` (its ``tool_mask``: environment tokens
are attended to but carry no gradient and are left out of the loss normaliser and the completion lengths) and
``env_reward``, a column for the ``env_reward`` reward function. :meth:`_episodes_for` is the seam the async rollout
engines override (episodes sampled ahead by the generator process or vLLM).

An episode whose environment raised, timed out or could not be built gets a NaN reward from every reward function
(:meth:`_calculate_rewards`), so its group's statistics leave it out, as TRL leaves out an unscorable completion, and
training goes on. Episode statistics (:func:`grpo.environments.metrics.episode_metrics`, gathered from every rank)
join TRL's metrics each generation batch.

Protocol ``chat``: TRL's own tool loop, unchanged: ``environment_factory`` (a dict of factories when the data has an
``environment`` column), ``tools`` and ``max_tool_calling_iterations`` go to ``trl.GRPOTrainer`` as they are, each
tool recorded by a :class:`~grpo.environments.chat.ToolLedger` for the per-tool metrics TRL does not log.
"""

from __future__ import annotations

import dataclasses
import time
from functools import partial
from typing import Any

import torch

from grpo.environments import ROUTING_COLUMN, ToolEnvironment, get_tool, make_environment
from grpo.environments.chat import ToolLedger
from grpo.environments.episodes import ENV_LOGPROB, Episode, Sample, rollout_fields, run_episodes
from grpo.environments.metrics import episode_metrics, tool_metrics

# Columns the rollout adds to a row (TRL merges rollout_func's extra fields into the rows): not the dataset's, so
# never passed to reset(**row), e.g. when a re-rolled row comes back.
_ROLLOUT_COLUMNS = frozenset(rollout_fields([]).keys())


def reset_row(row: dict[str, Any]) -> dict[str, Any]:
    """The columns of ``row`` an environment's ``reset(**row)`` gets: the dataset's, not the rollout's."""
    return {k: v for k, v in row.items() if k not in _ROLLOUT_COLUMNS}


def episode_record(ep: Episode, prompt: str, step: int, policy_version: int | None = None) -> dict[str, Any]:
    """An episode as plain data for a trace: ``step`` (the first optimizer step trained on it), ``policy_version``
    (the optimizer steps of the weights that sampled it; None: unknown), ``environment``, ``prompt`` (the text the
    model saw first, ``reset``'s observation included), ``transcript`` (``[source, text]`` segments), ``tool_calls``
    (``[turn, name, status, seconds]`` in order), ``model_calls`` (an agent's calls as the endpoint recorded them,
    ``Episode.model_calls``), ``turns``, ``turn_times`` (each turn's ``[generate start, generate end, step start,
    step end]``, wall-clock seconds), ``reward`` (the environment's; None when it gave none, NaN on an error),
    ``stop_reason``, ``error`` and ``time_ns`` (when it was recorded)."""
    return {
        "step": int(step), "policy_version": None if policy_version is None else int(policy_version),
        "environment": ep.environment, "prompt": prompt, "model_calls": [dict(c) for c in ep.model_calls],
        "transcript": [[source, text] for source, text in ep.transcript],
        "tool_calls": [list(call) for call in ep.tool_trace], "turns": ep.turns,
        "turn_times": [list(times) for times in ep.turn_times],
        "reward": None if ep.reward is None else float(ep.reward), "stop_reason": ep.stop_reason, "error": ep.error,
        "time_ns": time.time_ns(),
    }


def _decode_text(tokenizer: Any, ids: list[int]) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=True)


class _Unbuildable:
    """Stands in for an environment whose construction raised: its episode ends with that error (reward NaN)."""

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def reset(self, **row: Any) -> None:
        raise RuntimeError(f"building the environment failed: {type(self.error).__name__}: {self.error}")


def build_environment(name: str, kwargs: dict[str, Any], tools: list[str]) -> Any:
    """A new instance of the environment ``name`` with ``kwargs``; ``tools`` (registered names) are added to a
    :class:`ToolEnvironment`'s own."""
    env = make_environment(name, **kwargs)
    if tools and isinstance(env, ToolEnvironment):
        for tool in map(get_tool, tools):
            env.tools.setdefault(tool.__name__, tool)
    return env


def chat_environment_factory(env_cfg, dataset) -> Any:
    """TRL's ``environment_factory`` for protocol ``chat``: one zero-argument factory, or a dict of them by name when
    the dataset has an ``environment`` column (``environment.kwargs`` apply to ``environment.name`` only)."""

    def factory(name: str):
        return partial(make_environment, name, **(env_cfg.kwargs if name == env_cfg.name else {}))

    names = sorted(set(dataset[ROUTING_COLUMN])) if dataset is not None and ROUTING_COLUMN in getattr(
        dataset, "column_names", ()) else []
    if names:
        return {name: factory(name) for name in sorted({*names, env_cfg.name})}
    return factory(env_cfg.name)


class EnvironmentRollouts:
    """Mixin of :class:`grpo.training.trainer.GRPOTrainer`; see the module docstring."""

    _rollout_rows: list[dict[str, Any]] | None = None  # the rows of the batch being generated
    _episode_errors: list[bool] | None = None  # per local completion of the last rollout: its environment failed
    _tool_ledger: ToolLedger | None = None  # protocol chat: the tools TRL's loop calls, recorded
    _sampled_policy_version: int | None = None  # the optimizer steps of the weights that sampled the last episodes

    def _environment_trainer_kwargs(self, experiment, kwargs: dict[str, Any]) -> None:
        """Add TRL's arguments for ``experiment.environment`` to the trainer's keyword arguments (called before
        ``trl.GRPOTrainer.__init__``)."""
        env = experiment.environment if experiment is not None else None
        if env is None or not env.enabled:
            return
        if env.protocol == "text":
            kwargs["rollout_func"] = self._rollout_episodes
            return
        ledger = self._tool_ledger = ToolLedger()
        factory = chat_environment_factory(env, kwargs.get("train_dataset"))
        kwargs["environment_factory"] = ({name: ledger.instrumented(f) for name, f in factory.items()}
                                         if isinstance(factory, dict) else ledger.instrumented(factory))
        if env.tools:
            kwargs["tools"] = [ledger.wrap(get_tool(name)) for name in env.tools]

    def _log_chat_tool_metrics(self, episodes: int) -> None:
        """Protocol chat: the generation batch's per-tool calls, failures and latency (:class:`ToolLedger`), summed
        over every rank (the same values on every rank)."""
        if self._tool_ledger is None:
            return
        taken = self._tool_ledger.take()
        totals = torch.tensor([*taken.values(), [episodes, 0, 0]], dtype=torch.float64, device=self.accelerator.device)
        if self.accelerator.num_processes > 1:
            totals = self.accelerator.reduce(totals, reduction="sum")
        *rows, (everyone, _, _) = totals.tolist()
        mode = "train" if self.model.training else "eval"
        for name, value in tool_metrics(dict(zip(taken, rows)), int(everyone)).items():
            self._metrics[mode][name].append(value)

    # ------------------------------------------------------------ TRL's rollout_func

    def _rollout_episodes(self, prompts: list, trainer: Any = None) -> dict[str, Any]:
        """TRL's ``rollout_func``: the batch's episodes as TRL's fields, ``env_reward`` included."""
        rows = self._rollout_rows
        if rows is None or len(rows) != len(prompts):
            rows = [{"prompt": p} for p in prompts]
        prompt_ids = self._tokenize_prompts(prompts)[0]
        episodes = self._episodes_for(prompt_ids, rows)
        eos = next(iter(self.eos_token_ids))
        for row, ep in zip(rows, episodes):
            if not ep.completion_ids:  # failed at reset: TRL reads every completion's last token (one EOS, masked)
                ep._append([eos], [ENV_LOGPROB], 0)
            if ep.environment is None:
                ep.environment = self._environment_name(row)
            row["env_reward"] = ep.reward  # now, not after _generate: streamed reward scoring reads the rows first
        self._episode_errors = [ep.error is not None for ep in episodes]
        # earlier samples (an agent that rewrote its history) train as rows of their own, a failed episode's not
        self._episode_samples = [[] if ep.error is not None else ep.samples for ep in episodes]
        self._log_episode_metrics(episodes)
        self._offer_episode_traces(episodes)
        return rollout_fields(episodes)

    def _environment_name(self, row: dict[str, Any]) -> str:
        return row.get(ROUTING_COLUMN) or self.experiment.environment.name

    def _episodes_for(self, prompt_ids: list[list[int]], rows: list[dict[str, Any]]) -> list[Episode]:
        """The episodes of these prompts (one per row, in order): run here, with the current policy."""
        from grpo.training import chat_loop  # noqa: F401  (the agent endpoint's chat parser: TRL's, as the loop's)

        env = self.experiment.environment
        environments = []
        for row in rows:
            name = self._environment_name(row)
            try:
                environments.append(build_environment(name, env.kwargs if name == env.name else {}, env.tools))
            except Exception as err:  # noqa: BLE001 - that episode fails (reward NaN); the run goes on
                environments.append(_Unbuildable(err))
        reset_rows = [reset_row(row) for row in rows]
        self._sampled_policy_version = self.state.global_step  # the trace's: these weights sample the round
        return run_episodes(
            prompt_ids, environments, self._round_generate(), self._tokenizer, rows=reset_rows,
            max_turns=env.max_turns, max_completion_length=self.max_completion_length,
            step_timeout=env.step_timeout, max_workers=env.max_concurrency, eos_token_ids=list(self.eos_token_ids),
        )

    def _round_generate(self):
        """The episode runner's ``generate`` for one round: one batched sampling call of the current policy per turn
        (the async generator's sampling function, so both paths sample alike), each row stopped at its turn's stop
        strings, EOS or its budget, with the sampling log-prob of every token; built once a round (weights change
        only between rounds), carrying the sampling settings an agent's call may repeat."""
        from grpo.training.async_producer import sampling_generate

        gc = self.generation_config
        gen = {"temperature": gc.temperature, "top_p": gc.top_p, "top_k": gc.top_k,
               "pad_token_id": self._tokenizer.pad_token_id, "eos_token_ids": list(self.eos_token_ids),
               "shared_prompt": bool(self.experiment.async_.shared_prompt_forward)}
        return sampling_generate(self.accelerator.unwrap_model(self.model), gen, self._tokenizer)

    # ------------------------------------------------------------ faults and metrics

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        """Every reward function's value is NaN for an episode whose environment failed (all ranks' rows)."""
        rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        errors, self._episode_errors = self._episode_errors, None
        if errors is not None:
            from accelerate.utils import gather

            failed = gather(torch.tensor(errors, dtype=torch.bool, device=rewards.device))
            rewards[failed] = torch.nan  # in place: RewardScoring keeps this tensor for replay and re-roll
        return rewards

    def _offer_episode_traces(self, episodes: list[Episode]) -> None:
        """Once per logging interval (``logging_steps``), hand the first ``environment.trace_episodes_per_log``
        training episodes of the interval's first generation batch (main process) as :func:`episode_record` dicts to
        every trainer callback with an ``on_episodes(args, state, control, episodes=...)`` method (the MLflow callback
        writes them as traces on its own thread; nothing here waits). A sample, not every episode: a run logs a few
        traces per interval whatever its batch size, so the tracking server's load follows the logging cadence."""
        n = self.experiment.environment.trace_episodes_per_log
        if n <= 0 or not self.model.training or not self.accelerator.is_main_process:
            return
        hooks = [cb.on_episodes for cb in self.callback_handler.callbacks if callable(getattr(cb, "on_episodes", None))]
        if not hooks:
            return
        step = self.state.global_step + 1  # the first optimizer step trained on this generation batch
        interval = (step - 1) // max(1, int(self.args.logging_steps))
        if interval == getattr(self, "_traced_interval", None):
            return
        self._traced_interval = interval
        records = [episode_record(ep, _decode_text(self._tokenizer, ep.first_prompt_ids), step,
                                  self._sampled_policy_version) for ep in episodes[:n]]
        for hook in hooks:
            hook(self.args, self.state, self.control, episodes=records)

    def _log_episode_metrics(self, episodes: list[Episode]) -> None:
        """:func:`episode_metrics` over every rank's episodes (the same values on every rank)."""
        from accelerate.utils import gather_object

        light = [dataclasses.replace(ep, prompt_ids=[], completion_ids=[], logprobs=None, transcript=[],
                                     samples=[Sample([], [], s.env_mask, None) for s in ep.samples])
                 for ep in episodes]
        everyone = gather_object(light) if self.accelerator.num_processes > 1 else light
        mode = "train" if self.model.training else "eval"
        for name, value in episode_metrics(everyone).items():
            self._metrics[mode][name].append(value)


__all__ = ["EnvironmentRollouts", "build_environment", "chat_environment_factory", "episode_record", "reset_row"]
