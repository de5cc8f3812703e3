"""The backward of packed (thd) sequences reads the output and its gradient in the attention's
token order (halves grouped) without regrouping them whole (``reorder.RowsInOrder``): a block's
rows that are one run of the model's rows are a view, a part of up to half of them a gather of
those rows only (kept for the blocks that read them again), more than half the whole regrouped
once - and let go once the blocks read half of it or less."""

from __future__ import annotations

import pytest
import torch

from megatron_hcp.attention.reference.memory import LiveBytes
from megatron_hcp.attention.reference.reorder import RowsInOrder, run_starts, tokens_in_order
from megatron_hcp.attention.reference.seq_layout import half_grouping

pytestmark = pytest.mark.torch_only

PADDED, CP = (64, 32, 96), 2  # three packed sequences; halves of 16, 8 and 24 tokens a rank


def _rows():
    perm = half_grouping(PADDED, CP)
    x = torch.randn(1, 4, int(perm.numel()), 8).transpose(1, 2).contiguous().transpose(1, 2)
    return RowsInOrder(x, perm, tuple(perm.tolist()), run_starts(perm)), tokens_in_order(x, perm)


def test_run_starts_marks_each_run_of_consecutive_values():
    assert run_starts(torch.tensor([4, 5, 6, 0, 1, 9])) == (0, 0, 0, 3, 3, 5)
    assert run_starts(torch.tensor([], dtype=torch.long)) == ()


def test_rows_of_one_run_are_a_view_of_the_model_order():
    rows, whole = _rows()
    part = rows.take(slice(16, 24))  # the second sequence's first half
    assert part.untyped_storage().data_ptr() == rows.x.untyped_storage().data_ptr()
    assert torch.equal(part, whole[:, :, 16:24]) and not rows._kept


def test_a_small_part_is_a_gather_of_its_rows_only():
    rows, whole = _rows()
    with LiveBytes() as mem:
        part = rows.take(slice(12, 30))  # across sequences: not one run, under half the rows
        assert mem.current == part.numel() * part.element_size()
    assert torch.equal(part, whole[:, :, 12:30]) and rows._kept[0][:2] == (12, 30)
    index = torch.tensor([3, 40, 41, 70])
    assert torch.equal(rows.take(index), whole.index_select(2, index))


def test_most_rows_regroup_the_whole_once_and_then_read_views_of_it():
    rows, whole = _rows()
    first = rows.take(slice(0, 96))
    assert torch.equal(first, whole) and rows._kept[0][:2] == (0, 96)
    again = rows.take(slice(40, 96))
    assert again.untyped_storage().data_ptr() == rows._kept[0][2].untyped_storage().data_ptr()
    assert torch.equal(again, whole[:, :, 40:96])


def test_half_the_rows_or_fewer_let_the_whole_go_and_gather_their_own():
    """The ring's later blocks read the second half of the rows: the whole gathered for the
    blocks of every row is let go, not held beside their half (thd's peak)."""
    rows, whole = _rows()
    rows.take(slice(0, 96))
    with LiveBytes() as mem:
        half = rows.take(slice(48, 96))
        assert mem.current == half.numel() * half.element_size()  # the whole is gone
    assert torch.equal(half, whole[:, :, 48:96]) and rows._kept[0][:2] == (48, 96)
    again = rows.take(slice(60, 96))  # more than half of the kept rows: a view of them
    assert again.untyped_storage().data_ptr() == half.untyped_storage().data_ptr()
    rows.let_go()
    assert not rows._kept


def test_row_sums_are_in_the_attention_order():
    rows, whole = _rows()
    other = RowsInOrder(rows.x * 2, rows.perm)
    want = (whole * (whole * 2)).sum(-1)
    torch.testing.assert_close(rows.row_sums(other), want)
