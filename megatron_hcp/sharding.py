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
import numbers
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
    "check_cp_size",
    "check_cu_seqlens_tensor",
    "check_partition_mode",
    "contiguous_window_reach",
    "cu_seqlens_values",
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


def check_cp_size(cp_size: object, name: str = "cp_size") -> int:
    """``cp_size`` if it is an integer >= 1 (a bool, a float, 0 or a negative size is refused:
    it would silently shard as for one rank)."""
    if isinstance(cp_size, bool) or not isinstance(cp_size, numbers.Integral) or cp_size < 1:
        raise ShardingError(f"{name}={cp_size!r}: must be an integer >= 1 (the number of CP "
                            "ranks); pass the size of the context-parallel group")
    return int(cp_size)


def layout_unit(cp_size: int, cp_partition_mode: str = DEFAULT_CP_PARTITION_MODE) -> int:
    """The number of equal pieces a sequence is cut into: ``2*cp`` (zigzag; also for one
    rank, the attention's two-halves layout) or ``cp`` (contiguous)."""
    cp = check_cp_size(cp_size)
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


_CU_FIX = ("pass torch.tensor([0, len0, len0+len1, ...], dtype=torch.int32), the cumulative "
           "lengths of the packed sequences")


def check_cu_seqlens_tensor(cu_seqlens: object, name: str = "cu_seqlens") -> None:
    """The rules of ``cu_seqlens`` that need no read of its values (none on the hot path: on
    a GPU a read is a synchronisation): a 1-D integer ``torch.Tensor`` with at least one entry,
    not on ``meta``. A :class:`ShardingError` naming ``name`` otherwise."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise ShardingError(f"{name} is a {type(cu_seqlens).__name__}: must be a 1-D integer "
                            f"torch.Tensor; {_CU_FIX}")
    dtype = cu_seqlens.dtype
    if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
        raise ShardingError(f"{name} has dtype {dtype}: must be an integer dtype (a float "
                            f"length would be truncated); {_CU_FIX}")
    if cu_seqlens.device.type == "meta":
        raise ShardingError(f"{name} is on the meta device and holds no values; pass it on "
                            "the CPU or the device of the data")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ShardingError(f"{name} has shape {list(cu_seqlens.shape)}: must be 1-D with at "
                            f"least one entry; {_CU_FIX}")


def cu_seqlens_values(cu_seqlens: object, name: str = "cu_seqlens", *,
                      tokens: int | None = None) -> list[int]:
    """The values of ``cu_seqlens`` (cumulative sequence lengths of a packed batch), read on
    the host, after the rules every public function applies to them:
    :func:`check_cu_seqlens_tensor`, then starting at 0, non-decreasing and, with ``tokens``,
    ending at ``tokens`` (the tokens of the tensor it describes: a shorter total would drop
    tokens, a longer one read past them). Each broken rule is a :class:`ShardingError` naming
    ``name``."""
    check_cu_seqlens_tensor(cu_seqlens, name)
    assert isinstance(cu_seqlens, torch.Tensor)
    cu = [int(x) for x in cu_seqlens.tolist()]
    if cu[0] != 0:
        raise ShardingError(f"{name} starts at {cu[0]}: must start at 0 (tokens before the "
                            f"first offset would be dropped); {_CU_FIX}")
    bad = next((i for i in range(1, len(cu)) if cu[i] < cu[i - 1]), None)
    if bad is not None:
        raise ShardingError(f"{name} decreases at entry {bad} ({cu[bad - 1]} -> {cu[bad]}): "
                            f"must be non-decreasing; {_CU_FIX}")
    if tokens is not None and cu[-1] != tokens:
        raise ShardingError(f"{name} ends at {cu[-1]} but the tensor holds {tokens} tokens: "
                            "the packed sequences must cover exactly its tokens (fewer would "
                            "be dropped); pass the cu_seqlens of this tensor")
    return cu


def seq_lengths(cu_seqlens: torch.Tensor, name: str = "cu_seqlens") -> list[int]:
    """The sequence lengths ``cu_seqlens`` describes (checked: :func:`cu_seqlens_values`)."""
    cu = cu_seqlens_values(cu_seqlens, name)
    return [b - a for a, b in zip(cu[:-1], cu[1:])]


def _check_cp_position(cp_size: int, cp_rank: int) -> None:
    check_cp_size(cp_size)
    if (isinstance(cp_rank, bool) or not isinstance(cp_rank, numbers.Integral)
            or not 0 <= cp_rank < cp_size):
        raise ShardingError(
            f"cp_size={cp_size}, cp_rank={cp_rank}: need cp_size >= 1 and 0 <= cp_rank < cp_size")


def _pieces(cp_size: int, cp_rank: int, mode: str) -> tuple[int, ...]:
    """Which of a sequence's :func:`layout_unit` pieces ``cp_rank`` holds, in local order."""
    return (cp_rank, 2 * cp_size - 1 - cp_rank) if mode == "zigzag" else (cp_rank,)


def thd_partition_indices(cu_seqlens_padded: torch.Tensor, cp_size: int, cp_rank: int, *,
                          cp_partition_mode: str = DEFAULT_CP_PARTITION_MODE,
                          tokens: int | None = None) -> torch.Tensor:
    """Global token indices held by ``cp_rank`` (zigzag: TE's ``thd_get_partitioned_indices``).

    Every sequence length in ``cu_seqlens_padded`` must be a multiple of the layout's unit
    (:func:`pad_thd`); anything else would drop tokens, so it is refused, as is a total other
    than ``tokens`` (the global tensor's, where the caller has one)."""
    _check_cp_position(cp_size, cp_rank)
    unit = layout_unit(cp_size, cp_partition_mode)
    cu = cu_seqlens_values(cu_seqlens_padded, "cu_seqlens_padded", tokens=tokens)
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
                                    cp_partition_mode=cp_partition_mode,
                                    tokens=x.shape[dim]).to(x.device)
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
    """Inverse of :func:`get_local_chunk`: the global tensor from every rank's shard, one
    chunk per CP rank in rank order (their number is the CP size)."""
    dim = seq_dim(qkv_format)
    mode = check_partition_mode(cp_partition_mode)
    _check_chunks(chunks, dim)
    cp = len(chunks)
    if qkv_format == "thd":
        if cu_seqlens_padded is None:
            raise ShardingError("thd needs cu_seqlens_padded to reassemble sequences")
        # the padding rule first (it names the CP size the chunks' number gives), then the
        # tokens each chunk must hold
        indices = [thd_partition_indices(cu_seqlens_padded, cp, r, cp_partition_mode=mode)
                   for r in range(cp)]
        for r, (chunk, idx) in enumerate(zip(chunks, indices)):
            if chunk.shape[dim] != idx.numel():
                raise ShardingError(
                    f"chunk {r} of {cp} holds {chunk.shape[dim]} tokens; cu_seqlens_padded "
                    f"over cp_size={cp} ({mode}) gives rank {r} {idx.numel()}: pass one chunk "
                    "per CP rank, in rank order, with the cu_seqlens_padded they were cut with")
        shape = list(chunks[0].shape)
        shape[dim] = sum(idx.numel() for idx in indices)
        out = chunks[0].new_zeros(shape)
        for chunk, idx in zip(chunks, indices):
            out.index_copy_(dim, idx.to(chunk.device), chunk)
        return out
    if mode == "contiguous":
        return torch.cat(chunks, dim=dim)
    if chunks[0].shape[dim] % 2:
        raise ShardingError(f"each chunk holds {chunks[0].shape[dim]} tokens; a zigzag chunk "
                            "holds two equal halves (an even number): pass the chunks "
                            "get_local_chunk cut, or cp_partition_mode='contiguous'")
    pieces: list[torch.Tensor | None] = [None] * (2 * cp)
    for r, chunk in enumerate(chunks):
        a, b = chunk.chunk(2, dim=dim)
        pieces[r], pieces[2 * cp - 1 - r] = a, b
    return torch.cat(pieces, dim=dim)  # type: ignore[arg-type]


def _check_chunks(chunks: object, dim: int) -> None:
    """A non-empty list of tensors, one per CP rank, alike but for the sequence length."""
    if (not isinstance(chunks, (list, tuple)) or not chunks
            or not all(isinstance(c, torch.Tensor) for c in chunks)):
        raise ShardingError("chunks must be a non-empty list of tensors, one per CP rank in "
                            f"rank order; got {type(chunks).__name__}")
    first = chunks[0]
    for r, chunk in enumerate(chunks):
        if (chunk.dim() != first.dim() or chunk.dim() <= dim
                or chunk.shape[:dim] + chunk.shape[dim + 1:]
                != first.shape[:dim] + first.shape[dim + 1:]
                or chunk.dtype != first.dtype or chunk.device != first.device):
            raise ShardingError(f"chunk {r} is {list(chunk.shape)} {chunk.dtype} on "
                                f"{chunk.device}, chunk 0 {list(first.shape)} {first.dtype} "
                                f"on {first.device}: the chunks differ only in sequence length")


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
    ``cu_seqlens`` must cover exactly the tokens of ``x`` (:func:`cu_seqlens_values`).
    """
    check_cp_size(cp_size)
    if not isinstance(x, torch.Tensor) or x.dim() < 1:
        raise ShardingError("x must be a tensor [t, ...] of packed tokens")
    src = cu_seqlens_values(cu_seqlens, "cu_seqlens", tokens=x.shape[0])
    lengths = [b - a for a, b in zip(src[:-1], src[1:])]
    padded = [padded_length(n, cp_size, cp_partition_mode=cp_partition_mode) for n in lengths]
    cu_pad = torch.zeros(len(padded) + 1, dtype=cu_seqlens.dtype, device=cu_seqlens.device)
    cu_pad[1:] = torch.tensor(padded, dtype=cu_seqlens.dtype).cumsum(0)
    out = x.new_zeros((int(cu_pad[-1]), *x.shape[1:]))
    for i, n in enumerate(lengths):
        out[int(cu_pad[i]) : int(cu_pad[i]) + n] = x[src[i] : src[i] + n]
    return out, cu_pad
