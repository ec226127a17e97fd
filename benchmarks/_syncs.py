"""Count the operations that would make the host wait for the device on CUDA, on any device.

A CUDA step is as fast as its host side lets it be only while the host runs ahead of the GPU; every read of a
tensor's value on the host (``.item()``, ``.tolist()``, ``bool(t)`` / ``if t:``, a copy to the CPU) and every op whose
output shape depends on the data (``nonzero``, ``unique``, boolean-mask indexing) waits for the queue to drain. On the
CPU these cost nothing, which is why a CPU run hides them: this counter finds them there. It is a
``TorchFunctionMode``, so it sees the calls made from Python (ours, TRL's, transformers') and not the ones made inside
torch's own C++ code; the nested calls a counted op makes are not counted again (the mode is off while the op runs).

On the CPU every tensor is on the host, so the counter keeps its own idea of where each tensor would be on CUDA, and
counts a call only on a tensor that would be on the device: the results of ``.cpu()``, ``.numpy()``, ``.to("cpu")``
and of factory calls without a ``device`` (``torch.tensor(list)``, data from the collator) live on the host, and so
does whatever is computed from host tensors only; ``.to(device)`` with a ``torch.device`` (the accelerator's, in code
written for GPUs) and factory calls with a ``device`` put a tensor on the device, and model parameters are there.
TRL's ``[c[m].tolist() for c, m in zip(ids.cpu(), mask.cpu())]`` is thus one wait (the two copies are its only
waits, the first of them), not one per row.

Each counted call is attributed to the first frame outside torch, as ``path:line`` relative to its package
(``grpo/training/trainer.py:120``, ``trl/trainer/grpo_trainer.py:1500``), so a report can say where ours come from.
"""

from __future__ import annotations

import collections
import sys
import weakref
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_T = torch.Tensor
SYNCING = {
    _T.item: "item", _T.tolist: "tolist", _T.cpu: "cpu", _T.numpy: "numpy", _T.__bool__: "bool",
    _T.__int__: "int", _T.__float__: "float", _T.__index__: "index", _T.nonzero: "nonzero", torch.nonzero: "nonzero",
    _T.unique: "unique", torch.unique: "unique", torch.unique_consecutive: "unique", _T.masked_select: "masked_select",
    torch.masked_select: "masked_select", torch.repeat_interleave: "repeat_interleave",
    _T.repeat_interleave: "repeat_interleave",
}
"""Calls that wait for the device on CUDA, by the name reported. ``repeat_interleave`` waits only with tensor
repeats and no ``output_size``; ``__getitem__`` only with a boolean index (below)."""
CREATING = {torch.tensor, torch.as_tensor}
"""Tensors made from host data: with a ``device`` they are a blocking host-to-device copy on CUDA."""

_TORCH_DIR = str(Path(torch.__file__).parent)
_HERE = __file__
_REPO = Path(__file__).resolve().parent.parent


def _has_device_target(args: tuple, kwargs: dict) -> bool:
    return any(isinstance(a, (torch.device, str)) for a in (*args[1:], kwargs.get("device")))


def _syncing_name(func: Any, args: tuple, kwargs: dict) -> str | None:
    name = SYNCING.get(func)
    if name == "repeat_interleave":
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
        return name if isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None else None
    if name is not None:
        return name
    if func is _T.to and _has_device_target(args, kwargs):
        # ``.to(device)``: a copy to the CPU waits for the device; a host tensor sent to the accelerator is a blocking
        # copy (non_blocking=False); one already there is free. On the CPU the three look alike: all are counted.
        return "to_device"
    if func in CREATING and kwargs.get("device") is not None:
        return "tensor_to_device"
    if func is _T.__getitem__ and len(args) > 1:
        index = args[1] if isinstance(args[1], tuple) else (args[1],)
        if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index):
            return "bool_index"
    if func is torch.where and len(args) == 1 and not kwargs:
        return "where_1arg"
    return None


def _tensors(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    found = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            found.append(a)
        elif isinstance(a, (list, tuple)):
            found.extend(x for x in a if isinstance(x, torch.Tensor))
    return found


def _to_host(func: Any, args: tuple, kwargs: dict) -> bool | None:
    """Whether a call's result lives on the host (True), the device (False), or where its inputs do (None)."""
    if func in (_T.cpu, _T.numpy):
        return True
    if func is _T.to:
        for a in (*args[1:], kwargs.get("device")):
            if isinstance(a, str):
                return a.startswith("cpu")
            if isinstance(a, torch.device):
                return False
        return None
    return None


def _short(path: Path) -> str:
    """A source file as a person names it: relative to this checkout (``grpo/training/trainer.py``) or to its
    installed package's folder (``trl/trainer/grpo_trainer.py``)."""
    if path.is_relative_to(_REPO):
        return path.relative_to(_REPO).as_posix()
    parts = path.parts
    if "site-packages" in parts:
        return "/".join(parts[len(parts) - parts[::-1].index("site-packages"):])
    return "/".join(parts[-3:])


def _origin() -> str:
    """``package/path.py:line`` of the innermost frame outside torch and this file."""
    frame = sys._getframe(1)
    while frame is not None:
        path = frame.f_code.co_filename
        if not path.startswith(_TORCH_DIR) and path != _HERE:
            return f"{_short(Path(path))}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


class SyncCounter(TorchFunctionMode):
    """``with SyncCounter() as c: ...`` counts the device-waiting calls made in this thread, by origin and kind."""

    def __init__(self) -> None:
        super().__init__()
        self.by_origin: collections.Counter[str] = collections.Counter()
        self.by_kind: collections.Counter[str] = collections.Counter()
        self._host: set[int] = set()  # ids of live tensors on the host; a finalizer drops each with its tensor

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = _tensors(args, kwargs)
        inputs_on_host = all(id(t) in self._host for t in inputs)
        name = _syncing_name(func, args, kwargs)
        on_host = bool(args) and isinstance(args[0], torch.Tensor) and id(args[0]) in self._host
        if name is not None and not on_host:
            self.by_kind[name] += 1
            self.by_origin[_origin()] += 1
        out = func(*args, **kwargs)
        host = _to_host(func, args, kwargs)
        if host is None:
            host = inputs_on_host if inputs else kwargs.get("device") is None
        if host:
            for t in out if isinstance(out, (list, tuple)) else (out,):
                if isinstance(t, torch.Tensor) and id(t) not in self._host:
                    self._host.add(id(t))
                    weakref.finalize(t, self._host.discard, id(t))
        return out

    @property
    def total(self) -> int:
        return sum(self.by_kind.values())

    def report(self, steps: int, top: int = 10) -> dict:
        """Per optimizer step: the total, those made in ``grpo/``, by kind, and the ``top`` origins (``file:line``)."""
        per = max(1, steps)
        ours = sum(n for origin, n in self.by_origin.items() if origin.startswith("grpo/"))
        return {
            "syncs_per_step": round(self.total / per, 2),
            "syncs_from_grpo_per_step": round(ours / per, 2),  # made in this platform's own code
            "syncs_by_kind_per_step": {k: round(v / per, 2) for k, v in self.by_kind.most_common()},
            "syncs_top_origins_per_step": {k: round(v / per, 2) for k, v in self.by_origin.most_common(top)},
        }
