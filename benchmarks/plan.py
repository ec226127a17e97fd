"""Planning a large run: 1,000,000 prompts x 8 generations over 8 ranks, a little more than one epoch.

Config: per_device_train_batch_size 64, num_generations 8 (8 prompts per rank and round, 64 per round), world size 8,
SP degree 1, seqlen balancing on (its prediction runs on 1000 sampled rounds), max_steps 16,000 = 15,625 rounds of
epoch 0 plus 375 of epoch 1. Prompt lengths are lognormal(5, 1) tokens. The plan is built in a fresh subprocess so
its peak RSS (ru_maxrss of the child: interpreter, torch and pyarrow included) is the planner's alone.
Targets: build_plan <= 10 s, peak RSS <= 500 MB. Run with ``python -m benchmarks plan``; ``--smoke`` plans 4,096
prompts (70 steps: 64 rounds of epoch 0 and 6 of epoch 1) instead (``BENCH_PROMPTS`` and ``BENCH_MAX_STEPS`` override
either mode).
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks._sizes import size

N_PROMPTS, GENERATIONS, PER_DEVICE, WORLD, MAX_STEPS = 1_000_000, 8, 64, 8, 16_000
TARGET_SECONDS, TARGET_RSS_MB = 10.0, 500.0


def _child(out_dir: str, n_prompts: int, max_steps: int) -> None:
    """Runs in the subprocess: build the plan, time it and a resume read, print one JSON line."""
    import numpy as np

    from grpo.algo.plan import read_plan_indices
    from grpo.config import load_config
    from grpo.pipeline.plans import build_plan

    base = load_config(None, [f"grpo.per_device_train_batch_size={PER_DEVICE}", f"grpo.num_generations={GENERATIONS}",
                              f"grpo.max_steps={max_steps}", "grpo.gradient_accumulation_steps=1"])
    cfg = base.model_copy(
        update={"sampling": base.sampling.model_copy(update={"world_size": WORLD, "seqlen_balancing": True})}
    )
    lengths = np.clip(np.round(np.random.default_rng(0).lognormal(5, 1, n_prompts)), 1, 8192).astype(np.int32)
    start = time.perf_counter()
    summary = build_plan(cfg, lengths, Path(out_dir))
    seconds = time.perf_counter() - start
    start = time.perf_counter()
    next(read_plan_indices(summary.plan_path, WORLD - 1, start_round=summary.generation_rounds - 1))
    resume_ms = (time.perf_counter() - start) * 1e3
    print(json.dumps({"seconds": seconds, "resume_first_index_ms": resume_ms, "summary": summary.to_dict()}))


def main(smoke: bool = False) -> dict:
    n_prompts = size("BENCH_PROMPTS", N_PROMPTS, 4096, smoke)
    max_steps = size("BENCH_MAX_STEPS", MAX_STEPS, 70, smoke)
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "benchmarks.plan", "--child", tmp, str(n_prompts), str(max_steps)],
                              capture_output=True, text=True, check=False)
        wall = time.perf_counter() - start
        if proc.returncode:
            raise RuntimeError(f"planning subprocess failed:\n{proc.stderr}")
        peak_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024  # KiB on Linux
        child = json.loads(proc.stdout.strip().splitlines()[-1])
        file_mb = (Path(tmp) / "plan.parquet").stat().st_size / 2**20
    s = child["summary"]
    checks = {
        "seconds": child["seconds"] <= TARGET_SECONDS,
        "peak_rss_mb": peak_mb <= TARGET_RSS_MB,
        "covers_an_epoch": s["generation_rounds"] >= s["rounds_per_epoch"] and s["unique_prompts_used"] == n_prompts,
        "rows": s["rows"] == s["generation_rounds"] * s["prompts_per_round"],
    }
    return {
        "config": {"prompts": n_prompts, "num_generations": GENERATIONS, "per_device_train_batch_size": PER_DEVICE,
                   "world_size": WORLD, "sequence_parallel_degree": 1, "max_steps": max_steps,
                   "seqlen_balancing": True},
        "targets": {"seconds": TARGET_SECONDS, "peak_rss_mb": TARGET_RSS_MB},
        "seconds": round(child["seconds"], 3),
        "subprocess_wall_seconds": round(wall, 3),
        "peak_rss_mb": round(peak_mb, 1),
        "resume_first_index_ms": round(child["resume_first_index_ms"], 2),
        "rows": s["rows"],
        "plan_file_mb": round(file_mb, 1),
        "generation_rounds": s["generation_rounds"],
        "rounds_per_epoch": s["rounds_per_epoch"],
        "epochs": s["epochs"],
        "unique_prompts_used": s["unique_prompts_used"],
        "completions_total": s["completions_total"],
        "predicted_imbalance": s["predicted_imbalance"],
        "targets_failed": sorted(k for k, ok in checks.items() if not ok),
        "targets_met": all(checks.values()),
    }


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--child":
        _child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    else:
        print(json.dumps(main(), sort_keys=True))
