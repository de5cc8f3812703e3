"""The collectives CP attention uses, each recorded by an active :class:`CommCounter`.

What a record counts is what this rank puts on the wire for that call: for a p2p send the tensor
sent; for all-to-all the input minus the part kept locally; for all-gather and reduce-scatter the
input tensor (``numel`` is the number of elements, ``bytes`` the same in bytes).
"""

from __future__ import annotations

import contextvars
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

__all__ = [
    "CommCounter",
    "CommRecord",
    "all_gather_into_tensor",
    "all_to_all_single",
    "all_to_all_v",
    "reduce_scatter_tensor",
    "release",
    "ring_exchange",
]

_COUNTERS: contextvars.ContextVar[tuple[CommCounter, ...]] = contextvars.ContextVar(
    "megatron_hcp_comm_counters", default=()
)


@dataclass(frozen=True)
class CommRecord:
    """One communication call on this rank."""

    op: str
    group_size: int
    numel: int
    bytes: int
    dtype: torch.dtype
    peer: int | None = None


@dataclass
class CommCounter:
    """Context manager recording every CP-attention communication call on this rank.

    >>> with CommCounter() as counter:
    ...     out = context_parallel_attention(...)
    >>> counter.calls("send"), counter.numel("send")
    """

    records: list[CommRecord] = field(default_factory=list)
    _token: contextvars.Token | None = field(default=None, repr=False)

    def __enter__(self) -> CommCounter:
        self._token = _COUNTERS.set(_COUNTERS.get() + (self,))
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._token is not None
        _COUNTERS.reset(self._token)
        self._token = None

    def calls(self, op: str | None = None) -> int:
        return sum(1 for r in self.records if op is None or r.op == op)

    def numel(self, op: str | None = None) -> int:
        return sum(r.numel for r in self.records if op is None or r.op == op)

    def bytes(self, op: str | None = None) -> int:
        return sum(r.bytes for r in self.records if op is None or r.op == op)

    def summary(self) -> dict[str, int]:
        """Calls per op."""
        return dict(Counter(r.op for r in self.records))


def _record(op: str, numel: int, tensor: torch.Tensor, group, peer: int | None = None) -> None:
    counters = _COUNTERS.get()
    if not counters:
        return
    rec = CommRecord(
        op=op,
        group_size=dist.get_world_size(group),
        numel=numel,
        bytes=numel * tensor.element_size(),
        dtype=tensor.dtype,
        peer=peer,
    )
    for counter in counters:
        counter.records.append(rec)


def ring_exchange(
    send: torch.Tensor, recv: torch.Tensor, group: dist.ProcessGroup, next_rank: int,
    prev_rank: int
) -> list[dist.Work]:
    """Post ``send`` to ``next_rank`` and a receive into ``recv`` from ``prev_rank`` (global
    ranks); returns the works to wait on."""
    _record("send", send.numel(), send, group, peer=next_rank)
    ops = [
        dist.P2POp(dist.isend, send, next_rank, group),
        dist.P2POp(dist.irecv, recv, prev_rank, group),
    ]
    return dist.batch_isend_irecv(ops)


def all_to_all_single(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup) -> None:
    size = dist.get_world_size(group)
    _record("all_to_all", inp.numel() * (size - 1) // size, inp, group)
    dist.all_to_all_single(out, inp, group=group)


def all_to_all_v(out: torch.Tensor, inp: torch.Tensor, out_splits: list[int],
                 in_splits: list[int], group: dist.ProcessGroup) -> None:
    """All-to-all with uneven splits along dim 0 (counted: the rows not kept by this rank)."""
    row = inp[0].numel() if inp.shape[0] else 0
    kept = in_splits[dist.get_rank(group)] * row
    _record("all_to_all_v", inp.numel() - kept, inp, group)
    dist.all_to_all_single(out, inp, out_splits, in_splits, group=group)


def all_gather_into_tensor(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup,
                           async_op: bool = False) -> dist.Work | None:
    _record("all_gather", inp.numel(), inp, group)
    return dist.all_gather_into_tensor(out, inp, group=group, async_op=async_op)


def reduce_scatter_tensor(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup
                          ) -> None:
    _record("reduce_scatter", inp.numel(), inp, group)
    dist.reduce_scatter_tensor(out, inp, group=group)


def release(buffer: torch.Tensor, *keep: torch.Tensor) -> None:
    """Free the memory of ``buffer``, a communication buffer whose collective has finished
    and whose data is used, now - whoever still holds a reference to it: a backend's thread
    may hold a finished collective's tensors until it takes its next task (gloo's worker
    threads do), so without this what a rank holds after the call would depend on how fast
    its threads and peers are. The storage is resized to nothing (as FSDP frees gathered
    parameters); a tensor of it must not be read again. Nothing is freed where ``buffer``
    shares its storage with one of ``keep`` (a result that is a view of it, the caller's
    own tensor), nor on a device whose storages cannot be resized."""
    storage = buffer.untyped_storage()
    if any(t.untyped_storage().data_ptr() == storage.data_ptr() for t in keep):
        return
    try:
        storage.resize_(0)
    except (RuntimeError, NotImplementedError):  # a storage that cannot be resized
        pass
