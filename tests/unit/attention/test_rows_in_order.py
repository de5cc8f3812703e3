"""The backward of packed (thd) sequences reads the output and its gradient in the attention's
token order (halves grouped) without regrouping them whole (``reorder.RowsInOrder``): a block's
rows that are one run of the model's rows are a view, a part of up to half of them a gather of
those rows only, and more than half the whole regrouped once."""

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
    assert torch.equal(part, whole[:, :, 16:24]) and not rows._whole


def test_a_small_part_is_a_gather_of_its_rows_only():
    rows, whole = _rows()
    with LiveBytes() as mem:
        part = rows.take(slice(12, 30))  # across sequences: not one run, under half the rows
        assert mem.current == part.numel() * part.element_size()
    assert torch.equal(part, whole[:, :, 12:30]) and not rows._whole
    index = torch.tensor([3, 40, 41, 70])
    assert torch.equal(rows.take(index), whole.index_select(2, index))


def test_most_rows_regroup_the_whole_once_and_then_read_views_of_it():
    rows, whole = _rows()
    first = rows.take(slice(0, 96))
    assert torch.equal(first, whole) and len(rows._whole) == 1
    again = rows.take(slice(48, 96))
    assert again.untyped_storage().data_ptr() == rows._whole[0].untyped_storage().data_ptr()
    assert torch.equal(again, whole[:, :, 48:96])


def test_row_sums_are_in_the_attention_order():
    rows, whole = _rows()
    other = RowsInOrder(rows.x * 2, rows.perm)
    want = (whole * (whole * 2)).sum(-1)
    torch.testing.assert_close(rows.row_sums(other), want)
