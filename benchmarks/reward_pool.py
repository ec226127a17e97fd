"""Throughput of a CPU-bound pure-Python reward: in-process (serial) vs grpo.rewards.pool with 2 workers, same run.

Each batch is 512 completions (64 GRPO groups of 8); the reward spends ~2 ms of integer arithmetic per completion, so
one batch is ~1 s serially. Serial and pool batches alternate (so background load hits both alike) after one untimed
warm-up of each; throughput is completions per second from the median batch time. Run with
``python -m benchmarks reward_pool``. The reward lives in this module so spawned workers import it by name
(``benchmarks.reward_pool.cpu_reward``; the repo root is on sys.path, which spawned children inherit). ``--smoke``:
64 completions per batch, 2 timed batches (``BENCH_COMPLETIONS``, ``BENCH_BATCHES`` override either mode).
"""

from __future__ import annotations

import os
import statistics
import time

import psutil

from benchmarks._sizes import size
from grpo.rewards.pool import RewardWorkerPool

COMPLETIONS, GROUP_SIZE, BATCHES, WORKERS = 512, 8, 4, 2
ITERATIONS = 28_000  # ~2 ms per completion on a 2020s x86 core
TARGET_RATIO = 1.7


def cpu_reward(completions, **kwargs) -> list[float]:
    """A linear congruential walk seeded by the completion: pure Python, holds the GIL the whole time."""
    out = []
    for c in completions:
        x = len(c) + sum(map(ord, c[:8]))
        for _ in range(ITERATIONS):
            x = (x * 1103515245 + 12345) & 0x7FFFFFFF
        out.append((x % 1000) / 1000)
    return out


def _batch(seed: int, n: int) -> dict:
    completions = [f"answer {seed}-{i} " * (1 + i % 5) for i in range(n)]
    return {"prompts": [f"prompt {i // GROUP_SIZE}" for i in range(n)], "completions": completions,
            "completion_ids": [list(range(len(c) // 4)) for c in completions]}


def _busy_seconds(pids: list[int]) -> tuple[float, float]:
    """(CPU seconds used by the whole machine, by this process and the pool's workers): their difference over the
    run is load from other processes, which on a shared box explains a missed target."""
    total = psutil.cpu_times()
    own = sum(sum(psutil.Process(pid).cpu_times()[:2]) for pid in [os.getpid(), *pids])
    return total.user + total.system + total.nice + getattr(total, "irq", 0) + getattr(total, "softirq", 0), own


def main(smoke: bool = False) -> dict:
    completions = size("BENCH_COMPLETIONS", COMPLETIONS, 64, smoke)
    n_batches = size("BENCH_BATCHES", BATCHES, 2, smoke)
    warm_up, *batches = [_batch(seed, completions) for seed in range(n_batches + 1)]
    serial_s, pool_s, match = [], [], True
    with RewardWorkerPool([cpu_reward], num_workers=WORKERS, timeout=60) as pool:
        cpu_reward(**warm_up)
        pool.compute(**warm_up, group_size=GROUP_SIZE)
        start_wall, (start_busy, start_own) = time.perf_counter(), _busy_seconds(pool.worker_pids)
        for batch in batches:
            start = time.perf_counter()
            expected = cpu_reward(**batch)
            serial_s.append(time.perf_counter() - start)
            start = time.perf_counter()
            rows = pool.compute(**batch, group_size=GROUP_SIZE)
            pool_s.append(time.perf_counter() - start)
            match &= [r[0] for r in rows] == expected and pool.metrics["rewards/errors"] == 0
        end_busy, end_own = _busy_seconds(pool.worker_pids)
        other_cores = ((end_busy - start_busy) - (end_own - start_own)) / (time.perf_counter() - start_wall)
    serial_tput = completions / statistics.median(serial_s)
    pool_tput = completions / statistics.median(pool_s)
    ratio = pool_tput / serial_tput
    return {
        "completions_per_batch": completions,
        "timed_batches": n_batches,
        "workers": WORKERS,
        "serial_ms_per_completion": round(1e3 / serial_tput, 3),
        "serial_completions_per_s": round(serial_tput, 1),
        "pool_completions_per_s": round(pool_tput, 1),
        "serial_batch_s": [round(s, 3) for s in serial_s],
        "pool_batch_s": [round(s, 3) for s in pool_s],
        "speedup": round(ratio, 2),
        "target_speedup": TARGET_RATIO,
        "target_met": ratio >= TARGET_RATIO,
        "values_match_serial": match,
        "cpu_count": os.cpu_count(),
        "other_processes_cpu_cores": round(max(other_cores, 0.0), 2),
    }
