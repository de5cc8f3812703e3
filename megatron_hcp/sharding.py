"""Which tokens a CP rank holds: the two partition layouts, packed (THD) sequences, padding,
assembly.

Two layouts (``cp_partition_mode``, upstream megatron's name):

* ``"zigzag"`` (the default; megatron's ``get_batch_on_this_cp_rank``): every sequence is cut
  into ``2*cp`` equal chunks and CP position ``r`` holds chunks ``r`` and ``2*cp-1-r`` (its
  *first* and *second half*), so causal attention work is the same on every rank;
* ``"contiguous"``: every sequence is cut into ``cp`` equal slices and position ``r`` holds the
  ``r``-th (causal work grows with ``r``; a sliding window needs only the preceding slices).

For packed ``thd`` data each sequence is cut separately, so every padded sequence length must be
a multiple of the layout's unit (:func:`layout_unit`: ``2*cp`` or ``cp``; :func:`padded_length` is
the one rule, :func:`pad_thd` pads); a length that is not is refused, never truncated.
``cu_seqlens`` always describe the full (unsharded) packed batch, as in Transformer Engine and
megatron's ``PackedSeqParams``.

This module sits below the attention backend, the dynamic-CP packing and the training data
(all of which import it); it imports nothing of the project.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "CP_PARTITION_MODES",
    "DEFAULT_CP_PARTITION_MODE",
    "MicroBatch",
    "ShardingError",
    "assemble_from_chunks",
    "check_partition_mode",
    "contiguous_window_reach",
    "gather_from_cp",
    "get_local_chunk",
    "layout_unit",
    "pad_thd",
    "padded_length",
    "seq_dim",
    "seq_lengths",
    "thd_partition_indices",
]

CP_PARTITION_MODES = ("zigzag", "contiguous")
DEFAULT_CP_PARTITION_MODE = "zigzag"  # megatron's layout; the one place it is decided here


class ShardingError(ValueError):
    """Bad sharding input (format, lengths, layout), raised before any collective starts."""


@dataclass
class MicroBatch:
    """One micro-batch as a rank's model sees it (already sharded for its CP position)."""

    tokens: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor
    packed_seq_params: Any = None

    def to(self, device: torch.device | str) -> MicroBatch:
        """This micro-batch with its tensors and its packed-sequence boundaries on ``device``;
        itself when they are all there (a CPU run copies nothing). ``packed_seq_params`` is
        copied, never changed in place."""
        device = torch.device(device)
        params = self.packed_seq_params
        held = [self.tokens, self.labels, self.loss_mask, self.position_ids]
        if params is not None:
            held += [v for v in vars(params).values() if isinstance(v, torch.Tensor)]
        if all(t.device == device for t in held):
            return self
        if params is not None:
            params = copy.copy(params)
            for name, value in list(vars(params).items()):
                if isinstance(value, torch.Tensor):
                    setattr(params, name, value.to(device))
        return dataclasses.replace(
            self, tokens=self.tokens.to(device), labels=self.labels.to(device),
            loss_mask=self.loss_mask.to(device), position_ids=self.position_ids.to(device),
            packed_seq_params=params)


def check_partition_mode(cp_partition_mode: object) -> str:
    """``cp_partition_mode`` if it names a layout, else a :class:`ShardingError` saying which."""
    if cp_partition_mode not in CP_PARTITION_MODES:
        raise ShardingError(
            f"cp_partition_mode={cp_partition_mode!r}: use one of {', '.join(CP_PARTITION_MODES)} "
            "(zigzag: chunks r and 2cp-1-r of every sequence; contiguous: the r-th slice)")
    return str(cp_partition_mode)


def layout_unit(cp_size: int, cp_partition_mode: str = DEFAULT_CP_PARTITION_MODE) -> int:
    """The number of equal pieces a sequence is cut into: ``2*cp`` (zigzag; also for one
    rank, the attention's two-halves layout) or ``cp`` (contiguous)."""
    cp = max(1, cp_size)
    return 2 * cp if check_partition_mode(cp_partition_mode) == "zigzag" else cp


def contiguous_window_reach(slice_tokens: float, left: int, ring_size: int) -> int:
    """How many slices before its own a rank of the contiguous layout needs under a causal
    window of ``left`` tokens back, with slices of ``slice_tokens`` on a ring of ``ring_size``:
    ``ceil(left / slice_tokens)``, at most ``ring_size - 1`` (the zigzag layout needs both
    neighbours, so its ring is always whole)."""
    if slice_tokens <= 0:
        return 0
    return min(ring_size - 1, math.ceil(left / slice_tokens))


def padded_length(length: int, cp_size: int, multiple: int = 1, *,
                  cp_partition_mode: str = DEFAULT_CP_PARTITION_MODE) -> int:
    """Length of one sequence after padding for ``cp_size`` CP ranks: the next multiple of the
    layout's unit (:func:`layout_unit`), times ``multiple`` (the TP size under sequence
    parallelism, which splits each rank's tokens over the TP ranks). No more than the layout
    needs: a contiguous slice needs a multiple of ``cp``, not ``2*cp``."""
    if multiple < 1:
        raise ValueError(f"multiple={multiple} must be >= 1")
    unit = layout_unit(cp_size, cp_partition_mode) * multiple
    return -(-length // unit) * unit


def seq_dim(qkv_format: str) -> int:
    """The sequence dimension of a ``bshd``, ``sbhd`` or ``thd`` tensor."""
    try:
        return {"bshd": 1, "sbhd": 0, "thd": 0}[qkv_format]
    except KeyError:
        raise ShardingError(
            f"qkv_format={qkv_format!r}: use one of bshd, sbhd, thd"
        ) from None


def seq_lengths(cu_seqlens: torch.Tensor) -> list[int]:
    cu = [int(x) for x in cu_seqlens.tolist()]
    return [b - a for a, b in zip(cu[:-1], cu[1:])]


def _check_cp_position(cp_size: int, cp_rank: int) -> None:
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ShardingError(
            f"cp_size={cp_size}, cp_rank={cp_rank}: need cp_size >= 1 and 0 <= cp_rank < cp_size")


def _pieces(cp_size: int, cp_rank: int, mode: str) -> tuple[int, ...]:
    """Which of a sequence's :func:`layout_unit` pieces ``cp_rank`` holds, in local order."""
    return (cp_rank, 2 * cp_size - 1 - cp_rank) if mode == "zigzag" else (cp_rank,)


def thd_partition_indices(cu_seqlens_padded: torch.Tensor, cp_size: int, cp_rank: int, *,
                          cp_partition_mode: str = DEFAULT_CP_PARTITION_MODE) -> torch.Tensor:
    """Global token indices held by ``cp_rank`` (zigzag: TE's ``thd_get_partitioned_indices``).

    Every sequence length in ``cu_seqlens_padded`` must be a multiple of the layout's unit
    (:func:`pad_thd`); anything else would drop tokens, so it is refused."""
    _check_cp_position(cp_size, cp_rank)
    unit = layout_unit(cp_size, cp_partition_mode)
    cu = [int(x) for x in cu_seqlens_padded.tolist()]
    if len(cu) < 1 or cu[0] != 0 or any(b < a for a, b in zip(cu[:-1], cu[1:])):
        raise ShardingError(f"cu_seqlens_padded={cu} must start at 0 and be non-decreasing")
    for i, (start, end) in enumerate(zip(cu[:-1], cu[1:])):
        if (end - start) % unit:
            raise ShardingError(
                f"sequence {i} has length {end - start}, not a multiple of {unit} (the "
                f"{cp_partition_mode} layout over cp_size={cp_size}): sharding it would silently "
                "drop tokens. Pad every sequence with megatron_hcp.sharding.pad_thd (same "
                "cp_partition_mode) and pass its cu_seqlens_padded")
    out = []
    for start, end in zip(cu[:-1], cu[1:]):
        c = (end - start) // unit
        for piece in _pieces(cp_size, cp_rank, cp_partition_mode):
            out.append(torch.arange(start + piece * c, start + (piece + 1) * c))
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.long)


def get_local_chunk(
    x: torch.Tensor,
    cp_size: int,
    cp_rank: int,
    qkv_format: str = "bshd",
    cu_seqlens_padded: torch.Tensor | None = None,
    *,
    cp_partition_mode: str = DEFAULT_CP_PARTITION_MODE,
) -> torch.Tensor:
    """This CP rank's shard of a global tensor (zigzag: chunks ``r`` and ``2*cp-1-r``;
    contiguous: slice ``r``)."""
    dim = seq_dim(qkv_format)
    if qkv_format == "thd":
        if cu_seqlens_padded is None:
            raise ShardingError("thd needs cu_seqlens_padded to cut sequences")
        idx = thd_partition_indices(cu_seqlens_padded, cp_size, cp_rank,
                                    cp_partition_mode=cp_partition_mode).to(x.device)
        return x.index_select(dim, idx)
    _check_cp_position(cp_size, cp_rank)
    unit = layout_unit(cp_size, cp_partition_mode)
    if x.shape[dim] % unit:
        raise ShardingError(
            f"sequence length {x.shape[dim]} is not divisible by {unit} (the "
            f"{cp_partition_mode} layout over cp_size={cp_size}): pad the sequence to a "
            f"multiple of {unit} (thd: pad_thd)"
        )
    chunks = x.chunk(unit, dim=dim)
    return torch.cat([chunks[p] for p in _pieces(cp_size, cp_rank, cp_partition_mode)], dim=dim)


def assemble_from_chunks(
    chunks: list[torch.Tensor],
    qkv_format: str = "bshd",
    cu_seqlens_padded: torch.Tensor | None = None,
    *,
    cp_partition_mode: str = DEFAULT_CP_PARTITION_MODE,
) -> torch.Tensor:
    """Inverse of :func:`get_local_chunk`: the global tensor from every rank's shard."""
    cp = len(chunks)
    dim = seq_dim(qkv_format)
    mode = check_partition_mode(cp_partition_mode)
    if qkv_format == "thd":
        if cu_seqlens_padded is None:
            raise ShardingError("thd needs cu_seqlens_padded to reassemble sequences")
        total = int(cu_seqlens_padded[-1])
        shape = list(chunks[0].shape)
        shape[dim] = total
        out = chunks[0].new_zeros(shape)
        for r, chunk in enumerate(chunks):
            idx = thd_partition_indices(cu_seqlens_padded, cp, r,
                                        cp_partition_mode=mode).to(chunk.device)
            out.index_copy_(dim, idx, chunk)
        return out
    if mode == "contiguous":
        return torch.cat(chunks, dim=dim)
    pieces: list[torch.Tensor | None] = [None] * (2 * cp)
    for r, chunk in enumerate(chunks):
        a, b = chunk.chunk(2, dim=dim)
        pieces[r], pieces[2 * cp - 1 - r] = a, b
    return torch.cat(pieces, dim=dim)  # type: ignore[arg-type]


def gather_from_cp(
    local: torch.Tensor,
    cp_group: dist.ProcessGroup,
    qkv_format: str = "bshd",
    cu_seqlens_padded: torch.Tensor | None = None,
    *,
    cp_partition_mode: str = DEFAULT_CP_PARTITION_MODE,
) -> torch.Tensor:
    """All-gather every rank's shard over ``cp_group`` and reassemble the global tensor."""
    check_partition_mode(cp_partition_mode)
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(cp_group))]
    dist.all_gather(parts, local.contiguous(), group=cp_group)
    return assemble_from_chunks(parts, qkv_format, cu_seqlens_padded,
                                cp_partition_mode=cp_partition_mode)


def pad_thd(
    x: torch.Tensor, cu_seqlens: torch.Tensor, cp_size: int, *,
    cp_partition_mode: str = DEFAULT_CP_PARTITION_MODE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad every packed sequence of ``x`` (``[t, ...]``) to a multiple of the layout's unit
    (``2*cp_size`` zigzag, ``cp_size`` contiguous).

    Returns the padded tensor (zeros after each sequence) and its ``cu_seqlens_padded``.
    """
    lengths = seq_lengths(cu_seqlens)
    padded = [padded_length(n, cp_size, cp_partition_mode=cp_partition_mode) for n in lengths]
    cu_pad = torch.zeros(len(padded) + 1, dtype=cu_seqlens.dtype, device=cu_seqlens.device)
    cu_pad[1:] = torch.tensor(padded, dtype=cu_seqlens.dtype).cumsum(0)
    out = x.new_zeros((int(cu_pad[-1]), *x.shape[1:]))
    src = [int(v) for v in cu_seqlens.tolist()]
    for i, n in enumerate(lengths):
        out[int(cu_pad[i]) : int(cu_pad[i]) + n] = x[src[i] : src[i] + n]
    return out, cu_pad
