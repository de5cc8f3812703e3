"""Which query rows meet which key/value columns, for a pair of CP positions.

With load-balanced chunks, position ``r`` holds chunks ``r`` and ``2n-1-r``. Against the keys and
values of position ``src`` under a causal mask (as in Transformer Engine):

* ``src == r``: all local queries on all local keys, causal (the diagonal);
* ``src <  r``: all queries on the *first* half of the keys, no mask (it lies in the past);
* ``src >  r``: the *second* half of the queries on all keys, no mask.

Every rank therefore does the same work at every step. Without a causal mask every pair is full.
Packed (``thd``) data adds a mask: same sequence, both tokens real (not padding), and causal order
by position inside the sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .seq_layout import SeqLayout

__all__ = ["Block", "plan_block", "take"]

Selector = slice | torch.Tensor


@dataclass(frozen=True)
class Block:
    rows: Selector
    cols: Selector
    causal: bool
    mask: torch.Tensor | None


def take(x: torch.Tensor, sel: Selector, dim: int = 2) -> torch.Tensor:
    """``x`` restricted to the tokens ``sel`` along ``dim``."""
    if isinstance(sel, slice):
        return x[(slice(None),) * dim + (sel,)]
    return x.index_select(dim, sel)


def plan_block(q_layout: SeqLayout, kv_layout: SeqLayout, causal: bool) -> Block:
    """The block of ``q_layout``'s queries against ``kv_layout``'s keys (same chunking)."""
    r, src = q_layout.position, kv_layout.position
    if not causal:
        rows, cols, diag = q_layout.half("all"), kv_layout.half("all"), False
    elif src == r:
        rows, cols, diag = q_layout.half("all"), kv_layout.half("all"), True
    elif src < r:
        rows, cols, diag = q_layout.half("all"), kv_layout.half("first"), False
    else:
        rows, cols, diag = q_layout.half("second"), kv_layout.half("all"), False
    if q_layout.is_dense:
        return Block(rows, cols, diag, None)

    def meta(layout: SeqLayout, sel: Selector):
        return tuple(take(t, sel, 0) for t in (layout.seq_id, layout.pos, layout.valid))

    q_seq, q_pos, q_ok = meta(q_layout, rows)
    k_seq, k_pos, k_ok = meta(kv_layout, cols)
    mask = (q_seq[:, None] == k_seq[None, :]) & q_ok[:, None] & k_ok[None, :]
    if causal:
        mask &= k_pos[None, :] <= q_pos[:, None]
    return Block(rows, cols, False, mask)
