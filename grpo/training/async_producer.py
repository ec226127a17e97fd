"""Async rollout production on CPU: a generator process with its own copy of the policy runs ahead of training.

While the trainer runs the optimizer steps of generation round ``r``, the generator already samples the
completions of rounds ``r+1 .. r+prefetch_depth``. Weights are pushed to it every ``vllm_sync_interval`` optimizer
steps (the name axolotl uses for the same knob with vLLM); every rollout carries the policy version (optimizer step)
whose weights produced it, and the trainer refuses rollouts more than ``max_staleness`` versions old: they are
dropped, counted, and generated again with current weights. On GPUs the same role is played by TRL's vLLM
generation: ``grpo.use_vllm`` with ``grpo.vllm_mode: server`` selects
:class:`~grpo.training.rollout_engines.VLLMServerEngine` (TRL's vLLM client) behind the same interface
(:class:`~grpo.training.rollout_engines.RolloutEngine`); this module is the CPU process engine.
"""

from __future__ import annotations

import contextlib
import io
import multiprocessing as mp
import os
import queue
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Rollout:
    round_id: int
    version: int  # optimizer step of the weights that generated it
    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    logprobs: list[list[float]] | None  # sampling log-probs per completion token
    generate_seconds: float
    episodes: list | None = None  # a round of episodes: grpo.environments.episodes.Episode, one per row
    rows: list[dict] | None = None  # the rows the episodes were reset with


@dataclass(frozen=True)
class EpisodeSettings:
    """What an engine needs to run a round of episodes (``environment`` section of the config): the environment's
    registered ``name`` and ``kwargs`` (a row's ``environment`` column names another, built with its defaults),
    the ``tools`` a tool environment gets besides its own,
    the turn and token budgets, the step timeout and the concurrent environment calls. ``modules``: files
    registering environments and tools (``--env-module``, ``GRPO_ENV_MODULES``) the engine's process imports before
    building any, as reward workers import ``--reward-module`` files."""

    name: str
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    tools: tuple[str, ...] = ()
    max_turns: int = 4
    max_completion_length: int = 32
    step_timeout: float | None = 60.0
    max_concurrency: int = 16
    modules: tuple[str, ...] = ()


def environment_module_files() -> tuple[str, ...]:
    """The environment files this process imported or would import (``--env-module`` files already loaded, then
    ``GRPO_ENV_MODULES``): a forkserver child has the forkserver's environment and modules, not the trainer's."""
    import sys

    from grpo.environments import MODULES_ENV

    files = [getattr(m, "__file__", None) for name, m in list(sys.modules.items())
             if name.startswith("grpo_user_environments_")]
    files += os.environ.get(MODULES_ENV, "").split(os.pathsep)
    return tuple(dict.fromkeys(os.path.abspath(f) for f in files if f))


def build_environments(rows: Sequence[Mapping[str, Any]], settings: EpisodeSettings) -> list[Any]:
    """One fresh environment per row as the sync trainer builds them (:mod:`grpo.training.episodes`): the one its
    ``environment`` column names, else ``settings.name`` with ``settings.kwargs``; one whose factory raises fails
    its episode at ``reset`` (NaN reward) and the round goes on."""
    from grpo.environments import ROUTING_COLUMN
    from grpo.training.episodes import _Unbuildable, build_environment

    envs = []
    for row in rows:
        name = row.get(ROUTING_COLUMN) or settings.name
        try:
            envs.append(build_environment(name, dict(settings.kwargs) if name == settings.name else {},
                                          list(settings.tools)))
        except Exception as err:  # noqa: BLE001 - the user's factory; its episode reports it
            envs.append(_Unbuildable(err))
    return envs


def run_episode_round(prompt_ids: Sequence[Sequence[int]], rows: Sequence[Mapping[str, Any]], generate,
                      tokenizer, settings: EpisodeSettings, eos_token_ids: Sequence[int] | None = None) -> list:
    """A round of episodes through THE episode runner with an engine's own ``generate``; each episode's
    ``environment`` names the environment it ran in."""
    from grpo.environments import ROUTING_COLUMN
    from grpo.environments.episodes import run_episodes

    episodes = run_episodes(prompt_ids, build_environments(rows, settings), generate, tokenizer, rows=rows,
                        max_turns=settings.max_turns, max_completion_length=settings.max_completion_length,
                        step_timeout=settings.step_timeout, max_workers=settings.max_concurrency,
                        eos_token_ids=eos_token_ids)
    for ep, row in zip(episodes, rows):
        ep.environment = row.get(ROUTING_COLUMN) or settings.name
    return episodes


def _serialize_state(state_dict: dict) -> bytes:
    import torch

    buf = io.BytesIO()
    torch.save({k: v.detach().cpu() for k, v in state_dict.items()}, buf)
    return buf.getvalue()


# With model.lora the generator holds the base model and the adapter apart, as the trainer's peft model does, and a
# weight sync sends only the adapter (peft's get/set_peft_model_state_dict): small, and the generator computes exactly
# the trainer's function (unmerged, so no rounding from merging the adapter into the base).
ADAPTER_FILE = "adapter.safetensors"


def generator_weights(model) -> dict:
    """What a weight sync sends the generator process: the whole state dict of the (unwrapped) policy, or with
    ``model.lora`` the adapter's (``peft.get_peft_model_state_dict``; the base never changes)."""
    from accelerate.utils import is_peft_model

    if is_peft_model(model):
        from peft import get_peft_model_state_dict

        return get_peft_model_state_dict(model)
    return model.state_dict()


def base_weights(peft_model) -> dict:
    """The frozen base weights of a peft LoRA model under the plain model's names (adapter tensors left out)."""
    state = peft_model.get_base_model().state_dict()
    return {k.replace(".base_layer.", "."): v for k, v in state.items() if ".lora_" not in k}


def sample_round(model, prompt_ids: list[list[int]], gen: dict, stop_strings: tuple[str, ...] = (),
                 tokenizer=None, limits: list[int] | None = None) -> tuple[list[list[int]], list[list[float]]]:
    """One round of the generator: sampled completion token ids (cut after the first end-of-sequence token) and
    their sampling log-probs, for left-padded ``prompt_ids``, as TRL's in-process generation samples them. With
    ``stop_strings`` (and the ``tokenizer`` that decodes them) or ``limits`` (each row's own ``max_new_tokens``, at
    most ``gen["max_new_tokens"]``) each row also stops, and is cut, at its first stop string or its limit
    (:class:`~grpo.training.turn_sampling.TurnStop`) while the others go on."""
    import torch

    from grpo.training.padding import padded_rows

    eos = gen["eos_token_ids"]
    ids, mask = padded_rows(prompt_ids, gen["pad_token_id"], "left")  # left padding, as TRL generates
    width = ids.size(1)
    # On the model's device: the trainer's episode runner samples with the policy where it trains (a GPU), and inputs
    # left on the CPU made transformers sample every token there (a step of guess_digit 10x slower on an H200).
    device = next(model.parameters()).device
    ids, mask = ids.to(device), mask.to(device)
    from transformers import StoppingCriteriaList

    from grpo.training.model_support import GENERATION_KV_CACHE, applies
    from grpo.training.shared_prompt import shared_prompt_prefill
    from grpo.training.turn_sampling import TurnStop, trim

    stop = TurnStop.needed(tokenizer, stop_strings, width, limits or [gen["max_new_tokens"]] * len(prompt_ids), eos)
    share = shared_prompt_prefill(model) if gen.get("shared_prompt", True) else contextlib.nullcontext()
    with torch.no_grad(), share:  # each distinct prompt prefilled once (async.shared_prompt_forward)
        out = model.generate(
            input_ids=ids, attention_mask=mask, do_sample=True, max_new_tokens=gen["max_new_tokens"],
            temperature=gen["temperature"], top_p=gen["top_p"], top_k=gen["top_k"] or None,
            pad_token_id=gen["pad_token_id"], eos_token_id=eos, output_logits=True, return_dict_in_generate=True,
            stopping_criteria=StoppingCriteriaList([stop]) if stop is not None else None,
            # The policy's config says use_cache false (transformers' Trainer turns it off for training, and the
            # generator's copy is saved from it): without the KV cache every new token re-ran the whole sequence,
            # 2x slower on the 4-token default task and 9x on addition_cot's 20 tokens (2.5 s vs 0.28 s a round).
            use_cache=applies(GENERATION_KV_CACHE, model),
        )
    seqs = out.sequences[:, width:]
    logps = torch.stack(
        [torch.log_softmax(step_logits.float() / gen["temperature"], -1) for step_logits in out.logits], 1)
    token_logps = logps.gather(-1, seqs[..., None]).squeeze(-1)
    rows = seqs.tolist()
    completions, completion_logps = [], []
    for row, lp, end in zip(rows, token_logps.tolist(), trim(rows, stop, eos)):
        completions.append(row[:end])
        completion_logps.append(lp[:end])
    return completions, completion_logps


def sampling_generate(model, gen: dict, tokenizer):
    """The episode runner's ``generate`` (:data:`grpo.environments.episodes.GenerateFn`) over :func:`sample_round`:
    every live episode of a turn sampled in one batch, each row stopped at its turn's stop strings (decoded with
    ``tokenizer``), its end-of-sequence token or its own budget while the others go on. Each turn samples under
    :func:`~grpo.training.turn_sampling.turn_random_state`, so an episode's tokens do not depend on where a turn's
    batch stopped: sampling every turn to its budget, the runner cutting it, gives the same episodes."""
    from grpo.training.turn_sampling import turn_random_state

    device = next(model.parameters()).device

    def generate(seqs: list[list[int]], max_new_tokens: list[int], stop_strings: tuple[str, ...]):
        with turn_random_state(device):
            ids, logprobs = sample_round(model, seqs, {**gen, "max_new_tokens": max(max_new_tokens)}, stop_strings,
                                         tokenizer, list(max_new_tokens))
        return list(zip(ids, logprobs))

    from grpo.environments.endpoint import sampling_params

    generate.sampling = sampling_params(gen.get("temperature", 1.0), gen.get("top_p"), gen.get("top_k"))  # agents'
    return generate


# Test-only hook, no config field: seconds the generator sleeps before each round, so tests can run the same config
# with a slow generator and check that nothing but timing changes (the schedule below is fixed by the config). Read
# by the trainer process and passed to the generator: a forkserver child has the forkserver's environment, not the
# trainer's current one.
TEST_DELAY_ENV = "GRPO_TEST_GENERATOR_DELAY_S"


def _worker(conn, model_dir: str, gen: dict, seed: int, threads: int, lora=None, delay_s: float = 0.0,
            episodes: EpisodeSettings | None = None, tokenizer=None) -> None:
    """The generator process: load the policy, then serve weight updates and generation requests until told to stop.

    Messages are handled strictly in the order they were sent (one pipe, one FIFO sender): a round is sampled with
    the last weights sent before it, and rounds draw from one seeded RNG stream in submission order. So the version
    and the tokens of every round follow from the config and the seed, however fast either side runs. A round of
    episodes is one message too: every turn of every episode is sampled with the same weights, which change only
    between rounds.

    With ``episodes`` the process also imports the environment files and runs rounds of episodes (``rows`` given)
    with ``tokenizer``, the trainer's own. An environment's fault ends its episode (NaN reward) inside the
    runner; any other error in a round is sent back for that round, and the process serves the next one."""
    import signal

    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    # Ctrl-C reaches the whole process group; it belongs to the trainer, which finishes its step (it may still need a
    # round from here), saves, and closes this process (as the reward workers do).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    hf_logging.disable_progress_bar()  # a fresh process: no "Loading weights" bar in the trainer's console
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    load_weights = model.load_state_dict
    if lora is not None:
        from peft import get_peft_model, set_peft_model_state_dict
        from safetensors.torch import load_file

        model = get_peft_model(model, lora).eval()
        load_weights = lambda sd: set_peft_model_state_dict(model, sd)  # noqa: E731
        load_weights(load_file(os.path.join(model_dir, ADAPTER_FILE)))
    if episodes is not None:
        from grpo.environments import load_environment_module

        for path in episodes.modules:
            load_environment_module(path, source="GRPO_ENV_MODULES")
        if episodes.name == "agent":
            from grpo.training import chat_loop  # noqa: F401  (the agent endpoint's chat parser: TRL's)
        generate = sampling_generate(model, gen, tokenizer)
    version = 0
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        kind = msg[0]
        if kind == "stop":
            return
        if kind == "weights":
            _, version, blob = msg
            load_weights(torch.load(io.BytesIO(blob), weights_only=True))
            continue
        _, round_id, prompt_ids, rows = msg
        if delay_s:
            time.sleep(delay_s)
        start = time.perf_counter()
        try:
            if rows is None:
                result = sample_round(model, prompt_ids, gen)
            else:
                result = run_episode_round(prompt_ids, rows, generate, tokenizer, episodes, gen["eos_token_ids"])
        except Exception as err:  # noqa: BLE001 - reported for this round; the process goes on
            conn.send(("error", round_id, f"{type(err).__name__}: {err}"))
            continue
        conn.send(("result", round_id, version, result, time.perf_counter() - start))


# Generator processes fork from one forkserver per trainer process, which imports torch, transformers and the model
# code once: the first generator costs those imports (as a spawned one would, ~7 s here), every later one (the next
# training of an in-process sweep or of the invariant matrix) answers its first round in 0.15 s instead of 7.7 s
# (measured on this 2-core machine). Forking from the forkserver is safe with torch: it is single-threaded and never
# ran a kernel; each generator loads its own weights. A generator whose trainer dies sees its pipe close and exits.
_PRELOAD = ["torch", "transformers", "transformers.models.auto.modeling_auto", "transformers.modeling_utils",
            "transformers.generation.utils", "transformers.models.llama.modeling_llama",
            "transformers.models.qwen2.modeling_qwen2", "grpo.training.shared_prompt"]


def _generator_context() -> mp.context.BaseContext:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


class AsyncRolloutProducer:
    """Client side of the generator process: submit rounds ahead, collect them in order, push weights."""

    def __init__(self, model_dir: str, generation: dict, seed: int, threads: int = 1, start_timeout: float = 120,
                 lora=None, episodes: EpisodeSettings | None = None, tokenizer=None):
        """``lora``: the trainer's ``peft.LoraConfig`` when it trains an adapter (``model_dir`` then holds the base
        weights and :data:`ADAPTER_FILE`; weight syncs carry the adapter's state dict). ``episodes``: rounds
        submitted with ``rows`` are rounds of episodes in these settings, their turns decoded and observations encoded
        with ``tokenizer``, the trainer's own, sent to the process whole: one loaded from ``model_dir`` can be of
        another class (transformers picks the model type's from ``config.json``: the tiny model's character tokenizer
        came back as Qwen2's, which drops spaces) and tokenise observations otherwise than the sync trainer."""
        if episodes is not None and tokenizer is None:
            raise ValueError("a generator running episodes needs the trainer's tokenizer")
        ctx = _generator_context()
        self._conn, child = ctx.Pipe()
        delay = float(os.environ.get(TEST_DELAY_ENV) or 0.0)
        self._proc = ctx.Process(target=_worker, args=(child, model_dir, generation, seed, threads, lora, delay,
                                                               episodes, tokenizer),
                                 daemon=True)
        self._proc.start()
        child.close()
        # Sends go through one FIFO thread: a weight blob is larger than the pipe buffer, and a blocking send would
        # stall the trainer until the generator finishes its current round -- serialising the two again.
        self._outbox: queue.Queue = queue.Queue()
        self._sender = threading.Thread(target=self._send_loop, daemon=True, name="rollout-producer-send")
        self._sender.start()
        self._pending: dict[int, tuple[list[list[int]], list[dict] | None]] = {}
        self._done: dict[int, Rollout | str] = {}
        self._episodes = episodes

    def _send_loop(self) -> None:
        while (msg := self._outbox.get()) is not None:
            try:
                self._conn.send(msg)
            except (BrokenPipeError, OSError):  # the generator died; get() reports it
                return

    def submit(self, round_id: int, prompt_ids: list[list[int]], rows: list[dict] | None = None) -> None:
        """One round: completions of ``prompt_ids``, or with ``rows`` (one per prompt) their episodes."""
        if rows is not None and self._episodes is None:
            raise ValueError("a round of episodes needs the producer started with episode settings")
        rows = None if rows is None else [dict(r) for r in rows]
        self._pending[round_id] = (prompt_ids, rows)
        self._outbox.put(("generate", round_id, prompt_ids, rows))

    def push_weights(self, version: int, state_dict: dict) -> None:
        """New weights for the generator (returns at once); requests queued before this run with the older version."""
        self._outbox.put(("weights", version, _serialize_state(state_dict)))

    def sync_weights(self, version: int, model) -> None:
        """:class:`~grpo.training.rollout_engines.RolloutEngine`'s weight sync: the policy's weights (the adapter's
        with ``model.lora``), serialised now, sent behind the requests already queued."""
        self.push_weights(version, generator_weights(model))

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    def get(self, round_id: int, timeout: float = 600.0) -> Rollout:
        deadline = time.monotonic() + timeout
        shown = round_id if round_id >= 0 else -1 - round_id  # negative ids: a round generated again
        while round_id not in self._done:
            left = deadline - time.monotonic()
            if left <= 0 or not self._proc.is_alive():
                raise RuntimeError(
                    f"generator process {'died' if not self._proc.is_alive() else 'timed out'} "
                    f"waiting for round {shown}"
                )
            if self._conn.poll(min(left, 1.0)):
                try:
                    msg = self._conn.recv()
                except (EOFError, OSError):  # the pipe closed under us: the generator died
                    self._proc.join(timeout=5)
                    raise RuntimeError(f"generator process died (exit code {self._proc.exitcode}) waiting for round "
                                       f"{shown}") from None
                prompts, rows = self._pending.pop(msg[1])
                if msg[0] == "error":
                    self._done[msg[1]] = msg[2]
                    continue
                _, rid, version, result, seconds = msg
                self._done[rid] = rollout_of(rid, version, prompts, rows, result, seconds)
        done = self._done.pop(round_id)
        if isinstance(done, str):
            raise RuntimeError(f"generator process failed round {shown}: {done}")
        return done

    def close(self, wait: bool = True) -> None:
        """Stop the generator. ``wait=False`` returns at once and reaps the process in a daemon thread (it may be
        finishing a prefetched round nobody will read)."""
        self._outbox.put(("stop",))
        self._outbox.put(None)
        if wait:
            self._reap()
        else:
            threading.Thread(target=self._reap, daemon=True, name="rollout-producer-reap").start()

    def _reap(self) -> None:
        self._sender.join(timeout=10)
        self._proc.join(timeout=10)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()


def rollout_of(round_id: int, version: int, prompt_ids: list[list[int]], rows: list[dict] | None, result,
               seconds: float) -> Rollout:
    """A round's :class:`Rollout`: from ``(completions, logprobs)``, or from its episodes (``rows`` given), whose
    completions and log-probs (None when an episode has none) it also lists."""
    if rows is None:
        completions, logps = result
        return Rollout(round_id, version, prompt_ids, completions, logps, seconds)
    logps = [ep.logprobs for ep in result]
    return Rollout(round_id, version, prompt_ids, [ep.completion_ids for ep in result],
                   None if any(lp is None for lp in logps) else logps, seconds, episodes=list(result), rows=rows)


def available_cores() -> int:
    """Cores this process may run on (its CPU affinity: taskset, cgroups), else the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def producer_threads() -> int:
    """Threads for the generator: half the cores, at least one (HF generate of small models is overhead-bound)."""
    return max(1, available_cores() // 2)


def trainer_threads(generator_threads: int, current: int) -> int:
    """Intra-op threads for the trainer beside a generator of ``generator_threads``: the remaining cores, never
    more than it has now (a torchrun rank's ``OMP_NUM_THREADS``), at least one.

    Why split rather than share: torch's intra-op pool waits at every parallel region for its slowest thread, so a
    trainer thread that shares a core with the busy generator stalls the whole pool. Measured on this 2-core machine
    (tiny preset, 80 steps, steady step): trainer on 2 threads beside the generator 0.40-0.42 s, on 1 thread 0.25 s,
    sync on 1 thread 0.29 s. Pinning the two processes to their cores (sched_setaffinity) gained nothing (0.27 s).
    """
    return max(1, min(current, available_cores() - generator_threads))


__all__ = ["AsyncRolloutProducer", "EpisodeSettings", "Rollout", "available_cores", "build_environments",
           "environment_module_files", "generator_weights", "producer_threads", "rollout_of", "run_episode_round",
           "sampling_generate", "trainer_threads"]
