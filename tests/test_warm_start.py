"""The warm start a preset's first run builds (#48.6): said in its own stage, `policy`, with its progress in the
console and in the Prefect run's progress artifact; later runs reuse the cached model and say so."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import MICRO


def test_the_warm_start_says_its_progress_at_each_tenth_and_after_a_quiet_spell():
    """A line at each tenth of the steps with the loss, the pace and the time left (not one per step), one between
    tenths when 30 s passed without a line, and the whole at the end; the artifact gets each line's percentage. The
    clock is the test's: a step takes 0.5 s, and steps 11 to 14 take 40 s each."""
    from grpo.training.pace import duration
    from grpo.training.warm_start import WarmStartProgress

    now, lines, reports = [100.0], [], []
    progress = WarmStartProgress(50, lines.append, lambda percent, text: reports.append((percent, text)),
                                 clock=lambda: now[0])
    progress.start()
    for step in range(50):
        now[0] += 40.0 if 10 <= step < 14 else 0.5
        progress(step, 3.0 - step / 25)

    def pace(n: int) -> float:  # seconds per step after step n > 14: 165 s for the first 14, then 0.5 s each
        return (165.0 + 0.5 * (n - 14)) / n

    assert lines == [
        "warm start: step 5/50 | loss 2.840 | 0.50 s/step | ETA 22s (45 steps left)",
        "warm start: step 10/50 | loss 2.640 | 0.50 s/step | ETA 20s (40 steps left)",
        "warm start: step 11/50 | loss 2.600 | 4.09 s/step | ETA 2m40s (39 steps left)",  # 40 s after the last line
        "warm start: step 12/50 | loss 2.560 | 7.08 s/step | ETA 4m29s (38 steps left)",
        "warm start: step 13/50 | loss 2.520 | 9.62 s/step | ETA 5m56s (37 steps left)",
        "warm start: step 14/50 | loss 2.480 | 11.79 s/step | ETA 7m04s (36 steps left)",
        "warm start: step 15/50 | loss 2.440 | 11.03 s/step | ETA 6m26s (35 steps left)",
        *(f"warm start: step {n}/50 | loss {3.0 - (n - 1) / 25:.3f} | {pace(n):.2f} s/step | "
          f"ETA {duration(pace(n) * (50 - n))} ({50 - n} steps left)" for n in (20, 25, 30, 35, 40, 45)),
        "warm start: 50 steps in 3m03s, loss 3.000 → 1.040"]
    assert reports[0] == (0.0, "warm start: step 0/50")
    assert [p for p, _ in reports[1:]] == [10.0, 20.0, 22.0, 24.0, 26.0, 28.0, 30.0, 40.0, 50.0, 60.0, 70.0, 80.0,
                                           90.0, 100.0]
    assert [t for _, t in reports[1:]] == [line.replace(" | ", " · ") for line in lines]


def test_the_warm_start_runs_on_the_thread_count_its_own_steps_found_faster():
    """In each period, a few steps on each thread count, then the rest on the faster: two threads while they are
    faster, one once the machine is busy and two threads' steps take longer (the test's clock: a step's time depends on
    the count it ran on)."""
    from grpo.training.warm_start import FasterThreads

    threads, now, used = [2], [0.0], []
    cost = {2: 0.04, 1: 0.06}
    chooser = FasterThreads((2, 1), probe=2, every=10, clock=lambda: now[0],
                            set_threads=lambda n: threads.__setitem__(0, n))
    chooser.start()
    for step in range(20):
        used.append(threads[0])
        now[0] += cost[threads[0]]
        if step == 9:
            cost = {2: 0.4, 1: 0.06}  # other processes now hold the cores
        chooser(step, 0.0)
    assert used == [2, 2, 1, 1, 2, 2, 2, 2, 2, 2] + [2, 2, 1, 1, 1, 1, 1, 1, 1, 1]
    assert FasterThreads((1, 1)).choices == (1,)  # a one-thread process has nothing to pick


def grpo_run(tmp_path, prefect_server, cache, name: str) -> tuple[str, dict]:
    """``grpo run`` on the micro preset with a 20-step warm start into ``cache``: its console and summary."""
    sets = [f"output_dir={tmp_path / 'runs'}", "model.warm_start.steps=20", "grpo.max_steps=2", "grpo.save_steps=100",
            "tracking.backend=none"]
    result = subprocess.run(
        [sys.executable, "-m", "grpo.app.cli", "run", "--config", str(MICRO), "--run-name", name,
         *(a for s in sets for a in ("--set", s))],
        cwd=tmp_path, env={**prefect_server.env(), "GRPO_CACHE_DIR": str(cache)}, capture_output=True, text=True,
        timeout=900)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    return out, json.loads((tmp_path / "runs" / name / "summary.json").read_text())


def progress_artifacts(server, flow_run_ids: list[str]) -> dict[str, dict]:
    return {a["key"]: a for a in server.query("artifacts/filter", {"limit": 50, "offset": 0, "artifacts": {
        "flow_run_id": {"any_": flow_run_ids}, "type": {"any_": ["progress"]}}})}


@pytest.mark.integration
def test_the_first_run_of_a_preset_shows_its_warm_start_in_the_policy_stage(tmp_path, prefect_in_process):
    """The path a person takes: `grpo run` in a fresh folder builds the tiny policy in the `policy` stage, before
    `eval-before`, saying so and how far it is (a line each tenth of the steps, with the time left), and the
    pipeline's flow run carries a progress artifact for it; the second run reuses the model and says that instead."""
    from tests.test_pipeline import flow_runs_by_name

    prefect_server, cache = prefect_in_process, tmp_path / "cache"
    out, summary = grpo_run(tmp_path, prefect_server, cache, "first")
    said_in_policy = [line.split(" - ", 1)[1] for line in out.splitlines() if "Flow run 'policy' - " in line]
    policy_lines = [line for line in said_in_policy if line.startswith(("policy: ", "warm start: "))]
    assert re.fullmatch(rf"policy: building the tiny Qwen2 \(0\.\d\dM parameters, vocab \d+\) into {cache}/tiny-\w+, "
                        "once for this model, data and environment: later runs reuse it", policy_lines[0]), policy_lines
    assert policy_lines[1] == "warm start: 20 supervised steps of 64 demonstrations (of 600), learning rate 0.001"
    steps = [line for line in policy_lines if line.startswith("warm start: step ")]
    done = [int(line.split(" | ")[0].split()[-1].split("/")[0]) for line in steps]  # a tenth: 2 steps
    assert set(range(2, 20, 2)) <= set(done) and done == sorted(done), steps  # (and one after 30 s without a line)
    assert all(re.fullmatch(r"warm start: step \d+/20 \| loss \d\.\d{3} \| \d+\.\d\d s/step \| ETA \w+ \(\d+ steps? "
                            r"left\)", line) for line in steps), steps
    assert re.fullmatch(r"warm start: 20 steps in \w+, loss \d\.\d{3} → \d\.\d{3}", policy_lines[-1]), policy_lines
    assert said_in_policy[-1] == "Finished in state Completed()"
    said = [line for line in out.splitlines() if "policy: tiny model warm-started in " in line]
    assert len(said) == 1 and f", cached in {cache}/tiny-" in said[0], out[-3000:]
    assert out.index("Flow run 'policy' - Finished") < out.index("Beginning subflow run 'eval-before'")

    pipeline = summary["prefect_flow_run_id"]
    runs = flow_runs_by_name(pipeline)
    [policy_run] = runs["grpo-policy"]
    assert policy_run.name == "policy" and policy_run.state.is_completed()
    own = progress_artifacts(prefect_server, [pipeline])
    stage = progress_artifacts(prefect_server, [str(policy_run.id)])
    for artifact in (own["run-warm-start-progress"], stage["warm-start-progress"]):
        assert artifact["data"] == 100.0 and artifact["description"] == policy_lines[-1], artifact

    again, summary = grpo_run(tmp_path, prefect_server, cache, "second")
    assert "warm start:" not in again and "policy: building" not in again, again[-3000:]
    said = [line for line in again.splitlines() if " - policy: tiny model from the cache, " in line]
    assert len(said) == 1 and said[0].endswith(f"from the cache, {summary['policy_source']}"), again[-3000:]
    assert "run-warm-start-progress" not in progress_artifacts(prefect_server, [summary["prefect_flow_run_id"]])
    assert [p.name for p in cache.glob("tiny-*") if p.is_dir()] == [Path(summary["policy_source"]).name]


def test_every_tiny_preset_ships_its_warm_started_model_and_nothing_else_ships():
    """``grpo/presets/policies/`` holds one model per tiny preset, named by the cache entry its first run needs: a
    change to a preset, its data or environment, or the warm start's cache key leaves a preset without one (and this
    fails until ``python -m grpo.pipeline.shipped_policies`` rebuilds them)."""
    from grpo.pipeline.shipped_policies import entry_names, tiny_presets
    from grpo.training.policy import shipped_policies

    entries = entry_names(tiny_presets())
    assert set(entries) == {"tiny", "tiny-calculator", "tiny-calculator-agent", "tiny-guess-digit"}
    assert entries["tiny-calculator-agent"] == entries["tiny-calculator"]  # the agent plays calculator's task
    shipped = {d.name for d in shipped_policies().iterdir() if d.is_dir()}
    assert shipped == set(entries.values()), (
        f"the presets need {entries}, {sorted(shipped)} ship: run `python -m grpo.pipeline.shipped_policies`")
    for name in shipped:
        files = {f.name for f in shipped_policies().joinpath(name).iterdir()}
        assert {"model.safetensors", "config.json", "tokenizer.json", "done.json"} <= files, (name, files)


@pytest.mark.integration
def test_the_first_run_of_the_calculator_preset_copies_its_shipped_model_instead_of_warm_starting(tmp_path,
                                                                                                 prefect_server):
    """#48.6: `grpo run --config tiny-calculator` in a fresh folder spent 8m19s warm-starting its policy before 30 s
    of GRPO. The preset's model ships with the package: the first run's `policy` stage copies it into the cache
    (the same bytes), and no warm start runs. (Shortened: 1 GRPO step, 16 prompts evaluated; neither changes the
    model's cache key.)"""
    from grpo.training.policy import shipped_policies

    cache = tmp_path / "cache"
    sets = [f"output_dir={tmp_path / 'runs'}", "grpo.max_steps=1", "grpo.save_steps=100", "tracking.backend=none",
            "evaluation.num_prompts=16", "grpo.per_device_train_batch_size=16", "grpo.num_generations=4"]
    result = subprocess.run(
        [sys.executable, "-m", "grpo.app.cli", "run", "--config", "tiny-calculator", "--run-name", "first",
         *(a for s in sets for a in ("--set", s))],
        cwd=tmp_path, env={**prefect_server.env(), "GRPO_CACHE_DIR": str(cache)}, capture_output=True, text=True,
        timeout=900)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    assert "warm start:" not in out and "policy: building" not in out, out[-4000:]
    [entry] = [p for p in cache.iterdir() if p.is_dir() and p.name.startswith("tiny-")]
    said = [line for line in out.splitlines() if "policy: tiny model shipped with the platform" in line]
    assert len(said) == 1 and said[0].endswith(f"for this preset, copied into {entry}"), out[-4000:]
    shipped = shipped_policies().joinpath(entry.name)
    for item in shipped.iterdir():
        assert (entry / item.name).read_bytes() == item.read_bytes(), item.name
