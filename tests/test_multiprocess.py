"""Real multi-process GRPO on CPU (torchrun, gloo): every rank trains on its own prompts, whole groups per rank."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest

from tests.conftest import MICRO, micro_overrides, recorded_calls, write_prompt_recorder
from tests.servers import free_port

pytestmark = pytest.mark.integration  # trains a model, starts servers or processes: not in `make test-fast`

# Loaded into every rank with a second --reward-module: a TrainerCallback (added to each trainer as it is built) that
# writes this rank's parameter digest at the start and at the end of training to $PARAM_LOG. Observes, changes nothing.
PARAM_DIGEST = """
import hashlib, json, os
import transformers
from transformers import TrainerCallback

def digest(model):
    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        h.update(name.encode())
        h.update(p.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()

class ParamDigest(TrainerCallback):
    def _write(self, when, model):
        with open(os.environ["PARAM_LOG"], "a") as f:
            f.write(json.dumps({"rank": int(os.environ.get("RANK", 0)), "when": when, "digest": digest(model)}) + "\\n")

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self._write("begin", model)

    def on_train_end(self, args, state, control, model=None, **kwargs):
        self._write("end", model)

_init = transformers.Trainer.__init__

def _init_with_digest(self, *args, **kwargs):
    _init(self, *args, **kwargs)
    self.add_callback(ParamDigest())

transformers.Trainer.__init__ = _init_with_digest
"""


def rank_param_digests(log) -> dict[str, dict[int, str]]:
    out: dict[str, dict[int, str]] = defaultdict(dict)
    for row in recorded_calls(log):
        out[row["when"]][row["rank"]] = row["digest"]
    return out


@pytest.mark.parametrize("nproc", [3])  # 3: an odd world size; 2 ranks: test_torchrun_resume_after_a_crash_...
def test_torchrun_ranks_train_on_disjoint_prompts(tmp_path, nproc):
    """Each rank scores its own whole groups, and DDP keeps the ranks one model: every rank's final parameters are
    bitwise equal, and differ from the (equal) initial ones. Ranks training without gradient sync would diverge."""
    module = write_prompt_recorder(tmp_path)
    digest_module = tmp_path / "param_digest.py"
    digest_module.write_text(PARAM_DIGEST)
    digests = tmp_path / "digests.jsonl"
    log = tmp_path / "prompts.jsonl"
    steps = 4
    overrides = micro_overrides(tmp_path, **{
        "sampling.world_size": nproc, "grpo.max_steps": steps, "grpo.per_device_train_batch_size": 8,
        "grpo.num_generations": 4, "grpo.save_steps": 100,
        # digits_format: a reward with spread inside groups, so the policy gradient is not zero (the micro policy's
        # exact-match reward is 0 everywhere in 4 steps, and zero advantages would leave the weights unchanged)
        "grpo.reward_funcs": "[exact_match_recorded,digits_format]",
        "evaluation.num_prompts": 16, "evaluation.pass_k": 0,
    })
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--master_port", str(free_port()),
           "-m", "grpo.app.cli", "run", "--config", str(MICRO), "--run-name", "ddp", "--reward-module", str(module),
           "--reward-module", str(digest_module)]
    for item in overrides:
        cmd += ["--set", item]
    env = {**os.environ, "PROMPT_LOG": str(log), "PARAM_LOG": str(digests), "OMP_NUM_THREADS": "1"}
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
    # rank 0 alone reports: each of the run's lines once, however many ranks print
    reported = [line.split(":")[0] for line in result.stdout.splitlines()
                if line.startswith(("run:", "train:", "model:", "summary:"))]
    assert reported == ["run", "train", "model", "summary"], result.stdout
    # a forward reaches every parameter: DDP runs without its unused-parameter search and the warning it prints
    assert "find_unused_parameters=True was specified" not in result.stderr, result.stderr[-3000:]

    # one model across ranks: equal before, equal after, and training changed it
    params = rank_param_digests(digests)
    assert sorted(params["begin"]) == sorted(params["end"]) == list(range(nproc)), params
    assert len(set(params["begin"].values())) == 1, f"ranks started from different weights: {params['begin']}"
    assert len(set(params["end"].values())) == 1, f"ranks ended with different weights (no gradient sync?): {params}"
    assert params["end"][0] != params["begin"][0], "training did not change the parameters"


# Loaded into every rank of the first launch: rank 0 SIGKILLs itself at the end of optimizer step $KILL_AT_STEP, after
# the checkpoint of an earlier step was written (a crash); torchrun then stops the other rank and fails.
KILL_AT_STEP = """
import os, signal
import transformers
from transformers import TrainerCallback

class KillAtStep(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == int(os.environ["KILL_AT_STEP"]) and int(os.environ.get("RANK", 0)) == 0:
            os.kill(os.getpid(), signal.SIGKILL)

_init = transformers.Trainer.__init__

def _init_with_kill(self, *args, **kwargs):
    _init(self, *args, **kwargs)
    self.add_callback(KillAtStep())

transformers.Trainer.__init__ = _init_with_kill
"""


def test_torchrun_resume_after_a_crash_continues_every_rank_from_the_checkpoint(tmp_path):
    """A 2-rank run killed at step 3 (checkpoint at step 2) and relaunched with ``--resume``: every rank starts from
    the checkpoint's weights, scores exactly the prompts the crashed step 3 scored (the plan's next rounds), the ranks
    stay one model, and metrics.jsonl has each step once."""
    from transformers import AutoModelForCausalLM

    recorder = write_prompt_recorder(tmp_path)
    (tmp_path / "param_digest.py").write_text(PARAM_DIGEST)
    (tmp_path / "kill_at_step.py").write_text(KILL_AT_STEP)
    overrides = micro_overrides(tmp_path, **{
        "sampling.world_size": 2, "grpo.max_steps": 4, "grpo.per_device_train_batch_size": 8,
        "grpo.num_generations": 4, "grpo.save_steps": 2, "grpo.logging_steps": 1,
        "grpo.reward_funcs": "[exact_match_recorded,digits_format]", "evaluation.enabled": "false",
    })

    def launch(name: str, *extra: str, kill: bool) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
               "--master_port", str(free_port()),
               "-m", "grpo.app.cli", "run", "--config", str(MICRO), "--run-name", "crash", *extra,
               "--reward-module", str(recorder), "--reward-module", str(tmp_path / "param_digest.py")]
        if kill:
            cmd += ["--reward-module", str(tmp_path / "kill_at_step.py")]
        for item in overrides:
            cmd += ["--set", item]
        env = {**os.environ, "PROMPT_LOG": str(tmp_path / f"{name}-prompts.jsonl"), "OMP_NUM_THREADS": "1",
               "PARAM_LOG": str(tmp_path / f"{name}-digests.jsonl"), "KILL_AT_STEP": "3"}
        return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)

    crashed = launch("crashed", kill=True)
    run_dir = tmp_path / "crash"
    assert crashed.returncode != 0 and "exitcode  : -9" in crashed.stderr, crashed.stderr[-3000:]
    assert (run_dir / "checkpoints" / "checkpoint-2").is_dir() and not (run_dir / "summary.json").exists()

    resumed = launch("resumed", "--resume", kill=False)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["resumed_from"].endswith("checkpoint-2"), summary
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r["metrics"]] == [1, 2, 3, 4], rows

    # Every rank resumed from checkpoint-2's weights, and the ranks ended as one model.
    checkpoint = AutoModelForCausalLM.from_pretrained(run_dir / "checkpoints" / "checkpoint-2")
    namespace: dict = {}
    exec(PARAM_DIGEST.split("class ParamDigest")[0], namespace)
    params = rank_param_digests(tmp_path / "resumed-digests.jsonl")
    assert params["begin"] == {0: namespace["digest"](checkpoint), 1: namespace["digest"](checkpoint)}, params
    assert params["end"][0] == params["end"][1] != params["begin"][0], params

    # The resumed step 3 scores exactly the prompts the crashed step 3 scored, on each rank.
    before, after = defaultdict(list), defaultdict(list)
    for row in recorded_calls(tmp_path / "crashed-prompts.jsonl"):
        before[row["rank"]].append(row["prompts"])
    for row in recorded_calls(tmp_path / "resumed-prompts.jsonl"):
        after[row["rank"]].append(row["prompts"])
    for rank in (0, 1):
        assert len(after[rank]) == 2 and after[rank][0] == before[rank][2], (rank, before[rank], after[rank])
    # Steps 1-4 (crashed launch, then resumed): each rank scored its own 2 whole groups of 4, no prompt on both ranks.
    for step in (before[0][0], before[1][0]), (before[0][1], before[1][1]), (after[0][0], after[1][0]), \
            (after[0][1], after[1][1]):
        for prompts in step:
            assert len(prompts) == 8 and all(prompts[i] == prompts[i - i % 4] for i in range(8)), prompts
        assert not set(step[0]) & set(step[1]), step


def test_world_size_must_match_launch(tmp_path):
    """A config for 2 ranks launched as 1 process is refused with a clear message before any stage runs (no run
    directory, no data prepared, no Prefect server started)."""
    cmd = [sys.executable, "-m", "grpo.app.cli", "run", "--config", str(MICRO), "--run-name", "mismatch"]
    for item in micro_overrides(tmp_path, **{"sampling.world_size": 2, "evaluation.enabled": "false"}):
        cmd += ["--set", item]
    result = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert "sampling.world_size is 2 but 1 process(es) were launched" in result.stderr
    assert not (tmp_path / "mismatch").exists() and "prep:" not in result.stdout, result.stdout


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
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           "-m", "grpo.app.cli", "run", "--config", str(MICRO), "--run-name", "balanced"]
    for item in overrides:
        cmd += ["--set", item]
    result = subprocess.run(cmd, cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line)["metrics"] for line in (tmp_path / "balanced" / "metrics.jsonl").read_text().splitlines()]
    # The skip option is wired (the metric is logged 0 or 1 per micro-batch); that the ranks agree on every skip shows
    # only as the run finishing (a rank skipping alone would hang DDP). The exchange itself (rows kept, whole groups,
    # values unchanged) is checked by test_torchrun_rebalance_groups_moves_whole_groups_and_loses_no_row.
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
    assert {"train/balance/imbalance", "train/balance/max_tokens", "train/aux/skipped_zero_adv_batches",
            "train/reward"} <= set(run.data.metrics), sorted(run.data.metrics)
    assert run.data.params["sampling.world_size"] == "2" and {"prep.rows_in", "plan.generation_rounds"} <= set(
        run.data.params)
    history = MlflowClient(mlflow_server.uri).get_metric_history(run.info.run_id, "train/balance/imbalance")
    logged = [json.loads(line) for line in (tmp_path / "balanced" / "metrics.jsonl").read_text().splitlines()]
    assert [m.step for m in history] == [row["step"] for row in logged if "balance/imbalance" in row["metrics"]]


REBALANCE_SCRIPT = """
import json, sys
import torch
import torch.distributed as dist
from grpo.algo.group_balancing import rebalance_groups

G = 4
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
# Rank 0 drew 3 groups of long completions, rank 1 3 groups of short ones, with different pad widths (prompts
# left-padded, completions right-padded): balancing has to move groups and re-pad them.
gen = torch.Generator().manual_seed(rank)
groups = 3
n = groups * G
comp_width, prompt_width = (9, 4) if rank == 0 else (5, 6)
comp_len = torch.randint(6 if rank == 0 else 1, comp_width + 1, (n,), generator=gen)
prompt_len = torch.randint(2, prompt_width + 1, (groups,), generator=gen).repeat_interleave(G)
row_id = torch.arange(n) + 1000 * rank
completion_mask = (torch.arange(comp_width)[None] < comp_len[:, None]).long()
prompt_mask = (torch.arange(prompt_width)[None] >= prompt_width - prompt_len[:, None]).long()
batch = {
    "row_id": row_id,
    "prompt_ids": (row_id[:, None] * 100 + torch.arange(prompt_width)[None]) * prompt_mask,
    "prompt_mask": prompt_mask,
    "completion_ids": (row_id[:, None] * 100 + 50 + torch.arange(comp_width)[None]) * completion_mask,
    "completion_mask": completion_mask,
    "advantages": torch.randn(n, generator=gen),
    "old_per_token_logps": -torch.rand(n, comp_width, generator=gen) * completion_mask,
    "num_items_in_batch": torch.tensor(123.0),
}
out, metrics = rebalance_groups(batch, G, rank, world, pad_token_id=0)

def rows(b):
    res = []
    for i in range(b["completion_ids"].shape[0]):
        pm, cm = b["prompt_mask"][i].bool(), b["completion_mask"][i].bool()
        res.append({"row_id": int(b["row_id"][i]), "prompt": b["prompt_ids"][i][pm].tolist(),
                    "completion": b["completion_ids"][i][cm].tolist(), "advantage": float(b["advantages"][i]),
                    "logps": b["old_per_token_logps"][i][cm].tolist()})
    return res

gathered = [None] * world
# sampling.balance_quadratic_coef reaching the trainer's rebalancing: GRPOTrainer's own _rebalance (the
# SeqlenBalancing mixin, on a minimal host: a real trainer needs a model) with the experiment config loaded from YAML.
# Rank 0: 3 groups of length-8 completions; rank 1: two groups [1, 1, 1, 21] and one [2, 2, 2, 2]. By tokens the
# best split exchanges groups; by a*L + L^2 per sequence (coef 1) the split before the exchange is already best.
from types import SimpleNamespace
from grpo.config import load_config
from grpo.training.seqlen_balancing import SeqlenBalancing

class Host(SeqlenBalancing):
    def __init__(self, cfg):
        self.experiment, self.num_generations, self.metrics = cfg, G, {}
        self.accelerator = SimpleNamespace(process_index=rank, num_processes=world)
        self.processing_class = SimpleNamespace(pad_token_id=0)

    def _record(self, name, value):
        self.metrics[name] = value

lens = torch.tensor([8] * 12 if rank == 0 else [1, 1, 1, 21, 1, 1, 1, 21, 2, 2, 2, 2])
ids = torch.arange(12) + 1000 * rank
cmask = (torch.arange(21)[None] < lens[:, None]).long()
lb = {"row_id": ids, "prompt_ids": torch.ones(12, 2, dtype=torch.long),
      "prompt_mask": torch.ones(12, 2, dtype=torch.long),
      "completion_ids": cmask, "completion_mask": cmask, "advantages": torch.zeros(12)}
by_coef = {}
for coef in (None, 1.0):
    sets = [f"sampling.world_size={world}", "sampling.seqlen_balancing=true"]
    cfg = load_config(sys.argv[2], sets + ([f"sampling.balance_quadratic_coef={coef}"] if coef is not None else []))
    assert cfg.sampling.balance_quadratic_coef == coef
    host = Host(cfg)
    assert host._balancing
    by_coef[str(coef)] = host._rebalance(dict(lb))["row_id"].tolist()

# Per-call samples (grpo.training.call_samples) on the same host: rank 0's episodes have 4 earlier samples, one in a
# group replay replaced (left out), rank 1's one; each rank appends 3 rows (rank 1 two zero-weight fillers), the loss
# tokens of every rank's rows are counted, the micro-batches are as large on both ranks, and balancing exchanges the
# episodes' groups while the appended rows stay on their rank.
from grpo.algo.group_balancing import BALANCED_ROWS
from grpo.environments.episodes import Sample
from grpo.training.call_samples import CallSamples, split_rows

def gather(t):
    out = [torch.zeros_like(t) for _ in range(world)]
    dist.all_gather(out, t)
    return torch.cat(out)

def reduce(t, reduction):
    t = t.clone()
    dist.all_reduce(t)
    return t

class SampleHost(CallSamples, Host):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.accelerator = SimpleNamespace(process_index=rank, num_processes=world, gather=gather, reduce=reduce)
        self._tokenizer = self.processing_class

host = SampleHost(cfg)
host._episode_samples = [[] for _ in range(12)]
if rank == 0:
    host._episode_samples[0] = [Sample([7, 7], [5, 6, 7], [1, 0, 1], [-0.1, 0.0, -0.3])]
    host._episode_samples[5] = [Sample([8], [9, 9], [1, 1], [-0.2, -0.2]), Sample([8, 8, 8], [4], [1], [-0.5])]
    host._episode_samples[9] = [Sample([6], [6], [1], [-0.6])]
else:
    host._episode_samples[11] = [Sample([3], [2, 2, 2, 2], [1, 1, 0, 0], [-1.0, -1.0, 0.0, 0.0])]
episodes = {k: v for k, v in lb.items() if k != "row_id"}
episodes.update(advantages=torch.arange(12.0) + 100 * rank, tool_mask=torch.ones_like(cmask),
                num_items_in_batch=torch.tensor(0.0))
appended = host._append_call_samples(episodes, [slice(8, 12)] if rank == 0 else [])

def appended_rows(b):
    out = []
    for i in range(12, b["completion_ids"].shape[0]):
        size = int(b["completion_mask"][i].sum())
        out.append({"prompt": b["prompt_ids"][i][b["prompt_mask"][i].bool()].tolist(),
                    "completion": b["completion_ids"][i][:size].tolist(), "tokens": size,
                    "tool_mask": b["tool_mask"][i][:size].tolist(), "advantage": float(b["advantages"][i])})
    return out

extra = appended_rows(appended)
balanced = host._rebalance(appended)
samples = {"rows": int(appended["completion_ids"].shape[0]), "appended": host._call_sample_rows, "extra": extra,
           "normaliser": float(appended["num_items_in_batch"]),
           "micro": [part[BALANCED_ROWS] for part in split_rows(appended, 2)],
           "balanced_rows": int(balanced["completion_ids"].shape[0]),
           "tail_kept": appended_rows(balanced) == extra}

gathered = [None] * world
dist.all_gather_object(gathered, {"before": rows(batch), "after": rows(out), "metrics": metrics,
                                  "normaliser": float(out["num_items_in_batch"]), "by_coef": by_coef,
                                  "samples": samples})
if rank == 0:
    json.dump(gathered, open(sys.argv[1], "w"))
dist.destroy_process_group()
"""


def test_torchrun_rebalance_groups_moves_whole_groups_and_loses_no_row(tmp_path):
    """``rebalance_groups`` over 2 real ranks (gloo): the rows after the exchange are exactly the rows before it, each
    on exactly one rank, whole groups together, every row's tokens, advantage and log-probs unchanged (re-padding
    included), groups per rank equal, and the heavier rank lighter than before."""
    script = tmp_path / "rebalance.py"
    script.write_text(REBALANCE_SCRIPT)
    out = tmp_path / "rebalance.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           str(script), str(out), str(MICRO)]
    result = subprocess.run(cmd, cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    ranks = json.loads(out.read_text())
    # sampling.balance_quadratic_coef changes the trainer's assignment: by tokens (unset) rank 0 swaps a length-8
    # group for rank 1's short [2, 2, 2, 2] group; with coef 1 (the long tails dominate) every group stays put.
    assert ranks[0]["by_coef"]["None"] == [*range(0, 4), *range(8, 12), *range(1008, 1012)], ranks[0]["by_coef"]
    assert ranks[1]["by_coef"]["None"] == [*range(4, 8), *range(1000, 1008)], ranks[1]["by_coef"]
    assert [rank["by_coef"]["1.0"] for rank in ranks] == [list(range(12)), list(range(1000, 1012))]
    before = {r["row_id"]: r for rank in ranks for r in rank["before"]}
    after = [r for rank in ranks for r in rank["after"]]
    assert sorted(r["row_id"] for r in after) == sorted(before)  # every row once, none lost, none duplicated
    for r in after:
        assert r == before[r["row_id"]], r["row_id"]  # tokens, advantage and log-probs travel with their row
    for rank in ranks:
        ids = [r["row_id"] for r in rank["after"]]
        assert len(ids) == 12  # 3 groups each: equal counts
        for start in range(0, len(ids), 4):  # whole groups, kept in order
            group = ids[start:start + 4]
            assert group[0] % 4 == 0 and group == list(range(group[0], group[0] + 4)), ids
        assert rank["normaliser"] == 123.0  # batch-level values are not per-sample: untouched
    moved = {r["row_id"] // 1000 for r in ranks[0]["after"]}
    assert moved == {0, 1}, "balancing long groups against short ones must exchange groups"
    metrics = ranks[0]["metrics"]
    assert metrics == ranks[1]["metrics"]
    assert metrics["balance/imbalance"] < metrics["balance/imbalance_unbalanced"]

    # per-call samples: 3 rows appended on each rank (rank 1: its one sample and two fillers, no loss token), the
    # replaced group's sample left out; one loss-token count over both ranks; micro-batches as large on both ranks
    one, two = (rank["samples"] for rank in ranks)
    assert one["extra"] == [
        {"prompt": [7, 7], "completion": [5, 6, 7], "tokens": 3, "tool_mask": [1, 0, 1], "advantage": 0.0},
        {"prompt": [8], "completion": [9, 9], "tokens": 2, "tool_mask": [1, 1], "advantage": 5.0},
        {"prompt": [8, 8, 8], "completion": [4], "tokens": 1, "tool_mask": [1], "advantage": 5.0}]
    assert two["extra"][0] == {"prompt": [3], "completion": [2, 2, 2, 2], "tokens": 4, "tool_mask": [1, 1, 0, 0],
                               "advantage": 111.0}
    assert [(e["tokens"], e["advantage"]) for e in two["extra"][1:]] == [(0, 0.0), (0, 0.0)]
    lengths = 12 * 8 + 2 * (1 + 1 + 1 + 21) + 4 * 2  # the episodes' rows
    for rank in (one, two):
        assert (rank["rows"], rank["appended"], rank["micro"]) == (15, 3, [8, 7])
        assert rank["normaliser"] == lengths + (2 + 2 + 1) + 2  # the extra rows' sampled tokens, not the fillers'
        assert rank["balanced_rows"] == 15 and rank["tail_kept"]


DECIDE_SCRIPT = """
import json, os, sys
import torch.distributed as dist
from grpo import distributed
from grpo.errors import ConfigError

dist.init_process_group("gloo")
rank = dist.get_rank()
calls = []

def decide(value):
    calls.append(value)
    return value

def refuse():
    calls.append("refuse")
    raise ConfigError("run directory exists")

def crash():
    calls.append("crash")
    raise KeyError("bug")

out = {"ok": distributed.decide_on_main(lambda: decide(f"from rank {rank}"))}
for name, fn in (("refused", refuse), ("crashed", crash)):
    try:
        distributed.decide_on_main(fn)
        out[name] = None
    except Exception as err:
        out[name] = [type(err).__name__, str(err)]
out["calls"] = calls
with open(sys.argv[1] + f".{rank}", "w") as f:
    json.dump(out, f)
dist.destroy_process_group()
"""


def test_torchrun_decide_on_main_gives_rank_0_result_and_errors_to_every_rank(tmp_path):
    """Under torchrun: only rank 0 runs the decision; every rank gets its value, the same user-input error, and for
    an unexpected error rank 0 re-raises it while the others stop with a RuntimeError naming it (no rank waits)."""
    script = tmp_path / "decide.py"
    script.write_text(DECIDE_SCRIPT)
    out = tmp_path / "decide.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           str(script), str(out)]
    result = subprocess.run(cmd, cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    r0, r1 = (json.loads(Path(f"{out}.{r}").read_text()) for r in (0, 1))
    assert r0["ok"] == r1["ok"] == "from rank 0"
    assert r0["refused"] == r1["refused"] == ["ConfigError", "run directory exists"]
    assert (r0["crashed"] == ["KeyError", "'bug'"]
            and r1["crashed"] == ["RuntimeError", "rank 0 failed: KeyError: 'bug'"])
    assert r0["calls"] == ["from rank 0", "refuse", "crash"] and r1["calls"] == []


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
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4", "--master_port", str(free_port()),
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
           "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{free_port()}", "--rdzv_id", "two-nodes",
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


# Loaded into every rank with --reward-module: at the end of step $HOLD_AT_STEP each rank writes
# $HOLD_DIR/holding-<rank> and waits for $HOLD_DIR/go, which lists the ranks the test has signalled; a listed rank then
# also waits until its handler has seen the signal. So the signal arrives inside that step, on every run, however fast
# the ranks are.
# (Added in Trainer.__init__, so it runs before the platform's StopAtStepEnd, added after construction.)
HOLD_AT_STEP = """
import os, time
from pathlib import Path
import transformers
from transformers import TrainerCallback

class HoldAtStep(TrainerCallback):
    def __init__(self, trainer):
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step != int(os.environ["HOLD_AT_STEP"]):
            return
        hold, rank = Path(os.environ["HOLD_DIR"]), int(os.environ.get("RANK", 0))
        (hold / f"holding-{rank}").touch()
        while not (hold / "go").exists():
            time.sleep(0.05)
        if str(rank) in (hold / "go").read_text().split():
            from grpo.training.graceful_stop import StopAtStepEnd

            stop = next(c for c in self.trainer.callback_handler.callbacks if isinstance(c, StopAtStepEnd))
            while stop.signum is None:
                time.sleep(0.05)

_init = transformers.Trainer.__init__

def _init_with_hold(self, *args, **kwargs):
    _init(self, *args, **kwargs)
    self.add_callback(HoldAtStep(self))

transformers.Trainer.__init__ = _init_with_hold
"""


# Loaded into every rank of _torchrun's launches. Besides the reward: an object that aborts the process (SIGABRT) if
# the interpreter's teardown frees it, which forces what a C++ thread meeting the teardown does (gloo's threads
# outlive the group once DDP wrapped the model): a rank must end without that teardown (grpo.distributed.exit_rank);
# and an exit hook recording whether the process group was destroyed by then.
LENGTH_REWARD = """
import atexit, os, sys
from pathlib import Path
from grpo.rewards import register_reward

class _AbortInTeardown:
    def __del__(self, abort=os.abort):  # bound now: the teardown may clear the os module first
        abort()

sys._abort_in_teardown = _AbortInTeardown()  # freed only by the teardown

@atexit.register
def _record_the_process_group_at_exit():  # runs after the CLI returned: is a torch.distributed group still alive?
    import torch.distributed as dist
    alive = dist.is_available() and dist.is_initialized()
    with Path(f"group-at-exit-rank{os.environ.get('RANK', '0')}.txt").open("a") as f:
        f.write("alive\\n" if alive else "destroyed\\n")

@register_reward("completion_length")
def completion_length(completions, **kwargs):
    return [float(len(c)) for c in completions]  # differs within groups: every step moves the policy
"""


def _torchrun(tmp_path: Path, name: str, *modules: str, resume: bool = False, env: dict | None = None
              ) -> tuple[subprocess.Popen, Path]:
    """``grpo run`` of the micro config (4 steps, no save_steps checkpoint) on 2 gloo ranks under torchrun, leader of
    its own process group; returns the process and its output file."""
    (tmp_path / "length_reward.py").write_text(LENGTH_REWARD)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           # the launcher's hard stop after it forwards a signal: far beyond a step and a save on a loaded machine
           "--shutdown_timeout", "600",
           "-m", "grpo.app.cli", "run", "--config", str(MICRO), "--run-name", name, *(["--resume"] if resume else []),
           "--reward-module", str(tmp_path / "length_reward.py"), *(a for m in modules for a in ("--reward-module", m))]
    for item in micro_overrides(tmp_path, **{
            "sampling.world_size": 2, "grpo.max_steps": 4, "grpo.per_device_train_batch_size": 8,
            "grpo.num_generations": 4, "grpo.save_steps": 100, "grpo.logging_steps": 1,
            "grpo.reward_funcs": "[completion_length]", "evaluation.enabled": "false"}):
        cmd += ["--set", item]
    out = tmp_path / f"{name}{'-resumed' if resume else ''}.out"
    with out.open("w") as log:
        proc = subprocess.Popen(cmd, cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, out


def _finish(proc: subprocess.Popen, out: Path, timeout: float = 900) -> tuple[int, str]:
    """Wait for the launch to end (killing its group past ``timeout``); its exit code and output."""
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return proc.returncode, out.read_text()


def _groups_at_exit(tmp_path: Path) -> dict[int, list[str]]:
    """Per rank, what LENGTH_REWARD's exit hook saw of the torch.distributed group at each launch's interpreter exit.
    A group left alive for interpreter exit can kill a rank that finished its run (gloo's threads meet Python's
    teardown: SIGABRT), so every launch must have destroyed it by then, finished or interrupted. A rank that torchrun
    stops with SIGTERM because the other one exited first (a failed or interrupted launch) records nothing."""
    records = {rank: tmp_path / f"group-at-exit-rank{rank}.txt" for rank in (0, 1)}
    return {rank: f.read_text().split() if f.exists() else [] for rank, f in records.items()}


def _failed_ranks(out: str) -> dict[int, int]:
    """torchrun's failure report: rank -> exit code of each rank that did not exit 0."""
    return {int(rank): int(code) for rank, code in
            re.findall(r"rank\s+: (\d+) \(local_rank: \d+\)\n\s+exitcode\s+: (-?\d+)", out)}


@pytest.fixture(scope="module")
def uninterrupted_2_rank_run(tmp_path_factory) -> bytes:
    """The final weights of the 4-step 2-rank run, never interrupted."""
    tmp_path = tmp_path_factory.mktemp("uninterrupted")
    code, out = _finish(*_torchrun(tmp_path, "whole"))
    assert code == 0, out[-3000:]
    assert _groups_at_exit(tmp_path) == {0: ["destroyed"], 1: ["destroyed"]}, out[-3000:]
    return (tmp_path / "whole" / "model" / "model.safetensors").read_bytes()


@pytest.mark.parametrize("to", ["rank 1", "the whole group"])
def test_torchrun_ranks_agree_on_the_interrupted_step_all_save_it_and_resume_exactly(tmp_path, to,
                                                                                      uninterrupted_2_rank_run):
    """#28: SIGINT to one rank (rank 1: rank 0, which writes the model, never sees it) or to the launcher's whole
    process group (Ctrl-C: each rank gets it from the terminal and again from torchrun) inside step 2 of 4. The ranks
    agree on step 2 (an all-reduce of the stop flag at the step end), both save checkpoint-2 (each its RNG state),
    the run ends interrupted on every rank, and ``--resume`` under torchrun ends with exactly the weights of the
    uninterrupted run. Before, a signal stopped a multi-process run at once, and the resume point was the last
    save_steps checkpoint (none here)."""
    import psutil

    (tmp_path / "hold.py").write_text(HOLD_AT_STEP)
    hold = tmp_path / "hold"
    hold.mkdir()
    proc, log = _torchrun(tmp_path, "stopped", str(tmp_path / "hold.py"),
                          env={"HOLD_AT_STEP": "2", "HOLD_DIR": str(hold)})
    deadline = time.monotonic() + 900
    while not ((hold / "holding-0").exists() and (hold / "holding-1").exists()):
        if proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"the ranks never reached step 2 (exit {proc.poll()}):\n{_finish(proc, log, 0)[1][-3000:]}")
        time.sleep(0.2)
    ranks = {int(p.environ().get("RANK", -1)): p for p in psutil.Process(proc.pid).children(recursive=True)
             if "grpo.app.cli" in " ".join(p.cmdline()) and "torch.distributed.run" not in " ".join(p.cmdline())}
    assert sorted(ranks) == [0, 1], ranks
    if to == "rank 1":
        ranks[1].send_signal(signal.SIGINT)
        signalled = "1"
    else:
        os.killpg(proc.pid, signal.SIGINT)
        signalled = "0 1"
    (hold / "go.tmp").write_text(signalled)
    (hold / "go.tmp").rename(hold / "go")
    code, out = _finish(proc, log)
    assert code != 0, out[-3000:]  # the run ended interrupted (every rank exits 130)
    run_dir = tmp_path / "stopped"
    assert out.count("saving a checkpoint at the end of this step") == len(signalled.split()), out[-3000:]
    assert "exitcode  : 130" in out or to == "the whole group", out[-3000:]
    steps = [r["step"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
             if "loss" in r["metrics"]]
    assert steps == [1, 2], steps
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").glob("checkpoint-*"))
    assert checkpoints == ["checkpoint-2"], checkpoints
    saved = run_dir / "checkpoints" / "checkpoint-2"
    assert (saved / "rng_state_0.pth").is_file() and (saved / "rng_state_1.pth").is_file()  # both ranks saved it
    assert not (run_dir / "summary.json").exists()

    code, out = _finish(*_torchrun(tmp_path, "stopped", resume=True))
    assert code == 0, out[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumed_from"].endswith("checkpoint-2"), summary
    steps = [r["step"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
             if "loss" in r["metrics"]]
    assert steps == [1, 2, 3, 4], steps
    assert (run_dir / "model" / "model.safetensors").read_bytes() == uninterrupted_2_rank_run
    # The interrupted launch and the resumed one: every rank that reached its interpreter exit had destroyed its
    # group. In the interrupted launch the first rank to exit always does; torchrun then sends the other SIGTERM,
    # which ends it without an exit hook when it arrives after training (which rank, and whether, is timing).
    groups = _groups_at_exit(tmp_path)
    assert all(g in (["destroyed"], ["destroyed"] * 2) for g in groups.values()), groups
    assert sum(map(len, groups.values())) >= 3, groups


def test_torchrun_refusal_reaches_every_rank_as_one_line_and_exits_2_with_its_group_destroyed(tmp_path):
    """``--resume`` of a run that does not exist, under torchrun: rank 0 decides and every rank gets the refusal.
    Each rank that exits on its own prints the one line (no traceback of ours), exits 2 and has destroyed its process
    group before its interpreter exit. The first rank out always does; torchrun then stops the other with SIGTERM if
    it is still running (which one is first is timing)."""
    code, out = _finish(*_torchrun(tmp_path, "never-ran", resume=True))
    assert code != 0, out[-3000:]
    failed = _failed_ranks(out)
    assert sorted(failed) == [0, 1] and set(failed.values()) <= {2, -15} and 2 in failed.values(), out[-3000:]
    refusal = f"error: --resume: no run to resume at {tmp_path / 'never-ran'} (no config.yaml there)"
    assert out.count(refusal) >= list(failed.values()).count(2), out[-3000:]
    assert "RunDirectoryError" not in out, out[-3000:]  # torchrun's own ChildFailedError traceback is its report
    groups = _groups_at_exit(tmp_path)
    for rank, exit_code in failed.items():
        if exit_code == 2:
            assert groups[rank] == ["destroyed"], groups
        else:  # SIGTERM from torchrun: it may have come before or after the exit hook
            assert groups[rank] in ([], ["destroyed"]), groups
