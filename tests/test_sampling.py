"""SequenceParallelRepeatRandomSampler: the axolotl layout, wrap-around, epochs, TRL parity and validation."""

from __future__ import annotations

import inspect

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from trl.trainer.utils import RepeatSampler

from grpo.algo import sampling
from grpo.algo.sampling import SequenceParallelRepeatRandomSampler as Sampler
from grpo.algo.sampling import sp_group_of

FAST = settings(max_examples=60, deadline=None)


def all_ranks(n: int, **kw) -> list[list[int]]:
    world = kw.pop("world_size")
    return [list(Sampler(range(n), world_size=world, rank=r, **kw)) for r in range(world)]


def expected_stream(n, mini, world, degree, bs, repeat, shuffle, seed, epoch, drop_last, rank) -> list[int]:
    """The contract as closed-form index arithmetic (a second formulation, not a copy of the implementation):
    position p of the stream belongs to chunk p // (bs * mini * repeat); wrap-around is a modulo on the order."""
    order = (
        torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
        if shuffle
        else list(range(n))
    )
    groups = world // degree
    chunk = bs * groups
    chunks = n // chunk if drop_last else -(-n // chunk)
    per_chunk = bs * mini * repeat
    g = rank // degree
    out = []
    for p in range(chunks * per_chunk):
        c, within = divmod(p, per_chunk)
        element = (within % (bs * mini)) // mini
        out.append(order[(c * chunk + g * bs + element) % n])
    return out


@st.composite
def configs(draw):
    degree = draw(st.integers(1, 3))
    groups = draw(st.integers(1, 3))
    cfg = dict(
        n=draw(st.integers(1, 30)),
        mini=draw(st.integers(1, 3)),
        world=degree * groups,
        degree=degree,
        bs=draw(st.integers(1, 4)),
        repeat=draw(st.integers(1, 3)),
        shuffle=draw(st.booleans()),
        seed=draw(st.integers(0, 2**31)),
        epoch=draw(st.integers(0, 5)),
        drop_last=draw(st.booleans()),
    )
    return cfg


def build(cfg, rank) -> Sampler:
    s = Sampler(
        range(cfg["n"]),
        mini_repeat_count=cfg["mini"],
        world_size=cfg["world"],
        rank=rank,
        batch_size=cfg["bs"],
        repeat_count=cfg["repeat"],
        sequence_parallel_degree=cfg["degree"],
        shuffle=cfg["shuffle"],
        seed=cfg["seed"],
        drop_last=cfg["drop_last"],
    )
    s.set_epoch(cfg["epoch"])
    return s


def test_axolotl_table_exactly():
    """seed 000: world 4, degree 2, mini_repeat 3, batch 2, repeat 4, no shuffle."""
    streams = all_ranks(
        8, mini_repeat_count=3, world_size=4, batch_size=2, repeat_count=4, sequence_parallel_degree=2, shuffle=False
    )
    sp0 = [0, 0, 0, 1, 1, 1] * 4 + [4, 4, 4, 5, 5, 5] * 4
    sp1 = [2, 2, 2, 3, 3, 3] * 4 + [6, 6, 6, 7, 7, 7] * 4
    assert streams == [sp0, sp0, sp1, sp1]


@FAST
@given(configs())
def test_every_rule_against_closed_form(cfg):
    chunk = cfg["bs"] * cfg["world"] // cfg["degree"]
    if cfg["drop_last"] and cfg["n"] < chunk:
        with pytest.raises(ValueError, match="drop_last"):
            build(cfg, 0)
        return
    streams = []
    for rank in range(cfg["world"]):
        s = build(cfg, rank)
        stream = list(s)
        assert len(stream) == len(s)  # exact __len__
        args = [cfg[k] for k in ("n", "mini", "world", "degree", "bs", "repeat", "shuffle", "seed", "epoch")]
        assert stream == expected_stream(*args, cfg["drop_last"], rank)
        streams.append(stream)
    # Every SP group yields the same count; ranks of one SP group yield identical data.
    assert len({len(s) for s in streams}) == 1
    for rank in range(cfg["world"]):
        assert streams[rank] == streams[(rank // cfg["degree"]) * cfg["degree"]]


@FAST
@given(configs())
def test_structure_repeats_and_coverage(cfg):
    chunk = cfg["bs"] * cfg["world"] // cfg["degree"]
    if cfg["drop_last"] and cfg["n"] < chunk:
        return
    mini, bs, repeat = cfg["mini"], cfg["bs"], cfg["repeat"]
    seen: list[int] = []
    for g in range(cfg["world"] // cfg["degree"]):
        stream = list(build(cfg, g * cfg["degree"]))
        block = bs * mini
        for c in range(0, len(stream), block * repeat):
            first = stream[c : c + block]
            # each index mini_repeat_count times in a row ...
            assert first == [i for i in first[::mini] for _ in range(mini)]
            # ... and the whole slice repeat_count times in a row before the next chunk
            assert stream[c : c + block * repeat] == first * repeat
            seen.extend(first[::mini])
    n = cfg["n"]
    if cfg["drop_last"]:  # a permutation prefix: no index twice, nothing invented
        assert len(seen) == len(set(seen)) == (n // chunk) * chunk
    else:  # everything is covered; only the wrapped tail repeats indices
        assert set(seen) == set(range(n))
        assert len(seen) == -(-n // chunk) * chunk


def test_wrap_around_many_times():
    """Dataset of 3 with chunk 8 wraps the order around more than twice: 0 1 2 0 1 2 0 1."""
    streams = all_ranks(3, mini_repeat_count=1, world_size=4, batch_size=2, shuffle=False)
    assert streams == [[0, 1], [2, 0], [1, 2], [0, 1]]
    s = Sampler(range(3), mini_repeat_count=2, world_size=4, rank=3, batch_size=2, repeat_count=3, shuffle=False)
    assert list(s) == [0, 0, 1, 1] * 3 and len(s) == 12


def test_epochs_reshuffle_and_restart_reproduces():
    a = Sampler(range(50), mini_repeat_count=2, world_size=2, rank=1, batch_size=3, seed=7)
    b = Sampler(range(50), mini_repeat_count=2, world_size=2, rank=1, batch_size=3, seed=7)  # "after restart"
    epochs = []
    for e in range(3):
        a.set_epoch(e)
        b.set_epoch(e)
        assert list(a) == list(b)
        epochs.append(list(a))
    assert epochs[0] != epochs[1] != epochs[2]
    order = torch.randperm(50, generator=torch.Generator().manual_seed(7 + 2)).tolist()
    assert epochs[2][:6] == [order[3], order[3], order[4], order[4], order[5], order[5]]
    assert list(a) == list(a)  # iterating twice in one epoch does not advance the shuffle


def test_order_is_rank_independent():
    """Rank only picks the slice: the union over SP groups of one chunk is the first chunk of the shared order."""
    seed, n = 3, 40
    firsts = [list(Sampler(range(n), mini_repeat_count=1, world_size=4, rank=r, batch_size=2, seed=seed))[:2]
              for r in range(4)]
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    assert sum(firsts, []) == order[:8]


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 25),
    mini=st.integers(1, 4),
    bs=st.integers(1, 6),
    repeat=st.integers(1, 3),
    shuffle=st.booleans(),
    seed=st.integers(0, 10_000),
)
def test_matches_trl_repeat_sampler_on_one_rank(n, mini, bs, repeat, shuffle, seed):
    """world_size = degree = 1 reproduces TRL's first epoch. TRL drops an incomplete final batch, so that is
    drop_last=True (a dataset smaller than one batch is a ValueError here, an empty epoch in TRL); drop_last=False
    yields TRL's output followed by one wrapped-around batch."""
    trl = list(RepeatSampler(range(n), mini_repeat_count=mini, batch_size=bs, repeat_count=repeat, shuffle=shuffle,
                             seed=seed))
    kw = dict(mini_repeat_count=mini, world_size=1, rank=0, batch_size=bs, repeat_count=repeat, shuffle=shuffle,
              seed=seed)
    if n >= bs:
        ours = Sampler(range(n), drop_last=True, **kw)
        assert list(ours) == trl and len(ours) == len(trl)
    else:
        assert trl == []
        with pytest.raises(ValueError, match="drop_last"):
            Sampler(range(n), drop_last=True, **kw)
    padded = list(Sampler(range(n), drop_last=False, **kw))
    assert padded[: len(trl)] == trl
    assert len(padded) - len(trl) == (bs * mini * repeat if n % bs else 0)


def test_sp_group_of():
    assert [sp_group_of(r, 2) for r in range(6)] == [0, 0, 1, 1, 2, 2]
    assert [sp_group_of(r, 1) for r in range(3)] == [0, 1, 2]
    with pytest.raises(ValueError, match="sequence_parallel_degree"):
        sp_group_of(0, 0)
    with pytest.raises(ValueError, match="rank"):
        sp_group_of(-1, 2)


BASE = dict(mini_repeat_count=2, world_size=4, rank=0, batch_size=2, repeat_count=1, sequence_parallel_degree=2)


@pytest.mark.parametrize(
    ("override", "names"),
    [
        ({"world_size": 6, "sequence_parallel_degree": 4}, ["world_size=6", "sequence_parallel_degree=4"]),
        ({"rank": 4}, ["rank", "[0, world_size=4)"]),
        ({"rank": -1}, ["rank"]),
        ({"rank": True}, ["rank"]),
        ({"mini_repeat_count": 0}, ["mini_repeat_count", ">= 1"]),
        ({"batch_size": -2}, ["batch_size", ">= 1"]),
        ({"repeat_count": 0}, ["repeat_count", ">= 1"]),
        ({"world_size": 0}, ["world_size", ">= 1"]),
        ({"sequence_parallel_degree": 0}, ["sequence_parallel_degree", ">= 1"]),
        ({"batch_size": 2.0}, ["batch_size"]),
        ({"seed": "0"}, ["seed"]),
    ],
)
def test_invalid_arguments_name_the_argument(override, names):
    with pytest.raises(ValueError) as info:
        Sampler(range(16), **{**BASE, **override})
    for name in names:
        assert name in str(info.value)


def test_invalid_dataset_and_epoch():
    with pytest.raises(ValueError, match="dataset must not be empty"):
        Sampler([], **BASE)
    with pytest.raises(ValueError, match="dataset must be Sized"):
        Sampler(iter(range(4)), **BASE)
    too_small = r"dataset has 3 samples.*batch_size \* num_sp_groups = 2 \* 2 = 4.*drop_last=True"
    with pytest.raises(ValueError, match=too_small):
        Sampler(range(3), drop_last=True, **BASE)
    s = Sampler(range(16), **BASE)
    for bad in (-1, 1.5, None):
        with pytest.raises(ValueError, match="epoch must be an integer >= 0"):
            s.set_epoch(bad)


def test_no_assert_statements():
    """Validation must survive ``python -O``."""
    assert "assert " not in inspect.getsource(sampling)


def test_works_as_dataloader_sampler():
    data = list(range(100, 112))
    s = Sampler(data, mini_repeat_count=2, world_size=2, rank=1, batch_size=3, shuffle=False)
    batches = [b.tolist() for b in torch.utils.data.DataLoader(data, batch_size=6, sampler=s)]
    assert batches == [[103, 103, 104, 104, 105, 105], [109, 109, 110, 110, 111, 111]]
