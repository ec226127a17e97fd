"""Every benchmark runs in smoke mode, ``python -m benchmarks NAME --smoke``, so none can rot unnoticed.

One test per module in ``benchmarks/`` (from ``benchmarks.__main__.available()``): a new benchmark without a smoke mode,
or without a check below, fails here. The checks are on what a broken benchmark would get wrong (counts, equalities,
finite, positive ratios), never on timings: smoke sizes say nothing about performance, and a busy machine can
slow one variant of a ratio tenfold.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest

from benchmarks.__main__ import available

pytestmark = pytest.mark.integration  # trains a model, starts servers or processes: not in `make test-fast`


REPO = Path(__file__).resolve().parent.parent


def _finite(value, low: float = -math.inf, high: float = math.inf) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and low <= value <= high)


def _async_overlap(r: dict) -> None:
    assert r["steps"] == 8 and r["rounds"] == 1
    assert "addition_cot" not in r  # smoke: the default task only (BENCH_TASKS picks the generation-heavy one too)
    for task in ("addition",):
        t = r[task]
        assert _finite(t["ratio_steady_step_async_over_sync_1_thread"], 1e-6), t  # a ratio, not a bound on it
        for variant in ("sync", "async", "sync_1_thread"):
            assert _finite(t[f"{variant}_step_s"], 1e-4), (task, variant, t[f"{variant}_step_s"])
            assert _finite(t[f"{variant}_gain"], -1, 1), (task, variant, t[f"{variant}_gain"])  # after - before


def _balance(r: dict) -> None:
    assert r["quality_ours_never_worse_than_kk_or_greedy"] is True
    ours = r["quality_ours_equal_count_mean_max_over_mean"]
    assert _finite(ours, r["quality_equal_count_lower_bound_mean_max_over_mean"] - 1e-9, 1.03), ours
    assert r["spread_equal_ours_max_minus_min_tokens"] <= r["spread_equal_reference_kk_max_minus_min_tokens"]
    assert _finite(r["speed_free_speedup_vs_reference"], 1e-6)


def _chunked_backward(r: dict) -> None:
    assert _finite(r["max_relative_gradient_difference"], 0, 1e-4), r["max_relative_gradient_difference"]
    assert _finite(r["step_peak_mb_unchunked"], 0) and _finite(r["step_peak_mb_chunked"], 0)
    # smoke sizes are tiny: the chunked step may grow the RSS by nothing measurable (ratio 0.0)
    assert r["peak_ratio_chunked_over_unchunked"] is None or _finite(r["peak_ratio_chunked_over_unchunked"], 0.0)


def _cuda_trainer(r: dict) -> None:
    # smoke: the same code on the CPU in fp32, a 2-layer model, every variant in the benchmark's process
    assert (r["device"], r["dtype"], r["steps"], r["async_steps"], r["skip"]) == ("cpu", "float32", 2, 2, 0), r
    assert r["model"]["vocab_size"] == 512 and r["completions_per_step"] == 4
    assert set(r["variants"]) == {"trl", "ours", "ours_features_off", "trl_sparse", "ours_sparse", "env_sync",
                                  "ours_async", "env_async"}
    for name, v in r["variants"].items():
        assert v["error"] is None and v["steps_done"] == 2, (name, v)
        assert _finite(v["step_s"], 1e-6) and _finite(v["completion_tokens_per_s"], 1e-6), (name, v)
        assert v["peak_cuda_gib"] is None, (name, v)
    for name in ("trl", "ours", "ours_async"):
        assert 0 < r["variants"][name]["completion_mean_length"] <= r["completion_length"], r["variants"][name]
        assert r["variants"][name]["generated_over_kept"] is None  # single-turn: no episodes
    for name in ("env_sync", "env_async"):  # each turn stopped at its digit, EOS or its episode's budget
        assert 1.0 <= r["variants"][name]["generated_over_kept"] <= 1.05, r["variants"][name]
    for key in ("ratio_step_ours_over_trl", "ratio_step_ours_over_features_off", "ratio_step_features_off_over_trl",
                "ratio_step_sparse_ours_over_trl", "ratio_step_async_over_sync", "ratio_step_env_async_over_sync"):
        assert _finite(r[key], 1e-6), (key, r[key])


def _agent_concurrency(r: dict) -> None:
    assert r["agent_errors"] == 0 and r["agent_rewards"] == r["episodes"] == 8, r  # smoke: 8 agents, each finished
    assert r["episodes_match_text_protocol"] is True  # the agents' episodes are the tool environment's, token for token
    assert r["runner_turns"] == r["calls_per_agent"] == 3  # every agent's call of a turn sampled in one batch
    assert _finite(r["ratio_agent_round_over_turns_x_tool_plus_generation"], 1e-6)
    assert _finite(r["agent_generate_s"], 1e-6) and _finite(r["text_protocol_round_s"], 1e-6)


def _env_concurrency(r: dict) -> None:
    assert r["episodes_identical"] is True  # concurrent and serial steps: the same episodes
    assert r["tool_calls"] == r["episodes"] * r["turns"] == 16, r  # smoke: 8 episodes x 2 tool turns
    assert _finite(r["ratio_concurrent_over_turns_x_tool_plus_generation"], 1e-6)
    assert _finite(r["speedup_serial_over_concurrent"], 1e-6)
    assert _finite(r["concurrent_generate_s"], 1e-6) and _finite(r["serial_round_s"], 1e-6)
    stop = r["turn_stop"]  # guess_digit, a budget of 32 where a turn is a few tokens
    assert stop["episodes_identical"] is True  # stopping each turn where it ends: the full-budget round's episodes
    assert stop["stop_at_turn_end"]["generated_over_kept"] <= stop["target_generated_over_kept"] == 1.05, stop
    assert stop["full_budget"]["generated_over_kept"] > 2, stop  # what every turn generated before
    assert stop["stop_at_turn_end"]["kept_tokens"] == stop["full_budget"]["kept_tokens"] > 0
    assert _finite(stop["stop_at_turn_end"]["round_s"], 1e-6) and _finite(stop["full_budget"]["round_s"], 1e-6)


def _plan(r: dict) -> None:
    assert not {"covers_an_epoch", "rows"} & set(r["targets_failed"]), r["targets_failed"]
    assert r["unique_prompts_used"] == r["config"]["prompts"]
    assert r["generation_rounds"] == r["config"]["max_steps"] > r["rounds_per_epoch"]
    assert r["rows"] == r["generation_rounds"] * r["config"]["per_device_train_batch_size"]
    assert _finite(r["peak_rss_mb"], 1)


def _reward_pool(r: dict) -> None:
    assert r["values_match_serial"] is True
    assert _finite(r["speedup"], 1e-6), r["speedup"]
    assert len(r["pool_batch_s"]) == len(r["serial_batch_s"]) == r["timed_batches"]


def _tracking_overhead(r: dict) -> None:
    t = r["tracking"]
    assert t["all_points_arrived"] is True  # every metric point of every tracked run reached MLflow after close()
    assert t["reward_points"] == t["reward_points_expected"] == [t["steps"]], (t["reward_points"], t["steps"])
    assert t["points_mlflow"] == t["points_expected"] and t["points_expected"][0] >= 20 * t["steps"]
    assert t["log_metrics_calls"] >= t["steps"]
    assert _finite(t["overhead_pct"], -100) and _finite(t["on_per_step_ms"], 0) and _finite(t["off_per_step_ms"], 0)
    p = r["pipeline"]
    assert len(p["mlflow_tracker_start_s"]) == len(p["mlflow_tracker_close_s"]) == len(p["mlflow_log_model_s"]) == 1
    # the train subflow's and the pipeline's artifact, each at the first and last step and the end of training at least
    assert p["prefect_progress_artifact_calls_per_run"] >= 6
    assert _finite(p["prefect_pipeline_s"], 0) and _finite(p["direct_run_experiment_s"], 0)


def _step_overhead(r: dict) -> None:
    assert r["model"] == "tiny, 1 layer, hidden 16" and r["threads"] == 1 and r["completions_per_step"] == 16, r
    for key in ("ratio_step_features_off_over_trl", "ratio_step_ours_over_trl", "ratio_cpu_features_off_over_trl",
                "ratio_cpu_ours_over_trl"):
        assert _finite(r[key], 1e-6), (key, r[key])
    for name in ("trl", "ours_features_off", "ours"):
        syncs = r["syncs"][name]
        # every step reads values on the host (TRL's own metrics), and the counts say where from
        assert syncs["syncs_per_step"] == r[f"{name}_syncs_per_step"] > 0, syncs
        assert sum(syncs["syncs_by_kind_per_step"].values()) == pytest.approx(syncs["syncs_per_step"], abs=0.05)
        assert 0 < len(syncs["syncs_top_origins_per_step"]) <= 10
        assert all(re.fullmatch(r".+\.py:\d+", origin) for origin in syncs["syncs_top_origins_per_step"]), syncs
    # with the speed features off our own code makes the device wait once a step: generation reads the completions
    # and their lengths in one copy (grpo/training/host_batching.py), where TRL's copies twice, so ours waits less in
    # all (TRL's run never enters our code); compaction counts its rows once per micro-step (and the shared-prompt
    # forward finds the distinct prompts)
    from_grpo = {name: syncs["syncs_from_grpo_per_step"] for name, syncs in r["syncs"].items()}
    assert from_grpo["trl"] == 0 and from_grpo["ours_features_off"] == 1, from_grpo
    assert r["ours_features_off_syncs_per_step"] < r["trl_syncs_per_step"], r
    assert r["syncs"]["ours"]["syncs_from_grpo_per_step"] >= 1, r["syncs"]["ours"]


def _trl_parity(r: dict) -> None:
    assert _finite(r["ratio_ours_over_trl"], 1e-6), r["ratio_ours_over_trl"]
    assert _finite(r["ours_final_mean_reward"], 0, 1) and _finite(r["trl_final_mean_reward"], 0, 1)
    # same model, data, seed and config: a trainer that no longer learns like TRL's shows here
    assert abs(r["ours_final_mean_reward"] - r["trl_final_mean_reward"]) <= 0.05, r
    assert r["completions_per_step"] == 64  # smoke: 8 prompts x 8 completions


def _time_to_accuracy(r: dict) -> None:
    # smoke: target 0.0, so both runs reach it at their first evaluation (step 1) and stop there
    assert [run["trainer"] for run in r["runs"]] == ["ours", "trl", "ours_async"] and r["seeds"] == 1
    for run in r["runs"]:
        assert [e[0] for e in run["evals"]] == [1] and run["steps_to_target"] == 1, run
        assert _finite(run["train_s_to_target"], 1e-4) and _finite(run["final_accuracy"], 0, 1), run
    assert r["runs"][0]["compaction_rows_skipped_frac"] is not None  # ours logs compaction; TRL does not
    assert r["runs"][1]["compaction_rows_skipped_frac"] is None
    assert r["ours_async_steps_to_target"] == 1 and _finite(r["ratio_time_to_target_ours_async_over_trl"], 1e-6)
    # ours runs each group's prompt once: at most one prompt per 8 completions of the rows it computed (None when the
    # smoke's single step has no signal and compaction leaves no repeated prompt to share)
    shared = r["runs"][0]["shared_prompt_forwards_frac"]
    assert shared is None or _finite(shared, 1 / 64, 1 / 8 + 1e-9), r["runs"][0]
    assert r["runs"][1]["shared_prompt_forwards_frac"] is None
    assert r["ours_steps_to_target"] == r["trl_steps_to_target"] == 1
    assert _finite(r["ratio_time_to_target_ours_over_trl"], 1e-6)
    assert _finite(r["ratio_step_time_ours_over_trl"], 1e-6)
    assert r["eval_prompts"] == 16 and r["completions_per_step"] == 64


CHECKS: dict[str, Callable[[dict], None]] = {
    "async_overlap": _async_overlap,
    "balance": _balance,
    "chunked_backward": _chunked_backward,
    "cuda_trainer": _cuda_trainer,
    "agent_concurrency": _agent_concurrency,
    "env_concurrency": _env_concurrency,
    "plan": _plan,
    "reward_pool": _reward_pool,
    "step_overhead": _step_overhead,
    "tracking_overhead": _tracking_overhead,
    "time_to_accuracy": _time_to_accuracy,
    "trl_parity": _trl_parity,
}
FAST = {"balance", "reward_pool"}  # seconds; the others train, start servers or plan in a subprocess
# Needs CUDA and vLLM: refuses on CPU (exit 2, one line), tested so in tests/test_rollout_engines.py.
GPU_ONLY = {"gpu_smoke"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=[] if n in FAST else [pytest.mark.integration])
                                  for n in available() if n not in GPU_ONLY])
def test_benchmark_smoke(name, request):
    assert name in CHECKS, f"benchmark {name} has no smoke check in tests/test_benchmarks.py"
    # Sub-processes inherit the session's GRPO_CACHE_DIR, so the tiny warm start is built once for all of them.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    if name == "tracking_overhead":  # its pipeline part runs flows: on the session's server, not a new embedded one
        env = request.getfixturevalue("prefect_server").env(**env)
    # Below pytest's 900 s, so a hang reports the benchmark's output; async_overlap, the slowest, took 360 s on 2 cores
    # shared with three other test runs (load ~8).
    # The work folders a benchmark makes (and keeps, naming them in its result, for a full run's inspection) go to a
    # temporary folder removed after the smoke run: every suite run left about 60 MB in /tmp before. A short path:
    # multiprocessing and the servers put their Unix sockets under TMPDIR.
    with tempfile.TemporaryDirectory(prefix="bench-smoke-") as tmp:
        proc = subprocess.run([sys.executable, "-m", "benchmarks", name, "--smoke"], cwd=REPO,
                              env={**env, "TMPDIR": tmp}, capture_output=True, text=True, timeout=840)
    assert proc.returncode == 0, f"rc {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    for key in ("workdir", "out"):  # the folders a result names were made under TMPDIR, so they are gone now
        assert key not in result or Path(result[key]).is_relative_to(tmp), (key, result[key], tmp)
    assert result["benchmark"] == name
    assert result["smoke"] is True
    CHECKS[name](result)


def test_smoke_needs_a_smoke_mode(tmp_path):
    """``--smoke`` on a benchmark whose main() takes no ``smoke`` is a usage error, not a full-size run."""
    package = tmp_path / "benchmarks"
    package.mkdir()
    for f in ("__init__.py", "__main__.py"):
        (package / f).write_text((REPO / "benchmarks" / f).read_text())
    (package / "legacy.py").write_text("def main() -> dict:\n    return {'ran': True}\n")
    run = lambda *args: subprocess.run([sys.executable, "-m", "benchmarks", *args], cwd=tmp_path,  # noqa: E731
                                       capture_output=True, text=True, timeout=120)
    smoke = run("legacy", "--smoke")
    assert smoke.returncode == 2 and "no smoke mode" in smoke.stderr
    full = run("legacy")
    assert full.returncode == 0 and json.loads(full.stdout.splitlines()[-1]) == {"benchmark": "legacy", "ran": True,
                                                                                 "smoke": False}


def test_cuda_trainer_without_cuda_is_one_line_and_exit_2():
    """Without ``--smoke`` it times the trainers on a GPU: on a machine without CUDA it stops at once."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "cuda_trainer"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and proc.stdout == "", (proc.stdout, proc.stderr)
    assert proc.stderr.strip().startswith("cuda_trainer: no CUDA device") and len(proc.stderr.strip().splitlines()) == 1


def test_an_unknown_async_overlap_task_is_one_line_naming_the_valid_ones():
    env = {**os.environ, "BENCH_TASKS": "addition,gsm8k", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "async_overlap", "--smoke"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == ("benchmark async_overlap: BENCH_TASKS: unknown task(s) ['gsm8k']; "
                                   "valid: addition, addition_cot")
