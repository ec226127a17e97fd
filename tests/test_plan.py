"""Sampler plans: rows equal the SP sampler's stream for every rank, resume, summary numbers, errors, CLI.

Parity with TRL's RepeatSampler is tested on the sampler itself (tests/test_sampling.py); plan == sampler here makes
it hold for plans too, without importing trl (4 s) in this file."""

from __future__ import annotations

import hashlib
import itertools
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from unittest import mock

import numpy as np
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo.algo import plan
from grpo.algo.plan import PlanExistsError, PlanSampler, read_plan_indices
from grpo.algo.sampling import SequenceParallelRepeatRandomSampler
from grpo.config import load_config
from grpo.errors import ConfigError, DataError, GRPOPlatformError
from grpo.pipeline.plans import build_plan, plan_spec

BASE = load_config(None, [])


def make_cfg(sampling: dict | None = None, **grpo: object):
    """Bypasses ExperimentConfig's gate on world_size/SP/seqlen_balancing (not switched on in this version)."""
    return BASE.model_copy(
        update={
            "grpo": BASE.grpo.model_copy(update=grpo),
            "sampling": BASE.sampling.model_copy(update=sampling or {}),
        }
    )


def sampler_stream(n: int, spec: plan.PlanSpec, rank: int, length: int) -> list[int]:
    """What the trainer's sampler yields for ``rank`` over as many epochs as ``length`` indices need."""
    s = SequenceParallelRepeatRandomSampler(
        range(n),
        mini_repeat_count=spec.num_generations,
        world_size=spec.world_size,
        rank=rank,
        batch_size=spec.prompts_per_sp_group,
        repeat_count=spec.repeat_count,
        sequence_parallel_degree=spec.sequence_parallel_degree,
        shuffle=spec.shuffle,
        seed=spec.seed,
        drop_last=spec.drop_last,
    )
    out: list[int] = []
    for epoch in itertools.count():
        if len(out) >= length:
            return out[:length]
        s.set_epoch(epoch)
        out.extend(s)


@st.composite
def plan_cases(draw):
    gen, b = draw(st.integers(2, 4)), draw(st.integers(1, 3))
    spg = draw(st.sampled_from([d for d in range(1, b * gen + 1) if b * gen % d == 0 and d <= 4]))
    degree, groups = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    pdbs = b * gen // spg
    grpo = dict(
        num_generations=gen,
        per_device_train_batch_size=pdbs,
        gradient_accumulation_steps=draw(st.integers(1, 3)),
        num_iterations=draw(st.integers(1, 2)),
        max_steps=draw(st.integers(1, 12)),
        seed=draw(st.integers(0, 2**31)),
    )
    if draw(st.booleans()):
        grpo |= dict(generation_batch_size=pdbs * degree * groups * spg, steps_per_generation=None)
    else:
        grpo |= dict(steps_per_generation=spg)
    sampling = dict(
        world_size=degree * groups,
        sequence_parallel_degree=degree,
        shuffle=draw(st.booleans()),
        drop_last=draw(st.booleans()),
        seqlen_balancing=draw(st.booleans()),
    )
    n = draw(st.integers(1, 30))
    lengths = draw(st.lists(st.integers(0, 50), min_size=n, max_size=n))
    return make_cfg(sampling, **grpo), lengths, draw(st.integers(1, 40))


@settings(max_examples=40, deadline=None)
@given(plan_cases())
def test_plan_equals_sampler_for_every_rank_and_resumes_exactly(case):
    cfg, lengths, rows_per_group = case
    spec = plan_spec(cfg)
    n = len(lengths)
    with tempfile.TemporaryDirectory() as tmp, mock.patch.object(plan, "_ROWS_PER_ROW_GROUP", rows_per_group):
        if spec.drop_last and n < spec.prompts_per_round:
            with pytest.raises(ConfigError, match="sampling.drop_last"):
                build_plan(cfg, lengths, Path(tmp))
            with pytest.raises(ValueError):  # the sampler refuses the same config
                sampler_stream(n, spec, 0, 1)
            assert not any(Path(tmp).iterdir())
            return
        summary = build_plan(cfg, lengths, Path(tmp))
        path = Path(summary.plan_path)
        per_round = spec.prompts_per_sp_group * spec.num_generations * spec.repeat_count
        length = summary.generation_rounds * per_round
        for rank in range(spec.world_size):
            group = rank // spec.sequence_parallel_degree
            got = list(read_plan_indices(path, group))
            assert got == sampler_stream(n, spec, rank, length)
            sampler = PlanSampler(path, rank, spec.sequence_parallel_degree)
            assert len(sampler) == length and list(sampler) == got
            for k in {0, 1, summary.generation_rounds // 2, summary.generation_rounds}:
                if k <= summary.generation_rounds:
                    assert list(read_plan_indices(path, group, start_round=k)) == got[k * per_round :]
                    assert (len(PlanSampler(path, rank, spec.sequence_parallel_degree, start_round=k))
                            == length - k * per_round)
        table = pq.read_table(path)
        assert table.num_rows == summary.rows == summary.generation_rounds * summary.prompts_per_round
        assert table.schema.remove_metadata() == plan.SCHEMA
        cols = {name: table.column(name).to_numpy() for name in table.column_names}
        assert (cols["prompt_tokens"] == np.asarray(lengths)[cols["prompt_index"]]).all()
        assert (cols["micro_step_start"] == cols["round"] * spec.micro_steps_per_round).all()
        assert (cols["optimizer_step_start"] == cols["micro_step_start"] // spec.gradient_accumulation_steps).all()
        assert (cols["epoch"] == cols["round"] // summary.rounds_per_epoch).all()
        assert (cols["rank_end"] - cols["rank_start"] == spec.sequence_parallel_degree - 1).all()
        assert (cols["rank_start"] == cols["sp_group"] * spec.sequence_parallel_degree).all()
        assert (cols["reuse"] == spec.num_iterations).all() and (cols["num_generations"] == spec.num_generations).all()
        assert cols["optimizer_step_start"].max() < spec.max_steps


def test_summary_numbers_are_consistent(tmp_path):
    rng = np.random.default_rng(0)
    lengths = np.maximum(1, rng.lognormal(4, 1, 1000)).astype(np.int64)
    cfg = make_cfg({"world_size": 8, "sequence_parallel_degree": 2, "seqlen_balancing": True},
                   num_generations=4, per_device_train_batch_size=8, gradient_accumulation_steps=2, max_steps=100)
    s = build_plan(cfg, lengths, tmp_path)
    on_disk = json.loads((tmp_path / plan.SUMMARY_FILE).read_text())
    assert on_disk == json.loads(json.dumps(s.to_dict()))
    # B = 8 * 2 / 4 = 4 prompts per SP group, 4 SP groups -> 16 prompts a round, a round serves 2 micro-steps = 1 step.
    assert (s.prompts_per_round, s.generation_rounds, s.micro_steps) == (16, 100, 200)
    assert s.rounds_per_epoch == 63 and s.epochs == 2 and s.prompts_per_epoch == 63 * 16
    index = pq.read_table(s.plan_path, columns=["prompt_index"]).column("prompt_index").to_numpy()
    assert s.rows == index.size == 1600 and s.completions_total == 1600 * 4
    assert s.prompt_index_sha256 == hashlib.sha256(index.astype("<i8").tobytes()).hexdigest()
    assert s.unique_prompts_used == len(set(index.tolist())) == 1000
    per_rank = s.expected_prompt_tokens_per_rank
    assert per_rank["total_mean"] == pytest.approx(lengths[index].sum() * 4 / 8)
    assert per_rank["per_round_mean"] == pytest.approx(per_rank["total_mean"] / 100)
    imb = s.predicted_imbalance
    assert imb["plan_order"]["max_max_over_mean"] >= imb["plan_order"]["mean_max_over_mean"] > 1.0
    bal = imb["seqlen_balanced"]
    assert bal["rounds_sampled"] == 100
    assert 1.0 <= bal["mean_max_over_mean"] < bal["plan_order_mean_max_over_mean_same_rounds"]


@pytest.mark.parametrize(
    "sampling, grpo, lengths, error, fragments",
    [
        ({}, dict(per_device_train_batch_size=6, num_generations=4), [3] * 50, ConfigError,
         ["grpo.per_device_train_batch_size", "steps_per_generation", "grpo.num_generations (4)",
          "valid num_generations: [2, 3, 6]", "a multiple of 4"]),
        ({"world_size": 2}, dict(per_device_train_batch_size=4, num_generations=8), [3] * 50, ConfigError,
         ["4 x 1 = 4 completions per rank", "valid num_generations: [2, 4]"]),
        ({"drop_last": True}, dict(per_device_train_batch_size=256), [3] * 10, ConfigError,
         ["sampling.drop_last", "10 prompts", "one generation round of 32 prompts",
          "grpo.per_device_train_batch_size <= 80"]),
        ({}, {}, [], DataError, ["empty"]),
        ({}, dict(max_steps=0), [3] * 50, ConfigError, ["grpo.max_steps", ">= 1"]),
        ({}, {}, [1.5, 2.0], DataError, ["prompt_lengths", "integer"]),
        ({}, {}, [3, -1], DataError, ["prompt_lengths", "-1 at index 1"]),
        ({"world_size": 4, "sequence_parallel_degree": 3}, {}, [3] * 50, ConfigError,
         ["sampling.sequence_parallel_degree", "valid degrees: [1, 2, 4]"]),
    ],
)
def test_errors_name_fields_and_write_nothing(tmp_path, sampling, grpo, lengths, error, fragments):
    with pytest.raises(error) as info:
        build_plan(make_cfg(sampling, **grpo), lengths, tmp_path / "plan")
    assert isinstance(info.value, (ValueError, GRPOPlatformError))
    for fragment in fragments:
        assert fragment in str(info.value)
    assert not (tmp_path / "plan").exists()


def test_existing_plan_needs_overwrite_and_readers_validate(tmp_path):
    cfg = make_cfg(max_steps=3)
    first = build_plan(cfg, [5] * 40, tmp_path)
    with pytest.raises(PlanExistsError, match="overwrite"):
        build_plan(cfg, [5] * 40, tmp_path)
    assert build_plan(cfg, [5] * 40, tmp_path, overwrite=True).prompt_index_sha256 == first.prompt_index_sha256
    with pytest.raises(ValueError, match=r"sp_group must be an integer in \[0, 1\)"):
        read_plan_indices(first.plan_path, 1)
    with pytest.raises(ValueError, match=r"start_round must be an integer in \[0, 3\]"):
        read_plan_indices(first.plan_path, 0, start_round=4)
    with pytest.raises(ValueError, match="sequence_parallel_degree=2 does not match"):
        PlanSampler(first.plan_path, 0, 2)
    with pytest.raises(DataError, match="not written by grpo.algo.plan"):
        pq.write_table(pq.read_table(first.plan_path).replace_schema_metadata(None), tmp_path / "other.parquet")
        read_plan_indices(tmp_path / "other.parquet", 0)


def grpo_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "grpo.app.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.integration
def test_cli_plan_end_to_end_then_refuses_to_overwrite(tmp_path):
    args = ["plan", "--config", "tiny",
            "--set", f"output_dir={tmp_path / 'runs'}", "--set", "data.num_train=300", "--set", "grpo.max_steps=20"]
    result = grpo_cli(*args, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "GRPO plan" in result.stdout and "generation rounds" in result.stdout
    summary = json.loads((tmp_path / "runs" / "plans" / "tiny" / "plan.json").read_text())
    assert summary["rows"] == 20 * 32 and summary["dataset_size"] == 300
    assert pq.read_metadata(tmp_path / "runs" / "plans" / "tiny" / "plan.parquet").num_rows == 640
    lengths = pq.read_table(summary["plan_path"] if Path(summary["plan_path"]).is_absolute()
                            else tmp_path / summary["plan_path"], columns=["prompt_tokens"])
    assert lengths.column("prompt_tokens").to_numpy().min() >= 1  # len(prompt) for the tiny char model
    again = grpo_cli(*args, cwd=tmp_path)
    assert again.returncode == 2
    assert again.stderr.strip().splitlines() == [again.stderr.strip()] and "plan exists" in again.stderr


def test_cli_plan_bad_input_is_one_line_exit_2(tmp_path):
    tiny = "tiny"
    result = grpo_cli("plan", "--config", tiny, "--set", f"output_dir={tmp_path / 'runs'}",
                      "--set", "sampling.drop_last=true", "--set", "data.num_train=3", cwd=tmp_path)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: sampling.drop_last: the training split has 3 prompts")
    assert "Traceback" not in result.stderr + result.stdout
    assert not (tmp_path / "runs").exists()


def test_the_plan_line_counts_in_words():
    from grpo.pipeline.stages import plan_summary

    line = {"optimizer_steps": 4, "generation_rounds": 4, "prompts_per_round": 4, "epochs": 1}
    assert plan_summary(line) == "plan: 4 optimizer steps in 4 generation rounds of 4 prompts (1 epoch)"
    line.update(optimizer_steps=1, generation_rounds=1, prompts_per_round=1, epochs=2)
    assert plan_summary(line) == "plan: 1 optimizer step in 1 generation round of 1 prompt (2 epochs)"
