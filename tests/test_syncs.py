"""The device-wait counter of ``benchmarks/step_overhead`` (``benchmarks/_syncs.py``): what it counts, what it leaves
out, and where it says each wait comes from. Every figure of that benchmark's sync columns rests on these."""

from __future__ import annotations

import torch

from benchmarks._syncs import SyncCounter

HERE = "tests/test_syncs.py"


def _line(counter: SyncCounter) -> set[str]:
    return {origin.rsplit(":", 1)[0] for origin in counter.by_origin}


def test_reads_of_device_values_are_counted_where_they_are_made():
    on_device = torch.ones(4, device="cpu")  # a factory call with a device: the accelerator's, in GPU code
    with SyncCounter() as counter:
        on_device.sum().item()
        if on_device.any():
            pass
        on_device.nonzero()
        on_device[on_device > 0]
        on_device.tolist()
    assert dict(counter.by_kind) == {"item": 1, "bool": 1, "nonzero": 1, "bool_index": 1, "tolist": 1}
    assert _line(counter) == {HERE}, counter.by_origin


def test_host_tensors_cost_nothing_and_copies_count_once():
    """TRL's ``[c.tolist() for c in ids.cpu()]``: one copy waits, the rows it then reads are on the host."""
    with SyncCounter() as counter:
        ids = torch.arange(12, device="cpu").reshape(3, 4)
        rows = [c.tolist() for c in ids.cpu()]
        host = torch.tensor([1.0, 2.0])  # made from Python data, no device: the host
        float(host.sum()), host.tolist(), bool(host.any())
    assert rows[2] == [8, 9, 10, 11]
    assert dict(counter.by_kind) == {"cpu": 1}, counter.by_kind


def test_a_counted_call_is_counted_once_and_nothing_outside_the_block():
    x = torch.ones(3, device="cpu")
    x.item() if x.numel() == 1 else None
    with SyncCounter() as counter:
        torch.unique(x)  # unique's own internals are not counted again
    x.sum().item()
    assert counter.total == 1 and dict(counter.by_kind) == {"unique": 1}
    assert counter.report(steps=2)["syncs_per_step"] == 0.5
