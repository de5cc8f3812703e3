"""A windowed block as FlashAttention-2's own sliding window: its pairs of runs as bands.

A block under a sliding window ``(left, right)`` (query at position ``p`` sees keys
``p - left .. p + right``; ``-1``: unbounded; causal: ``right`` at most 0) is masked: its kernel
computes, and on CUDA reads a mask of, every pair of its trimmed rows and columns, where the
window sees a band. Per sequence, the block's tokens are runs of consecutive positions
(:func:`~.pieces.seq_runs`); between a run of queries at position ``a`` and a run of keys at
``b`` the visible pairs (local row ``i``, column ``j``) are those with
``j - i`` in ``[a - b - left, a - b + right]``. Trimmed to the rows and columns that see
anything, that is exactly FlashAttention-2's local attention of the trimmed piece: its causal
mask is aligned bottom-right, so row ``i`` sees ``j - i`` in
``[(cols - rows) - wl, (cols - rows) + wr]``, and the trimming makes both ``wl`` and ``wr``
non-negative (the last row sees a key, and the last column is seen). Pieces of one window
``(wl, wr)`` whose rows and columns increase are one varlen call (:mod:`.gpu.varlen`). No CPU
kernel takes a window: only the varlen calls (CUDA) use bands; the masked block stays the
plan everywhere else.
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

from .pieces import Piece, Run, seq_runs
from .seq_layout import SeqLayout

__all__ = ["Band", "band_of", "block_bands"]

_INF = float("inf")


class Band(NamedTuple):
    """Local query rows ``[row, row + rows)`` against key columns ``[col, col + cols)`` under
    FlashAttention-2's window ``(left, right)`` of the piece (bottom-right aligned; both
    non-negative)."""

    row: int
    rows: int
    col: int
    cols: int
    window: tuple[int, int]


def band_of(q: Run, k: Run, causal: bool, window: tuple[int, int]) -> Band | Piece | None:
    """The visible pairs of the real tokens of runs ``q`` x ``k`` (one sequence) under
    ``window`` and ``causal``: a :class:`Band`, a :class:`~.pieces.Piece` where they are a
    full rectangle or a causal square, or ``None`` where none is visible."""
    left, right = window
    d = q.pos - k.pos  # key j and row i are visible where j - i is in [lo, hi]
    lo = d - left if left >= 0 else -_INF
    hi = d + right if right >= 0 else _INF
    if causal:
        hi = min(hi, d)
    n_q, n_k = q.real, k.real
    i0, i1 = max(0, -hi), min(n_q, n_k - lo)  # rows that see a key
    j0, j1 = max(0, lo), min(n_k, n_q + hi)  # keys a row sees
    if lo > hi or i1 <= i0 or j1 <= j0:
        return None
    i0, i1, j0, j1 = int(i0), int(i1), int(j0), int(j1)
    rows, cols, shift = i1 - i0, j1 - j0, j0 - i0
    lo, hi = lo - shift, hi - shift  # in the trimmed piece
    row, col = q.start + i0, k.start + j0
    full_left = lo <= -(rows - 1)  # no row's first key cut off by the window
    full_right = hi >= cols - 1  # no row's last key cut off
    if full_left and full_right:
        return Piece(row, rows, col, cols, False)
    if full_left and hi == 0 and rows == cols:
        return Piece(row, rows, col, cols, True)
    offset = cols - rows  # FA2's bottom-right alignment
    return Band(row, rows, col, cols, (-1 if full_left else int(offset - lo),
                                      -1 if full_right else int(hi - offset)))


@lru_cache(maxsize=256)
def block_bands(q_layout: SeqLayout, kv_layout: SeqLayout, which_rows: str, which_cols: str,
                causal: bool, window: tuple[int, int]) -> tuple[Band | Piece, ...]:
    """The bands (and full or causal pieces) of the windowed block of ``q_layout``'s half
    ``which_rows`` against ``kv_layout``'s half ``which_cols``: every visible pair once."""
    parts: list[Band | Piece] = []
    for q_runs, k_runs in zip(seq_runs(q_layout, which_rows), seq_runs(kv_layout, which_cols)):
        for q in q_runs:
            for k in k_runs:
                if q.real and k.real and (part := band_of(q, k, causal, window)) is not None:
                    parts.append(part)
    return tuple(parts)
