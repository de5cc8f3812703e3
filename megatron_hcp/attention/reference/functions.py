"""autograd Functions of CP attention, each with its own communication in backward.

* :class:`RingAttention` - KV ring over a group of ``p`` ranks (``p-1`` steps; ``p == 1`` is
  plain local attention). Backward sends KV round the ring again with a travelling dK/dV
  accumulator that ends at its owner.
* :class:`AllGatherAttention` - one all-gather of KV; backward gathers again and
  reduce-scatters dK/dV.

Tensors are ``[B, H, S, D]``; K and V come packed (:func:`~.reorder.pack_kv`:
``[B, Hkv, S, D + Dv]``, V's head dim ``Dv`` may differ, as in MLA); ``S`` is the local
sequence in the two-halves layout of :class:`~.seq_layout.SeqLayout`.

What they keep for the backward is what its kernels read again and nothing twice: q, the
packed K/V (the message itself: no second copy), the output *as returned* (an
:class:`~.reorder.OutputOrder` - the a2a back, or the token order of packed halves - moves it
inside the function, and the backward moves it back: the model holds the returned output
anyway; once moved back the returned one is let go, :class:`~.reorder.HeldOutput`) and the
LSE. A large block's backward may run in halves (:func:`_halves`), so that its largest
gradient beside the accumulators is half as large. Communication buffers are dropped, or released
(:func:`~.comm.release`), as soon as their data is used, so what a rank holds when the
forward returns does not depend on how fast its peers are.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator

import torch

from ...sharding import contiguous_window_reach
from . import comm
from .block_counter import record_kernel
from .blocks import Block, plan_block, record_block, take
from .gpu import VARLEN_KERNEL, kernel_calls, varlen_backward, varlen_forward, varlen_takes
from .grad_rows import LazyRows, add_rows
from .kernel_support import acc_dtype
from .kernels import block_backward, block_forward, row_chunks
from .masks import Window
from .merge import merge_into
from .pieces import split_mode, splitting
from .reorder import HeldOutput, OutputOrder, RowsInOrder, split_kv
from .seq_layout import SeqLayout

__all__ = ["AllGatherAttention", "RingAttention", "ring_reach"]

NO_ORDER = OutputOrder()


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
    """The varlen calls a block runs as (:func:`~.gpu.varlen.kernel_calls` for q's heads and head
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
    for part in _row_parts(block, q, v, bias):  # each merged as it comes: rows apart
        ob, lb = block_forward(
            take(q, part.rows), take(k, part.cols), take(v, part.cols),
            scale=scale, causal=part.causal, mask=part.mask, bias=bias,
        )
        merge_into(out, lse, part.rows, ob, lb, first=first,
                   empty_rows=part.mask is not None or bias is not None)


def _backward_block(dout, q, k, v, out, lse, block, scale, dq, dk, dv, bias=None, *,
                    varlen=None):
    calls = _calls(block, q, varlen and bias is None)
    if calls is not None:  # its varlen calls (FA2 takes no bias: those blocks keep theirs)
        for call in calls:
            gq, gk, gv = varlen_backward(dout, q, k, v, out, lse, call, scale)
            add_rows(dq, call.row_span, gq)
            add_rows(dk, call.col_span, gk)
            add_rows(dv, call.col_span, gv)
        return None
    if block.pieces is not None:  # no bias with packed sequences: no bias gradient
        for piece in block.pieces:
            _backward_block(dout, q, k, v, out, lse, piece, scale, dq, dk, dv)
        return None
    gb: list[torch.Tensor] = []
    gathered = _gathered(_reread(block, dout, out))
    for part in _row_parts(block, q, v, bias, gathered):  # each added in as it comes
        rows, cols = part.row_view, part.col_view
        gq, gk, gv, *gb = block_backward(
            _rows(dout, rows), take(q, rows), take(k, cols), take(v, cols), _rows(out, rows),
            take(lse, rows), scale=scale, causal=part.causal, mask=part.mask, bias=bias,
        )
        for acc, grad, sel in ((dq, gq, rows), (dk, gk, cols), (dv, gv, cols)):
            add_rows(acc, sel, grad)
        del gq, gk, gv, grad
    return gb[0] if gb else None


def _rows(x: torch.Tensor | RowsInOrder, sel) -> torch.Tensor:
    """The rows ``sel`` of the output or its gradient, as the backward holds them."""
    return x.take(sel) if isinstance(x, RowsInOrder) else take(x, sel)


def _back(ctx, x: torch.Tensor) -> torch.Tensor | RowsInOrder:
    """The returned output or its gradient in the attention's layout (``ctx.order.back``); in
    token order read in place (:class:`~.reorder.RowsInOrder`: each block gathers the rows it
    reads, no regrouped copy of the whole) unless varlen calls read them (they take spans of
    the regrouped tensors)."""
    return ctx.order.back(x, whole=ctx.varlen is not None)


def _save(ctx, out: torch.Tensor, *tensors) -> None:
    """Save ``tensors`` for the backward, and the returned ``out``: with them where it is the
    attention's own output, no graph is recorded (no_grad, inference mode) or saved-tensor
    hooks are active, else in a :class:`~.reorder.HeldOutput` (its backward lets go of it
    once moved back: not alive in both layouts at the peak)."""
    held = ctx.order.moves and any(ctx.needs_input_grad) and HeldOutput.applies(out)
    ctx.held = HeldOutput(out) if held else None
    ctx.save_for_backward(None if held else out, *tensors)


def _saved(ctx, dout: torch.Tensor) -> tuple:
    """The output's gradient ``dout`` and the output :func:`_save` saved, both in the
    attention's layout (:func:`_back`), and the other saved tensors."""
    out, *tensors = ctx.saved_tensors
    if ctx.held is not None:  # moved back whole, and the returned one let go: the blocks
        # then read views of it, as of an output that never moved
        out = ctx.order.back(ctx.held.take())
    else:
        out = _back(ctx, out)
    return _back(ctx, dout), out, tensors


def _chunks(block: Block, q: torch.Tensor, v: torch.Tensor, bias) -> list[slice] | None:
    """The row chunks ``block`` runs in (:func:`~.kernels.row_chunks`: where its kernel would
    build a mask or scores of rows x cols larger than its share of q), or ``None``."""
    n, m = q.shape[2], v.shape[2]
    return row_chunks(q, v, _count(block.rows, n), _count(block.cols, m), causal=block.causal,
                      masked=block.mask is not None, biased=bias is not None)


def _reread(block: Block, dout, out) -> list[RowsInOrder]:
    """Of ``dout`` and ``out``, those whose rows ``block`` gathers (the output and its
    gradient read in token order, :class:`~.reorder.RowsInOrder`, where the block's rows are
    not one run of theirs)."""
    return [x for x in (dout, out)
            if isinstance(x, RowsInOrder) and not x.in_place(block.row_view)]


def _gathered(reread: list[RowsInOrder]) -> int:
    """Elements per row that a block's backward gathers of the tensors it rereads
    (:func:`_reread`), held beside its dq."""
    return sum(x.row_elements for x in reread)


def _split_gathered(chunks: list[slice], per_row: int, gathered: int) -> list[slice]:
    """Row ``chunks`` whose rows of dq (``per_row`` elements a row) and gathered rows
    (``gathered``) add up to ``2 * HALVE_ELEMENTS`` or more, each in halves: a chunk then
    holds no more beside the accumulators than a half of the same block without gathered
    rows (bshd) holds of its dq."""
    out: list[slice] = []
    for chunk in chunks:
        rows = chunk.stop - chunk.start
        if rows > 1 and rows * (per_row + gathered) >= 2 * HALVE_ELEMENTS:
            mid = chunk.start + rows // 2
            out += [slice(chunk.start, mid), slice(mid, chunk.stop)]
        else:
            out.append(chunk)
    return out


def _row_parts(block: Block, q: torch.Tensor, v: torch.Tensor, bias, gathered: int = 0
               ) -> Iterator[Block]:
    """``block`` as the blocks of the row chunks it runs in (:func:`_chunks`; in a backward,
    its chunks - or the block itself, where it runs whole - that gather ``gathered`` elements
    a row besides split further, :func:`_split_gathered`: a half of a later block is split
    once more where its rows are that large), each with its rows, its mask's rows and a
    causal diagonal folded into a mask offset by the chunk's start; else ``block`` alone.
    Made as the caller asks for them: a chunk's mask exists while its chunk runs, not all the
    chunks' at once (a causal diagonal's chunk masks add up to half its rows x cols)."""
    n, m = q.shape[2], v.shape[2]
    cols = _count(block.cols, m)
    parts = _chunks(block, q, v, bias)
    if gathered and bias is None:  # (a bias's gradient is its block's: never in chunks)
        parts = _split_gathered(parts or [slice(0, _count(block.rows, n))],
                                q.shape[0] * q.shape[1] * q.shape[-1], gathered)
    if parts is None or len(parts) == 1:  # (one chunk of every row: the block)
        yield block
        return
    for part in parts:
        part_cols, col_run = block.cols, block.col_run
        if block.mask is not None:
            mask = block.mask.query_rows(part)
            if block.reach is not None and bias is None:  # the columns its rows reach
                lo, hi = block.reach.cover(part)
                if lo < hi and hi - lo < cols:
                    part_cols, col_run = _sub(block.cols, lo, hi, m), _sub_run(col_run, lo, hi)
                    mask = mask.key_cols(slice(lo, hi))
        elif block.causal:  # the diagonal of the chunk's rows (offset by its start): the
            # columns up to its last row's (a causal block runs in chunks on the math path
            # only, which takes no bias in chunks)
            part_cols, col_run = _sub(block.cols, 0, part.stop, m), _sub_run(col_run, 0, part.stop)
            mask = torch.ones(part.stop - part.start, part.stop, dtype=torch.bool,
                              device=q.device).tril(part.start)
        else:
            mask = None
        yield Block(_sub(block.rows, part.start, part.stop, n), part_cols, False, mask,
                    row_run=_sub_run(block.row_run, part.start, part.stop), col_run=col_run)
        del mask


def _sub(sel, lo: int, hi: int, n: int):
    """The tokens ``lo`` to ``hi`` of a selector (a slice of ``n`` tokens, or an index)."""
    if isinstance(sel, slice):
        first = range(n)[sel].start
        return slice(first + lo, first + hi)
    return sel[lo:hi]


def _sub_run(run: slice | None, lo: int, hi: int) -> slice | None:
    """The tokens ``lo`` to ``hi`` of a block's run (``None``: it has none)."""
    return None if run is None else slice(run.start + lo, run.start + hi)


def _count(sel, n: int) -> int:
    """Tokens a selector (slice of ``n``, or index) takes."""
    return len(range(n)[sel]) if isinstance(sel, slice) else int(sel.numel())


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
    if isinstance(dout, RowsInOrder) and isinstance(out, RowsInOrder):
        delta = dout.row_sums(out).to(lse.dtype)
    else:
        dout, out = (_rows(x, slice(None)) for x in (dout, out))
        delta = (dout.to(lse.dtype) * out.to(lse.dtype)).sum(-1)
    prob = torch.exp(sink.to(lse.dtype).view(1, -1, 1) - lse)
    return -(prob * delta).sum((0, 2)).to(sink.dtype)


def _varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: SeqLayout,
            window: Window) -> tuple[int, int] | None:
    """q's (heads, head dim) where this call's packed blocks in pieces and windowed blocks
    run as varlen calls (:func:`~.gpu.varlen.varlen_takes`; a dense layout without a window has
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


def _ring_steps(kv: torch.Tensor, group, ranks: list[int], pos: int, steps: int,
                after_step: Callable[[int], None] | None = None):
    """Yield ``(src, kv of src)`` for each of ``steps`` ring steps (``p``: the whole ring).

    The next step's K/V is already on its way while the caller computes with the current one;
    a step's buffer is dropped (its send's work with it) before the next one is allocated, so
    two messages live at a time besides ``kv`` - provided the caller drops what it was given
    before asking for the next. ``after_step(step)`` runs once a step's exchange is done and
    its message dropped, before the next step's buffer exists (one message alive then: the
    backward hands dK/dV on there).
    """
    p = len(ranks)
    nxt, prv = ranks[(pos + 1) % p], ranks[(pos - 1) % p]
    for step in range(steps):
        works, incoming = [], None  # the last step's works (a send holds its tensor) go first
        if step < steps - 1:
            incoming = torch.empty_like(kv)
            works = comm.ring_exchange(kv, incoming, group, nxt, prv)
        yield (pos - step) % p, kv
        while works:
            works.pop().wait()
        kv, incoming = incoming, None
        if after_step is not None:
            after_step(step)


def _pass_grads(dkv: torch.Tensor, group, ranks: list[int], pos: int, hop: int
                ) -> torch.Tensor:
    """Send ``dkv`` ``hop`` ranks on and return the one that arrives from ``hop`` ranks back
    (the sent one is dropped with its work)."""
    p = len(ranks)
    arrived = torch.empty_like(dkv)
    works = comm.ring_exchange(dkv, arrived, group, ranks[(pos + hop) % p],
                               ranks[(pos - hop) % p])
    while works:
        works.pop().wait()
    return arrived


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


def _ring_forward_step(q, msg, dim, layout: SeqLayout, src: int, block, scale, out, lse,
                       bias, first: bool, varlen) -> None:
    """The block of the K/V ``msg`` of ``src`` merged into ``out`` / ``lse`` (its views die
    with this call)."""
    kj, vj = split_kv(msg, dim)
    where = _bias_positions(bias, layout, layout.at(layout.cp, src), block)
    _forward_block(q, kj, vj, block, scale, out, lse, _bias_block(bias, where), first=first,
                   varlen=varlen)


def _ring_backward_step(dout, q, msg, dim, layout: SeqLayout, src: int, block, scale, out,
                        lse, dq, dkv, bias, dbias, varlen) -> None:
    """The gradients of the block of the K/V ``msg`` of ``src``, added into ``dq`` and
    ``dkv`` (and ``dbias``); a later source's block in halves (:func:`_halves`; the local
    block comes first and is not halved: where it runs as one kernel call, its dq is the
    accumulator - a thd block that gathers large rows runs in row halves,
    :func:`_row_parts`, and adds into a zeroed one)."""
    kj, vj = split_kv(msg, dim)
    dk, dv = split_kv(dkv, dim)
    where = _bias_positions(bias, layout, layout.at(layout.cp, src), block)
    whole = bias is not None or src == layout.position  # a bias's gradient is the block's
    for part in (block,) if whole else _parts(block, q, kj, vj, dout, out):
        gb = _backward_block(dout, q, kj, vj, out, lse, part, scale, dq, dk, dv,
                             _bias_block(bias, where), varlen=varlen)
        if gb is not None:
            _add_bias_grad(dbias, gb, where)


def _whole_block_grads(dout, q, kv, dim, out, lse, block, scale, varlen):
    """The gradients (dq, dk, dv) of a block of every row and column of q and the packed
    ``kv`` (as its kernel returns them), or ``None`` where the block is not whole (rows or
    columns an index or a part, pieces, varlen calls, no block)."""
    s = q.shape[2]
    whole = slice(0, s)
    if (block is None or not isinstance(block.rows, slice) or not isinstance(block.cols, slice)
            or range(s)[block.rows] != range(s) or range(s)[block.cols] != range(s)):
        return None
    k, v = split_kv(kv, dim)
    if not _whole_run(block, q, v, varlen):
        return None
    grads = block_backward(_rows(dout, whole), take(q, whole), k, v, _rows(out, whole),
                           take(lse, whole), scale=scale, causal=block.causal,
                           mask=block.mask)
    return tuple(grads[:3])


class RingAttention(torch.autograd.Function):
    """Ring (p2p) CP attention over ``ranks`` (global ranks in ring order) of q and the packed
    ``kv`` (K's head dim ``dim``); the output leaves by ``order``. The ring runs
    :func:`ring_reach` + 1 steps: in the contiguous layout under a backward-looking window it
    stops once every rank has the K/V its window reaches (the rest never travels)."""

    @staticmethod
    def forward(ctx, q, kv, dim: int, layout: SeqLayout, group, ranks: list[int],
                causal: bool, scale: float, window: Window = None,
                sink: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                order: OutputOrder = NO_ORDER):
        # the kernels take q and the K/V views as they are (head dim contiguous); the packed
        # K/V is the ring's message, and the backward sends the same message again
        k, v = split_kv(kv, dim)
        varlen = _varlen(q, k, v, layout, window)
        # the first step is the local block: with all rows, the accumulators need no fill
        local = plan_block(layout, layout, causal, window, varlen=varlen)
        out, lse = _new_acc(q, v, local)
        del k, v
        steps = ring_reach(layout, causal, window) + 1
        first = True
        for src, msg in _ring_steps(kv, group, ranks, layout.position, steps):
            block = local if src == layout.position else plan_block(
                layout, layout.at(layout.cp, src), causal, window, varlen=varlen)
            record_block(block, layout)
            if block is not None:  # outside the window: pass the K/V on, compute nothing
                _ring_forward_step(q, msg, dim, layout, src, block, scale, out, lse, bias,
                                   first, varlen)
                first = False
            del msg  # before the next step's buffer is allocated
        lse = _apply_sink(out, lse, sink)
        out = out.to(q.dtype)  # the backward's kernels read the output in q's dtype
        out = order.leave(out)
        ctx.meta = (dim, layout, group, ranks, causal, scale, window)
        ctx.split, ctx.varlen, ctx.order = split_mode(), varlen, order
        _save(ctx, out, q, kv, lse, sink, bias)
        return out

    @staticmethod
    @_as_planned
    def backward(ctx, dout):
        dout, out, (q, kv, lse, sink, bias) = _saved(ctx, dout)
        dim, layout, group, ranks, causal, scale, window = ctx.meta
        p, pos = len(ranks), layout.position
        if p == 1 and bias is None:  # one block (a2a, local attention): where it is whole,
            # its gradients are the gradients - no accumulators beside them
            block = plan_block(layout, layout, causal, window, varlen=ctx.varlen)
            grads = _whole_block_grads(dout, q, kv, dim, out, lse, block, scale, ctx.varlen)
            if grads is not None:
                dsink = _sink_grad(dout, out, lse, sink) if sink is not None else None
                del dout, out  # the output and its gradient in this layout are done with
                gq, gk, gv = grads
                dkv = torch.cat([gk, gv], dim=-1)
                del gk, gv, grads
                return (gq.to(q.dtype), dkv.to(kv.dtype), None, None, None, None, None, None,
                        None, dsink, None, None)
        acc = acc_dtype(q.dtype)
        dq = LazyRows(q.shape, acc, q.device)  # the local block's dq, where it has every row
        dkv = torch.zeros(kv.shape, dtype=acc, device=q.device)
        dbias = torch.zeros(bias.shape, dtype=acc, device=q.device) if bias is not None else None
        steps = ring_reach(layout, causal, window) + 1
        travelling = [dkv]

        def hand_on(step: int) -> None:
            """dK/dV of this step's source travel on with its K/V; after the last step they
            go home: `step` ranks back (the whole ring: the next rank)."""
            if p > 1 and steps > 1:
                hop = 1 if step < steps - 1 else (p - step) % p
                travelling.append(_pass_grads(travelling.pop(), group, ranks, pos, hop))

        del dkv
        for src, msg in _ring_steps(kv, group, ranks, pos, steps, hand_on):
            block = plan_block(layout, layout.at(layout.cp, src), causal, window,
                               varlen=ctx.varlen)
            if block is not None:
                _ring_backward_step(dout, q, msg, dim, layout, src, block, scale, out, lse,
                                    dq, travelling[0], bias, dbias, ctx.varlen)
            del msg
        dkv = travelling.pop()
        dsink = _sink_grad(dout, out, lse, sink) if sink is not None else None
        dbias = dbias.to(bias.dtype) if bias is not None else None
        return (dq.value().to(q.dtype), dkv.to(kv.dtype), None, None, None, None, None, None,
                None, dsink, dbias, None)


def _sources(layout: SeqLayout, causal: bool, window: Window, record: bool,
             varlen: tuple[int, int] | None = None) -> list[tuple[int, Block]]:
    """The sources of an all-gather whose K/V this rank's queries see, each with its block,
    this rank's own first (it needs no gathered data). One block per source: sources of one
    block shape are not concatenated (that would copy the gathered K/V once more)."""
    n = layout.cp
    plans = [(src, plan_block(layout, layout.at(n, src), causal, window, varlen=varlen))
             for src in range(n)]
    for _src, plan in plans if record else ():  # forward only: BlockCounter counts forwards
        record_block(plan, layout)
    plans = [(src, plan) for src, plan in plans if plan is not None]
    return sorted(plans, key=lambda item: item[0] != layout.position)


# a block's backward runs in halves only where that saves this many gradient elements or
# more (half its largest gradient); below it the block runs whole: one more kernel call and
# its adds cost more than the bytes are worth. 2^17 (512 KiB in fp32): the ring's blocks
# at 256 tokens a rank with 8 heads of 64 (CP 16 at S 4096) halve and keep the peak within
# 2x of a flash call, at the cost of 5 more kernels a step of the launch proxy's CP 2 case
# (21 -> 26, blocks of the same size); its CP 4 blocks (128 tokens a rank) save 2^15 - 2^16
# and run whole (2^16 would add 13-40 kernels a step there)
HALVE_ELEMENTS = 2**17


def _halves(block: Block, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            gathered: int = 0) -> tuple[Block, ...]:
    """A dense block as two blocks, the same work in two kernel calls (and one more add of
    the whole gradient), where that halves its largest gradient beside the accumulators, by
    :data:`HALVE_ELEMENTS` or more: half its rows each where dq is its largest gradient
    (GQA: more query heads than KV heads) or as large as dK/dV (MHA: a ring's block of every
    row and half the columns - a half holds half its dq beside its dK/dV, 3/4 of the whole's
    gradients) and it has more than half of q's rows; half its columns each where dK/dV are
    the largest (MHA: the later rows of a ring or all-gather block, which see every column)
    and it has more than half of the K/V's columns; a masked block (packed sequences, a
    window) with its mask's rows or columns, where it runs whole (not in row chunks, which
    bound its parts already). ``gathered``: elements per row that its backward gathers
    besides (rows of the output and its gradient read in token order, :func:`_parts`), held
    beside dq and halved with it. Else ``(block,)``: causal, packed and varlen blocks."""
    n, m = q.shape[2], k.shape[2]
    rows, cols = _count(block.rows, n), _count(block.cols, m)
    b = q.shape[0]
    dq = b * rows * q.shape[1] * q.shape[-1]
    dkv = b * cols * k.shape[1] * (k.shape[-1] + v.shape[-1])
    by_row = dq + rows * gathered  # what halves with its rows
    if (block.causal or block.pieces is not None or block.calls is not None
            or max(by_row, dkv) < 2 * HALVE_ELEMENTS
            or (block.mask is not None and _chunks(block, q, v, None) is not None)):
        return (block,)
    mask = block.mask
    if by_row >= dkv and 2 * rows > n:
        half = rows // 2
        return tuple(Block(_sub(block.rows, lo, hi, n), block.cols, False,
                           None if mask is None else mask.query_rows(slice(lo, hi)),
                           row_run=_sub_run(block.row_run, lo, hi), col_run=block.col_run)
                     for lo, hi in ((0, half), (half, rows)))
    if dkv > dq and 2 * cols > m:
        half = cols // 2
        return tuple(Block(block.rows, _sub(block.cols, lo, hi, m), False,
                           None if mask is None else mask.key_cols(slice(lo, hi)),
                           row_run=block.row_run, col_run=_sub_run(block.col_run, lo, hi))
                     for lo, hi in ((0, half), (half, cols)))
    return (block,)


def _parts(block: Block, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout, out
           ) -> tuple[Block, ...]:
    """``block`` as a later block's backward runs (:func:`_halves`), the rows of ``dout`` and
    ``out`` it gathers (:class:`~.reorder.RowsInOrder`, rows not one run) counted beside its
    dq; in halves of its rows, the gathered rows kept are let go first: each half gathers its
    own, no copy of them all beside (the thd ring's block of every row)."""
    reread = _reread(block, dout, out)
    parts = _halves(block, q, k, v, _gathered(reread))
    if len(parts) > 1 and parts[0].cols is block.cols:  # halves of its rows
        for x in reread:
            x.let_go()
    return parts


def _gather(kv: torch.Tensor, group, n: int):
    """Start the all-gather of the packed K/V ([n, *kv.shape]); the local block is computed
    while it runs."""
    full = torch.empty(n * kv.numel(), dtype=kv.dtype, device=kv.device)
    work = comm.all_gather_into_tensor(full, kv.reshape(-1), group, async_op=True)
    return full.view(n, *kv.shape), work


def _whole_run(block: Block, q: torch.Tensor, v: torch.Tensor, varlen) -> bool:
    """``block`` has no pieces, varlen calls or row chunks: one kernel call, or two row
    halves where its backward gathers large rows (:func:`_row_parts`; its gradients' first
    add then zeroes the accumulator, :class:`~.grad_rows.LazyRows`)."""
    return (block.pieces is None and _calls(block, q, varlen) is None
            and _chunks(block, q, v, None) is None)


def _every_source(shape: torch.Size, dtype: torch.dtype, own: tuple[LazyRows, LazyRows],
                  position: int, dim: int) -> torch.Tensor:
    """The all-gather's dK/dV accumulator of every source ([n, *kv.shape], zeros), with the
    local block's ``own`` dK and dV in its row ``position``: made once the local block is
    done, so that it is not alive beside that block's gradients and the whole output
    gradient it reads (thd)."""
    dk, dv = own
    dkv_all = torch.zeros(shape, dtype=dtype, device=dk.device)
    mk, mv = split_kv(dkv_all[position], dim)
    mk.copy_(dk.value())
    mv.copy_(dv.value())
    return dkv_all


def _gathered_forward(q, msg, dim, block, scale, out, lse, first: bool, varlen) -> None:
    """The block of one source's packed K/V ``msg`` merged into ``out`` / ``lse``."""
    kj, vj = split_kv(msg, dim)
    _forward_block(q, kj, vj, block, scale, out, lse, first=first, varlen=varlen)


class AllGatherAttention(torch.autograd.Function):
    """CP attention with one all-gather of the packed K/V over ``group`` (this rank at
    ``layout.position``); the output leaves by ``order``. The gathered K/V live from the
    gather to the last block, forward and again backward (with their gradients)."""

    @staticmethod
    def forward(ctx, q, kv, dim: int, layout: SeqLayout, group, causal: bool, scale: float,
                window: Window = None, sink: torch.Tensor | None = None,
                order: OutputOrder = NO_ORDER):
        full, work = _gather(kv, group, layout.cp)
        k, v = split_kv(kv, dim)
        varlen = _varlen(q, k, v, layout, window)
        sources = _sources(layout, causal, window, record=True, varlen=varlen)
        local = sources[0][1] if sources and sources[0][0] == layout.position else None
        out, lse = _new_acc(q, v, local)
        del k, v
        for index, (src, block) in enumerate(sources):
            if src != layout.position and work is not None:
                work.wait()
                work = None
            _gathered_forward(q, kv if src == layout.position else full[src], dim, block,
                              scale, out, lse, index == 0, varlen)
        if work is not None:
            work.wait()
        comm.release(full)  # not kept: the backward gathers again
        lse = _apply_sink(out, lse, sink)
        out = out.to(q.dtype)  # the backward's kernels read the output in q's dtype
        out = order.leave(out)
        ctx.meta = (dim, layout, group, causal, scale, window)
        ctx.split, ctx.varlen, ctx.order = split_mode(), varlen, order
        _save(ctx, out, q, kv, lse, sink)
        return out

    @staticmethod
    @_as_planned
    def backward(ctx, dout):
        dout, out, (q, kv, lse, sink) = _saved(ctx, dout)
        dim, layout, group, causal, scale, window = ctx.meta
        full, work = _gather(kv, group, layout.cp)  # again: O(local) saved
        acc = acc_dtype(q.dtype)
        dq = LazyRows(q.shape, acc, q.device)  # the local block's dq (it comes first)
        sources = _sources(layout, causal, window, record=False, varlen=ctx.varlen)
        # a local block run whole (its dK/dV the kernel's own tensors) before the accumulator
        # of every source is made: not alive beside it (a block in chunks or pieces adds
        # into the accumulator, which a separate one of its own would only double)
        own = None
        k, v = split_kv(kv, dim)
        if sources and sources[0][0] == layout.position and _whole_run(
                sources[0][1], q, v, ctx.varlen):
            own = (LazyRows(k.shape, acc, q.device), LazyRows(v.shape, acc, q.device))
        del k, v
        dkv_all = None if own is not None else torch.zeros(full.shape, dtype=acc,
                                                           device=q.device)
        for index, (src, block) in enumerate(sources):
            if src != layout.position and work is not None:
                work.wait()
                work = None
            if src != layout.position and dkv_all is None:
                dkv_all = _every_source(full.shape, acc, own, layout.position, dim)
                own = None
            kj, vj = split_kv(kv if src == layout.position else full[src], dim)
            dk, dv = own if own is not None else split_kv(dkv_all[src], dim)
            for part in _parts(block, q, kj, vj, dout, out) if index else (block,):
                _backward_block(dout, q, kj, vj, out, lse, part, scale, dq, dk, dv,
                                varlen=ctx.varlen)
        if work is not None:
            work.wait()
        comm.release(full)
        if dkv_all is None:  # the local block was the only one
            dkv_all = _every_source(full.shape, acc, own, layout.position, dim)
            own = None
        mine = torch.empty(kv.shape, dtype=acc, device=q.device)
        comm.reduce_scatter_tensor(mine.view(-1), dkv_all.view(-1), group)
        comm.release(dkv_all)
        dsink = _sink_grad(dout, out, lse, sink) if sink is not None else None
        return (dq.value().to(q.dtype), mine.to(kv.dtype), None, None, None, None, None, None,
                dsink, None)
