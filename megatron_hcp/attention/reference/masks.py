"""A masked block's visible pairs: same sequence, both tokens real, causal order and a
sliding window's band - held as the tokens' metadata (:class:`BlockMask`) and built as a
[rows, cols] tensor only where a kernel takes one (booleans, or an additive mask); and each
row's first and last visible column (:class:`Reach`), so that a block run in row chunks
gives each chunk only the columns its rows reach."""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

import torch

from .block_counter import record_mask
from .gpu import fuses, run_fused
from .launches import fused_region

__all__ = ["BlockMask", "Meta", "Reach", "Window", "additive_of"]

Window = tuple[int, int] | None
Meta = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # sequence id, position, real token


def _mask(q: Meta, k: Meta, causal: bool, window: Window) -> torch.Tensor:
    """Visible (query, key) pairs of the query tokens ``q`` x the key tokens ``k`` (their
    metadata): same sequence, both tokens real, causal order and the window band - built where
    the metadata lives."""
    q_seq, q_pos, q_ok = q
    k_seq, k_pos, k_ok = k
    mask = (q_seq[:, None] == k_seq[None, :]) & q_ok[:, None] & k_ok[None, :]
    if causal:
        mask &= k_pos[None, :] <= q_pos[:, None]
    if window is not None:  # bounds per query, compared with every key: booleans only, no
        left, right = window  # [rows, cols] of integer gaps
        if left >= 0:
            mask &= k_pos[None, :] >= (q_pos - left)[:, None]
        if right >= 0:
            mask &= k_pos[None, :] <= (q_pos + right)[:, None]
    return mask


# a side of a window no token limit (-1) as a bound no gap reaches: one fused function for
# every window (a Python branch would compile a variant per side); within int32, which a
# compiled kernel may type its integer arguments as (inductor's block pointers)
_UNBOUNDED = 2**31 - 1


def _additive_fused(q_seq, q_pos, q_ok, k_seq, k_pos, k_ok, left: int, right: int,
                    width: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_mask` as the fused kernels' additive mask (0 / ``-inf`` in ``dtype``, its rows
    ``width`` apart) and which rows see any key: keys ``left`` to ``right`` tokens from the
    query (causal: ``right`` 0). The keys are padded to ``width`` as keys no query sees, so
    the mask, its padding and the rows' reduction run over one [rows, width] range: one
    kernel when compiled, no [rows, cols] buffer in between."""
    cols = k_seq.shape[0]
    k_seq, k_pos = (torch.nn.functional.pad(t, (0, width - cols)) for t in (k_seq, k_pos))
    k_ok = torch.nn.functional.pad(k_ok, (0, width - cols), value=False)
    visible = (q_seq[:, None] == k_seq[None, :]) & q_ok[:, None] & k_ok[None, :]
    gap = q_pos[:, None] - k_pos[None, :]
    visible = visible & (gap <= left) & (-gap <= right)
    add = torch.where(visible, 0.0, float("-inf")).to(dtype)
    return add[:, :cols], visible.any(1)


def additive_of(visible: torch.Tensor, dtype: torch.dtype, width: int, *, seen: bool
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The boolean [rows, cols] ``visible`` as an additive mask (0 / ``-inf`` in ``dtype``,
    a view of a [rows, ``width``] buffer) and, where ``seen``, which rows see any key."""
    rows, cols = visible.shape
    add = torch.full((rows, width), float("-inf"), dtype=dtype, device=visible.device)
    add = add[:, :cols]
    add.masked_fill_(visible, 0.0)
    return add, visible.any(1) if seen else None


@dataclass(frozen=True, eq=False)
class BlockMask:
    """The visible (query, key) pairs of a masked block - same sequence, both tokens real,
    causal order and the window band - held as its tokens' metadata (``q``, ``k``: sequence
    id, position, real token) and built as a [rows, cols] tensor only where a kernel takes it:
    booleans (:meth:`dense`, the math path) or the fused kernels' additive mask
    (:meth:`additive`: one fused kernel where :func:`~.gpu.fused.fuses`, instead of a dozen passes
    over the block)."""

    q: Meta
    k: Meta
    causal: bool
    window: Window

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.q[0].numel()), int(self.k[0].numel())

    @property
    def device(self) -> torch.device:
        return self.q[0].device

    def query_rows(self, rows: slice) -> BlockMask:
        """The mask of the query rows ``rows`` only (the same keys)."""
        return BlockMask(tuple(t[rows] for t in self.q), self.k, self.causal, self.window)

    def key_cols(self, cols: slice) -> BlockMask:
        """The mask of the keys ``cols`` only (the same queries)."""
        return BlockMask(self.q, tuple(t[cols] for t in self.k), self.causal, self.window)

    def dense(self) -> torch.Tensor:
        """The visible pairs as a boolean [rows, cols] tensor."""
        return _mask(self.q, self.k, self.causal, self.window)

    def additive(self, dtype: torch.dtype, width: int | None = None, *, seen: bool = True
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(0 where visible and ``-inf`` elsewhere as a [rows, cols] tensor in ``dtype`` whose
        rows start ``width`` elements apart (default: cols), whether each row sees any key -
        ``None`` where not ``seen`` is asked for and the work is eager)."""
        rows, cols = self.shape
        width = cols if width is None else width
        if fuses(self.device, rows * cols):
            left, right = self.window if self.window is not None else (-1, -1)
            left, right = (_UNBOUNDED if x < 0 else min(x, _UNBOUNDED) for x in (left, right))
            if self.causal:  # keys at most 0 tokens after the query
                right = min(right, 0)
            done, result = run_fused(_additive_fused, *self.q, *self.k, left, right, width,
                                     dtype)
            if done:
                record_mask("fused")
                return result
        with fused_region("megatron_hcp::fused_mask"):  # the fused path: one kernel
            result = additive_of(self.dense(), dtype, width, seen=seen)
        record_mask("eager")
        return result


@dataclass(frozen=True, eq=False)
class Reach:
    """Per row of a masked block, the first column the row sees and one past the last
    (columns between may be unseen: other sequences, padding; a row that sees none has
    ``lo >= hi``), in the block's own row and column order, on the host: the mask of the
    metadata ``q`` x ``k`` (on the host), computed when a chunk first asks for its cover (a
    block that never runs in row chunks never pays for it). Compared by identity: one per
    planned block."""

    q: Meta
    k: Meta
    causal: bool
    window: Window
    _bounds: list = field(default_factory=list, repr=False)
    _covers: dict = field(default_factory=dict, repr=False)

    @property
    def lo(self) -> array:
        return self._rows()[0]

    @property
    def hi(self) -> array:
        return self._rows()[1]

    def _rows(self) -> tuple[array, array]:
        if not self._bounds:
            self._bounds.append(_row_bounds(self.q, self.k, self.causal, self.window))
        return self._bounds[0]

    def cover(self, rows: slice) -> tuple[int, int]:
        """The columns ``[lo, hi)`` the rows ``rows`` reach together: host work only, once
        per chunk of rows (every layer and the backward reuse it)."""
        key = (rows.start, rows.stop)
        if key not in self._covers:
            lo, hi = self._rows()
            self._covers[key] = (min(lo[rows]), max(hi[rows]))
        return self._covers[key]


def _row_bounds(q: Meta, k: Meta, causal: bool, window: Window) -> tuple[array, array]:
    """:class:`Reach`'s bounds, without the [rows, cols] mask: the real keys sorted by
    (sequence, position), a row's visible keys are one range of them (its sequence, from its
    window's left edge to its right or causal edge). Every column for every row where a
    sequence's keys are not in position order in memory (no layout the backend makes)."""
    q_seq, q_pos, q_ok = q
    k_seq, k_pos, k_ok = k
    n, m = int(q_seq.numel()), int(k_seq.numel())
    lo = torch.full((n,), m, dtype=torch.long)
    hi = torch.zeros(n, dtype=torch.long)
    col = torch.nonzero(k_ok).flatten()  # the real keys, in memory order
    if n and col.numel():
        span = int(torch.maximum(q_pos.max(), k_pos.max())) + 2  # one sequence's keys apart
        key, order = torch.sort(k_seq[col] * span + k_pos[col], stable=True)
        col = col[order]
        same = k_seq[col][1:] == k_seq[col][:-1]
        if bool((col[1:][same] <= col[:-1][same]).any()):
            return array("q", [0] * n), array("q", [m] * n)
        left, right = window if window is not None else (-1, -1)
        first = q_pos - left if left >= 0 else torch.zeros_like(q_pos)
        last = q_pos + right if right >= 0 else torch.full_like(q_pos, span - 1)
        if causal:
            last = torch.minimum(last, q_pos)
        base = q_seq * span
        i0 = torch.searchsorted(key, base + first.clamp(min=0))
        i1 = torch.searchsorted(key, base + last.clamp(max=span - 1), right=True) - 1
        seen = q_ok & (i1 >= i0)
        lo[seen] = col[i0[seen]]
        hi[seen] = col[i1[seen]] + 1
    return array("q", lo.tolist()), array("q", hi.tolist())
