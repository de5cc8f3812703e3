"""Which query rows meet which key/value columns, for a pair of CP positions.

With load-balanced (zigzag) chunks, position ``r`` holds chunks ``r`` and ``2n-1-r``. Against the
keys and values of position ``src`` under a causal mask (as in Transformer Engine):

* ``src == r``: all local queries on all local keys, causal (the diagonal);
* ``src <  r``: all queries on the *first* half of the keys, no mask (it lies in the past);
* ``src >  r``: the *second* half of the queries on all keys, no mask.

Every rank therefore does the same work at every step. In the contiguous layout (position ``r``
holds slice ``r``) a causal block is the diagonal (``src == r``), full (``src < r``) or empty
(``src > r``: skipped), so position ``r`` computes ``r + 1`` blocks. Without a causal mask every
pair is full.
Packed (``thd``) data adds a mask: same sequence, both tokens real (not padding), and causal order
by position inside the sequence.

A sliding window ``(left, right)`` (query at position i sees keys i-left .. i+right, ``-1`` =
unbounded, as in Transformer Engine) adds its band to the mask; a block is trimmed to the rows and
columns that see anything and skipped (``None``) when the window sees none of it.
:class:`~.block_counter.BlockCounter` records which blocks the forward computed and which it
skipped.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from .bands import block_bands
from .block_counter import COUNTERS
from .gpu import VarlenCall, kernel_calls, varlen_calls
from .masks import BlockMask, Meta, Reach, Window
from .pieces import block_pieces, split_mode, worth_splitting
from .seq_layout import SeqLayout

__all__ = ["Block", "plan_block", "record_block", "take"]

Selector = slice | torch.Tensor


@dataclass(frozen=True)
class Block:
    """Query ``rows`` against key/value ``cols`` (slices or token indices), ``causal`` (the
    square diagonal) or masked by ``mask`` (a :class:`~.masks.BlockMask`); or, where ``pieces`` is
    not ``None``, computed as those dense blocks (:mod:`.pieces`: a packed block per
    sequence) instead; ``calls``: the varlen calls that compute the block (its pieces, or a
    windowed block's bands: :mod:`.gpu.varlen`) where the kernel takes them. ``row_run`` /
    ``col_run``: where ``rows`` / ``cols`` are an index of one run of consecutive tokens, that
    run as a slice - the backward takes the block's tensors as views of it (no gathered copies
    of q, K/V, dO and O) and adds its gradients into it. The forward keeps the index: its
    merges are compiled per layout of the block's output (:mod:`.gpu.fused`), and a kernel's
    output from views would multiply their variants past dynamo's recompile limit.
    ``reach``: a masked block's first and last column of each row (:class:`~.masks.Reach`):
    where it runs in row chunks, each chunk takes only the columns its rows reach."""

    rows: Selector
    cols: Selector
    causal: bool
    mask: BlockMask | None
    pieces: tuple[Block, ...] | None = None
    calls: tuple[VarlenCall, ...] | None = None
    row_run: slice | None = None
    col_run: slice | None = None
    reach: Reach | None = None

    @property
    def row_view(self) -> Selector:
        """The rows as a block takes its tensors: the run where there is one."""
        return self.rows if self.row_run is None else self.row_run

    @property
    def col_view(self) -> Selector:
        """The columns as a block takes its tensors: the run where there is one."""
        return self.cols if self.col_run is None else self.col_run


def _size(sel: Selector, n: int) -> int:
    return len(range(n)[sel]) if isinstance(sel, slice) else int(sel.numel())


def record_block(block: Block | None, layout: SeqLayout) -> None:
    """Count a forward block (``None``: skipped; one in pieces: each piece, or skipped where it
    has none) in every active :class:`~.block_counter.BlockCounter`."""
    if block is not None and block.pieces is not None:  # the pieces are the blocks run;
        for piece in block.pieces:  # none (every token padding): nothing is seen, as a
            record_block(piece, layout)  # window's skipped block
        if not block.pieces:
            record_block(None, layout)
        return
    for counter in COUNTERS.get():
        if block is None:
            counter.skipped += 1
        else:
            n = layout.local_tokens
            counter.computed.append((_size(block.rows, n), _size(block.cols, n)))


def take(x: torch.Tensor, sel: Selector, dim: int = 2) -> torch.Tensor:
    """``x`` restricted to the tokens ``sel`` along ``dim``."""
    if isinstance(sel, slice):
        return x[(slice(None),) * dim + (sel,)]
    return x.index_select(dim, sel)


def _halves(q_layout: SeqLayout, kv_layout: SeqLayout, causal: bool
            ) -> tuple[str, str, bool] | None:
    """Which query / key half a block takes (``"all"``, ``"first"``, ``"second"``) and whether
    it is the causal diagonal; ``None``: no pair of it is visible (contiguous, the future)."""
    r, src = q_layout.position, kv_layout.position
    if not causal:
        return "all", "all", False
    if q_layout.contiguous:  # slices in order: the past in full, the future not at all
        return None if src > r else ("all", "all", src == r)
    if src == r:
        return "all", "all", True
    if src < r:
        return "all", "first", False
    return "second", "all", False


def _meta(layout: SeqLayout, sel: Selector) -> Meta:
    """The per-token metadata of the tokens ``sel`` of ``layout``."""
    return tuple(take(t, sel, 0) for t in (layout.seq_id, layout.pos, layout.valid))


@lru_cache(maxsize=128)  # three vectors of a half's tokens; a packing needs 4 per position
def _half_meta(layout: SeqLayout, which: str, side: str) -> Meta:
    """:func:`_meta` of a half of ``layout`` (``"all"``, ``"first"``, ``"second"``), gathered
    once per packing: every block of every layer, forward and backward, reads it. The query
    and the key ``side`` get tensors of their own, so that a block never passes the same
    tensor as both (the fused mask compiles a variant for each way tensors alias)."""
    return _meta(layout, layout.half(which))


def _spans(parts, start: str, size: str) -> torch.Tensor:
    """The local tokens ``parts`` cover (``start``/``size``: the attributes of a part's rows or
    columns), ascending, each once."""
    covered = sorted((getattr(p, start), getattr(p, start) + getattr(p, size)) for p in parts)
    merged: list[list[int]] = []
    for a, b in covered:
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return torch.cat([torch.arange(a, b) for a, b in merged])


@lru_cache(maxsize=128)  # a packing needs up to cp entries a rank; it holds device memory
def _window_trim(q_layout: SeqLayout, kv_layout: SeqLayout, causal: bool, window: Window,
                 halves: tuple[str, str]
                 ) -> tuple[Selector, Selector, Meta, Meta, slice | None, slice | None,
                            Reach] | None:
    """The rows and columns of a windowed block that see anything (token indices on the
    layouts' device; every local token: a slice), their metadata, where an index is one
    run of consecutive tokens, that run (:attr:`Block.row_run`), and each row's reach
    (:class:`~.masks.Reach`), or ``None`` when the window
    sees none of it: from the block's bands (:func:`~.bands.block_bands`: per pair of runs,
    exactly the rows and columns that see anything) - no [rows, cols] mask on the host - once
    per packing (every layer and the backward reuse it; no device read per block)."""
    parts = block_bands(q_layout, kv_layout, halves[0], halves[1], causal, window)
    if not parts:
        return None
    row_index, col_index = _spans(parts, "row", "rows"), _spans(parts, "col", "cols")
    rows, cols = _whole_or(row_index, q_layout), _whole_or(col_index, kv_layout)
    return (rows, cols, _meta(q_layout, rows), _meta(kv_layout, cols),
            _run_of(row_index, rows), _run_of(col_index, cols),
            _reach(q_layout, kv_layout, row_index, col_index, causal, window))


def _reach(q_layout: SeqLayout, kv_layout: SeqLayout, rows: torch.Tensor, cols: torch.Tensor,
           causal: bool, window: Window) -> Reach:
    """The :class:`~.masks.Reach` of the block of the host tokens ``rows`` x ``cols``."""
    return Reach(_meta(q_layout.on_host(), rows), _meta(kv_layout.on_host(), cols), causal,
                 window)


def _host_index(layout: SeqLayout, which: str) -> torch.Tensor:
    """The local tokens of a half of ``layout`` as an index on the host."""
    sel = layout.on_host().half(which)
    if isinstance(sel, slice):
        span = range(layout.local_tokens)[sel]
        return torch.arange(span.start, span.stop, span.step)
    return sel


@lru_cache(maxsize=128)
def _packed_reach(q_layout: SeqLayout, kv_layout: SeqLayout, which_rows: str,
                  which_cols: str, causal: bool) -> Reach:
    """Each row's reach (:class:`~.masks.Reach`) in a masked packed block, planned once per
    packing."""
    return _reach(q_layout, kv_layout, _host_index(q_layout, which_rows),
                  _host_index(kv_layout, which_cols), causal, None)


def _run_of(index: torch.Tensor, sel: Selector) -> slice | None:
    """``index`` (ascending, on the host) as a slice where it is one run of consecutive
    tokens and ``sel`` is not a slice already."""
    n = int(index.numel())
    if isinstance(sel, slice) or n == 0 or int(index[-1]) - int(index[0]) + 1 != n:
        return None
    return slice(int(index[0]), int(index[-1]) + 1)


def _whole_or(index: torch.Tensor, layout: SeqLayout) -> Selector:
    """Token indices (on the host) as a slice where they are every local token (a block then
    takes its tensors whole, not gathered copies), else on the layout's device."""
    n = layout.local_tokens
    if int(index.numel()) == n and (n == 0 or int(index[-1]) == n - 1):
        return slice(0, n)
    return index.to(layout.device)


@lru_cache(maxsize=128)
def _piece_blocks(q_layout: SeqLayout, kv_layout: SeqLayout, which_rows: str, which_cols: str,
                  causal: bool
                  ) -> tuple[tuple[Block, ...], tuple[VarlenCall, ...], int] | None:
    """:func:`~.pieces.block_pieces` as dense blocks of slices, as varlen calls
    (:func:`~.gpu.varlen.varlen_calls`), and the pairs they compute, once per packing."""
    pieces = block_pieces(q_layout, kv_layout, which_rows, which_cols, causal)
    if pieces is None:
        return None
    blocks = tuple(Block(slice(p.row, p.row + p.rows), slice(p.col, p.col + p.cols), p.causal,
                         None) for p in pieces)
    return blocks, varlen_calls(pieces), sum(p.rows * p.cols for p in pieces)


@lru_cache(maxsize=128)
def _band_calls(q_layout: SeqLayout, kv_layout: SeqLayout, which_rows: str, which_cols: str,
                causal: bool, window: tuple[int, int]
                ) -> tuple[tuple, tuple[VarlenCall, ...], int]:
    """A windowed block's bands (:func:`~.bands.block_bands`), their varlen calls and the
    pairs of their rectangles, once per packing (as :func:`_piece_blocks`)."""
    bands = block_bands(q_layout, kv_layout, which_rows, which_cols, causal, window)
    return bands, varlen_calls(bands), sum(b.rows * b.cols for b in bands)


def _launches(pieces: tuple, calls: tuple[VarlenCall, ...],
              varlen: bool | tuple[int, int] | None) -> int:
    """The kernel calls a block in ``pieces`` makes: its varlen ``calls`` as FA2 runs them for
    ``varlen``'s (heads, head dim) - as planned where ``varlen`` is ``True`` - else one a
    piece (also where FA2 cannot take a segment)."""
    if varlen is True:
        return len(calls)
    parts = kernel_calls(calls, *varlen) if varlen else None
    return len(pieces) if parts is None else len(parts)


def plan_block(q_layout: SeqLayout, kv_layout: SeqLayout, causal: bool,
               window: Window = None, *, varlen: bool | tuple[int, int] | None = None
               ) -> Block | None:
    """The block of ``q_layout``'s queries against ``kv_layout``'s keys (same chunking);
    ``None`` when ``window`` leaves no visible pair in it. Index tensors and the mask are on
    the layouts' device. ``varlen`` (q's heads and head dim, or ``True``: as planned): a
    packed block in pieces will run as its varlen calls (:mod:`.gpu.varlen`), so splitting costs
    the calls FA2 runs (:func:`~.gpu.varlen.kernel_calls`), not one per piece; a windowed block
    gets the varlen calls of its bands (:mod:`.bands`) besides its mask where they cost less
    (:func:`~.pieces.worth_splitting`, in ``MEGATRON_HCP_SPLIT_PACKED``'s mode)."""
    halves = _halves(q_layout, kv_layout, causal)
    if halves is None:
        return None
    which_rows, which_cols, diag = halves
    if q_layout.is_dense and window is None:
        return Block(q_layout.half(which_rows), kv_layout.half(which_cols), diag, None)
    if window is None:
        rows, cols = q_layout.half(which_rows), kv_layout.half(which_cols)
        split = split_mode()
        if split != "off":  # per sequence, where it pays (MEGATRON_HCP_SPLIT_PACKED)
            split_into = _piece_blocks(q_layout, kv_layout, which_rows, which_cols, causal)
            if split_into is not None:
                pieces, calls, pairs = split_into
                launches = _launches(pieces, calls, varlen)
                if worth_splitting(pairs, launches, _size(rows, q_layout.local_tokens),
                                   _size(cols, kv_layout.local_tokens), split):
                    return Block(rows, cols, False, None, pieces, calls)
        q_meta = _half_meta(q_layout, which_rows, "q")
        k_meta = _half_meta(kv_layout, which_cols, "k")
        reach = _packed_reach(q_layout, kv_layout, which_rows, which_cols, causal)
    else:
        trimmed = _window_trim(q_layout, kv_layout, causal, window, (which_rows, which_cols))
        if trimmed is None:
            return None
        rows, cols, q_meta, k_meta, row_run, col_run, reach = trimmed
        if varlen:  # FA2's own window over each pair of runs (:mod:`.bands`) where its
            # calls cost less than the masked block (MEGATRON_HCP_SPLIT_PACKED's rule); the
            # mask stays the block's plan where the calls cannot run (a segment too large)
            bands, calls, pairs = _band_calls(q_layout, kv_layout, which_rows, which_cols,
                                              causal, window)
            if worth_splitting(pairs, _launches(bands, calls, varlen),
                               _size(rows, q_layout.local_tokens),
                               _size(cols, kv_layout.local_tokens), split_mode()):
                return Block(rows, cols, False, BlockMask(q_meta, k_meta, causal, window),
                             calls=calls, row_run=row_run, col_run=col_run, reach=reach)
        return Block(rows, cols, False, BlockMask(q_meta, k_meta, causal, window),
                     row_run=row_run, col_run=col_run, reach=reach)
    return Block(rows, cols, False, BlockMask(q_meta, k_meta, causal, window), reach=reach)
