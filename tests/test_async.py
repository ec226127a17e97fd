"""Async rollouts: a generator process runs ahead, staleness is bounded, stale rollouts are regenerated."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import defaultdict

import pytest

from grpo.config import load_config
from grpo.pipeline.experiment import run_experiment
from grpo.runs import open_run_dir
from tests.conftest import MICRO, micro_overrides, recorded_calls, write_prompt_recorder
from tests.servers import free_port

pytestmark = pytest.mark.integration  # trains a model, starts servers or processes: not in `make test-fast`



def metrics(run) -> list[dict]:
    return [json.loads(line)["metrics"] for line in run.metrics_file.read_text().splitlines()]


def async_run(tmp_path, name, after_load=None, **extra):
    cfg = load_config(MICRO, micro_overrides(tmp_path, **{
        "async.use_data_producer": "true", "async.async_prefetch": "true", "grpo.max_steps": 8,
        "grpo.logging_steps": 1, "evaluation.enabled": "false", **extra}))
    for key, value in (after_load or {}).items():  # past the load-time rules, to exercise a code path they refuse
        setattr(cfg.async_, key, value)
    run = open_run_dir(cfg, name, resume=False)
    summary = run_experiment(cfg, run, log=lambda *_: None)
    return run, summary, metrics(run)


def test_prefetched_rollouts_are_one_version_old_and_logged(tmp_path):
    run, summary, rows = async_run(tmp_path, "prefetch", **{"async.max_staleness": 1})
    assert summary["steps"] == 8
    staleness = [r["async/staleness_max"] for r in rows if "async/staleness_max" in r]
    assert len(staleness) == 8 and max(staleness) <= 1 and staleness[1:] == [1.0] * 7  # generated a step ahead
    for key in ("async/staleness_mean", "async/dropped_stale", "async/queue_wait_s", "async/generate_s",
                "async/train_s"):
        assert any(key in r for r in rows), key
    assert sum(r.get("async/dropped_stale", 0) for r in rows) == 0


def test_the_generator_and_the_trainer_split_the_cores_and_the_trainer_gets_its_threads_back(tmp_path):
    """A trainer thread sharing a core with the busy generator stalls torch's whole intra-op pool, so while the
    generator runs the trainer computes on the other cores only; its thread count comes back when training ends."""
    import torch

    from grpo.training.async_producer import available_cores

    before = torch.get_num_threads()
    _, _, rows = async_run(tmp_path, "split", **{"async.generator_threads": 1})
    threads = {r["async/trainer_threads"] for r in rows if "async/trainer_threads" in r}
    assert threads == {float(max(1, min(before, available_cores() - 1)))}, (threads, before, available_cores())
    assert torch.get_num_threads() == before


def test_rollouts_older_than_max_staleness_are_dropped_and_regenerated(tmp_path):
    # The config refuses max_staleness 0 with prefetch (vllm_sync_interval 1 > 0: every prefetched round would be
    # dropped, see tests/test_config_combinations.py); set after load, it shows the drop itself works.
    run, summary, rows = async_run(tmp_path, "strict", after_load={"max_staleness": 0},
                                   **{"async.vllm_importance_sampling_correction": "true"})
    staleness = [r["async/staleness_max"] for r in rows if "async/staleness_max" in r]
    assert staleness and max(staleness) == 0  # nothing older than allowed was ever trained on
    assert sum(r.get("async/dropped_stale", 0) for r in rows) == 7  # every prefetched round after the first
    # Not only the version label: the generator really sampled from the trainer's current weights, so the
    # importance ratio pi_train / pi_generator is 1 on every token (wrong weights pushed would move it).
    for key in ("min", "max"):
        ratios = [r[f"sampling/importance_sampling_ratio/{key}"] for r in rows
                  if f"sampling/importance_sampling_ratio/{key}" in r]
        assert len(ratios) == 8 and all(abs(v - 1.0) < 1e-5 for v in ratios), (key, ratios)


def test_two_process_async_training_neither_hangs_nor_shares_data(tmp_path):
    recorder = write_prompt_recorder(tmp_path)
    log = tmp_path / "prompts.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           "-m", "grpo.app.cli", "run", "--config", str(MICRO), "--run-name", "async-ddp", "--reward-module",
           str(recorder)]
    for item in micro_overrides(tmp_path, **{
            "sampling.world_size": 2, "async.use_data_producer": "true", "async.async_prefetch": "true",
            "grpo.max_steps": 4, "grpo.per_device_train_batch_size": 8, "grpo.num_generations": 4,
            "grpo.reward_funcs": "[exact_match_recorded]", "evaluation.enabled": "false",
            "async.streaming_partial_batch": "true", "async.streaming_min_groups": 1}):
        cmd += ["--set", item]
    result = subprocess.run(cmd, cwd=tmp_path, env={**os.environ, "PROMPT_LOG": str(log), "OMP_NUM_THREADS": "1"},
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    calls = defaultdict(list)
    for row in recorded_calls(log):
        calls[row["rank"]].append(row["prompts"])
    # streamed scoring: one reward call per group (2 per rank and step), each call one whole group
    assert len(calls[0]) == len(calls[1]) == 8
    assert all(len(set(c)) == 1 and len(c) == 4 for rank in calls.values() for c in rank)
    for step in range(4):
        a = calls[0][2 * step] + calls[0][2 * step + 1]
        b = calls[1][2 * step] + calls[1][2 * step + 1]
        assert not set(a) & set(b)


def test_sync_interval_and_prefetch_depth_set_the_rollouts_policy_versions(tmp_path):
    """``vllm_sync_interval`` 2: weights reach the generator only after even optimizer steps. ``prefetch_depth`` 2:
    at step r the rounds r+1 and r+2 are already submitted. Requests and weights go down one FIFO pipe, so the
    version of each round is fixed: rounds 0-2 are sampled by the first weights (round 0 generated now, 1 and 2
    submitted at step 0); round k >= 3 was submitted at step k-2, after the pushes of steps 2, 4, .. <= k-2. A
    round trained at step k has version k - staleness."""
    run, summary, rows = async_run(tmp_path, "sync2-depth2", **{
        "async.vllm_sync_interval": 2, "async.prefetch_depth": 2, "async.max_staleness": 3})
    assert summary["steps"] == 8
    staleness = [r["async/staleness_max"] for r in rows if "async/staleness_max" in r]
    versions = [step - int(s) for step, s in enumerate(staleness)]
    # interval 1 would give [0, 0, 0, 1, 2, 3, 4, 5]; depth 1 would give [0, 0, 0, 2, 2, 4, 4, 6]
    assert versions == [0, 0, 0, 0, 2, 2, 4, 4], versions
    assert sum(r.get("async/dropped_stale", 0) for r in rows) == 0


def test_a_dead_generator_fails_the_trainer_with_a_clear_error(tmp_path):
    """The generator process killed mid-run (after it was sent the prefetched round): the trainer's next round
    raises an error naming the generator process, within the producer's liveness poll, instead of waiting for a
    round that never comes (or failing with a bare pipe error)."""
    import signal

    import torch

    from grpo.pipeline.data import load_data
    from grpo.rewards import get_reward
    from grpo.training.policy import load_policy
    from grpo.training.train import grpo_args
    from grpo.training.trainer import GRPOTrainer

    cfg = load_config(MICRO, micro_overrides(tmp_path, **{
        "async.use_data_producer": "true", "async.async_prefetch": "true", "evaluation.enabled": "false"}))
    data = load_data(cfg)
    policy = load_policy(cfg, data, log=lambda *_: None)
    trainer = GRPOTrainer(model=policy.model, processing_class=policy.tokenizer,
                          reward_funcs=[get_reward(n) for n in cfg.grpo.reward_funcs],
                          args=grpo_args(cfg, tmp_path / "out"), train_dataset=data["train"], experiment=cfg)
    try:
        trainer.model.train()
        torch.manual_seed(0)
        rows = [r for r in list(trainer.train_dataset)[:4] for _ in range(trainer.num_generations)]
        trainer.assemble_generation_batch(rows)  # round 0, and round 1 submitted ahead
        producer = trainer._producer
        assert producer.in_flight == 1
        os.kill(producer._proc.pid, signal.SIGKILL)
        trainer.state.global_step = 1  # the next round: the prefetched one, which the dead process never returns
        with pytest.raises(RuntimeError, match=r"generator process died .*waiting for round"):
            trainer.assemble_generation_batch(rows)
    finally:
        trainer.close_producer()


def test_future_rounds_are_read_once_in_order_and_a_resumed_run_skips_without_tokenizing(tmp_path, monkeypatch):
    """The prompts the producer gets ahead of time: the train sampler's rounds in order; asking for round 3 first (a
    resumed run) reads past rounds 0-2 without tokenizing them, and nothing is kept per round (it grew every step)."""
    from tests.test_loss_extensions import make_trainer

    trainer = make_trainer(tmp_path, **{"model.warm_start.steps": 0})

    def fresh():
        trainer._round_iter, trainer._rounds_read = None, 0

    fresh()
    in_order = [trainer._future_round_prompt_ids(r) for r in range(5)]
    assert all(in_order) and in_order[0] != in_order[1]
    fresh()
    calls = []
    tokenize = trainer._tokenize_prompts
    monkeypatch.setattr(trainer, "_tokenize_prompts", lambda prompts: calls.append(len(prompts)) or tokenize(prompts))
    assert trainer._future_round_prompt_ids(3) == in_order[3]
    assert len(calls) == 1  # rounds 0-2 were skipped, not tokenized
    assert trainer._future_round_prompt_ids(2) is None  # already read: generated on demand instead
    assert trainer._future_round_prompt_ids(4) == in_order[4]
    assert not [k for k, v in vars(trainer).items() if k.startswith("_round") and isinstance(v, (list, dict))]


# What a run computes, step by step: everything in metrics.jsonl except wall-clock timings (async/*_s, step_time,
# streaming/reward_*_s, rewards/pool_seconds, throughput figures).
_COMPUTED = ("reward", "async/staleness", "async/dropped_stale", "sampling/", "loss", "grad_norm", "completions/",
             "entropy", "num_tokens", "frac_reward_zero_std")


def _computed(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k.startswith(_COMPUTED) and not k.endswith(("_s", "_seconds"))}
            for r in rows]


def test_a_slow_generator_and_a_slow_reward_worker_change_nothing_but_timing(tmp_path, monkeypatch):
    """#28: the same async config and seed twice, once with the generator sleeping before every round (the trainer
    then waits for every prefetched round, and weight pushes queue up behind requests) and one of the two reward
    workers (the one holding the first shard) finishing every batch after the other (streamed scoring), once at full
    speed: the same rewards,
    staleness per step, importance-sampling statistics and final weights, byte for byte. Each round's policy version
    follows from prefetch_depth 2 and vllm_sync_interval 1 alone: round 0 generated now, rounds 1-2 submitted at step
    0 behind the first weights, round k >= 3 submitted at step k-2 behind the push of step k-2 (staleness 2)."""
    from grpo.training.async_producer import TEST_DELAY_ENV
    from tests import deterministic_rewards  # noqa: F401 - registers the rewards

    def run(name: str, slow: bool):
        slow_dir = tmp_path / f"slow-{name}"
        slow_dir.mkdir()
        with monkeypatch.context() as m:
            if slow:
                m.setenv(TEST_DELAY_ENV, "0.5")
                m.setenv("SLOW_REWARD_DIR", str(slow_dir))
            out, summary, rows = async_run(tmp_path, name, **{
                "async.prefetch_depth": 2, "async.vllm_sync_interval": 1, "async.max_staleness": 2,
                "async.vllm_importance_sampling_correction": "true", "grpo.max_steps": 6,
                "grpo.reward_funcs": "[completion_length_slow_worker]", "async.reward_num_workers": 2,
                "async.streaming_partial_batch": "true", "async.streaming_min_groups": 2})
        assert summary["steps"] == 6
        return out, rows, sorted(p.name for p in slow_dir.iterdir())

    fast, fast_rows, none = run("fast", slow=False)
    slow, slow_rows, markers = run("slow", slow=True)
    assert none == []
    # the forced state: in every scored batch (2 chunks a step x 6 steps) the first shard's worker finished second
    assert sum(m.startswith("slow-done-") for m in markers) == 12, markers
    staleness = [r["async/staleness_max"] for r in fast_rows if "async/staleness_max" in r]
    assert staleness == [0, 1, 2, 2, 2, 2], staleness
    assert all(r["grad_norm"] > 0 for r in fast_rows if "grad_norm" in r)  # the policy moves: versions differ
    assert _computed(slow_rows) == _computed(fast_rows)
    weights = [(d.model_dir / "model.safetensors").read_bytes() for d in (fast, slow)]
    assert weights[0] == weights[1]
