"""Speed and quality of grpo.algo.balance, next to a plain pure-Python Karmarkar-Karp measured in the same run.

Speed: n=8192 lengths into k=64 partitions (median of several runs, ms). Quality: 64 GRPO groups of 8 completions
(prompt 32 tokens, completion lengths lognormal(mu=5, sigma=1)) over 8 ranks, 50 seeded trials, mean max/mean rank
load per method. Run with ``python -m benchmarks balance``; ``--smoke``: n=1024 into k=16, 5 trials, fewer timing
repeats (``BENCH_ITEMS``, ``BENCH_PARTS``, ``BENCH_TRIALS`` override either mode).
"""

from __future__ import annotations

import heapq
import time

import numpy as np

from benchmarks._sizes import size
from grpo.algo import balance

N_ITEMS, K_PARTS = 8192, 64
GROUPS, GENERATIONS, RANKS, TRIALS, PROMPT_LEN = 64, 8, 8, 50, 32
TARGET_MS = {"equal": 5.0, "free": 100.0}
TARGET_IMBALANCE = {"ours_equal_count": 1.03, "ours_free_count": 1.005}


def reference_kk(seqlens: list[int], k: int, equal_size: bool) -> list[list[int]]:
    """Textbook LDM with Python lists (the shape of verl's implementation): a state is k (sum, members) pairs sorted
    by sum; merging pairs one state's heaviest with the other's lightest and re-sorts. Equal size needs n % k == 0."""
    items = sorted((length, i) for i, length in enumerate(seqlens))
    if equal_size:
        rows = [items[r : r + k] for r in range(0, len(items), k)]
        states = [sorted(([length, [i]] for length, i in row), key=lambda p: -p[0]) for row in rows]
    else:
        states = [[[length, [i]]] + [[0, []] for _ in range(k - 1)] for length, i in items]
    heap = [(-(s[0][0] - s[-1][0]), n, s) for n, s in enumerate(states)]
    heapq.heapify(heap)
    counter = len(heap)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        merged = [[a[i][0] + b[k - 1 - i][0], a[i][1] + b[k - 1 - i][1]] for i in range(k)]
        merged.sort(key=lambda p: -p[0])
        counter += 1
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), counter, merged))
    return [sorted(members) for _, members in heap[0][2]]


def _median_ms(fn, runs: int) -> float:
    """Median wall time of ``runs`` calls after one untimed warm-up call (first-call allocations, caches)."""
    fn()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return round(float(np.median(times)), 3)


def _loads(x: np.ndarray, parts: list[list[int]]) -> np.ndarray:
    return np.array([x[p].sum() for p in parts])


def _ratio(x: np.ndarray, parts: list[list[int]]) -> float:
    loads = _loads(x, parts)
    return float(loads.max() / loads.mean())


def _speed(n_items: int, k_parts: int, repeat: float) -> dict:
    """``repeat`` scales the number of timed calls (at least one each)."""
    rng = np.random.default_rng(0)
    lengths = np.maximum(1, np.round(rng.lognormal(5, 1, n_items))).astype(np.int64)
    as_list = lengths.tolist()
    out: dict = {}
    for mode, equal in (("equal", True), ("free", False)):
        def runs(n: int) -> int:
            return max(1, round(n * repeat))

        ours = _median_ms(lambda: balance.get_seqlen_balanced_partitions(lengths, k_parts, equal),
                          runs(15 if equal else 7))
        out[f"speed_{mode}_ours_ms"] = ours
        out[f"speed_{mode}_ours_kk_only_ms"] = _median_ms(lambda: balance.karmarkar_karp(lengths, k_parts, equal),
                                                          runs(5))
        out[f"speed_{mode}_greedy_ms"] = _median_ms(lambda: balance.greedy_partition(lengths, k_parts, equal), runs(5))
        ref = _median_ms(lambda: reference_kk(as_list, k_parts, equal), runs(5 if equal else 2))
        out[f"speed_{mode}_reference_pure_python_kk_ms"] = ref
        out[f"speed_{mode}_speedup_vs_reference"] = round(ref / ours, 1)
        x = lengths.astype(np.float64)
        parts = {
            "reference_kk": reference_kk(as_list, k_parts, equal),
            "kk": balance.karmarkar_karp(lengths, k_parts, equal),
            "greedy": balance.greedy_partition(lengths, k_parts, equal),
            "ours": balance.get_seqlen_balanced_partitions(lengths, k_parts, equal),
        }
        for name, p in parts.items():
            loads = _loads(x, p)
            out[f"spread_{mode}_{name}_max_minus_min_tokens"] = int(loads.max() - loads.min())
    return out


def _quality(trials: int) -> tuple[dict, bool]:
    rng = np.random.default_rng(1234)
    ratios: dict[str, list[float]] = {
        k: [] for k in ("contiguous", "kk_equal_size", "greedy_equal_count", "ours_equal_count", "ours_free_count")
    }
    never_worse = True
    per_rank = GROUPS // RANKS
    lower_bounds: list[float] = []
    for _ in range(trials):
        completions = np.maximum(1, np.round(rng.lognormal(5, 1, GROUPS * GENERATIONS))).astype(np.int64)
        w = balance.group_workloads([PROMPT_LEN] * GROUPS, completions, GENERATIONS)
        candidates = {
            "contiguous": [list(range(r * per_rank, (r + 1) * per_rank)) for r in range(RANKS)],
            "kk_equal_size": balance.karmarkar_karp(w, RANKS, equal_size=True),
            "greedy_equal_count": balance.greedy_partition(w, RANKS, equal_size=True),
            "ours_equal_count": balance.balance_groups(w, RANKS, equal_count=True),
            "ours_free_count": balance.balance_groups(w, RANKS, equal_count=False),
        }
        for name, parts in candidates.items():
            ratios[name].append(_ratio(w, parts))
        # No equal-count split beats the rank holding the largest group plus the per_rank - 1 smallest others.
        rest = np.sort(w)[:-1]
        lower_bounds.append(max(w.sum() / RANKS, w.max() + rest[: per_rank - 1].sum()) / (w.sum() / RANKS))
        best_baseline = min(ratios["kk_equal_size"][-1], ratios["greedy_equal_count"][-1])
        never_worse &= ratios["ours_equal_count"][-1] <= best_baseline
    out = {f"quality_{name}_mean_max_over_mean": round(float(np.mean(v)), 5) for name, v in ratios.items()}
    out["quality_ours_equal_count_worst_max_over_mean"] = round(float(np.max(ratios["ours_equal_count"])), 5)
    out["quality_ours_free_count_worst_max_over_mean"] = round(float(np.max(ratios["ours_free_count"])), 5)
    out["quality_equal_count_lower_bound_mean_max_over_mean"] = round(float(np.mean(lower_bounds)), 5)
    out["quality_equal_count_lower_bound_worst_max_over_mean"] = round(float(np.max(lower_bounds)), 5)
    out["quality_ours_never_worse_than_kk_or_greedy"] = bool(never_worse)
    return out, never_worse


def main(smoke: bool = False) -> dict:
    n_items = size("BENCH_ITEMS", N_ITEMS, 1024, smoke)
    k_parts = size("BENCH_PARTS", K_PARTS, 16, smoke)
    trials = size("BENCH_TRIALS", TRIALS, 5, smoke)
    speed = _speed(n_items, k_parts, 0.2 if smoke else 1.0)
    quality, never_worse = _quality(trials)
    checks = {
        "equal_ms": speed["speed_equal_ours_ms"] <= TARGET_MS["equal"],
        "free_ms": speed["speed_free_ours_ms"] <= TARGET_MS["free"],
        "equal_quality": quality["quality_ours_equal_count_mean_max_over_mean"] <= TARGET_IMBALANCE["ours_equal_count"],
        "free_quality": quality["quality_ours_free_count_mean_max_over_mean"] <= TARGET_IMBALANCE["ours_free_count"],
        "never_worse": never_worse,
    }
    return {
        "config": {
            "n_items": n_items,
            "k_partitions": k_parts,
            "quality_groups": GROUPS,
            "quality_generations": GENERATIONS,
            "quality_ranks": RANKS,
            "quality_trials": trials,
        },
        "targets": {"ms": TARGET_MS, "max_over_mean": TARGET_IMBALANCE},
        **speed,
        **quality,
        "targets_failed": sorted(k for k, ok in checks.items() if not ok),
        "targets_met": all(checks.values()),
    }
