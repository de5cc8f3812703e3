"""A windowed block whose trimmed rows or columns are one run of consecutive tokens has its
backward take its tensors as views of that run (``Block.row_run`` / ``col_run``), not as gathered
copies: the same result bit for bit, and the bytes of the gathered q, K/V, dO and O rows no
longer in the backward's peak."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_hcp.attention.reference.blocks import plan_block
from megatron_hcp.attention.reference.functions import _backward_block, _forward_block, _new_acc
from megatron_hcp.attention.reference.memory import LiveBytes
from megatron_hcp.attention.reference.pieces import splitting
from megatron_hcp.attention.reference.seq_layout import SeqLayout

pytestmark = pytest.mark.torch_only

CP, POSITION, LOCAL, HEADS, DIM = 4, 1, 512, 4, 32
WINDOW = (128, 0)  # a quarter chunk back: chunk 1's first rows see chunk 0's last columns


def _block(runs: bool):
    layout = SeqLayout.dense(LOCAL, CP, POSITION)
    block = plan_block(layout, layout.at(CP, POSITION - 1), True, WINDOW)
    return block if runs else dataclasses.replace(block, row_run=None, col_run=None)


def _tensors():
    gen = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, HEADS, LOCAL, DIM, generator=gen) for _ in range(4))
    return q, k, v, dout


def _run(block, q, k, v, dout):
    """``block``'s forward merged into fresh accumulators, then its backward; the results and
    the backward's peak bytes above what exists before it."""
    out, lse = _new_acc(q, v, None)
    _forward_block(q, k, v, block, DIM**-0.5, out, lse, first=True)
    out = out.to(q.dtype)
    dq, dk, dv = (torch.zeros_like(x) for x in (q, k, v))
    with LiveBytes() as mem:
        _backward_block(dout, q, k, v, out, lse, block, DIM**-0.5, dq, dk, dv)
    return (out, lse, dq, dk, dv), mem.peak


def _step(runs: bool):
    """The test block with or without its runs (:func:`_run`)."""
    return _run(_block(runs), *_tensors())


def test_a_windowed_block_of_one_run_is_planned_with_its_runs():
    block = _block(runs=True)
    assert block.row_run == slice(0, 128) and block.col_run == slice(128, 256)
    assert torch.equal(block.rows, torch.arange(0, 128))  # merges keep the index
    assert torch.equal(block.cols, torch.arange(128, 256))


def test_runs_give_the_same_result_without_the_gathered_copies():
    with_runs, peak_runs = _step(runs=True)
    gathered, peak_gathered = _step(runs=False)
    for got, want in zip(with_runs, gathered):  # bit for bit: the same kernel on the same rows
        assert torch.equal(got, want)
    # the gathered dO, q, O rows and K, V columns (128 tokens each, fp32) and the LSE rows
    copies = 5 * 128 * HEADS * DIM * 4
    assert peak_gathered - peak_runs >= copies, (peak_gathered, peak_runs, copies)


# ------------------------------------------------------------ row chunks take their reach
REACH_LAYOUTS = {  # (q layout, the key positions it meets) - dense, the a2a's whole sequence,
    # packed and padded sequences with their halves grouped
    "dense": (SeqLayout.dense(LOCAL, CP, POSITION), (0, 1, 2)),
    "whole": (SeqLayout.dense(2048, 1, 0), (0,)),
    "packed": (SeqLayout((256, 192, 64), (250, 192, 60), CP, POSITION).with_grouped_halves(),
               (0, 1, 2)),
}


@pytest.mark.parametrize("window,causal", [((64, 0), True), ((32, 16), False), ((100, -1), False)])
@pytest.mark.parametrize("name", sorted(REACH_LAYOUTS))
def test_each_rows_reach_is_its_first_and_last_visible_column(name, window, causal):
    layout, sources = REACH_LAYOUTS[name]
    planned = 0
    for src in sources:
        block = plan_block(layout, layout.at(layout.cp, src), causal, window)
        if block is None:
            continue
        planned += 1
        visible = block.mask.dense()
        cols = torch.arange(visible.shape[1])
        first = torch.where(visible, cols, visible.shape[1]).amin(1)
        last = torch.where(visible, cols, -1).amax(1) + 1
        assert visible.any(1).all()  # trimmed: every row sees a column
        assert list(block.reach.lo) == first.tolist() and list(block.reach.hi) == last.tolist()
    assert planned


def _chunked_step(reach: bool, monkeypatch):
    """A2a's one windowed block (the whole sequence, 2048 tokens, a window of 256) run in row
    chunks of 64 rows, with or without each chunk trimmed to its reach: results and the
    backward's peak above what exists before it."""
    from megatron_hcp.attention.reference import kernels

    monkeypatch.setattr(kernels, "MASK_ELEMENTS", 64 * 2048)
    monkeypatch.setattr(kernels, "MASK_SHARE", 2**62)
    layout = SeqLayout.dense(2048, 1, 0)
    block = plan_block(layout, layout, True, (256, 0))
    block = block if reach else dataclasses.replace(block, reach=None)
    gen = torch.Generator().manual_seed(1)
    return _run(block, *(torch.randn(1, HEADS, 2048, DIM, generator=gen) for _ in range(4)))


def test_row_chunks_take_only_the_columns_they_reach(monkeypatch):
    trimmed, peak_trimmed = _chunked_step(True, monkeypatch)
    whole, peak_whole = _chunked_step(False, monkeypatch)
    for got, want in zip(trimmed, whole):  # the same pairs; sums in another grouping
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # a chunk's K and V gradients: 64 + 256 columns instead of 2048 (fp32)
    saved = 2 * (2048 - 320) * HEADS * DIM * 4
    assert peak_whole - peak_trimmed >= saved, (peak_whole, peak_trimmed, saved)


@pytest.mark.parametrize("name", ["dense", "packed"])
def test_a_packed_blocks_rows_reach_their_mask(name):
    """Without a window, a masked packed block's reach comes from its dense pieces: each row's
    first and last visible column, as its mask has them."""
    layout, sources = REACH_LAYOUTS[name]
    for src in sources:
        with splitting("off"):  # the masked block, not its pieces
            block = plan_block(layout, layout.at(layout.cp, src), True)
        if name == "dense":  # one unpadded sequence: slices and the causal flag, no mask
            assert block.mask is None and block.reach is None
            continue
        visible = block.mask.dense()
        cols = torch.arange(visible.shape[1])
        seen = visible.any(1)  # padding rows see nothing: no reach of their own
        first = torch.where(visible, cols, visible.shape[1]).amin(1)
        last = torch.where(visible, cols, -1).amax(1) + 1
        lo, hi = torch.tensor(list(block.reach.lo)), torch.tensor(list(block.reach.hi))
        assert torch.equal(lo[seen], first[seen]) and torch.equal(hi[seen], last[seen])
        assert (lo[~seen] >= hi[~seen]).all()


def test_a_reach_out_of_position_order_covers_every_column():
    """Keys of one sequence out of position order in memory (no layout the backend makes): each
    row's reach is every column, so its chunks take them all - never fewer than it sees."""
    from megatron_hcp.attention.reference.masks import Reach

    seq, ok = torch.zeros(4, dtype=torch.long), torch.ones(4, dtype=torch.bool)
    reach = Reach((seq, torch.arange(4), ok), (seq, torch.tensor([3, 2, 1, 0]), ok), True, None)
    assert list(reach.lo) == [0] * 4 and list(reach.hi) == [4] * 4
    ordered = Reach((seq, torch.arange(4), ok), (seq, torch.arange(4), ok), True, None)
    assert list(ordered.lo) == [0] * 4 and list(ordered.hi) == [1, 2, 3, 4]
    assert ordered.cover(slice(1, 3)) == (0, 3)
