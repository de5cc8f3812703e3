"""Pack variable-length samples into one THD micro-batch and cut it for a CP rank (pure).

A sample is an int64 tensor ``[3, L]``: input tokens, labels, loss mask (0/1). With a CP group
of ``c`` ranks every sequence is padded to a multiple of the layout's unit (padding has loss mask
0 and lies outside ``cu_seqlens``, inside ``cu_seqlens_padded``) and the rank keeps its part of
each sequence: in the zigzag layout (the default, as Transformer Engine's THD layout expects) the
load-balanced chunks ``r`` and ``2c-1-r`` of ``2c``, in the contiguous layout slice ``r`` of
``c``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch

from ..sharding import (
    DEFAULT_CP_PARTITION_MODE,
    MicroBatch,
    check_partition_mode,
    padded_length,
    thd_partition_indices,
)

__all__ = ["carries_partition_mode", "pack_thd"]


@functools.cache
def carries_partition_mode(packed_seq_params_class: type) -> bool:
    """Whether this megatron-core's ``PackedSeqParams`` has upstream's ``cp_partition_mode``
    field (megatron's development branch; no release up to 0.19.2)."""
    return any(f.name == "cp_partition_mode"
               for f in dataclasses.fields(packed_seq_params_class))


def pack_thd(samples: list[torch.Tensor], cp_size: int, cp_rank: int, cp_group: Any = None,
             *, dynamic: bool = False, levels: list[Any] | None = None,
             pad_multiple: int = 1,
             cp_partition_mode: str = DEFAULT_CP_PARTITION_MODE) -> MicroBatch:
    """Pack ``samples`` (each ``[3, L]``) for CP rank ``cp_rank`` of ``cp_size``.

    ``dynamic`` sets ``local_cp_size``/``cp_group`` in the ``PackedSeqParams`` (the per
    micro-batch group of dynamic CP); otherwise the model's static CP group applies. ``levels``
    (dynamic hierarchical CP) are the group's ``[a2a, p2p]`` level groups, carried as
    ``PackedSeqParams.hierarchical_cp_groups`` (``cp_group`` stays the flat group: RoPE and MTP
    read positions from it). ``pad_multiple``: sequences are padded to a multiple of
    ``2 * cp_size * pad_multiple`` (zigzag) or ``cp_size * pad_multiple`` (contiguous), with
    ``pad_multiple`` the TP size under sequence parallelism. ``cp_partition_mode`` is carried
    on the ``PackedSeqParams`` where the installed megatron-core has upstream's field.
    """
    from megatron.core.packed_seq_params import PackedSeqParams

    if not samples:
        raise ValueError("pack_thd needs at least one sample")
    if cp_size > 1 and not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank={cp_rank} outside a CP group of {cp_size}")
    mode = check_partition_mode(cp_partition_mode)
    lengths = [int(s.shape[1]) for s in samples]
    padded = [padded_length(n, cp_size, pad_multiple, cp_partition_mode=mode) for n in lengths]
    total = sum(padded)
    data = torch.zeros(3, total, dtype=torch.int64)
    positions = torch.zeros(total, dtype=torch.int64)
    start = 0
    for sample, n, p in zip(samples, lengths, padded):
        data[:, start:start + n] = sample
        positions[start:start + p] = torch.arange(p)
        start += p
    cu = torch.zeros(len(samples) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths, dtype=torch.int32).cumsum(0)
    cu_pad = torch.zeros(len(samples) + 1, dtype=torch.int32)
    cu_pad[1:] = torch.tensor(padded, dtype=torch.int32).cumsum(0)
    if cp_size > 1:
        idx = thd_partition_indices(cu_pad, cp_size, cp_rank, cp_partition_mode=mode)
        data, positions = data[:, idx], positions[idx]
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        cu_seqlens_q_padded=cu_pad,
        cu_seqlens_kv_padded=cu_pad,
        max_seqlen_q=max(padded),
        max_seqlen_kv=max(padded),
        **({"cp_partition_mode": mode} if carries_partition_mode(PackedSeqParams) else {}),
    )
    if dynamic:
        params.local_cp_size = cp_size
        params.cp_group = cp_group if cp_size > 1 else None
        params.hierarchical_cp_groups = levels if cp_size > 1 else None
    return MicroBatch(
        tokens=data[0].unsqueeze(0),
        labels=data[1].unsqueeze(0),
        loss_mask=data[2].unsqueeze(0).float(),
        position_ids=positions.unsqueeze(0),
        packed_seq_params=params,
    )
