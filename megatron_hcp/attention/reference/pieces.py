"""A packed block computed per sequence: dense pieces instead of one masked block.

A block of packed (``thd``) sequences meets every query of the block with every key and masks
what belongs to other sequences, padding or the future: its kernel computes rows x cols pairs
(and, on CUDA, reads an additive mask of that size) where the sequences need only the sum of
their own squares. Per sequence, the block's tokens are a few runs of consecutive positions (a
zigzag half is one chunk; the whole local sequence at CP 1), and every pair of runs is either
fully visible (keys before the queries, or no causal mask), the causal square of one chunk, or
invisible: one dense piece per visible pair of runs, trimmed to its real tokens (padding ends
every chunk it is in), taken by the fast unmasked kernels (flash on CUDA) and merged into the
running output like any block. Rows no piece reaches (padding) keep output 0 and LSE ``-inf``.

A piece costs launches (its kernel, its merge, its gradients' adds, forward and backward), so
splitting pays where sequences are long and few, and loses where they are many and short.
``MEGATRON_HCP_SPLIT_PACKED`` chooses, read at every plan (:func:`split_mode` validates it;
:func:`splitting` overrides it in a thread):

* ``auto`` (the default) - split where the pieces' pairs plus :data:`PIECE_COST_PAIRS` per
  piece stay within the masked block's rows x cols, and always where the block has
  :data:`MAX_MASKED_PAIRS` pairs or more (its additive mask alone would take 512 MiB or more
  in bf16; a reasoned limit, not a measured one): the same plan on every device (the CPU runs
  the plan a GPU would);
* ``on`` - split every packed block that splits into dense pieces;
* ``off`` - never split.

Blocks with a sliding window stay masked (a window inside a pair of runs is a band, not a
dense piece), and so do layouts whose runs meet otherwise than above (none the planner makes);
where FlashAttention-2's varlen calls run (CUDA), a windowed block's bands take them under the
same rule (:mod:`.bands`).
"""

from __future__ import annotations

import contextlib
from functools import lru_cache
from typing import NamedTuple

from .seq_layout import SeqLayout
from .switches import Switch

__all__ = ["MAX_MASKED_PAIRS", "PIECE_COST_PAIRS", "SPLIT_ENV", "SPLIT_MODES", "Piece", "Run",
           "block_pieces", "seq_runs", "split_mode", "splitting", "worth_splitting"]

SPLIT_ENV = "MEGATRON_HCP_SPLIT_PACKED"
SPLIT_MODES = ("auto", "on", "off")
# the launches of one piece (attention kernel, merge and gradient adds, forward and backward:
# about ten, tens of microseconds of host time) against the pairs a GPU kernel computes in
# that time at 16 heads of 128 in bf16 on an H100-class GPU: about a 1K x 1K block. Reasoned,
# not measured on a GPU; the masked block's own mask work is not counted in its favour.
PIECE_COST_PAIRS = 2**20
# a masked block this large is split whatever its pieces cost: its additive mask alone would
# be 512 MiB in bf16 (1 GiB in fp32) on CUDA, forward and again backward
MAX_MASKED_PAIRS = 2**28


SPLIT = Switch(
    "split", SPLIT_ENV, SPLIT_MODES,
    "auto (the default: a packed block is computed per sequence where that costs less than "
    "its masked block), on (always per sequence) or off (always masked)")


def split_mode() -> str:
    """``MEGATRON_HCP_SPLIT_PACKED`` as :func:`splitting` chose it here, else as set (default
    ``auto``), checked against :data:`SPLIT_MODES`."""
    return SPLIT.mode()


def splitting(mode: str) -> contextlib.AbstractContextManager[None]:
    """Packed blocks planned as ``mode`` inside the block, in this thread
    (:class:`~.switches.Switch`)."""
    return SPLIT.chosen(mode)


class Run(NamedTuple):
    """Consecutive tokens of one sequence: where they start among the local tokens, the
    sequence position of the first, how many, and how many of them are real (not padding)."""

    start: int
    pos: int
    size: int
    real: int


class Piece(NamedTuple):
    """A dense piece of a block: local query rows ``[row, row + rows)`` against local key
    columns ``[col, col + cols)``; ``causal``: the square diagonal of one chunk."""

    row: int
    rows: int
    col: int
    cols: int
    causal: bool


def _chunks(layout: SeqLayout, which: str) -> tuple[int, ...]:
    """The chunks (of ``layout_unit`` per sequence) a half of ``layout`` holds, in order."""
    if layout.contiguous:
        return (layout.position,)
    first, second = layout.position, 2 * layout.cp - 1 - layout.position
    return {"first": (first,), "second": (second,), "all": (first, second)}[which]


@lru_cache(maxsize=256)  # a packing needs a few per position
def seq_runs(layout: SeqLayout, which: str) -> tuple[tuple[Run, ...], ...]:
    """Per sequence of ``layout``, the runs of its tokens in the half ``which`` (``"all"``,
    ``"first"``, ``"second"``); two chunks that follow each other in memory and in position
    (the whole sequence at CP 1) are one run."""
    per_seq = 1 if layout.contiguous else 2  # chunks of a sequence on each position
    sizes = [n // (layout.cp * per_seq) for n in layout.padded]
    total = sum(sizes)
    chunks = _chunks(layout, which)
    every = _chunks(layout, "all")
    runs: list[tuple[Run, ...]] = []
    offset = before = 0  # local tokens before this sequence; its tokens in earlier halves
    for c, real in zip(sizes, layout.real):
        seq: list[Run] = []
        for chunk in chunks:
            slot = every.index(chunk)
            if layout.grouped:  # every sequence's first half, then every second half
                start = slot * total + before
            else:
                start = offset + slot * c
            pos = chunk * c
            if seq and seq[-1].start + seq[-1].size == start and seq[-1].pos + seq[-1].size == pos:
                last = seq.pop()
                start, pos, c_run = last.start, last.pos, last.size + c
            else:
                c_run = c
            seq.append(Run(start, pos, c_run, max(0, min(c_run, real - pos))))
        runs.append(tuple(seq))
        offset += c * len(every)
        before += c
    return tuple(runs)


@lru_cache(maxsize=256)
def block_pieces(q_layout: SeqLayout, kv_layout: SeqLayout, which_rows: str, which_cols: str,
                 causal: bool) -> tuple[Piece, ...] | None:
    """The dense pieces of the packed block of ``q_layout``'s half ``which_rows`` against
    ``kv_layout``'s half ``which_cols`` (causal: keys at positions up to the query's), or
    ``None`` where a pair of runs is neither fully visible, a causal square nor invisible."""
    pieces: list[Piece] = []
    for q_runs, k_runs in zip(seq_runs(q_layout, which_rows), seq_runs(kv_layout, which_cols)):
        for q in q_runs:
            for k in k_runs:
                if not (q.real and k.real):
                    continue
                if not causal or k.pos + k.real - 1 <= q.pos:  # every key before every query
                    pieces.append(Piece(q.start, q.real, k.start, k.real, False))
                elif k.pos == q.pos and k.real == q.real:  # one chunk's causal square
                    pieces.append(Piece(q.start, q.real, k.start, k.real, True))
                elif k.pos > q.pos + q.real - 1:  # every key after every query
                    continue
                else:
                    return None
    return tuple(pieces)


def worth_splitting(pairs: int, count: int, rows: int, cols: int, mode: str) -> bool:
    """Whether ``count`` pieces of ``pairs`` pairs in all cost less than their masked block of
    ``rows`` x ``cols``, or the masked block's mask would take 512 MiB or more in bf16
    (:data:`MAX_MASKED_PAIRS`), in ``mode`` (``MEGATRON_HCP_SPLIT_PACKED``'s: module
    docstring)."""
    if mode != "auto":
        return mode == "on"
    if rows * cols >= MAX_MASKED_PAIRS:
        return True
    return pairs + PIECE_COST_PAIRS * count <= rows * cols
