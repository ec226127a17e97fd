"""grpo.algo.balance: partitions are valid, KK and LPT match textbook references, the combined balancer is never worse
than either and close to the brute-force optimum, and the GRPO-level helpers keep their contracts."""

from __future__ import annotations

import heapq
import inspect
import itertools
from functools import cache

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo.algo import balance
from grpo.algo.balance import (
    balance_groups,
    balanced_micro_batches,
    get_seqlen_balanced_partitions,
    greedy_partition,
    group_workloads,
    imbalance_metrics,
    karmarkar_karp,
)

PARTITIONERS = [karmarkar_karp, greedy_partition, get_seqlen_balanced_partitions]
FAST = settings(max_examples=60, deadline=None)


def loads_of(x, parts) -> list[float]:
    return [float(sum(x[i] for i in p)) for p in parts]


def max_load(x, parts) -> float:
    return max(loads_of(x, parts))


@st.composite
def instances(draw, max_n=40, max_k=8):
    k = draw(st.integers(1, max_k))
    # Small values with many duplicates and zeros exercise ties; occasional huge ones exercise outliers.
    values = st.one_of(st.integers(0, 20), st.integers(0, 5000), st.sampled_from([0, 1, 10**6]))
    x = draw(st.lists(values, min_size=k, max_size=max_n))
    return x, k


# ------------------------------------------------------------------------------------------------ partition validity


@FAST
@given(instances(), st.booleans())
def test_partitions_cover_every_index_once_sorted_and_nonempty(inst, equal_size):
    x, k = inst
    for fn in PARTITIONERS:
        parts = fn(x, k, equal_size)
        assert len(parts) == k
        assert sorted(i for p in parts for i in p) == list(range(len(x)))
        assert all(p == sorted(p) for p in parts)
        assert [p[0] for p in parts] == sorted(p[0] for p in parts)  # canonical order, and no list is empty
        if equal_size:
            counts = [len(p) for p in parts]
            assert max(counts) - min(counts) <= 1, (fn.__name__, counts)


@FAST
@given(instances(max_n=60, max_k=10), st.booleans())
def test_balanced_never_worse_than_kk_or_greedy(inst, equal_size):
    x, k = inst
    ours = max_load(x, get_seqlen_balanced_partitions(x, k, equal_size))
    assert ours <= max_load(x, karmarkar_karp(x, k, equal_size))
    assert ours <= max_load(x, greedy_partition(x, k, equal_size))
    assert ours >= sum(x) / k  # sanity: no partition can beat the average


def test_never_worse_on_larger_random_inputs():
    rng = np.random.default_rng(5)
    for n, k in [(500, 7), (1000, 32), (3000, 64)]:
        for equal in (True, False):
            x = np.maximum(1, np.round(rng.lognormal(5, 1, n))).astype(int)
            ours = max_load(x, get_seqlen_balanced_partitions(x, k, equal))
            kk = max_load(x, karmarkar_karp(x, k, equal))
            lpt = max_load(x, greedy_partition(x, k, equal))
            assert ours <= min(kk, lpt)


def test_uneven_equal_size_does_not_crash():
    """verl asserts len % k == 0; here bins get len//k or len//k + 1 items."""
    x = list(range(1, 12))  # 11 items into 4 bins
    for fn in PARTITIONERS:
        counts = sorted(len(p) for p in fn(x, 4, True))
        assert counts == [2, 3, 3, 3]


def test_zero_lengths_still_fill_every_partition():
    """LPT would pile zero-length items onto one bin; free-size results still give every bin an item."""
    for fn in (greedy_partition, get_seqlen_balanced_partitions, karmarkar_karp):
        parts = fn([5, 0, 0, 0], 3, False)
        assert all(parts) and sorted(map(len, parts)) == [1, 1, 2]


# -------------------------------------------------------------------------------- textbook references (differential)


def reference_ldm(x: list[float], k: int, equal_size: bool) -> list[float]:
    """Sorted bin loads of the textbook largest differencing method (k-vectors merged opposite-sorted)."""
    if equal_size:
        desc = sorted(x, reverse=True) + [0.0] * ((-len(x)) % k)
        states = [desc[r : r + k] for r in range(0, len(desc), k)]
    else:
        states = [[v] + [0.0] * (k - 1) for v in x]
    heap = [(-(s[0] - s[-1]), i, s) for i, s in enumerate(states)]
    heapq.heapify(heap)
    counter = len(heap)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        merged = sorted((a[i] + b[k - 1 - i] for i in range(k)), reverse=True)
        counter += 1
        heapq.heappush(heap, (-(merged[0] - merged[-1]), counter, merged))
    return sorted(heap[0][2])


def reference_lpt(x: list[float], k: int, equal_size: bool) -> list[float]:
    """Sorted bin loads of item-by-item LPT; with equal_size the first len % k bins may exceed len // k items."""
    base, extra = divmod(len(x), k)
    loads, counts, used = [0.0] * k, [0] * k, 0
    for v in sorted(x, reverse=True):
        open_bins = [
            b for b in range(k) if not equal_size or counts[b] < base or (counts[b] == base and used < extra)
        ]
        b = min(open_bins, key=lambda i: loads[i])
        used += equal_size and counts[b] == base
        loads[b] += v
        counts[b] += 1
    return sorted(loads)


@FAST
@given(st.integers(1, 7), st.integers(0, 60), st.booleans(), st.integers(0, 2**32 - 1))
def test_kk_and_greedy_match_textbook_references(k, extra, equal_size, seed):
    """Distinct continuous values, so ties cannot make two correct implementations differ."""
    x = np.random.default_rng(seed).random(k + extra) * 100
    for fn, ref in ((karmarkar_karp, reference_ldm), (greedy_partition, reference_lpt)):
        got = sorted(loads_of(x, fn(x, k, equal_size)))
        assert np.allclose(got, ref(x.tolist(), k, equal_size), rtol=0, atol=1e-9), fn.__name__


def test_integer_fast_sort_equals_stable_sort():
    rng = np.random.default_rng(0)
    x = rng.integers(0, 5, 500).astype(float)  # many ties
    assert np.array_equal(balance._desc_order(x), np.argsort(-x, kind="stable"))
    y = x + 0.5  # non-integer: the stable path
    assert np.array_equal(balance._desc_order(y), np.argsort(-y, kind="stable"))


# ------------------------------------------------------------------------------------------------ brute-force optimum


@cache
def all_assignments(n: int, k: int) -> np.ndarray:
    return np.array(list(itertools.product(range(k), repeat=n)), dtype=np.int8)


def brute_force_opt(x: np.ndarray, k: int, equal_size: bool) -> float:
    a = all_assignments(x.size, k)
    onehot = a[:, :, None] == np.arange(k)
    loads = np.einsum("ank,n->ak", onehot, x)
    counts = onehot.sum(axis=1)
    if equal_size:
        base = x.size // k
        ok = (counts >= base) & (counts <= base + 1)
        loads = loads[ok.all(axis=1)]
    return float(loads.max(axis=1).min())


def test_against_brute_force_optimum():
    """200 random instances, n <= 10, k <= 3, lognormal integer lengths; ratio = max load / optimum.

    Measured (seed 11), worst ratio equal / free sizes: KK 1.216 / 1.061, LPT 1.070 / 1.068, ours 1.013 / 1.052;
    ours is optimal on 195/200 (equal) and 182/200 (free) instances. Where it is not, the optimum needs a cyclic
    exchange over three bins, which the pairwise swap/move search cannot see. Asserted: the published free-size
    bounds (LDM <= 4/3, Michiels et al. 2007; LPT <= 4/3 - 1/(3k), Graham 1969) and regression bounds on ours.
    Run with ``pytest -s`` to see the numbers."""
    rng = np.random.default_rng(11)
    worst: dict[tuple[str, bool], float] = {}
    optimal = {True: 0, False: 0}
    trials = 200
    for _ in range(trials):
        k = int(rng.integers(2, 4))
        n = int(rng.integers(k, 11))
        x = np.maximum(1, np.round(rng.lognormal(4, 1, n)))
        for equal in (True, False):
            opt = brute_force_opt(x, k, equal)
            ratios = {fn.__name__: max_load(x, fn(x, k, equal)) / opt for fn in PARTITIONERS}
            for name, r in ratios.items():
                assert r >= 1 - 1e-12
                worst[name, equal] = max(worst.get((name, equal), 1.0), r)
            optimal[equal] += ratios["get_seqlen_balanced_partitions"] <= 1 + 1e-12
            if not equal:
                assert ratios["karmarkar_karp"] <= 4 / 3 + 1e-12
                assert ratios["greedy_partition"] <= 4 / 3 - 1 / (3 * k) + 1e-12
    print("worst ratio to optimum:", {f"{n}/{'equal' if e else 'free'}": round(r, 3) for (n, e), r in worst.items()})
    print("ours optimal on", {("equal" if e else "free"): f"{c}/{trials}" for e, c in optimal.items()})
    assert worst["get_seqlen_balanced_partitions", False] <= 1.06
    assert worst["get_seqlen_balanced_partitions", True] <= 1.03
    assert optimal[False] >= 0.88 * trials and optimal[True] >= 0.95 * trials


# -------------------------------------------------------------------------------------------------------- validation


@pytest.mark.parametrize("fn", PARTITIONERS)
@pytest.mark.parametrize(
    ("seqlens", "k", "match"),
    [
        ([1, 2, 3], 0, "k_partitions must be an integer >= 1"),
        ([1, 2, 3], -1, "k_partitions must be an integer >= 1"),
        ([1, 2, 3], 2.0, "k_partitions must be an integer"),
        ([1, 2, 3], True, "k_partitions must be an integer"),
        ([1, 2], 3, "fewer than k_partitions=3"),
        ([], 1, "fewer than k_partitions=1"),
        ([1, -2, 3], 2, "seqlens must be >= 0"),
        ([1, float("nan"), 3], 2, "seqlens must be finite"),
        ([1, float("inf"), 3], 2, "seqlens must be finite"),
        (["a", "b"], 1, "seqlens must contain int or float"),
        ([1, None], 1, "seqlens must contain int or float"),
        ([True, False], 1, "seqlens must contain int or float"),
        ([[1, 2], [3, 4]], 1, "seqlens must be a 1-D sequence"),
    ],
)
def test_invalid_inputs_raise_value_error_naming_the_argument(fn, seqlens, k, match):
    with pytest.raises(ValueError, match=match):
        fn(seqlens, k, True)


def test_no_assert_statements():
    """Validation must survive ``python -O``."""
    assert "assert " not in inspect.getsource(balance)


def test_float_workloads_are_accepted():
    x = [0.5, 1.25, 2.0, 3.75, 0.1]
    parts = get_seqlen_balanced_partitions(x, 2, False)
    assert max_load(x, parts) == pytest.approx(3.85)  # optimum: {3.75, 0.1} vs {0.5, 1.25, 2.0}


# -------------------------------------------------------------------------------------------------- GRPO-level API


def test_group_workloads_linear_and_quadratic():
    comp = [10, 20, 30, 40]  # two groups of two completions
    assert group_workloads([5, 5], comp, 2).tolist() == [40.0, 80.0]  # per-group prompt lengths
    assert group_workloads([5, 5, 6, 6], comp, 2).tolist() == [40.0, 82.0]  # per-completion prompt lengths
    # a*L + L^2 with a=2: L = 15, 25 -> 255 + 675; L = 36, 46 -> 1368 + 2208
    assert group_workloads([5, 5, 6, 6], comp, 2, quadratic_coef=2).tolist() == [930.0, 3576.0]


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        (([5], [1, 2, 3], 2), {}, "not a multiple of num_generations=2"),
        (([5, 5, 5], [1, 2, 3, 4], 2), {}, "prompt_lens must have one length per completion"),
        (([5], [1, 2], 0), {}, "num_generations must be an integer >= 1"),
        (([5], [1, -2], 2), {}, "completion_lens must be >= 0"),
        (([5], [1, 2], 2), {"quadratic_coef": -1.0}, "quadratic_coef"),
        (([5], [1, 2], 2), {"quadratic_coef": "2"}, "quadratic_coef"),
    ],
)
def test_group_workloads_validation(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        group_workloads(*args, **kwargs)


@FAST
@given(st.lists(st.integers(0, 10_000), max_size=40), st.integers(1, 9), st.booleans())
def test_balance_groups_never_crashes_and_keeps_counts_within_one(workloads, dp, equal_count):
    ranks = balance_groups(workloads, dp, equal_count=equal_count)
    assert len(ranks) == dp
    assert sorted(g for r in ranks for g in r) == list(range(len(workloads)))
    counts = [len(r) for r in ranks]
    if equal_count or len(workloads) < dp:
        assert max(counts) - min(counts) <= 1
    if len(workloads) >= dp:
        assert min(counts) >= 1


def test_balance_groups_beats_contiguous_split():
    rng = np.random.default_rng(0)
    comp = np.round(rng.lognormal(5, 1, 64 * 8))
    w = group_workloads([32] * 64, comp, 8)
    contiguous = max(w[r * 8 : (r + 1) * 8].sum() for r in range(8))
    balanced = balance_groups(w, 8)
    assert [len(r) for r in balanced] == [8] * 8
    assert max_load(w, balanced) < contiguous
    assert max_load(w, balanced) / (w.sum() / 8) < 1.03


@FAST
@given(st.lists(st.integers(0, 5000), max_size=30), st.integers(1, 6))
def test_balanced_micro_batches_contract(workloads, m):
    batches = balanced_micro_batches(workloads, m)
    assert len(batches) == m
    assert sorted(i for b in batches for i in b) == list(range(len(workloads)))
    if len(workloads) >= m:
        assert all(batches)
        assert max_load(workloads, batches) <= max_load(workloads, greedy_partition(workloads, m, False))
    budgets = loads_of(workloads, batches)
    assert budgets == sorted(budgets, reverse=True)  # heaviest first


def test_imbalance_metrics():
    m = imbalance_metrics([90, 110, 100, 100], [40, 160, 100, 100])
    assert m == {
        "balance/max_tokens": 110.0,
        "balance/min_tokens": 90.0,
        "balance/imbalance": pytest.approx(1.1),
        "balance/imbalance_unbalanced": pytest.approx(1.6),
    }
    assert imbalance_metrics([0, 0], [0, 0])["balance/imbalance"] == 1.0
    with pytest.raises(ValueError, match="rank_loads"):
        imbalance_metrics([], [1])
    with pytest.raises(ValueError, match="unbalanced_rank_loads must be >= 0"):
        imbalance_metrics([1], [-1])
