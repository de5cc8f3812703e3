"""The backward's gradient accumulators (grad_rows): a first gradient of every row is the
accumulator, anything else is added into zeros."""

from __future__ import annotations

import torch

from megatron_hcp.attention.reference.grad_rows import LazyRows, add_rows

SHAPE = torch.Size((1, 2, 6, 3))


def _grad(rows: int = 6, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(1, 2, rows, 3, generator=torch.Generator().manual_seed(rows)).to(dtype)


def test_a_first_gradient_of_every_row_is_the_accumulator():
    acc, grad = LazyRows(SHAPE, torch.float32, torch.device("cpu")), _grad()
    want = grad.clone()
    acc.add(slice(0, 6), grad)
    assert acc.value() is grad  # no zeros beside it, no copy
    later = _grad(3)
    acc.add(slice(3, 6), later)
    want[:, :, 3:] += later
    assert acc.value() is grad and torch.equal(acc.value(), want)


def test_partial_rows_views_and_other_dtypes_start_from_zeros():
    part = _grad(3)
    acc = LazyRows(SHAPE, torch.float32, torch.device("cpu"))
    acc.add(slice(0, 3), part)  # not every row
    assert torch.equal(acc.value()[:, :, :3], part)
    assert not acc.value()[:, :, 3:].any()

    base = torch.randn(1, 2, 6, 4)
    view = base[..., :3]
    acc = LazyRows(SHAPE, torch.float32, torch.device("cpu"))
    acc.add(slice(None), view)  # a slice of another tensor: never the accumulator
    assert acc.value().untyped_storage().data_ptr() != base.untyped_storage().data_ptr()
    assert torch.equal(acc.value(), view)

    permuted = torch.randn(1, 6, 2, 3).transpose(1, 2)  # all of its storage, in another order
    acc = LazyRows(SHAPE, torch.float32, torch.device("cpu"))
    acc.add(slice(None), permuted)
    assert acc.value() is permuted
    broadcast = torch.randn(1, 2, 1, 3).expand(SHAPE)
    acc = LazyRows(SHAPE, torch.float32, torch.device("cpu"))
    acc.add(slice(None), broadcast)  # one element many times: never written into
    assert acc.value() is not broadcast and torch.equal(acc.value(), broadcast)

    half = _grad(dtype=torch.bfloat16)
    acc = LazyRows(SHAPE, torch.float32, torch.device("cpu"))
    acc.add(slice(0, 6), half)  # a half-precision block into an fp32 accumulator
    assert acc.value().dtype == torch.float32 and torch.equal(acc.value(), half.float())


def test_nothing_added_is_zeros_and_an_index_adds_its_rows():
    acc = LazyRows(SHAPE, torch.float64, torch.device("cpu"))
    assert acc.value().dtype == torch.float64 and not acc.value().any()
    rows = torch.tensor([5, 0, 2])
    grad = _grad(3)
    acc = LazyRows(SHAPE, torch.float32, torch.device("cpu"))
    acc.add(rows, grad)
    add_rows(acc, rows, grad)
    want = torch.zeros(SHAPE)
    want[:, :, rows] = 2 * grad
    assert torch.equal(acc.value(), want)
    plain = torch.zeros(SHAPE)
    add_rows(plain, slice(1, 4), grad)
    assert torch.equal(plain[:, :, 1:4], grad)
