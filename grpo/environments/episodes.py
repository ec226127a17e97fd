"""THE episode runner: multi-turn rollouts of the text protocol, every live episode of a round together.

Per turn, every live episode generates in one batched ``generate`` call (one call per distinct set of stop strings
when environments differ), then their environment steps run concurrently on a bounded pool of threads, so a slow
tool costs one latency per turn, not one per episode (verifiers runs ``env.rollout()`` for every repeated prompt
concurrently against a model server in the same way).

An episode's ``completion_ids`` are the model's and the environment's tokens in order, never re-tokenised: the ids
``generate`` returned and the ids of each observation tokenised on its own, concatenated (TRL's tool loop does the
same, trl#5144). ``env_mask`` marks them as TRL's ``rollout_func`` ``env_mask`` (its ``tool_mask``) does: 1 for a
model token (in the loss), 0 for an environment token (attended to, no gradient, not counted as completion length);
an environment token's sampling log-prob is 0.0, TRL's value for tool-result tokens.

``max_completion_length`` covers model and environment tokens. An episode ends when

* the model writes the end-of-sequence token (``eos``; the turn is still stepped, so the environment can score it).
  For an environment whose ``eos_ends_turn`` is true (the chat protocol's
  :class:`~grpo.training.chat_loop.ChatToolLoop`, whose template ends every turn with it) the episode ends there only
  when the step says done;
* the environment says done (``done``): its last observation and the end-of-sequence token are appended as
  environment tokens when they fit, so TRL's "last token is EOS" check reads the episode as finished, not clipped;
* the turn limit is reached with the environment not done (``max_turns``; the last observation is not appended);
* the token budget runs out: a turn without a stop string or EOS, an observation that does not fit whole (dropped,
  as TRL rolls back a tool result that would overflow), or no budget left for another turn (``max_tokens``);
* the environment raises, returns something else than a step result, exceeds ``step_timeout`` or writes an
  observation the tokenizer cannot encode (``error``: reward NaN, left out of the group statistics, and ``error``
  says why). A tool that raises is not an environment error: :class:`~grpo.environments.base.ToolEnvironment`
  answers with its error text, and the call is counted as a failure.

An environment with a ``concurrency_limit`` (a server's session limit, shared by the environments on that server)
starts its episode only while fewer than the limit of that group are live; the others start, in order, at the turn
after an episode of the group ends, and join the live episodes' batched turns. An environment's ``close()`` is called
when its episode ends, whatever ended it, before any waiting episode starts.

An environment may also set, per turn, ``stop_strings`` and ``turn_budget`` (read before each turn: an agent's call
brings its own ``stop`` and ``max_tokens``; a turn cut by ``turn_budget`` is stepped with ``length``, not ended),
``replaces_prompt`` (``reset``'s observation is the whole prompt), ``use_runner(tokenizer, generate)`` (called once
before the episodes start), ``record_turn(ids, logprobs, ended)`` (the turn's kept ids as sampled, before the step)
and observations as :class:`~grpo.environments.base.Tokens` (ids appended as given) or
:class:`~grpo.environments.base.Restart` (the sequence so far becomes an earlier sample of the episode,
``Episode.samples``, and the episode goes on from the given ids as its new prompt, with its own
``max_completion_length``): what :class:`grpo.environments.agents.AgentEnvironment` needs to serve an agent's calls
from this runner, an agent that rewrites its history included.

The result depends only on the inputs: steps are collected by episode, whichever finishes first, and each turn's
batch lists the live episodes in their order.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from grpo.environments.base import Environment, Restart, StepResult, Tokens

GenerateFn = Callable[[list[list[int]], list[int], tuple[str, ...]],
                      Sequence[tuple[Sequence[int], Sequence[float] | None]]]
"""``generate(sequences, max_new_tokens, stop_strings) -> [(new_token_ids, logprobs or None), ...]``, one per
sequence, in order; ``max_new_tokens[i]`` is sequence ``i``'s budget (its episode's tokens left). It should stop each
sequence at a stop string (included in its ids), the end-of-sequence token or its budget while the others go on (the
platform's do: :func:`grpo.training.async_producer.sampling_generate`, evaluation's, vLLM's ``stop``); one that
returns more tokens loses time, not tokens: the runner cuts each turn itself at its own budget, its first stop string
and its first EOS, and counts what was generated (``Episode.generated_tokens``)."""

ENV_LOGPROB = 0.0
"""The sampling log-prob recorded for environment tokens (TRL's value for tool-result tokens; masked out)."""

STOP_REASONS = ("eos", "done", "max_turns", "max_tokens", "error")


@dataclass
class Sample:
    """An earlier sample of an episode (:class:`~grpo.environments.base.Restart`): its prompt and completion ids,
    ``env_mask`` and sampling log-probs as the runner recorded them; it trains as a row of its own with its episode's
    reward."""

    prompt_ids: list[int]
    completion_ids: list[int]
    env_mask: list[int]
    logprobs: list[float] | None


@dataclass
class Episode:
    """One rollout. ``prompt_ids`` are the given prompt's ids plus those of ``reset``'s observation, if any.
    ``tool_calls`` / ``tool_failures`` count calls of the environment's tools by name; a call naming no tool of the
    environment counts in ``unknown_tool_calls`` only. ``reward`` is the sum of the steps' rewards (the environment's
    ``default_reward`` when none gave one; NaN on an error). ``transcript`` is the completion as ``(source, text)``
    segments, ``source`` ``model`` or ``env``. ``tool_seconds`` (wall clock per tool) is left out of comparisons.
    ``prompt_ids`` / ``completion_ids`` / ``logprobs`` / ``env_mask`` are the episode's last sample (what the reward
    functions score); ``samples`` its earlier ones, in order (empty unless the environment restarted the sequence)."""

    prompt_ids: list[int]
    completion_ids: list[int] = field(default_factory=list)
    logprobs: list[float] | None = field(default_factory=list)
    env_mask: list[int] = field(default_factory=list)
    turns: int = 0
    tool_calls: dict[str, int] = field(default_factory=dict)
    tool_failures: dict[str, int] = field(default_factory=dict)
    unknown_tool_calls: int = 0
    stop_reason: str = ""
    reward: float | None = None
    error: str | None = None
    transcript: list[tuple[str, str]] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    tool_seconds: dict[str, float] = field(default_factory=dict, compare=False)
    environment: str | None = None
    """The registered name of the episode's environment, set by whoever chose it (for per-environment metrics)."""
    tool_trace: list[tuple[int, str, str, float]] = field(default_factory=list, compare=False)
    """Every tool call in order as ``(turn, name, status, seconds)`` (``turn`` 1-based, ``status`` ``ok``, ``error`` or
    ``unknown``), for the episode's trace; the counts above are the metrics' view of the same calls."""
    generated_tokens: int = field(default=0, compare=False)
    """Model tokens ``generate`` returned over the episode's turns, the ones cut off after a stop string, EOS or the
    budget included: with ``model_tokens`` (the kept ones), what stopping each turn where it ends saves."""
    turn_times: list[tuple[float, float, float, float]] = field(default_factory=list, compare=False)
    """Each model turn's wall-clock times (``time.time()`` seconds) as ``(generate start, generate end, step start,
    step end)``: the batched ``generate`` call that wrote it and its environment step (both ends the generate end
    for a turn not stepped), so the episode's trace shows what each turn and tool took."""
    model_calls: list[dict[str, Any]] = field(default_factory=list, compare=False)
    """An agent's calls in order, for its trace and metrics: each answered call (one per turn: ``prompt_tokens``,
    ``completion_tokens``, ``finish_reason``, ``route``, ``max_tokens``, ``stop``, the sampling parameters,
    ``tool_calls`` names) and each refused one (``refused``: the error's message, ``status``, ``time``); the
    environment's ``model_calls`` list at the episode's end (empty for an environment without one)."""

    @property
    def truncated(self) -> bool:
        """Cut off by the turn or token budget."""
        return self.stop_reason in ("max_turns", "max_tokens")

    @property
    def env_tokens(self) -> int:
        """Environment tokens (``env_mask`` 0) over the episode's samples."""
        return sum(len(mask) - sum(mask) for mask in self._masks())

    @property
    def model_tokens(self) -> int:
        """The model's tokens kept in the completion (``env_mask`` 1), over the episode's samples."""
        return sum(sum(mask) for mask in self._masks())

    @property
    def first_prompt_ids(self) -> list[int]:
        """The prompt the model saw first: the first sample's (the transcript starts after it)."""
        return self.samples[0].prompt_ids if self.samples else self.prompt_ids

    def _masks(self) -> list[list[int]]:
        return [s.env_mask for s in self.samples] + [self.env_mask]

    def _restart(self, prompt_ids: list[int]) -> None:
        """Keep the sequence so far as an earlier sample and go on from ``prompt_ids`` with an empty completion."""
        self.samples.append(Sample(self.prompt_ids, self.completion_ids, self.env_mask, self.logprobs))
        self.prompt_ids, self.completion_ids, self.env_mask = prompt_ids, [], []
        self.logprobs = None if self.logprobs is None else []

    def _append(self, ids: Sequence[int], logprobs: Sequence[float] | None, source: int) -> None:
        self.completion_ids.extend(ids)
        self.env_mask.extend([source] * len(ids))
        if self.logprobs is not None:
            if logprobs is None:
                self.logprobs = None  # one turn without log-probs: the episode has none
            else:
                self.logprobs.extend(logprobs)

    def _fail(self, error: str) -> None:
        self.stop_reason, self.error, self.reward = "error", error, math.nan


class _Call:
    __slots__ = ("fn", "started", "ended", "finished", "abandoned", "value", "error")

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn, self.started, self.ended, self.finished, self.abandoned = fn, None, None, False, False
        self.value: Any = None
        self.error: str | None = None


class StepPool:
    """A bounded pool of daemon threads for environment calls, each with a timeout from the moment it starts.

    A call past its timeout is abandoned: its result is reported as a timeout, its thread (which Python cannot
    stop) is replaced so the pool keeps ``max_workers`` working threads, and being a daemon it never keeps the
    process from exiting. Results are returned in the order of the calls.
    """

    def __init__(self, max_workers: int) -> None:
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        self.max_workers = max_workers
        self._queue: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
        self._cond = threading.Condition()
        self._workers = 0

    def _spawn(self) -> None:
        self._workers += 1
        threading.Thread(target=self._work, name="grpo-env-step", daemon=True).start()

    def _work(self) -> None:
        while (call := self._queue.get()) is not None:
            with self._cond:
                call.started = time.monotonic()
                self._cond.notify_all()
            try:
                value, error = call.fn(), None
            except BaseException as err:  # noqa: BLE001 - the environment's failure, reported for its episode
                value, error = None, f"{type(err).__name__}: {err}"
            with self._cond:
                if call.abandoned:
                    return  # timed out: a replacement thread took this one's place
                call.value, call.error, call.finished, call.ended = value, error, True, time.monotonic()
                self._cond.notify_all()

    def run(self, fns: Sequence[Callable[[], Any]], timeout: float | None) -> list[_Call]:
        """Run ``fns`` concurrently; each ``_Call`` has ``value`` or ``error`` (a timeout: ``timed out after N s``)."""
        calls = [_Call(fn) for fn in fns]
        with self._cond:
            while self._workers < min(self.max_workers, len(calls)):
                self._spawn()
            for call in calls:
                self._queue.put(call)
            while True:
                now, wait, pending = time.monotonic(), None, False
                for call in calls:
                    if call.finished or call.abandoned:
                        continue
                    if call.started is not None and timeout is not None:
                        left = call.started + timeout - now
                        if left <= 0:
                            call.abandoned, call.error = True, f"timed out after {timeout:g} s"
                            self._workers -= 1
                            self._spawn()
                            continue
                        wait = left if wait is None else min(wait, left)
                    pending = True
                if not pending:
                    return calls
                self._cond.wait(wait)

    def close(self) -> None:
        """Let the idle threads end (abandoned ones end when their call returns, if ever)."""
        with self._cond:
            for _ in range(self._workers):
                self._queue.put(None)
            self._workers = 0


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _decode(tokenizer: Any, ids: Sequence[int]) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=True)


def _first_stop(ids: list[int], stops: tuple[str, ...], tokenizer: Any) -> int | None:
    """The shortest prefix of ``ids`` whose text contains a stop string (its length), or None. Binary search on
    decoded prefixes: a token's text may join its neighbours', so stops are found in text, not per token."""
    if not stops or not any(s in _decode(tokenizer, ids) for s in stops):
        return None
    lo, hi = 1, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if any(s in _decode(tokenizer, ids[:mid]) for s in stops):
            hi = mid
        else:
            lo = mid + 1
    return lo


def _cut_turn(ids: list[int], budget: int, eos: set[int], stops: tuple[str, ...],
              tokenizer: Any) -> tuple[int, str | None]:
    """How many of a turn's generated ids to keep, and why the turn ended: ``stop``, ``eos`` or None (budget)."""
    ids = ids[:budget]
    first_eos = next((j for j, t in enumerate(ids) if t in eos), None)
    stop = _first_stop(ids[:first_eos] if first_eos is not None else ids, stops, tokenizer)
    if stop is not None:
        return stop, "stop"
    if first_eos is not None:
        return first_eos + 1, "eos"
    return len(ids), None


def run_episodes(
    prompt_ids: Sequence[Sequence[int]],
    environments: Sequence[Any],
    generate: GenerateFn,
    tokenizer: Any,
    *,
    rows: Sequence[Mapping[str, Any]] | None = None,
    max_turns: int,
    max_completion_length: int,
    step_timeout: float | None = 60.0,
    max_workers: int = 16,
    eos_token_ids: Sequence[int] | None = None,
) -> list[Episode]:
    """Run one episode per prompt (``environments[i]`` a fresh or reusable instance, reset with ``rows[i]``) to its
    end; see the module docstring. ``max_turns`` counts model turns; ``step_timeout`` (seconds, None: none) bounds
    each ``reset`` and ``step`` call; ``max_workers`` bounds concurrent environment calls. ``tokenizer`` needs
    ``__call__(text, add_special_tokens=False)``, ``decode(ids, skip_special_tokens=True)`` and, without
    ``eos_token_ids``, ``eos_token_id``. An exception from ``generate`` propagates (the model's failure, not the
    environment's)."""
    n = len(prompt_ids)
    rows = list(rows) if rows is not None else [{} for _ in range(n)]
    if len(environments) != n or len(rows) != n:
        raise ValueError(f"run_episodes: {n} prompts, {len(environments)} environments, {len(rows)} rows")
    if max_turns < 1 or max_completion_length < 1:
        raise ValueError(f"max_turns and max_completion_length must be >= 1, got {max_turns}, {max_completion_length}")
    eos = set(eos_token_ids if eos_token_ids is not None else [tokenizer.eos_token_id])
    eos_id = next(iter(eos_token_ids)) if eos_token_ids else tokenizer.eos_token_id
    episodes = [Episode(list(p)) for p in prompt_ids]
    rewards: list[list[float]] = [[] for _ in range(n)]
    stops_of = [tuple(getattr(env, "stop_strings", ())) for env in environments]
    pool = StepPool(max_workers)
    for env in environments:
        if (use := getattr(env, "use_runner", None)) is not None:
            use(tokenizer, generate)  # an agent's endpoint: the runner's tokenizer and sampling settings

    def observation_ids(ep: Episode, text: str | Tokens | None) -> list[int] | None:
        if isinstance(text, Tokens):
            return list(text.ids)
        try:
            return _encode(tokenizer, text) if text else []
        except Exception as err:  # noqa: BLE001 - text the model's tokenizer cannot represent
            ep._fail(f"observation {text!r} cannot be tokenised: {type(err).__name__}: {err}")
            return None

    limits = [getattr(env, "concurrency_limit", None) for env in environments]
    pending, live = list(range(n)), []
    wall_offset = time.time() - time.monotonic()  # the step pool's monotonic times as wall-clock ones

    def admit() -> list[int]:
        """Pending episodes (in order) whose environments' shared limit leaves room beside the live ones."""
        held: dict[int, int] = {}
        for i in live:
            if limits[i] is not None:
                held[id(limits[i])] = held.get(id(limits[i]), 0) + 1
        chosen = []
        for i in pending:
            limit = limits[i]
            if limit is not None:
                if limit.value is not None and held.get(id(limit), 0) >= max(limit.value, 1):
                    continue
                held[id(limit)] = held.get(id(limit), 0) + 1
            chosen.append(i)
        return chosen

    def close(ended: Sequence[int]) -> None:
        """Give an ended episode's per-episode resources back (a server session) before others start; a failing
        close changes nothing of the episode, which is over."""
        closers = [environments[i].close for i in ended
                   if getattr(type(environments[i]), "close", Environment.close) is not Environment.close]
        if closers:
            pool.run(closers, step_timeout)

    try:
        while pending or live:
            admitted = admit()
            started = set(admitted)
            pending = [i for i in pending if i not in started]
            resets = pool.run([partial(environments[i].reset, **rows[i]) for i in admitted], step_timeout)
            failed = []
            for i, call in zip(admitted, resets):
                ep = episodes[i]
                if call.error is not None:
                    ep._fail(f"environment reset: {call.error}")
                    failed.append(i)
                elif (ids := observation_ids(ep, call.value)) is not None:
                    if getattr(environments[i], "replaces_prompt", False):
                        ep.prompt_ids = ids
                    else:
                        ep.prompt_ids.extend(ids)
                    live.append(i)
                else:
                    failed.append(i)
            close(failed)
            live.sort()
            if not live:
                continue
            generated: dict[int, tuple[list[int], list[float] | None]] = {}
            generate_times: dict[int, tuple[float, float]] = {}
            groups: dict[tuple[str, ...], list[int]] = {}
            budget_of: dict[int, int] = {}
            for i in live:
                stops_of[i] = tuple(getattr(environments[i], "stop_strings", ()))  # an agent's call sets its own
                left = max_completion_length - len(episodes[i].completion_ids)
                cap = getattr(environments[i], "turn_budget", None)
                budget_of[i] = left if cap is None else max(1, min(left, cap))
                groups.setdefault(stops_of[i], []).append(i)
            for stops, members in groups.items():
                budgets = [budget_of[i] for i in members]
                seqs = [episodes[i].prompt_ids + episodes[i].completion_ids for i in members]
                started_at = time.time()
                out = list(generate(seqs, budgets, stops))
                generate_times.update(dict.fromkeys(members, (started_at, time.time())))
                if len(out) != len(seqs):
                    raise ValueError(f"generate returned {len(out)} results for {len(seqs)} sequences")
                for i, (ids, logprobs) in zip(members, out):
                    if logprobs is not None and len(logprobs) != len(ids):
                        raise ValueError(f"generate returned {len(logprobs)} log-probs for {len(ids)} tokens")
                    generated[i] = (list(ids), None if logprobs is None else list(logprobs))
                    episodes[i].generated_tokens += len(ids)

            stepping: list[tuple[int, str, str]] = []
            for i in live:
                ep, (ids, logprobs) = episodes[i], generated[i]
                keep, ended = _cut_turn(ids, budget_of[i], eos, stops_of[i], tokenizer)
                if ended is None and budget_of[i] < max_completion_length - len(ep.completion_ids):
                    ended = "length"  # the turn's own budget (an agent's max_tokens), not the episode's: stepped
                ep._append(ids[:keep], None if logprobs is None else logprobs[:keep], 1)
                ep.turns += 1
                if (record := getattr(environments[i], "record_turn", None)) is not None:
                    record(ids[:keep], None if logprobs is None else logprobs[:keep], ended)
                text = _decode(tokenizer, ids[:keep])
                ep.transcript.append(("model", text))
                if ended is None:
                    ep.stop_reason = "max_tokens"
                    ep.turn_times.append((*generate_times[i], generate_times[i][1], generate_times[i][1]))
                else:
                    stepping.append((i, text, ended))

            steps = pool.run([partial(environments[i].step, text) for i, text, _ in stepping], step_timeout)
            previous, live = live, []
            for (i, _, ended), call in zip(stepping, steps):
                ep = episodes[i]
                step_start = generate_times[i][1] if call.started is None else call.started + wall_offset
                step_end = time.time() if call.ended is None else call.ended + wall_offset  # None: timed out
                ep.turn_times.append((*generate_times[i], step_start, step_end))
                if call.error is not None:
                    ep._fail(f"environment step: {call.error}")
                    continue
                value = call.value
                if not isinstance(value, tuple) or len(value) not in (3, 4):
                    ep._fail(f"environment step returned {type(value).__name__}, expected StepResult(observation, "
                             f"done, reward)")
                    continue
                result = StepResult(*value)
                for tc in result.tool_calls:
                    ep.tool_trace.append((ep.turns, tc.name, tc.status, tc.seconds))
                    if tc.status == "unknown":
                        ep.unknown_tool_calls += 1
                        continue
                    ep.tool_calls[tc.name] = ep.tool_calls.get(tc.name, 0) + 1
                    ep.tool_seconds[tc.name] = ep.tool_seconds.get(tc.name, 0.0) + tc.seconds
                    if tc.status == "error":
                        ep.tool_failures[tc.name] = ep.tool_failures.get(tc.name, 0) + 1
                if result.reward is not None:
                    rewards[i].append(float(result.reward))
                left = max_completion_length - len(ep.completion_ids)
                if ended == "eos" and (result.done or not getattr(environments[i], "eos_ends_turn", False)):
                    ep.stop_reason = "eos"
                elif result.done:
                    ep.stop_reason = "done"
                    if (obs := observation_ids(ep, result.observation)) is None:
                        continue
                    tail = obs + [eos_id] if len(obs) + 1 <= left else [eos_id] if left >= 1 else []
                    if tail:
                        ep._append(tail, [ENV_LOGPROB] * len(tail), 0)
                        if len(tail) > 1:
                            ep.transcript.append(("env", str(result.observation or "")))
                elif ep.turns >= max_turns:
                    ep.stop_reason = "max_turns"
                elif isinstance(result.observation, Restart):  # a new sample: the budget is its own
                    ep._restart(list(result.observation.ids))
                    ep.transcript.append(("env", result.observation.text))
                    live.append(i)
                else:
                    if (obs := observation_ids(ep, result.observation)) is None:
                        continue
                    if len(obs) > left:
                        ep.stop_reason = "max_tokens"
                        continue
                    if obs:
                        ep._append(obs, [ENV_LOGPROB] * len(obs), 0)
                        ep.transcript.append(("env", str(result.observation or "")))
                    if len(obs) == left:
                        ep.stop_reason = "max_tokens"
                    else:
                        live.append(i)
            going_on = set(live)
            close([i for i in previous if i not in going_on])
    finally:
        pool.close()

    for ep, env, got in zip(episodes, environments, rewards):
        if isinstance(calls := getattr(env, "model_calls", None), list):
            ep.model_calls = list(calls)
        if ep.error is None:
            ep.reward = math.fsum(got) if got else getattr(env, "default_reward", None)
    return episodes


def rollout_fields(episodes: Sequence[Episode]) -> dict[str, Any]:
    """What TRL's ``rollout_func`` returns for these episodes: ``prompt_ids``, ``completion_ids``, ``logprobs`` (None
    when any episode has none), ``env_mask``, and ``env_reward`` (forwarded to reward functions as a column)."""
    logprobs = [ep.logprobs for ep in episodes]
    return {
        "prompt_ids": [ep.prompt_ids for ep in episodes],
        "completion_ids": [ep.completion_ids for ep in episodes],
        "logprobs": None if any(lp is None for lp in logprobs) else logprobs,
        "env_mask": [ep.env_mask for ep in episodes],
        "env_reward": [ep.reward for ep in episodes],
    }
