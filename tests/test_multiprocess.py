"""Real multi-process GRPO on CPU (torchrun, gloo): every rank trains on its own prompts, whole groups per rank."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import defaultdict

import pytest

from tests.conftest import MICRO, micro_overrides, recorded_calls, write_prompt_recorder

pytestmark = pytest.mark.integration  # trains a model, starts servers or processes: not in `make test-fast`

@pytest.mark.parametrize("nproc", [2, 4])
def test_torchrun_ranks_train_on_disjoint_prompts(tmp_path, nproc):
    module = write_prompt_recorder(tmp_path)
    log = tmp_path / "prompts.jsonl"
    steps = 4
    overrides = micro_overrides(tmp_path, **{
        "sampling.world_size": nproc, "grpo.max_steps": steps, "grpo.per_device_train_batch_size": 8,
        "grpo.num_generations": 4, "grpo.reward_funcs": "[exact_match_recorded]", "grpo.save_steps": 100,
        "evaluation.num_prompts": 16, "evaluation.pass_k": 0,
    })
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port", str(29530 + nproc),
           "-m", "grpo.app.cli", "run", "--config", str(MICRO), "--run-name", "ddp", "--reward-module", str(module)]
    for item in overrides:
        cmd += ["--set", item]
    env = {**os.environ, "PROMPT_LOG": str(log), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]

    calls = defaultdict(list)
    for row in recorded_calls(log):
        calls[row["rank"]].append(row["prompts"])
    assert sorted(calls) == list(range(nproc))
    assert all(len(c) == steps for c in calls.values())  # one generation round per optimizer step here
    for step in range(steps):
        per_rank = [calls[r][step] for r in range(nproc)]
        for prompts in per_rank:
            assert len(prompts) == 8
            # whole groups: each prompt 4 times in a row
            assert all(prompts[i] == prompts[i - i % 4] for i in range(8))
        sets = [set(p) for p in per_rank]
        assert not set.intersection(*sets), f"ranks share prompts at step {step}: {per_rank}"
    # and no rank trained on another rank's batch at any step
    for r in range(1, nproc):
        assert all(calls[0][s] != calls[r][s] for s in range(steps))

    summary = json.loads((tmp_path / "ddp" / "summary.json").read_text())
    assert summary["steps"] == steps and summary["eval_accuracy_after"] is not None


def test_world_size_must_match_launch(tmp_path):
    """A config for 2 ranks launched as 1 process is refused with a clear message before training."""
    cmd = [sys.executable, "-m", "grpo.app.cli", "run", "--config", str(MICRO), "--run-name", "mismatch"]
    for item in micro_overrides(tmp_path, **{"sampling.world_size": 2, "evaluation.enabled": "false"}):
        cmd += ["--set", item]
    result = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert "sampling.world_size is 2 but 1 process(es) were launched" in result.stderr


def test_torchrun_seqlen_balancing_exchanges_groups_and_logs_balance(tmp_path, mlflow_server):
    """Also: a multi-process run is tracked in MLflow by rank 0 (balance/* exists only with several ranks)."""
    from mlflow import MlflowClient

    overrides = micro_overrides(tmp_path, **{
        "tracking.backend": "mlflow", "tracking.tracking_uri": mlflow_server.uri,
        "tracking.experiment_name": "multiprocess", "tracking.log_system_metrics": "false",
        "sampling.world_size": 2, "sampling.seqlen_balancing": "true", "grpo.max_steps": 4,
        "grpo.per_device_train_batch_size": 8, "grpo.num_generations": 4, "grpo.steps_per_generation": 2,
        "grpo.logging_steps": 1, "grpo.save_steps": 100, "evaluation.enabled": "false",
        "async.skip_zero_advantage_batches": "true",
    })
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29534",
           "-m", "grpo.app.cli", "run", "--config", str(MICRO), "--run-name", "balanced"]
    for item in overrides:
        cmd += ["--set", item]
    result = subprocess.run(cmd, cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line)["metrics"] for line in (tmp_path / "balanced" / "metrics.jsonl").read_text().splitlines()]
    # ranks agreed on every zero-advantage skip (a rank skipping alone would hang DDP and the run would time out)
    assert any("skipped_zero_adv_batches" in r for r in rows)
    balanced = [r for r in rows if "balance/imbalance" in r]
    assert balanced, "no balance metrics logged"
    for r in balanced:
        assert r["balance/max_tokens"] >= r["balance/min_tokens"] > 0
        assert r["balance/imbalance"] <= r["balance/imbalance_unbalanced"] + 1e-9
        assert r["balance/imbalance"] >= 1.0

    summary = json.loads((tmp_path / "balanced" / "summary.json").read_text())
    run = MlflowClient(mlflow_server.uri).get_run(summary["mlflow_run_id"])
    assert run.info.status == "FINISHED" and run.data.tags["grpo.world_size"] == "2"
    assert {"balance/imbalance", "balance/max_tokens", "skipped_zero_adv_batches", "reward", "prep/rows_in",
            "plan/generation_rounds"} <= set(run.data.metrics), sorted(run.data.metrics)
    assert run.data.params["sampling.world_size"] == "2"
    history = MlflowClient(mlflow_server.uri).get_metric_history(run.info.run_id, "balance/imbalance")
    logged = [json.loads(line) for line in (tmp_path / "balanced" / "metrics.jsonl").read_text().splitlines()]
    assert [m.step for m in history] == [row["step"] for row in logged if "balance/imbalance" in row["metrics"]]


SP_SCRIPT = """
import json, sys
import torch.distributed as dist
from grpo.algo.sampling import SequenceParallelRepeatRandomSampler

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
out = {}
for epoch in (0, 1):
    s = SequenceParallelRepeatRandomSampler(range(50), mini_repeat_count=3, world_size=world, rank=rank, batch_size=2,
                                            repeat_count=2, sequence_parallel_degree=2, shuffle=True, seed=7)
    s.set_epoch(epoch)
    out[epoch] = list(s)
gathered = [None] * world
dist.all_gather_object(gathered, out)
if rank == 0:
    json.dump(gathered, open(sys.argv[1], "w"))
dist.destroy_process_group()
"""


def test_torchrun_sequence_parallel_sampler_layout(tmp_path):
    """4 real processes, SP degree 2: ranks of one SP group draw identical prompts, the two groups disjoint ones."""
    script = tmp_path / "sp.py"
    script.write_text(SP_SCRIPT)
    out = tmp_path / "indices.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4", "--master_port", "29541",
           str(script), str(out)]
    result = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    ranks = json.loads(out.read_text())
    for epoch in ("0", "1"):
        r = [ranks[i][epoch] for i in range(4)]
        assert r[0] == r[1] and r[2] == r[3]
        assert len(r[0]) == len(r[2]) > 0
        # within each step (chunk of 2 prompts x 3 repeats x 2 reuses = 12 indices) the SP groups are disjoint
        for start in range(0, len(r[0]), 12):
            assert not set(r[0][start:start + 12]) & set(r[2][start:start + 12])
    assert ranks[0]["0"] != ranks[0]["1"]  # set_epoch reshuffles


def test_two_nodes_c10d_rendezvous_with_the_toolkit(tmp_path):
    """The multi-node launch path of infra/README.md on two simulated nodes (``torchrun --nnodes 2``, c10d rendezvous
    on 127.0.0.1, one process per node), training with replay + zero-advantage skip + chunked backward + balancing +
    gradient accumulation 2: the combination of issue #10 that used to hang or desynchronise."""
    overrides = micro_overrides(tmp_path, **{
        "sampling.world_size": 2, "sampling.seqlen_balancing": "true", "grpo.max_steps": 3,
        "grpo.per_device_train_batch_size": 8, "grpo.num_generations": 4, "grpo.gradient_accumulation_steps": 2,
        "grpo.num_generations_chunks": 2, "async.replay_buffer_size": 4, "async.skip_zero_advantage_batches": "true",
        "grpo.save_steps": 100, "evaluation.enabled": "false",
    })
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
           "--rdzv_backend", "c10d", "--rdzv_endpoint", "127.0.0.1:29547", "--rdzv_id", "two-nodes",
           "-m", "grpo.app.cli", "run", "--config", str(MICRO), "--run-name", "two-nodes"]
    for item in overrides:
        cmd += ["--set", item]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    nodes = [subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for _ in range(2)]
    try:
        outputs = [node.communicate(timeout=600)[0] for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
    assert [node.returncode for node in nodes] == [0, 0], "\n---\n".join(o[-2000:] for o in outputs)
    summary = json.loads((tmp_path / "two-nodes" / "summary.json").read_text())
    assert summary["steps"] == 3
