"""autograd Functions of CP attention, each with its own communication in backward.

* :class:`RingAttention` - KV ring over a group of ``p`` ranks (``p-1`` steps; ``p == 1`` is
  plain local attention). Backward sends KV round the ring again with a travelling dK/dV
  accumulator that ends at its owner. Saves only local tensors: memory is O(local sequence).
* :class:`AllGatherAttention` - one all-gather of KV; backward gathers again and
  reduce-scatters dK/dV.
* :class:`UlyssesAllToAll` - Ulysses all-to-all (scatter heads, gather sequence) and its
  inverse, each the other's backward.

Tensors are ``[B, H, S, D]`` (V and the output may have their own head dim ``Dv``, as in MLA);
``S`` is the local sequence in the two-halves layout of
:class:`~.seq_layout.SeqLayout`.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from ...sharding import contiguous_window_reach
from . import comm
from .blocks import Block, Window, plan_block, record_block, record_kernel, take
from .kernels import acc_dtype, block_backward, block_forward
from .merge import merge_into
from .pieces import split_mode, splitting
from .seq_layout import SeqLayout
from .varlen import VARLEN_KERNEL, kernel_calls, varlen_backward, varlen_forward, varlen_takes

__all__ = ["AllGatherAttention", "RingAttention", "TokenOrder", "UlyssesAllToAll"]


def _pack(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """K and V in one flat message (two copies, whatever their strides)."""
    nk = k.numel()
    kv = torch.empty(nk + v.numel(), dtype=k.dtype, device=k.device)
    kv[:nk].view(k.shape).copy_(k)
    kv[nk:].view(v.shape).copy_(v)
    return kv


def _unpack(kv: torch.Tensor, k_shape, v_shape) -> tuple[torch.Tensor, torch.Tensor]:
    nk = k_shape.numel()
    return kv[:nk].view(k_shape), kv[nk:].view(v_shape)


def _bias_positions(bias, q_layout: SeqLayout, kv_layout: SeqLayout, block):
    """Global (row, column) positions of ``block`` in a bias over the whole sequence."""
    if bias is None:
        return None
    rows = take(q_layout.pos, block.rows, 0) if bias.shape[2] > 1 else None
    return rows, take(kv_layout.pos, block.cols, 0)


def _bias_block(bias, where):
    """The part of ``bias`` [B|1, H|1, S|1, S] a block's scores get (None without bias)."""
    if bias is None:
        return None
    rows, cols = where
    part = bias if rows is None else bias.index_select(2, rows.to(bias.device))
    return part.index_select(3, cols.to(bias.device))


def _add_bias_grad(dbias, grad, where) -> None:
    """Accumulate a block's score gradient into ``dbias``, reduced to the bias's shape."""
    rows, cols = where
    dims = [d for d in range(4) if dbias.shape[d] == 1 and grad.shape[d] > 1]
    grad = grad.sum(dims, keepdim=True) if dims else grad
    by_col = torch.zeros((*grad.shape[:3], dbias.shape[3]), dtype=grad.dtype, device=grad.device)
    by_col.index_add_(3, cols.to(grad.device), grad)
    if rows is None:
        dbias += by_col.to(dbias.dtype)
    else:
        dbias.index_add_(2, rows.to(grad.device), by_col.to(dbias.dtype))


def _calls(block: Block, q: torch.Tensor, varlen: object):
    """The varlen calls a block runs as (:func:`~.varlen.kernel_calls` for q's heads and head
    dim), or ``None``: not ``varlen``, no calls planned, or a segment FA2 cannot take (the
    block then runs its pieces one call each, or its mask)."""
    if not varlen or block.calls is None:
        return None
    return kernel_calls(block.calls, q.shape[1], q.shape[-1])


def _forward_block(q, k, v, block, scale, out, lse, bias=None, *, first=False, varlen=None):
    """One block's attention merged into ``out``/``lse`` (``first``: nothing merged yet;
    ``varlen``: a block in pieces runs as its varlen calls, :func:`_varlen`)."""
    calls = _calls(block, q, varlen and bias is None)
    if calls is not None:  # a few calls of many sequences each, each copied in where it is
        # the first to reach its rows (calls' rows may overlap)
        spans: list[slice] = []
        for call in calls:
            ob, lb = varlen_forward(q, k, v, call, scale)
            rows = call.row_span
            record_kernel(VARLEN_KERNEL)
            apart = all(rows.stop <= s.start or s.stop <= rows.start for s in spans)
            merge_into(out, lse, rows, ob, lb, first=first and apart,
                       empty_rows=call.empty_rows)
            spans.append(rows)
        return
    if block.pieces is not None:  # a packed block per sequence: its dense pieces, each
        # copied in where it is the first to reach its rows (pieces' rows are equal or apart)
        reached: set[tuple[int, int]] = set()
        for piece in block.pieces:
            rows = (piece.rows.start, piece.rows.stop)
            _forward_block(q, k, v, piece, scale, out, lse, bias,
                           first=first and rows not in reached)
            reached.add(rows)
        return
    ob, lb = block_forward(
        take(q, block.rows), take(k, block.cols), take(v, block.cols),
        scale=scale, causal=block.causal, mask=block.mask, bias=bias,
    )
    merge_into(out, lse, block.rows, ob, lb, first=first,
               empty_rows=block.mask is not None or bias is not None)


def _backward_block(dout, q, k, v, out, lse, block, scale, dq, dk, dv, bias=None, *,
                    varlen=None):
    calls = _calls(block, q, varlen and bias is None)
    if calls is not None:  # its varlen calls (FA2 takes no bias: those blocks keep theirs)
        for call in calls:
            gq, gk, gv = varlen_backward(dout, q, k, v, out, lse, call, scale)
            dq[:, :, call.row_span].add_(gq)
            dk[:, :, call.col_span].add_(gk)
            dv[:, :, call.col_span].add_(gv)
        return None
    if block.pieces is not None:  # no bias with packed sequences: no bias gradient
        for piece in block.pieces:
            _backward_block(dout, q, k, v, out, lse, piece, scale, dq, dk, dv)
        return None
    gq, gk, gv, *gb = block_backward(
        take(dout, block.rows), take(q, block.rows), take(k, block.cols), take(v, block.cols),
        take(out, block.rows), take(lse, block.rows),
        scale=scale, causal=block.causal, mask=block.mask, bias=bias,
    )
    for acc, grad, sel in ((dq, gq, block.rows), (dk, gk, block.cols), (dv, gv, block.cols)):
        if isinstance(sel, slice):
            acc[:, :, sel].add_(grad)  # not `+=`: its copy back is one more op
        else:
            acc.index_add_(2, sel, grad.to(acc.dtype))
    return gb[0] if gb else None


def _new_acc(q: torch.Tensor, v: torch.Tensor, first: Block | None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Output (in v's head dim) and LSE accumulators for q's rows: zero and ``-inf``, or left
    unfilled where the ``first`` block merged (copied) into them covers every row (not one
    computed in pieces: padding rows are in none)."""
    acc = acc_dtype(q.dtype)
    b, h, s, _ = q.shape
    # the output in [B, S, H, Dv] memory order, seen as [B, H, S, Dv]: as megatron's bshd
    # output (a view, no copy) and as the efficient kernel's backward reads it
    # (kernels._heads_inner)
    shape, order = (b, s, h, v.shape[-1]), (0, 2, 1, 3)
    if first is not None and first.pieces is None and first.rows == slice(0, s):
        return (torch.empty(shape, dtype=acc, device=q.device).permute(order),
                torch.empty(b, h, s, dtype=acc, device=q.device))
    out = torch.zeros(shape, dtype=acc, device=q.device).permute(order)
    lse = torch.full((b, h, s), float("-inf"), dtype=acc, device=q.device)
    return out, lse


def _apply_sink(out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor | None
                ) -> torch.Tensor:
    """Add the softmax offset (one extra logit per head, a key with value 0) to every query
    row, once, after all blocks merged: rescales ``out`` in place, returns the new LSE."""
    if sink is None:
        return lse
    total = torch.logaddexp(lse, sink.to(lse.dtype).view(1, -1, 1))
    out.mul_(torch.exp(lse - total).unsqueeze(-1))
    return total


def _sink_grad(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor
               ) -> torch.Tensor:
    """d loss / d sink of this rank's rows: the sink's probability times ``-rowsum(dO * O)``,
    summed over batch and rows (its value is 0, so it only takes share from the others)."""
    delta = (dout.to(lse.dtype) * out.to(lse.dtype)).sum(-1)
    prob = torch.exp(sink.to(lse.dtype).view(1, -1, 1) - lse)
    return -(prob * delta).sum((0, 2)).to(sink.dtype)


def _varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: SeqLayout,
            window: Window) -> tuple[int, int] | None:
    """q's (heads, head dim) where this call's packed blocks in pieces and windowed blocks
    run as varlen calls (:func:`~.varlen.varlen_takes`; a dense layout without a window has
    neither), else ``None``: :func:`~.blocks.plan_block`'s ``varlen``. Planned once per
    forward and saved for its backward."""
    if (not layout.is_dense or window is not None) and varlen_takes(q, k, v):
        return q.shape[1], q.shape[-1]
    return None


def ring_reach(layout: SeqLayout, causal: bool, window: Window) -> int:
    """How many ring steps past the local one a rank needs: ``cp - 1``, or fewer in the
    contiguous layout under a window that looks only back (causal, or right size 0) a bounded
    ``left`` tokens: the slices within ``left`` tokens before this one, ``ceil(left / c)`` for
    slices of ``c`` tokens (the longest reach over the packed sequences)."""
    p = layout.cp
    if not layout.contiguous or window is None or window[0] < 0 or not (
            causal or window[1] == 0):
        return p - 1
    return max((contiguous_window_reach(n // p, window[0], p) for n in layout.padded if n),
               default=0)


def _ring_steps(kv: torch.Tensor, group, ranks: list[int], pos: int, steps: int):
    """Yield ``(src, kv of src)`` for each of ``steps`` ring steps (``p``: the whole ring).

    The next step's K/V is already on its way while the caller computes with the current one.
    """
    p = len(ranks)
    nxt, prv = ranks[(pos + 1) % p], ranks[(pos - 1) % p]
    for step in range(steps):
        if step < steps - 1:
            incoming = torch.empty_like(kv)
            works = comm.ring_exchange(kv, incoming, group, nxt, prv)
        yield (pos - step) % p, kv
        if step < steps - 1:
            for w in works:
                w.wait()
            kv = incoming


def _as_planned(backward):
    """``backward`` with packed blocks planned as its forward planned them
    (``ctx.split``: :func:`~.pieces.split_mode` then): the autograd engine may run it on a
    thread of its own (CUDA), which does not see a :func:`~.pieces.splitting` of the
    forward's thread."""
    @functools.wraps(backward)
    def run(ctx, *grads):
        with splitting(ctx.split):
            return backward(ctx, *grads)
    return run


class RingAttention(torch.autograd.Function):
    """Ring (p2p) CP attention over ``ranks`` (global ranks in ring order). The ring runs
    :func:`ring_reach` + 1 steps: in the contiguous layout under a backward-looking window it
    stops once every rank has the K/V its window reaches (the rest never travels)."""

    @staticmethod
    def forward(ctx, q, k, v, layout: SeqLayout, group, ranks: list[int], causal: bool,
                scale: float, window: Window = None, sink: torch.Tensor | None = None,
                bias: torch.Tensor | None = None):
        # the kernels take q as it is (head dim contiguous); K and V travel packed, and the
        # backward sends the same message again
        packed = _pack(k, v)
        varlen = _varlen(q, k, v, layout, window)
        # the first step is the local block: with all rows, the accumulators need no fill
        local = plan_block(layout, layout, causal, window, varlen=varlen)
        out, lse = _new_acc(q, v, local)
        steps = ring_reach(layout, causal, window) + 1
        first = True
        for src, kv in _ring_steps(packed, group, ranks, layout.position, steps):
            kv_layout = layout.at(layout.cp, src)
            block = local if src == layout.position else plan_block(
                layout, kv_layout, causal, window, varlen=varlen)
            record_block(block, layout)
            if block is not None:  # outside the window: pass the K/V on, compute nothing
                kj, vj = _unpack(kv, k.shape, v.shape)
                where = _bias_positions(bias, layout, kv_layout, block)
                _forward_block(q, kj, vj, block, scale, out, lse, _bias_block(bias, where),
                               first=first, varlen=varlen)
                first = False
        lse = _apply_sink(out, lse, sink)
        out = out.to(q.dtype)  # the backward's kernels read the output in q's dtype
        ctx.save_for_backward(q, packed, out, lse, sink, bias)
        ctx.meta = (layout, group, ranks, causal, scale, window, k.shape, v.shape)
        ctx.split, ctx.varlen = split_mode(), varlen
        return out

    @staticmethod
    @_as_planned
    def backward(ctx, dout):
        q, packed, out, lse, sink, bias = ctx.saved_tensors
        layout, group, ranks, causal, scale, window, k_shape, v_shape = ctx.meta
        k, v = _unpack(packed, k_shape, v_shape)
        p, pos = len(ranks), layout.position
        acc = acc_dtype(q.dtype)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dkv = torch.zeros(k.numel() + v.numel(), dtype=acc, device=q.device)
        dbias = torch.zeros(bias.shape, dtype=acc, device=q.device) if bias is not None else None
        steps = ring_reach(layout, causal, window) + 1
        for step, (src, kv) in enumerate(_ring_steps(packed, group, ranks, pos, steps)):
            kv_layout = layout.at(layout.cp, src)
            block = plan_block(layout, kv_layout, causal, window, varlen=ctx.varlen)
            if block is not None:
                kj, vj = _unpack(kv, k.shape, v.shape)
                dk, dv = _unpack(dkv, k.shape, v.shape)
                where = _bias_positions(bias, layout, kv_layout, block)
                gb = _backward_block(dout, q, kj, vj, out, lse, block, scale, dq, dk, dv,
                                     _bias_block(bias, where), varlen=ctx.varlen)
                if gb is not None:
                    _add_bias_grad(dbias, gb, where)
            if p > 1 and steps > 1:  # dK/dV of `src` travel on with its K/V; after the
                # last step they go home: `step` ranks back (the whole ring: the next rank)
                hop = 1 if step < steps - 1 else (p - step) % p
                arrived = torch.empty_like(dkv)
                works = comm.ring_exchange(dkv, arrived, group, ranks[(pos + hop) % p],
                                           ranks[(pos - hop) % p])
                for w in works:
                    w.wait()
                dkv = arrived
        dk, dv = _unpack(dkv, k.shape, v.shape)
        dsink = _sink_grad(dout, out, lse, sink) if sink is not None else None
        dbias = dbias.to(bias.dtype) if bias is not None else None
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None,
                None, dsink, dbias)


def _source_groups(layout: SeqLayout, causal: bool, window: Window, record: bool,
                   varlen: tuple[int, int] | None = None) -> list[tuple[list[int], Block]]:
    """Sources of an all-gather grouped by identical block shape.

    With one dense sequence every past source meets all queries on its first half and every
    future source meets the second half of the queries on all of it: one kernel call per group
    instead of one per source. Packed (masked) layouts and windows keep one block per source;
    sources a window sees nothing of are left out.
    """
    n = layout.cp
    plans = [(src, plan_block(layout, layout.at(n, src), causal, window, varlen=varlen))
             for src in range(n)]
    for _src, plan in plans if record else ():  # forward only: BlockCounter counts forwards
        record_block(plan, layout)
    plans = [(src, plan) for src, plan in plans if plan is not None]
    if not layout.is_dense or window is not None:
        return [([src], plan) for src, plan in plans]
    grouped: dict[tuple, list[tuple[int, Block]]] = {}
    for src, plan in plans:
        key = (plan.rows.start, plan.rows.stop, plan.cols.start, plan.cols.stop, plan.causal)
        grouped.setdefault(key, []).append((src, plan))
    return [([src for src, _ in members], members[0][1]) for members in grouped.values()]


def _gathered_kv(full, srcs, block, k_shape, v_shape):
    """K and V of ``srcs`` restricted to ``block.cols``, concatenated along the sequence."""
    parts = [_unpack(full[src], k_shape, v_shape) for src in srcs]
    if len(parts) == 1:
        return parts[0][0], parts[0][1], block
    k = torch.cat([take(kj, block.cols) for kj, _ in parts], dim=2)
    v = torch.cat([take(vj, block.cols) for _, vj in parts], dim=2)
    return k, v, Block(block.rows, slice(0, k.shape[2]), block.causal, None)


class AllGatherAttention(torch.autograd.Function):
    """CP attention with one all-gather of KV over ``group`` (this rank at ``layout.position``)."""

    @staticmethod
    def _gather(k, v, group, n):
        """Start the all-gather of K/V; the local block is computed while it runs."""
        local = _pack(k, v)
        full = torch.empty(n * local.numel(), dtype=local.dtype, device=local.device)
        work = comm.all_gather_into_tensor(full, local, group, async_op=True)
        return full.view(n, -1), work

    @staticmethod
    def _ordered(layout: SeqLayout, causal: bool, window: Window, record: bool = False,
                 varlen: tuple[int, int] | None = None):
        """Source groups, this rank's own first (it needs no gathered data)."""
        groups = _source_groups(layout, causal, window, record, varlen)
        return sorted(groups, key=lambda g: g[0] != [layout.position])

    @staticmethod
    def forward(ctx, q, k, v, layout: SeqLayout, group, causal: bool, scale: float,
                window: Window = None, sink: torch.Tensor | None = None):
        full, work = AllGatherAttention._gather(k, v, group, layout.cp)
        varlen = _varlen(q, k, v, layout, window)
        groups = AllGatherAttention._ordered(layout, causal, window, record=True, varlen=varlen)
        local = groups[0][1] if groups and groups[0][0] == [layout.position] else None
        out, lse = _new_acc(q, v, local)
        for index, (srcs, plan) in enumerate(groups):
            if srcs == [layout.position]:
                kj, vj, block = k, v, plan
            else:
                if work is not None:
                    work.wait()
                    work = None
                kj, vj, block = _gathered_kv(full, srcs, plan, k.shape, v.shape)
            _forward_block(q, kj, vj, block, scale, out, lse, first=index == 0, varlen=varlen)
        if work is not None:
            work.wait()
        lse = _apply_sink(out, lse, sink)
        out = out.to(q.dtype)  # the backward's kernels read the output in q's dtype
        ctx.save_for_backward(q, k, v, out, lse, sink)
        ctx.meta = (layout, group, causal, scale, window)
        ctx.split, ctx.varlen = split_mode(), varlen
        return out

    @staticmethod
    @_as_planned
    def backward(ctx, dout):
        q, k, v, out, lse, sink = ctx.saved_tensors
        layout, group, causal, scale, window = ctx.meta
        dout = dout.contiguous()
        full, work = AllGatherAttention._gather(k, v, group, layout.cp)  # again: O(local) saved
        acc = acc_dtype(q.dtype)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dkv_all = torch.zeros(full.shape, dtype=acc, device=q.device)
        for srcs, plan in AllGatherAttention._ordered(layout, causal, window,
                                                      varlen=ctx.varlen):
            if srcs == [layout.position]:
                kj, vj, block = k, v, plan
            else:
                if work is not None:
                    work.wait()
                    work = None
                kj, vj, block = _gathered_kv(full, srcs, plan, k.shape, v.shape)
            if len(srcs) == 1:
                dk, dv = _unpack(dkv_all[srcs[0]], k.shape, v.shape)
                _backward_block(dout, q, kj, vj, out, lse, block, scale, dq, dk, dv,
                                varlen=ctx.varlen)
                continue
            dk_cat = torch.zeros(kj.shape, dtype=acc, device=q.device)
            dv_cat = torch.zeros(vj.shape, dtype=acc, device=q.device)
            _backward_block(dout, q, kj, vj, out, lse, block, scale, dq, dk_cat, dv_cat)
            for part, src in enumerate(srcs):
                dk, dv = _unpack(dkv_all[src], k.shape, v.shape)
                width = dk_cat.shape[2] // len(srcs)
                piece = slice(part * width, (part + 1) * width)
                dk[:, :, plan.cols].add_(dk_cat[:, :, piece])
                dv[:, :, plan.cols].add_(dv_cat[:, :, piece])
        if work is not None:
            work.wait()
        mine = torch.empty(full.shape[1], dtype=acc, device=q.device)
        comm.reduce_scatter_tensor(mine, dkv_all.view(-1), group)
        dk, dv = _unpack(mine, k.shape, v.shape)
        dsink = _sink_grad(dout, out, lse, sink) if sink is not None else None
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None,
                dsink)


def _seq_to_heads(x: torch.Tensor, group, perm: torch.Tensor) -> torch.Tensor:
    """[B, H, S, D] -> [B, H/a, a*S, D]: scatter heads, gather sequence, reorder."""
    a = dist.get_world_size(group)
    b, h, s, d = x.shape
    send = x.reshape(b, a, h // a, s, d).transpose(0, 1).contiguous()
    recv = torch.empty_like(send)
    comm.all_to_all_single(recv, send, group)
    gathered = recv.permute(1, 2, 0, 3, 4).reshape(b, h // a, a * s, d)
    return gathered.index_select(2, perm)


def _heads_to_seq(x: torch.Tensor, group, inv_perm: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`_seq_to_heads`: [B, H/a, a*S, D] -> [B, H, S, D]."""
    a = dist.get_world_size(group)
    b, hl, sa, d = x.shape
    s = sa // a
    ordered = x.index_select(2, inv_perm).reshape(b, hl, a, s, d)
    send = ordered.permute(2, 0, 1, 3, 4).contiguous()
    recv = torch.empty_like(send)
    comm.all_to_all_single(recv, send, group)
    return recv.transpose(0, 1).reshape(b, a * hl, s, d)


class UlyssesAllToAll(torch.autograd.Function):
    """Ulysses all-to-all: ``to_heads`` scatters heads and gathers the a2a group's sequence,
    otherwise the inverse. Each direction is the other's backward."""

    @staticmethod
    def forward(ctx, x, group, perm, inv_perm, to_heads: bool):
        ctx.meta = (group, perm, inv_perm, to_heads)
        return _seq_to_heads(x, group, perm) if to_heads else _heads_to_seq(x, group, inv_perm)

    @staticmethod
    def backward(ctx, grad):
        group, perm, inv_perm, to_heads = ctx.meta
        back = _heads_to_seq(grad, group, inv_perm) if to_heads else _seq_to_heads(
            grad, group, perm)
        return back, None, None, None, None


def _tokens_in_order(x: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """``x`` [B, H, S, D] with its tokens in the order ``perm``, laid out [B, S, H, D] in
    memory (heads inside the rows), as megatron's bshd / thd tensors and the CP output are: the
    output's reshape back to [t, h*d] stays a view."""
    return x.transpose(1, 2).index_select(1, perm).transpose(1, 2)


class TokenOrder(torch.autograd.Function):
    """Tokens (dim 2 of [B, H, S, D]) taken in the order ``perm``; the backward takes the
    gradient back with ``inv`` (its inverse): one gather each way, heads inside the rows."""

    @staticmethod
    def forward(ctx, x, perm, inv):
        ctx.inv = inv
        return _tokens_in_order(x, perm)

    @staticmethod
    def backward(ctx, grad):
        return _tokens_in_order(grad, ctx.inv), None, None
