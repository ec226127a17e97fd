"""Async rollouts (``async.use_data_producer``, ``async.async_prefetch``, ``async.max_staleness``,
``async.prefetch_depth``, ``async.vllm_sync_interval``): the trainer side of the rollout engine.

Completions for a round come from a :class:`~grpo.training.rollout_engines.RolloutEngine`: the CPU generator process
(:class:`~grpo.training.async_producer.AsyncRolloutProducer`, a separate process holding a copy of the policy) or,
with ``grpo.use_vllm`` in server mode, a vLLM server through TRL's client
(:class:`~grpo.training.rollout_engines.VLLMServerEngine`); this code is the same for both. With prefetch, future
rounds are submitted ahead so generation overlaps training.
Each rollout carries the policy version it was sampled with; one older than ``max_staleness`` optimizer steps is
dropped and generated again with current weights (never trained on). Weights are pushed every
``vllm_sync_interval`` steps (:class:`_WeightSync`) and whenever a round must be generated now.

The schedule is a function of the config, never of timing: requests and weight pushes reach the engine in one FIFO
order, and a round is sampled with the last weights pushed before it was submitted. Round 0 is generated at step 0
with the weights of step 0; rounds 1..d (``d = prefetch_depth``) are submitted at step 0 too; round k > d is
submitted at step k - d, after that step's push, so its version is the last push at or before step k - d
(``vllm_sync_interval * floor((k - d) / vllm_sync_interval)`` when no round had to be generated now, which pushes
too). The trainer waits for the round it needs however slow the generator is, and the CPU generator draws every
round from one seeded RNG stream in submission order, so the tokens are fixed as well (a vLLM server's are not:
it batches requests as they arrive).

With an environment (``environment.name``, protocol ``text``) a round is a round of EPISODES: the engine runs THE
episode runner (:func:`grpo.environments.episodes.run_episodes`) with its own ``generate`` and returns the
episodes, and :meth:`AsyncRollouts._episodes_for` hands them to the trainer's ``rollout_func`` (TRL's per-turn
generation never reaches the round cache). A round is one request, so every turn of every episode is sampled with
the round's one policy version; prefetch and ``max_staleness`` act on whole rounds of episodes (a stale round is
generated again whole, never partly).
"""

from __future__ import annotations

import itertools
import time
from pathlib import Path

from accelerate.utils import is_peft_model
from transformers import TrainerCallback

from grpo.training.async_producer import ADAPTER_FILE, EpisodeSettings, Rollout, base_weights
from grpo.training.episodes import reset_row


class AsyncRollouts:
    """Mixin of :class:`grpo.training.trainer.GRPOTrainer`: TRL's ``_generate_single_turn`` served by the producer."""

    def _init_async_rollouts(self) -> None:
        a = self.experiment.async_ if self.experiment is not None else None
        self._producer = None  # the rollout engine (RolloutEngine), started below (see _start_producer)
        self._threads_before: int | None = None  # the trainer's intra-op threads before the generator took its cores
        self._async = bool(a and (a.use_data_producer or a.async_prefetch))
        self._round_iter = None  # the rounds' train-sampler indices, read ahead (see _future_round_prompt_ids)
        self._rounds_read = 0
        self._submitted: set[int] = set()
        self._last_round_end: float | None = None
        self._episode_settings = self._async_episode_settings() if self._async else None
        if self._async:
            self.add_callback(_WeightSync(self))
            if self.args.max_steps > 0:
                self._start_producer()

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        if not (self._async and self.model.training) or images is not None:
            return super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations,
                                                 has_tool_images)
        return self._async_rollouts(prompt_ids)

    def _async_episode_settings(self) -> EpisodeSettings | None:
        """The rollout engine's episode settings (``environment`` section, protocol ``text``), or None: single-turn
        rounds (TRL's chat tool loop generates through ``_generate_single_turn``, turn by turn)."""
        from grpo.training.async_producer import environment_module_files

        env = getattr(self.experiment, "environment", None)
        if env is None or not env.is_text:
            return None
        return EpisodeSettings(name=env.name, kwargs=dict(env.kwargs), tools=tuple(env.tools), max_turns=env.max_turns,
                               max_completion_length=self.max_completion_length, step_timeout=env.step_timeout,
                               max_concurrency=env.max_concurrency, modules=environment_module_files())

    def _episodes_for(self, prompt_ids: list[list[int]], rows: list[dict]) -> list:
        """The round's episodes from the rollout engine (async training), else as the sync trainer runs them."""
        if self._async and self.model.training and self._episode_settings is not None:
            rollout = self._async_round(prompt_ids, rows)
            self._sampled_policy_version = rollout.version  # the episodes' traces show the weights that sampled them
            return rollout.episodes
        return super()._episodes_for(prompt_ids, rows)

    @property
    def _micro_steps_per_round(self) -> int:
        return self.batch_layout.micro_steps_per_round

    def _current_round(self) -> int:
        ga = self.args.gradient_accumulation_steps
        return (self.state.global_step * ga + self._step % ga) // self._micro_steps_per_round

    def _future_round_prompt_ids(self, round_id: int) -> list[list[int]] | None:
        """Prompt token ids of a future round (see :meth:`_future_round`)."""
        future = self._future_round(round_id)
        return None if future is None else future[0]

    def _future_round(self, round_id: int) -> tuple[list[list[int]], list[dict] | None] | None:
        """Prompt token ids of a future round and, for rounds of episodes, its rows, read from a fresh copy of the
        (deterministic) train sampler; ``None`` past the end of the data or for a round already read. Rounds are asked
        for in increasing order, each once (then it is submitted), so nothing is kept: keeping every round grew by a
        round's token ids per step (~1.4 MB a round of 256 GSM8K-length prompts), and a resumed run skips the rounds
        before it without tokenizing them."""
        if self._round_iter is None:
            sampler = self.build_train_sampler(self.train_dataset)
            rows = self.batch_layout.completions_per_rank
            block = rows * self._micro_steps_per_round
            self._round_iter = (list(itertools.islice(it, rows)) for it in iter(
                lambda s=iter(sampler): list(itertools.islice(s, block)), []))
        if round_id < self._rounds_read:
            return None
        idx = None
        while self._rounds_read <= round_id:
            try:
                idx = next(self._round_iter)
            except StopIteration:
                return None
            self._rounds_read += 1
        # One read for the round (datasets answers a list of indices at once): row by row it cost ~9 ms of a 0.10 s
        # async step on the tiny preset (256 rows, each a separate Arrow lookup and formatting)
        batch = self.train_dataset[list(idx)]
        episode_rows = None  # not "rows": the sampler's generator above reads that name lazily
        if self._episode_settings is not None:
            episode_rows = [reset_row(dict(zip(batch, values))) for values in zip(*batch.values())]
        return self._tokenize_prompts(batch["prompt"])[0], episode_rows

    def _start_producer(self) -> None:
        """Start the rollout engine. Called at construction, so its start-up (imports, model load, the server
        connection) overlaps the rest of set-up; its first round is generated with weights pushed at that moment
        (see _async_rollouts)."""
        from grpo.training.rollout_engines import engine_kind

        if engine_kind(self.experiment) == "vllm_server":
            self._start_vllm_engine()
            return
        import torch
        from safetensors.torch import save_file

        from grpo.training.async_producer import AsyncRolloutProducer, producer_threads, trainer_threads

        # Each rank writes its own copy: under torch.distributed, save_pretrained writes on rank 0 only, so another
        # rank's generator would find an empty (or half-written) directory.
        init_dir = Path(self.args.output_dir) / f"generator-init-rank{self.accelerator.process_index}"
        init_dir.mkdir(parents=True, exist_ok=True)
        model = self.accelerator.unwrap_model(self.model)
        lora = None
        if is_peft_model(model):  # model.lora: the generator holds the frozen base plus the adapter, as the trainer
            lora = model.peft_config[model.active_adapter]
            save_file(self._generator_weights(), str(init_dir / ADAPTER_FILE), metadata={"format": "pt"})
            state = base_weights(model)
            model = model.get_base_model()
        else:
            state = model.state_dict()
        model.config.save_pretrained(init_dir)
        # Every tensor under its own name (tied embeddings included): safetensors' save_model keeps one name of a
        # tied pair, and from_pretrained then left the other randomly initialised, so the generator sampled garbage.
        state = {k: v.detach().contiguous().clone() for k, v in state.items()}
        save_file(state, str(init_dir / "model.safetensors"), metadata={"format": "pt"})
        gc = self.generation_config
        gen = {"max_new_tokens": self.max_completion_length, "temperature": gc.temperature, "top_p": gc.top_p,
               "top_k": gc.top_k, "pad_token_id": self._tokenizer.pad_token_id,
               "eos_token_ids": list(self.eos_token_ids), "shared_prompt": self.experiment.async_.shared_prompt_forward}
        # The generator gets async.generator_threads cores, the trainer the rest (see trainer_threads: sharing a core
        # stalls the trainer's whole intra-op pool); restored when the producer closes.
        threads = self.experiment.async_.generator_threads or producer_threads()
        self._threads_before = torch.get_num_threads()
        torch.set_num_threads(trainer_threads(threads, self._threads_before))
        self._producer = AsyncRolloutProducer(str(init_dir), gen, seed=self.args.seed + self.accelerator.process_index,
                                              threads=threads, lora=lora, episodes=self._episode_settings,
                                              tokenizer=self._tokenizer if self._episode_settings is not None else None)

    def _start_vllm_engine(self) -> None:
        """Connect TRL's vLLM client to the server (``grpo.vllm_server_host``/``port``, TRL's ``vllm_server_*``
        arguments) with the trainer's sampling settings."""
        from grpo.training.rollout_engines import VLLMServerEngine

        a, g = self.args, self.experiment.grpo
        sampling = {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                    "min_p": 0.0 if self.min_p is None else self.min_p, "repetition_penalty": self.repetition_penalty,
                    "max_tokens": self.max_completion_length, "generation_kwargs": a.generation_kwargs or {}}
        self._producer = VLLMServerEngine.connect(
            host=g.vllm_server_host, port=g.vllm_server_port, base_url=a.vllm_server_base_url,
            group_port=a.vllm_group_port, timeout=a.vllm_server_timeout, sampling=sampling,
            num_generations=self.num_generations, device=self.accelerator.device,
            episodes=self._episode_settings, tokenizer=self._tokenizer, eos_token_ids=list(self.eos_token_ids))

    def _generator_weights(self) -> dict:
        """What a weight sync sends the CPU generator process: the whole state dict, or with ``model.lora`` the
        adapter's (``peft.get_peft_model_state_dict``; the base never changes)."""
        from grpo.training.async_producer import generator_weights

        return generator_weights(self.accelerator.unwrap_model(self.model))

    def _sync_engine(self) -> None:
        """The current policy to the rollout engine, tagged with the optimizer step."""
        self._producer.sync_weights(self.state.global_step, self.accelerator.unwrap_model(self.model))

    def _async_rollouts(self, prompt_ids: list[list[int]]):
        rollout = self._async_round(prompt_ids)
        return rollout.completion_ids, rollout.logprobs

    def _async_round(self, prompt_ids: list[list[int]], rows: list[dict] | None = None) -> Rollout:
        """The current round from the engine: the prefetched one if its rows are these and it is fresh enough, else
        generated now with current weights; then the next rounds submitted ahead. ``rows``: a round of episodes."""
        a = self.experiment.async_
        rows = None if rows is None else [reset_row(r) for r in rows]
        if self._producer is None:
            self._start_producer()
        producer = self._producer
        round_id = self._current_round()
        now = time.perf_counter()
        train_s = now - self._last_round_end if self._last_round_end is not None else 0.0

        rollout, dropped = None, 0
        if round_id in self._submitted:
            candidate = producer.get(round_id)
            self._submitted.discard(round_id)
            if candidate.prompt_ids != [list(p) for p in prompt_ids] or candidate.rows != rows:
                candidate = None  # the round's rows changed after submission (re-roll injection): generate them now
            elif self.state.global_step - candidate.version > a.max_staleness:
                dropped = 1  # too old: never trained on, generated again below with current weights
                candidate = None
            rollout = candidate
        if rollout is None:
            self._sync_engine()
            producer.submit(-1 - round_id, [list(p) for p in prompt_ids], rows=rows)
            rollout = producer.get(-1 - round_id)
        waited = time.perf_counter() - now

        depth = a.prefetch_depth if a.async_prefetch else 0
        for future in range(round_id + 1, round_id + 1 + depth):
            if future not in self._submitted:
                ahead = self._future_round(future)
                if ahead is not None:
                    ids, future_rows = ahead
                    producer.submit(future, [list(p) for p in ids], rows=future_rows)
                    self._submitted.add(future)

        staleness = float(self.state.global_step - rollout.version)
        self._record("async/staleness_mean", staleness)
        self._record("async/staleness_max", staleness)
        self._record("async/dropped_stale", float(dropped))
        self._record("async/queue_wait_s", waited)
        self._record("async/generate_s", rollout.generate_seconds)
        self._record("async/train_s", train_s)
        if self._threads_before:  # the CPU engine's core split (see _start_producer)
            import torch

            self._record("async/trainer_threads", float(torch.get_num_threads()))
        self._last_round_end = time.perf_counter()
        return rollout

    def close_producer(self, wait: bool = True) -> None:
        if self._producer is not None:
            self._producer.close(wait=wait)
            self._producer = None
        if self._threads_before:
            import torch

            torch.set_num_threads(self._threads_before)  # the trainer's share of the cores ends with the generator
            self._threads_before = None


class _WeightSync(TrainerCallback):
    """Push the trainer's weights to the rollout engine every ``async.vllm_sync_interval`` optimizer steps."""

    def __init__(self, trainer: AsyncRollouts) -> None:
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        t = self.trainer
        if t._producer is not None and state.global_step % t.experiment.async_.vllm_sync_interval == 0:
            t._sync_engine()
