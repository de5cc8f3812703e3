"""Kernel launches of a piece of code, counted on any device.

On a GPU the CP attention backend spends what it spends outside the attention kernel mostly on
launches: per-block merges, index gathers, copies. Counting them needs no GPU: every aten op
that runs a kernel passes torch's dispatcher after autograd, whatever the device.
:func:`count_launches` watches that point (a ``TorchDispatchMode``, which sees the ops of the
forward and of the backward, composite ops already split into the ops that run) and counts:

* ``kernels`` - aten ops that do work: every op except views (``OpOverload.is_view``),
  allocations and metadata (:data:`NO_KERNEL`) and ``.item()``-style reads; a fused attention
  op counts once, however many kernels it runs inside; ``nonzero`` counts here and as a sync;
* ``syncs`` - host reads of a tensor's value (:data:`SYNC`: ``.item()``, ``bool(t)``,
  ``nonzero``), each a host-device synchronisation where the tensor is on a GPU - on the CPU
  the counter cannot tell a read of host metadata (free) from one of device data, and a copy
  to the host (``.cpu()``, the sync on a GPU) is no op on the CPU at all;
* collectives (``c10d`` ops) are not counted: they are communication.

Counts are deterministic for given shapes, code and torch release, so a test can hold them to a
budget: a change that adds launches to CP attention fails on the CPU, in CI (issue #34). On the
CPU every op is counted; on a GPU the ops on host metadata (packing, permutations) are host
work rather than launches - the same overhead, paid on the host.

``fused=True`` counts the work that :mod:`.gpu.fused` compiles (a merge, a block's mask: each inside
:func:`fused_region`) as the kernels the compiled function launches on a GPU, named by its
region - what a GPU launches with ``MEGATRON_HCP_FUSED_OPS`` fusing them; the ops still run
eagerly here, where the counter watches them. Those kernel counts are inductor's expected Triton
kernels (a mask 1, a merge over a slice of rows 2, over gathered rows 4: work over [rows] and
over [rows, head dim] do not share a kernel); the CPU backend puts a compiled function into one
C++ function, so the CPU cannot confirm them and ``tests/gpu`` checks them. CPU only: on CUDA
the autograd engine runs the backward on threads that do not see the counter's context.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["NO_KERNEL", "SYNC", "LaunchCount", "count_launches", "fused_region"]

# aten ops that launch no kernel: allocations and metadata (views are found by their schema)
NO_KERNEL = frozenset(f"aten::{name}" for name in (
    "empty", "empty_like", "empty_strided", "lift_fresh", "resize_", "set_", "sym_size",
    "sym_stride", "sym_numel", "sym_storage_offset", "is_same_size", "is_nonzero",
    "_unsafe_view", "_reshape_alias",
))
# host reads of device values (a synchronisation on a GPU)
SYNC = frozenset({"aten::_local_scalar_dense", "aten::nonzero", "aten::is_nonzero"})


@dataclass(frozen=True)
class LaunchCount:
    """What one call launched: kernel-running ops (by name) and host synchronisations."""

    by_op: dict[str, int] = field(default_factory=dict)
    syncs: int = 0

    @property
    def kernels(self) -> int:
        return sum(self.by_op.values())

    def line(self) -> str:
        top = ", ".join(f"{n.removeprefix('aten::')} {c}"
                        for n, c in Counter(self.by_op).most_common(6))
        return f"{self.kernels} kernels, {self.syncs} syncs ({top})"


class _Watch(TorchDispatchMode):
    def __init__(self, fused: bool = False) -> None:
        super().__init__()
        self.kernels: Counter = Counter()
        self.syncs = 0
        self.fused = fused
        self.in_region = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        name = func._schema.name
        if name.startswith("aten::"):
            if name in SYNC:
                self.syncs += 1
            if not (func.is_view or name in NO_KERNEL or name == "aten::_local_scalar_dense"
                    or self.in_region):
                self.kernels[name] += 1
        return func(*args, **(kwargs or {}))


# the launch counter of this thread's code, where one counts (fused regions report to it)
_WATCHING: contextvars.ContextVar[_Watch | None] = contextvars.ContextVar(
    "megatron_hcp_launch_watch", default=None)


@contextlib.contextmanager
def fused_region(name: str, kernels: int = 1) -> Iterator[None]:
    """Work that :mod:`.gpu.fused` compiles, run eagerly here: a counter with ``fused=True``
    counts it as the ``kernels`` kernels of the compiled function, under ``name``; otherwise
    nothing changes."""
    watch = _WATCHING.get()
    if watch is None or not watch.fused:
        yield
        return
    watch.in_region += 1
    try:
        yield
    finally:
        watch.in_region -= 1
        if not watch.in_region:
            watch.kernels[name] += kernels


def count_launches(fn: Callable[..., Any], *args: Any, fused: bool = False, **kwargs: Any
                   ) -> tuple[Any, LaunchCount]:
    """Run ``fn(*args, **kwargs)`` and return its result and what it launched (module
    docstring; ``fused``: each :func:`fused_region` counted as its compiled function's
    kernels)."""
    with _Watch(fused) as watch:
        token = _WATCHING.set(watch)
        try:
            result = fn(*args, **kwargs)
        finally:
            _WATCHING.reset(token)
    return result, LaunchCount(dict(watch.kernels), watch.syncs)
