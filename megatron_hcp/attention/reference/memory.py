"""Live tensor bytes of a piece of code, counted on any device.

CP exists so that a long sequence fits in a GPU's memory; what CP attention keeps from its
forward for its backward, and the most it holds at once, can be counted without a GPU: every
aten op that allocates passes torch's dispatcher, whatever the device. :class:`LiveBytes` (a
``TorchDispatchMode``, like :mod:`.launches`) watches that point and tracks **storages**, not
tensors:

* an op *creates* a storage when one of its outputs has a storage that none of its inputs has
  (views and in-place ops return an input's storage: counted once, by storage; ``lift_fresh``,
  the op ``torch.tensor`` ends in, hands on a storage made outside the dispatcher: counted);
* a storage is *alive* until its last holder drops it - a tensor, a view, a tensor autograd
  saved, a communication backend's thread. The counter holds a C++ weak reference to each
  storage (``UntypedStorage._weak_ref``, what ``torch.multiprocessing``'s ``StorageWeakRef``
  holds) and sweeps them after every op and at every read: a finalizer on the Python storage
  object would fire when that wrapper dies, which may be long before the storage (it is not
  kept alive by the tensors that share the storage);
* a storage's bytes are re-read at each sweep, so a storage resized in place (an ``out=``
  op, ``UntypedStorage.resize_`` - which does not pass the dispatcher) counts at its size.

``current`` is the bytes of the live storages, ``peak`` the most seen right after an op (the
moment an allocation can raise it), :meth:`LiveBytes.mark` the bytes alive at a point of the
caller's choosing. Storages made before the counter started are not counted, nor memory a
kernel allocates inside itself (workspaces) or a backend outside torch's tensors (gloo's, NCCL's
buffers). On CUDA the autograd engine runs the backward on threads of its own, which a dispatch
mode does not see: count backward on the CPU, or run it under the counter on that thread.
"""

from __future__ import annotations

import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["LiveBytes", "LiveStorage", "StepMemory", "measure_step"]

# ops whose output storage was made outside the dispatcher (torch.tensor's data)
_FRESH = frozenset({"aten::lift_fresh", "aten::lift_fresh_copy", "aten::lift"})


@dataclass
class LiveStorage:
    """One tracked storage: its bytes (as last read), the op that created it, its device and,
    where the counter was asked to trace, the line of code the op ran from."""

    nbytes: int
    op: str
    device: torch.device
    ref: StorageWeakRef = field(repr=False)
    where: str = ""


def _caller(skip: str) -> str:
    """``file:line function`` of the innermost frame outside this module and torch whose file
    contains ``skip`` (the code that asked for the op)."""
    for frame in reversed(traceback.extract_stack()):
        if skip in frame.filename and not frame.filename.endswith("memory.py"):
            return f"{frame.filename.rsplit('/', 1)[-1]}:{frame.lineno} {frame.name}"
    return ""


def _storages(values: Any) -> Iterator[torch.UntypedStorage]:
    """The untyped storages of the tensors among ``values`` (nested), skipping tensors that
    have none (sparse, nested, meta)."""
    for value in tree_leaves(values):
        if isinstance(value, torch.Tensor) and value.layout == torch.strided:
            if value.device.type == "meta":
                continue
            try:
                yield value.untyped_storage()
            except (RuntimeError, NotImplementedError):  # a tensor without a storage
                continue


class LiveBytes(TorchDispatchMode):
    """Context manager counting the live bytes of the storages ops create (module docstring).

    >>> with LiveBytes() as mem:
    ...     out = attention(q, k, v)
    ...     kept = mem.mark("forward")
    ...     out.backward(dout)
    >>> mem.peak, mem.marks["forward"]
    """

    def __init__(self, trace: str | None = None) -> None:
        """``trace``: record for each storage the innermost line of code whose file path
        contains this string (e.g. ``"megatron_hcp"``), and keep the storages alive at the
        peak in ``at_peak`` - slow, for finding where memory goes."""
        super().__init__()
        self._live: dict[int, LiveStorage] = {}  # by the storage's C++ address
        self._current = 0
        self.peak = 0
        self.marks: dict[str, int] = {}
        self.trace = trace
        self.at_peak: list[LiveStorage] = []

    # ------------------------------------------------------------------ tracking
    def _sweep(self) -> None:
        """Forget the storages that died; re-read the bytes of the others."""
        dead = []
        for key, entry in self._live.items():
            if entry.ref.expired():
                dead.append(key)
                continue
            storage = torch.UntypedStorage._new_with_weak_ptr(entry.ref.cdata)
            nbytes = storage.nbytes() if storage is not None else 0
            self._current += nbytes - entry.nbytes
            entry.nbytes = nbytes
        for key in dead:
            self._current -= self._live.pop(key).nbytes

    def _track(self, storage: torch.UntypedStorage, op: str) -> None:
        key = storage._cdata
        if key in self._live:
            return
        entry = LiveStorage(storage.nbytes(), op, storage.device, StorageWeakRef(storage),
                            _caller(self.trace) if self.trace else "")
        self._live[key] = entry
        self._current += entry.nbytes

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        name = func._schema.name
        inputs = {s._cdata for s in _storages((args, kwargs))} if name not in _FRESH else set()
        self._sweep()
        for storage in _storages(result):
            if storage._cdata not in inputs:
                self._track(storage, name)
        if self._current > self.peak:
            self.peak = self._current
            if self.trace:
                self.at_peak = [LiveStorage(e.nbytes, e.op, e.device, e.ref, e.where)
                                for e in sorted(self._live.values(), key=lambda e: -e.nbytes)]
        return result

    # ------------------------------------------------------------------ reading
    @property
    def current(self) -> int:
        """Bytes of the storages alive now."""
        self._sweep()
        return self._current

    def mark(self, name: str) -> int:
        """Record (in ``marks``) and return the bytes alive now."""
        self.marks[name] = self.current
        return self.marks[name]

    def reset_peak(self) -> None:
        """Start the peak again from what is alive now."""
        self.peak = self.current

    def live(self) -> list[LiveStorage]:
        """The storages alive now, largest first."""
        self._sweep()
        return sorted(self._live.values(), key=lambda e: -e.nbytes)

    def by_op(self) -> dict[str, int]:
        """Bytes alive now per op that created them (where memory is held)."""
        counts: Counter = Counter()
        for entry in self.live():
            counts[entry.op] += entry.nbytes
        return dict(counts.most_common())

    def by_device(self) -> dict[str, int]:
        """Bytes alive now per device."""
        counts: Counter = Counter()
        for entry in self.live():
            counts[str(entry.device)] += entry.nbytes
        return dict(counts)


@dataclass(frozen=True)
class StepMemory:
    """What one forward and backward held: bytes alive after the forward (the inputs made in
    it dropped, its output held: what the autograd graph keeps), the peak over forward and
    backward, and the bytes alive after the backward (the gradients)."""

    kept: int
    peak: int
    after: int

    def ratios(self, baseline: StepMemory) -> tuple[float, float]:
        """(kept, peak) of this step over ``baseline``'s."""
        return self.kept / baseline.kept, self.peak / baseline.peak


def measure_step(forward: Callable[..., torch.Tensor], leaves: list[torch.Tensor],
                 grad: torch.Tensor) -> StepMemory:
    """Count one step as a model runs it: the inputs are made inside the step as tensors of
    the graph (a copy of each of ``leaves``, which require grad, as a projection makes q, k,
    v), ``forward(*inputs)`` runs, the inputs are dropped (the model keeps only what autograd
    saved), the output's backward runs with ``grad`` and nothing but the graph holds the output
    (the next layer's backward has released it). ``leaves`` and ``grad`` exist before the
    counter starts and are not counted; the gradients of ``leaves`` are."""
    for leaf in leaves:
        leaf.grad = None
    with LiveBytes() as mem:
        inputs = [leaf.clone() for leaf in leaves]
        out = forward(*inputs)
        del inputs
        kept = mem.mark("forward")
        # the backward starts from the output's edge, not the output: a model's next layer
        # releases its reference to the attention's output in its own backward, which runs
        # first, so the attention's backward is then all that may hold it
        edge = torch.autograd.graph.get_gradient_edge(out)
        del out
        torch.autograd.backward(edge, grad)
        del edge
        after = mem.mark("backward")
    return StepMemory(kept, mem.peak, after)
