"""``python -m benchmarks async_overlap``: sync vs async (prefetch_depth 1) training, same steps, on two tasks.

Generation (HF generate in a separate process with its own policy copy and its own core) overlaps the optimizer steps
(the trainer gets the remaining cores, see ``grpo.training.async_producer.trainer_threads``); the best possible step
time is about max(gen, train) instead of gen + train. Three variants per task, alternating so machine noise hits all:

- ``sync``: TRL's in-process generation, the trainer on every core;
- ``async``: the generator process on one core, the trainer on the other;
- ``sync_1_thread``: sync on one intra-op thread -- the core the async trainer itself gets. ``async`` against it is
  the overlap as a GPU split would see it (one device generating, one training), apart from what a second core buys a
  sync trainer on a CPU.

Two tasks (``BENCH_TASKS``, comma-separated):

- ``addition``: the tiny preset's default task; answers of 1-4 tokens, generation about a quarter of a sync step;
- ``addition_cot``: the same sums with worked answers (``27+15=`` -> ``7+5=12;2+1+1=4;42``, ~16 tokens,
  ``max_completion_length`` 20), so generation is the larger share of a step, as in reasoning RL.

Reported per task: train-stage wall (trainer construction included, so the generator's start-up counts), the median
steady-state step time, the eval accuracy gain, and the ratios; goal: steady step async / sync_1_thread <= 0.8 (most
of the generation hidden) with the eval gains within 0.05.

Environment: BENCH_STEPS (default 300), BENCH_ROUNDS (default 2), BENCH_TASKS (default both), BENCH_SET (extra --set
overrides, ';'-separated). ``--smoke``: 8 steps of 64 completions (the steady-state step time skips the first 5),
1 round, the default task only (the other differs in its overrides alone), a short warm start, a small eval set.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
from pathlib import Path

from benchmarks._sizes import TINY_SMOKE_OVERRIDES, size

EXTRA = [s for s in os.environ.get("BENCH_SET", "").split(";") if s]
# One-version-stale rollouts need the importance-sampling correction: without it this task learned ~8 points less in
# 150 steps (0.672 -> 0.860 vs 0.962 with it; sync 0.948); see docs/benchmarks.md.
ASYNC = ["async.use_data_producer=true", "async.async_prefetch=true", "async.prefetch_depth=1", "async.max_staleness=1",
         "async.vllm_importance_sampling_correction=true"]
TASKS = {
    "addition": [],
    "addition_cot": ["data.source=synthetic:addition_cot", "grpo.max_completion_length=20"],
}
GOAL_STEP_RATIO, GOAL_GAIN_GAP = 0.8, 0.05


def _steady_step_time(metrics_file: Path) -> float:
    rows = [json.loads(line)["metrics"] for line in metrics_file.read_text().splitlines()]
    times = [r["step_time"] for r in rows if "step_time" in r][5:]  # skip start-up steps
    return statistics.median(times)


def _run(name: str, extra: list[str], run_name: str, out: Path, steps: int) -> dict:
    import torch

    from grpo.config import load_config
    from grpo.pipeline.experiment import run_experiment
    from grpo.runs import open_run_dir

    threads = torch.get_num_threads()
    if name == "sync_1_thread":
        torch.set_num_threads(1)
    try:
        base = [f"output_dir={out}", f"grpo.max_steps={steps}", "grpo.logging_steps=1", "tracking.backend=none",
                "evaluation.pass_k=0", f"grpo.save_steps={steps * 10}", *EXTRA]
        cfg = load_config("tiny", base + extra)
        run = open_run_dir(cfg, run_name, resume=False)
        summary = run_experiment(cfg, run, log=lambda *_: None)
    finally:
        torch.set_num_threads(threads)
    return {"train_seconds": summary["train_seconds"], "step_s": _steady_step_time(run.metrics_file),
            "gain": summary["eval_accuracy_after"] - summary["eval_accuracy_before"]}


def _report(results: dict[str, list[dict]]) -> dict:
    med = {name: {k: statistics.median(x[k] for x in rows) for k in rows[0]} for name, rows in results.items()}
    step_ratio = med["async"]["step_s"] / med["sync_1_thread"]["step_s"]
    gap = abs(med["async"]["gain"] - med["sync"]["gain"])
    return {
        **{f"{name}_{k}": round(v, 4 if k == "step_s" else 3) for name, m in med.items() for k, v in m.items()},
        "ratio_async_over_sync": round(med["async"]["train_seconds"] / med["sync"]["train_seconds"], 3),
        "ratio_steady_step_async_over_sync": round(med["async"]["step_s"] / med["sync"]["step_s"], 3),
        "ratio_steady_step_async_over_sync_1_thread": round(step_ratio, 3),
        "eval_gain_gap": round(gap, 3),
        "goal_met": step_ratio <= GOAL_STEP_RATIO and gap <= GOAL_GAIN_GAP,
    }


def main(smoke: bool = False) -> dict:
    steps = size("BENCH_STEPS", 300, 8, smoke)
    rounds = size("BENCH_ROUNDS", 2, 1, smoke)
    tasks = [t for t in size("BENCH_TASKS", ",".join(TASKS), "addition", smoke).split(",") if t]
    unknown = sorted(set(tasks) - set(TASKS))
    if unknown:
        raise ValueError(f"BENCH_TASKS: unknown task(s) {unknown}; valid: {', '.join(TASKS)}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("GRPO_CACHE_DIR", tempfile.mkdtemp(prefix="bench-async-"))
    out = Path(tempfile.mkdtemp(prefix="bench-async-runs-"))
    variants = {"sync": [], "async": ASYNC, "sync_1_thread": []}
    report = {"steps": steps, "rounds": rounds, "cpu_count": os.cpu_count(), "extra_overrides": EXTRA,
              "goal_steady_step_async_over_sync_1_thread": GOAL_STEP_RATIO, "goal_eval_gain_gap": GOAL_GAIN_GAP}
    for task in tasks:
        results: dict[str, list[dict]] = {name: [] for name in variants}
        for r in range(rounds):
            for name, extra in variants.items():
                overrides = [*(TINY_SMOKE_OVERRIDES if smoke else []), *TASKS[task], *extra]
                results[name].append(_run(name, overrides, f"{task}-{name}-{r}", out, steps))
        report[task] = _report(results)
    return report
