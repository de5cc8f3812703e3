"""Convert a CP-sharded micro-batch from one partition layout to the other over the CP group.

:func:`convert_partition` moves each token from the rank that holds it in one layout
(``"zigzag"`` / ``"contiguous"``, :mod:`megatron_hcp.sharding`) to the rank that holds it in the
other, with one all-to-all with uneven splits (all-to-all-v): a rank sends only the tokens it
does not keep, never a gather of the whole sequence. Packed (``thd``) sequences are converted one
by one, each re-padded only where the target layout cannot cut its padded length (positions
past the shorter padding are padding: zeros in the result). The conversion is differentiable:
its backward is the conversion back. Its all-to-all is counted by
:class:`~.comm.CommCounter` (op ``"all_to_all_v"``).
"""

from __future__ import annotations

from functools import lru_cache

import torch
import torch.distributed as dist

from ...sharding import (
    ShardingError,
    check_partition_mode,
    layout_unit,
    padded_length,
    seq_dim,
    seq_lengths,
    thd_partition_indices,
)
from . import comm

__all__ = ["ConversionPlan", "conversion_plan", "convert_partition"]


class ConversionPlan:
    """Which local rows one rank sends to each rank and where the rows it receives go."""

    def __init__(self, send_rows: torch.Tensor, send_splits: list[int],
                 recv_rows: torch.Tensor, recv_splits: list[int], local_out: int):
        self.send_rows, self.send_splits = send_rows, send_splits
        self.recv_rows, self.recv_splits = recv_rows, recv_splits
        self.local_out = local_out


def _owners(lengths: tuple[int, ...], cp: int, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(owner rank, local row) of every token of a padded packed batch in ``mode``."""
    cu = torch.tensor([0, *lengths]).cumsum(0)
    total = int(cu[-1])
    owner = torch.empty(total, dtype=torch.long)
    row = torch.empty(total, dtype=torch.long)
    for r in range(cp):
        idx = thd_partition_indices(cu, cp, r, cp_partition_mode=mode)
        owner[idx] = r
        row[idx] = torch.arange(idx.numel())
    return owner, row


@lru_cache(maxsize=64)
def conversion_plan(old: tuple[int, ...], new: tuple[int, ...], cp: int, rank: int,
                    from_mode: str, to_mode: str) -> ConversionPlan:
    """The plan of ``rank`` for padded sequence lengths ``old`` (in ``from_mode``) becoming
    ``new`` (in ``to_mode``): position j of sequence i moves where j < min(old[i], new[i])."""
    old_owner, old_row = _owners(old, cp, from_mode)
    new_owner, new_row = _owners(new, cp, to_mode)
    old_start = [0, *torch.tensor(old).cumsum(0).tolist()]
    new_start = [0, *torch.tensor(new).cumsum(0).tolist()]
    moved = [min(a, b) for a, b in zip(old, new)]
    src = torch.cat([torch.arange(s, s + n) for s, n in zip(old_start, moved)] or
                    [torch.zeros(0, dtype=torch.long)])
    dst = torch.cat([torch.arange(s, s + n) for s, n in zip(new_start, moved)] or
                    [torch.zeros(0, dtype=torch.long)])
    frm, to = old_owner[src], new_owner[dst]
    # what this rank sends: ordered by destination, then by the destination's row
    mine = (frm == rank).nonzero().view(-1)
    order = mine[torch.argsort(to[mine] * (len(dst) + 1) + new_row[dst[mine]])]
    send_rows = old_row[src[order]]
    send_splits = torch.bincount(to[order], minlength=cp).tolist()
    # what it receives: from each source in turn, each in this rank's row order
    theirs = (to == rank).nonzero().view(-1)
    order = theirs[torch.argsort(frm[theirs] * (len(dst) + 1) + new_row[dst[theirs]])]
    recv_rows = new_row[dst[order]]
    recv_splits = torch.bincount(frm[order], minlength=cp).tolist()
    return ConversionPlan(send_rows, send_splits, recv_rows, recv_splits, sum(new) // cp)


def _run(x: torch.Tensor, plan: ConversionPlan, group, dim: int) -> torch.Tensor:
    rows = x.movedim(dim, 0)
    send = rows.index_select(0, plan.send_rows.to(x.device)).contiguous()
    recv = send.new_empty((sum(plan.recv_splits), *send.shape[1:]))
    comm.all_to_all_v(recv, send, plan.recv_splits, plan.send_splits, group)
    out = send.new_zeros((plan.local_out, *send.shape[1:]))
    out.index_copy_(0, plan.recv_rows.to(x.device), recv)
    return out.movedim(0, dim)


class _Convert(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, plan, back, group, dim):
        ctx.meta = (back, group, dim)
        return _run(x, plan, group, dim)

    @staticmethod
    def backward(ctx, grad):
        back, group, dim = ctx.meta
        return _run(grad.contiguous(), back, group, dim), None, None, None, None


def convert_partition(
    x: torch.Tensor,
    cp_group: dist.ProcessGroup,
    *,
    from_mode: str,
    to_mode: str,
    qkv_format: str = "bshd",
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_padded: torch.Tensor | None = None,
    cu_seqlens_padded_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """This rank's shard of ``x`` in ``to_mode``, from its shard in ``from_mode``.

    ``bshd``/``sbhd``: one sequence, whose global length must be a multiple of both layouts'
    units (zigzag ``2*cp``, contiguous ``cp``). ``thd``: ``cu_seqlens`` (real lengths) and
    ``cu_seqlens_padded`` (the padding ``x`` is in) describe the full packed batch;
    ``cu_seqlens_padded_out`` is the padding of the result (default: the input's where the
    target layout can cut it, else each sequence padded up to the target's unit). Returns the
    converted shard and the result's ``cu_seqlens_padded`` (``None`` for bshd/sbhd). Every
    check runs before the all-to-all, on every rank alike.
    """
    frm, to = check_partition_mode(from_mode), check_partition_mode(to_mode)
    dim = seq_dim(qkv_format)
    if cp_group is None:
        raise ShardingError("cp_group is None: converting a layout needs the CP group")
    cp, rank = dist.get_world_size(cp_group), dist.get_rank(cp_group)
    if qkv_format == "thd":
        if cu_seqlens_padded is None:
            raise ShardingError("qkv_format='thd' needs cu_seqlens_padded (the input's padding)")
        old = tuple(seq_lengths(cu_seqlens_padded.cpu()))
        real = tuple(seq_lengths(cu_seqlens.cpu())) if cu_seqlens is not None else old
        if len(real) != len(old) or any(r > p for r, p in zip(real, old)):
            raise ShardingError(
                f"cu_seqlens={list(real)} and cu_seqlens_padded={list(old)} disagree: one "
                "padded length per sequence, each >= its real length")
        if cu_seqlens_padded_out is None:
            new = tuple(padded_length(p, cp, cp_partition_mode=to) for p in old)
        else:
            new = tuple(seq_lengths(cu_seqlens_padded_out.cpu()))
            short = [i for i, (r, p) in enumerate(zip(real, new)) if p < r]
            if len(new) != len(real) or short:
                raise ShardingError(
                    f"cu_seqlens_padded_out={list(new)}: one padded length per sequence, each "
                    f">= its real length {list(real)}")
        for mode, lengths, name in ((frm, old, "cu_seqlens_padded"),
                                    (to, new, "cu_seqlens_padded_out")):
            unit = layout_unit(cp, mode)
            bad = [n for n in lengths if n % unit]
            if bad:
                raise ShardingError(
                    f"{name} has sequence lengths {bad} that are not multiples of {unit}: the "
                    f"{mode} layout over {cp} ranks cannot cut them; pad with pad_thd")
        if x.shape[dim] != sum(old) // cp:
            raise ShardingError(
                f"x holds {x.shape[dim]} tokens but cu_seqlens_padded gives {sum(old)} / cp={cp}"
                f" = {sum(old) // cp} per rank; pass this rank's shard")
        cu_out = torch.tensor([0, *new], dtype=cu_seqlens_padded.dtype,
                              device=cu_seqlens_padded.device).cumsum(0)
    else:
        total = x.shape[dim] * cp
        for mode in (frm, to):
            unit = layout_unit(cp, mode)
            if total % unit:
                raise ShardingError(
                    f"sequence length {total} ({x.shape[dim]} a rank x cp={cp}) is not a "
                    f"multiple of {unit}: the {mode} layout cannot cut it; pad the sequence to a "
                    f"multiple of {2 * cp}")
        old = new = (total,)
        cu_out = None
    if frm == to and old == new:
        return x, cu_out
    plan = conversion_plan(old, new, cp, rank, frm, to)
    back = conversion_plan(new, old, cp, rank, to, frm)
    return _Convert.apply(x, plan, back, cp_group, dim), cu_out
