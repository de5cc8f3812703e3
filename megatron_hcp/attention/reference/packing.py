"""The packing of a ``thd`` attention call, read from its ``cu_seqlens`` once per packing.

Every layer of a micro-batch passes the same ``cu_seqlens`` tensors (megatron's
``PackedSeqParams``), and on a GPU each read of them by the host is a synchronisation: the host
waits for the GPU to drain its queue before it can enqueue the layer's next kernels. The
lengths they describe, checked, are therefore kept per tensor object while it lives and is not
modified in place (its version counter): the first layer reads and checks, the others find
them. A new tensor, or one written in place by a torch op (``copy_``, indexing, ``fill_``:
they bump its version counter), is read again; an entry is trusted only while weak references
show its very tensors alive (an id alone may be reused by a later tensor). Bad packings raise
at every call (nothing is kept for them).

The rule for a ``cu_seqlens`` buffer kept across micro-batches: refill it with torch in-place
ops, or pass a new tensor. Writes torch does not count - through ``.data``, a numpy array or
DLPack alias of its memory, another tensor on the same storage, a collective such as
``torch.distributed.broadcast`` into it, a custom kernel - leave the version as it was; after
such a write call :func:`forget_packings` (megatron-core and Megatron-Bridge build new tensors
for every micro-batch).
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass

import torch

from ...sharding import seq_lengths
from .seq_layout import CPAttentionError, check_cu_seqlens

__all__ = ["KEPT_PACKINGS", "forget_packings", "packing_lengths"]

KEPT_PACKINGS = 8  # a micro-batch needs one; pipeline schedules hold a few in flight


@dataclass(frozen=True)
class _Entry:
    refs: tuple[weakref.ref, ...]
    versions: tuple[int, ...]
    lengths: tuple[tuple[int, ...], tuple[int, ...]]


_KEPT: OrderedDict[tuple, _Entry] = OrderedDict()
_LOCK = threading.Lock()  # rank threads of one process share the cache


def _versions(tensors: tuple[torch.Tensor, ...]) -> tuple[int, ...] | None:
    try:
        return tuple(t._version for t in tensors)
    except RuntimeError:  # inference-mode tensors have no version counter: read every time
        return None


def _read(cu_q: torch.Tensor, cu_kv: torch.Tensor, pad_q: torch.Tensor, pad_kv: torch.Tensor,
          cp: int, mode: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    # each distinct tensor read once (megatron passes the same tensor as q's and kv's)
    host = {id(t): t.cpu() for t in (cu_q, cu_kv, pad_q, pad_kv)}
    cu_host, pad_host = host[id(cu_q)], host[id(pad_q)]
    if not (torch.equal(cu_host, host[id(cu_kv)]) and torch.equal(pad_host, host[id(pad_kv)])):
        raise CPAttentionError(
            "cu_seqlens_q/_kv (and their padded forms) differ; CP attention supports "
            "self-attention with one packing"
        )
    check_cu_seqlens(cu_host, pad_host, cp, cp_partition_mode=mode)
    return tuple(seq_lengths(pad_host)), tuple(seq_lengths(cu_host))


def packing_lengths(cu_q: torch.Tensor, cu_kv: torch.Tensor, pad_q: torch.Tensor,
                    pad_kv: torch.Tensor, cp: int, mode: str
                    ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(padded, real) lengths of the packed sequences, checked for CP size ``cp`` in layout
    ``mode`` (``check_cu_seqlens``): read on the host at the first call with these tensors,
    found again while they live unmodified."""
    tensors = (cu_q, cu_kv, pad_q, pad_kv)
    key = (*(id(t) for t in tensors), cp, mode)
    versions = _versions(tensors)
    with _LOCK:
        entry = _KEPT.get(key)
        if (entry is not None and entry.versions == versions
                and all(ref() is t for ref, t in zip(entry.refs, tensors))):
            _KEPT.move_to_end(key)
            return entry.lengths
    lengths = _read(*tensors, cp, mode)
    if versions is not None:
        with _LOCK:
            _KEPT[key] = _Entry(tuple(weakref.ref(t) for t in tensors), versions, lengths)
            _KEPT.move_to_end(key)
            while len(_KEPT) > KEPT_PACKINGS:
                _KEPT.popitem(last=False)
    return lengths


def forget_packings() -> None:
    """Forget every packing kept, so that the next call reads ``cu_seqlens`` again (after a
    write torch does not count: module docstring)."""
    with _LOCK:
        _KEPT.clear()
