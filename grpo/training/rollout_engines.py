"""Rollout engines: where async rollouts (``async.use_data_producer``) are generated, behind one small interface.

The trainer side (:mod:`grpo.training.async_rollouts`: prefetch, version tags, the ``max_staleness`` bound, the
importance-sampling correction of :mod:`grpo.training.off_policy`) is the same for every engine. An engine

* ``submit(round_id, prompt_ids, rows=None)`` -- starts generating one round (one row per completion), returns at
  once; with ``rows`` (dataset rows, one per prompt) the round is a round of episodes: the engine runs THE episode
  runner (:func:`grpo.environments.episodes.run_episodes`) with its own ``generate``, the environments built in the
  engine's process from the registry (:func:`~grpo.training.async_producer.build_environments`);
* ``get(round_id, timeout)`` -- waits for that round: a :class:`~grpo.training.async_producer.Rollout` with the
  completions, the per-token sampling log-probs and the policy ``version`` whose weights sampled it (every turn of
  a round's episodes: weights change only between rounds), and its ``episodes`` for a round of episodes;
* ``sync_weights(version, model)`` -- new weights (returns at once; rounds submitted before it use the older ones:
  requests and weights are served in one FIFO order, so every round's version is fixed at submission);
* ``in_flight`` -- rounds submitted and not yet collected; ``close(wait)``.

Engines (:func:`engine_kind` picks one from the config):

* ``cpu_process`` -- :class:`~grpo.training.async_producer.AsyncRolloutProducer`, a generator process with its own
  policy copy (HF generate), weights sent through a pipe;
* ``vllm_server`` -- :class:`VLLMServerEngine` (``grpo.use_vllm: true``, ``grpo.vllm_mode: server``): a vLLM server
  on its own GPU (``trl vllm-serve``), driven by TRL's ``VLLMClient``: completions and their sampling log-probs from
  ``/v1/completions``, weights broadcast over the client's NCCL group (``update_named_params``) followed by
  ``reset_prefix_cache``. TRL's own per-step vLLM sync is then off (``use_vllm`` is not passed to
  ``trl.GRPOConfig``): this engine is the only owner of the server's weight-sync group, and weights move every
  ``async.vllm_sync_interval`` steps.

vLLM and TRL's client are imported only when a vLLM engine is created: CPU installs never import them.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from functools import partial
from typing import Any, Protocol

from grpo.environments.endpoint import sampling_params
from grpo.training.async_producer import EpisodeSettings, Rollout, rollout_of, run_episode_round


class RolloutEngine(Protocol):
    """What the trainer needs from a rollout generator (see the module docstring)."""

    def submit(self, round_id: int, prompt_ids: list[list[int]], rows: list[dict] | None = None) -> None: ...

    def get(self, round_id: int, timeout: float = 600.0) -> Rollout: ...

    def sync_weights(self, version: int, model: Any) -> None: ...

    @property
    def in_flight(self) -> int: ...

    def close(self, wait: bool = True) -> None: ...


def engine_kind(cfg) -> str | None:
    """``None`` (no async rollouts: TRL generates, with vLLM or not), ``"cpu_process"`` or ``"vllm_server"``."""
    if cfg is None:
        return None
    a, g = cfg.async_, cfg.grpo
    if not (a.use_data_producer or a.async_prefetch):
        return None
    if g.use_vllm and g.vllm_mode == "server":
        return "vllm_server"
    return "cpu_process"  # async with colocated vLLM is refused at load (grpo.config)


def vllm_named_weights(model):
    """``(name, tensor)`` of the policy under the names vLLM's model loader takes, as TRL's ``VLLMGeneration`` sends
    them (single process, no FSDP/DeepSpeed): with a LoRA adapter, merged into the base for the walk and unmerged
    after it; adapter tensors and ``modules_to_save`` originals left out."""
    from accelerate.utils import is_peft_model

    if not is_peft_model(model):
        for name, param in model.named_parameters():
            yield name.replace("_checkpoint_wrapped_module.", ""), param.data
        return
    model.merge_adapter()
    try:
        for name, param in model.named_parameters():
            name = name.removeprefix("base_model.model.").replace(".base_layer", "")
            if model.prefix in name or "original_module" in name:
                continue
            name = name.replace("modules_to_save.default.", "").replace("_checkpoint_wrapped_module.", "")
            yield name, param.data
    finally:
        model.unmerge_adapter()


class VLLMServerEngine:
    """Rollouts from a vLLM server through TRL's ``VLLMClient``; one worker thread serves requests and weight
    pushes in submission order (the FIFO the CPU engine's pipe gives), so the server GPU generates while the
    trainer's GPU trains.

    ``sync_weights`` copies the weights on the trainer's device at call time (one extra copy of the policy in GPU
    memory) so the optimizer can keep updating them in place while the copy waits its turn in the queue.

    A round of episodes (``episodes`` settings, ``rows`` given to ``submit``) runs the episode runner on the engine's
    thread, its environments built there: each turn is one ``/v1/completions`` request for every live episode (token
    ids in, the turn's stop strings as vLLM's ``stop`` with ``include_stop_str_in_output``, the sampled tokens'
    log-probs out), and no weight push is served until the round's last turn is done.
    """

    def __init__(self, client, sampling: dict, num_generations: int, device=None,
                 episodes: EpisodeSettings | None = None, tokenizer=None, eos_token_ids=None) -> None:
        if episodes is not None and tokenizer is None:
            raise ValueError("a vLLM engine running episodes needs the tokenizer")
        self._episodes, self._tokenizer, self._eos_token_ids = episodes, tokenizer, eos_token_ids
        self._client = client
        self._sampling = dict(sampling)
        self._episode_turn = partial(self._turn)  # the runner's generate, with what an agent's call may repeat
        self._episode_turn.sampling = sampling_params(self._sampling.get("temperature", 1.0),
                                                      self._sampling.get("top_p"), self._sampling.get("top_k"))
        self._num_generations = num_generations
        self._device = device
        self._version = 0
        self._pending: dict[int, list[list[int]]] = {}
        self._done: dict[int, Rollout] = {}
        self._error: BaseException | None = None
        self._closing = False
        self._ready = threading.Condition()
        self._inbox: queue.Queue = queue.Queue()
        self._channel_open = False
        self._worker = threading.Thread(target=self._serve, daemon=True, name="vllm-rollout-engine")
        self._worker.start()

    @classmethod
    def connect(cls, *, host: str, port: int, base_url: str | None = None, group_port: int = 51216,
                timeout: float = 240.0, sampling: dict, num_generations: int, device=None,
                episodes: EpisodeSettings | None = None, tokenizer=None, eos_token_ids=None) -> VLLMServerEngine:
        """Wait for the server (``timeout`` seconds) and connect TRL's client to it. The weight-sync group (NCCL,
        ``init_communicator``) is opened by the first weight sync, on the engine's thread. ``episodes``: rounds
        submitted with rows are rounds of episodes (``tokenizer`` decodes turns and encodes observations)."""
        from trl.generation.vllm_client import VLLMClient  # lazy: vLLM is the GPU install's

        client = VLLMClient(base_url=base_url, host=host, server_port=port, group_port=group_port,
                            connection_timeout=timeout)
        if episodes is not None:  # environment files the trainer process was given (this process: already loaded)
            from grpo.environments import load_environment_module

            for path in episodes.modules:
                load_environment_module(path, source="GRPO_ENV_MODULES")
        return cls(client, sampling, num_generations, device=device, episodes=episodes, tokenizer=tokenizer,
                   eos_token_ids=eos_token_ids)

    # ------------------------------------------------------------ the RolloutEngine interface

    def submit(self, round_id: int, prompt_ids: list[list[int]], rows: list[dict] | None = None) -> None:
        if rows is not None and self._episodes is None:
            raise ValueError("a round of episodes needs the engine connected with episode settings")
        with self._ready:
            self._pending[round_id] = prompt_ids
        self._inbox.put(("generate", round_id, prompt_ids, None if rows is None else [dict(r) for r in rows]))

    def sync_weights(self, version: int, model) -> None:
        snapshot = [(name, tensor.detach().clone()) for name, tensor in vllm_named_weights(model)]
        self._inbox.put(("weights", version, snapshot))

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    def get(self, round_id: int, timeout: float = 600.0) -> Rollout:
        shown = round_id if round_id >= 0 else -1 - round_id  # negative ids: a round generated again
        deadline = time.monotonic() + timeout
        with self._ready:
            while round_id not in self._done:
                if self._error is not None:
                    raise RuntimeError(f"vLLM server engine failed waiting for round {shown}: "
                                       f"{type(self._error).__name__}: {self._error}") from self._error
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RuntimeError(f"vLLM server engine timed out waiting for round {shown}")
                self._ready.wait(min(left, 1.0))
            self._pending.pop(round_id, None)
            return self._done.pop(round_id)

    def close(self, wait: bool = True) -> None:
        """Stop: rounds nobody will read are skipped, then the weight-sync group is closed."""
        self._closing = True
        self._inbox.put(None)
        if wait:
            self._worker.join(timeout=30)

    # ------------------------------------------------------------ the engine's thread

    def _serve(self) -> None:
        while (msg := self._inbox.get()) is not None:
            if self._closing or self._error is not None:
                continue
            try:
                if msg[0] == "weights":
                    _, version, snapshot = msg
                    self._push(snapshot)
                    self._version = version
                else:
                    _, round_id, prompt_ids, rows = msg
                    rollout = (self._generate(round_id, prompt_ids) if rows is None
                               else self._run_episodes(round_id, prompt_ids, rows))
                    with self._ready:
                        self._done[round_id] = rollout
                        self._ready.notify_all()
            except BaseException as err:  # noqa: BLE001 -- reported to the trainer by get()
                with self._ready:
                    self._error = err
                    self._ready.notify_all()
        if self._channel_open:
            self._client.close_communicator()

    def _push(self, snapshot: list[tuple[str, Any]]) -> None:
        """TRL's server-mode weight sync (``VLLMGeneration.sync_weights``): announce the tensors, broadcast them
        over the NCCL group, then drop the prefix cache computed with the old weights."""
        if not self._channel_open:
            self._client.init_communicator(device=self._device if self._device is not None else 0)
            self._channel_open = True
        metadata = [(name, str(t.dtype).removeprefix("torch."), list(t.shape)) for name, t in snapshot]
        self._client.update_named_params(metadata, iter(snapshot))
        self._client.reset_prefix_cache()

    def _generate(self, round_id: int, prompt_ids: list[list[int]]) -> Rollout:
        start = time.perf_counter()
        version = self._version
        # Rows come in groups of num_generations copies of one prompt (TRL's RepeatSampler): ask for n per prompt,
        # as TRL's VLLMGeneration does; any other layout is sent one row per prompt.
        n = self._num_generations
        grouped = len(prompt_ids) % n == 0 and all(
            prompt_ids[i] == prompt_ids[i - i % n] for i in range(len(prompt_ids)))
        prompts = prompt_ids[::n] if grouped else prompt_ids
        out = self._client.generate(prompts=prompts, n=n if grouped else 1, logprobs=0, **self._sampling)
        completions = [list(ids) for ids in out["completion_ids"]]
        # logprobs=0: one entry per token, the sampled token's (after temperature: the server runs with
        # --logprobs-mode processed_logprobs); a NaN the server could not compute arrives as None.
        logps = [[math.nan if lp[0] is None else float(lp[0]) for lp in seq] for seq in out["logprobs"]]
        if len(completions) != len(prompt_ids) or any(len(c) != len(lp) for c, lp in zip(completions, logps)):
            raise RuntimeError(f"vLLM server returned {len(completions)} completions for {len(prompt_ids)} rows")
        return Rollout(round_id, version, [list(p) for p in prompt_ids], completions, logps,
                       time.perf_counter() - start)

    def _turn(self, seqs: list[list[int]], max_new_tokens: list[int], stop_strings: tuple[str, ...]):
        """The episode runner's ``generate`` over the server: one completion per live episode's token ids, each
        stopped by the server at its stop strings or EOS; one request has one ``max_tokens``, the largest budget (the
        runner cuts an episode with less left at its own)."""
        sampling = {**self._sampling, "max_tokens": max(max_new_tokens)}
        if stop_strings:
            sampling["generation_kwargs"] = {**sampling.get("generation_kwargs", {}), "stop": list(stop_strings),
                                             "include_stop_str_in_output": True}
        out = self._client.generate(prompts=seqs, n=1, logprobs=0, **sampling)
        logps = [[math.nan if lp[0] is None else float(lp[0]) for lp in seq] for seq in out["logprobs"]]
        return list(zip(out["completion_ids"], logps))

    def _run_episodes(self, round_id: int, prompt_ids: list[list[int]], rows: list[dict]) -> Rollout:
        start = time.perf_counter()
        version = self._version  # weights move only between messages: every turn below is sampled by this version
        from grpo.training import chat_loop  # noqa: F401  (the agent endpoint's chat parser: TRL's)

        episodes = run_episode_round(prompt_ids, rows, self._episode_turn, self._tokenizer, self._episodes,
                                     self._eos_token_ids)
        return rollout_of(round_id, version, [list(p) for p in prompt_ids], rows, episodes,
                          time.perf_counter() - start)


__all__ = ["RolloutEngine", "VLLMServerEngine", "engine_kind", "vllm_named_weights"]
