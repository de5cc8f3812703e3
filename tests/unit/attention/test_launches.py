"""The launch counter (issue #34's CPU proxy): what counts as a kernel, what as a sync."""

from __future__ import annotations

import torch

from megatron_hcp.attention.reference.launches import count_launches


def test_ops_that_do_work_count_views_and_allocations_do_not():
    x = torch.randn(4, 6)

    def step():
        y = x.t().unsqueeze(0).view(6, 4)  # views: nothing launched
        z = torch.empty(3)  # an allocation: nothing launched
        return (y + 1).sum(), torch.zeros(5), z

    _, count = count_launches(step)
    assert count.by_op == {"aten::add": 1, "aten::sum": 1, "aten::zeros": 1}, count.by_op
    assert count.kernels == 3 and count.syncs == 0


def test_composite_ops_count_once_and_copies_count():
    x = torch.randn(4, 6)
    _, count = count_launches(lambda: x.t().contiguous())  # one copy kernel
    assert count.by_op == {"aten::clone": 1}, count.by_op
    _, same = count_launches(lambda: x.to(torch.float32).contiguous())  # nothing to do
    assert same.kernels == 0
    _, cast = count_launches(lambda: x.to(torch.float64))
    assert cast.by_op == {"aten::_to_copy": 1}, cast.by_op
    _, iso = count_launches(lambda: torch.isfinite(x))  # composite: the ops that run
    assert iso.kernels >= 2 and "aten::isfinite" not in iso.by_op, iso.by_op


def test_attention_kernels_count_with_what_they_call():
    q = torch.randn(1, 2, 8, 4, requires_grad=True)
    out, forward = count_launches(
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu, q, q, q, 0.0, True)
    assert forward.by_op.get("aten::_scaled_dot_product_flash_attention_for_cpu") == 1


def test_host_reads_are_syncs():
    x = torch.randn(5)
    _, count = count_launches(lambda: (x.sum().item(), bool(x.any()), x.nonzero()))
    assert count.syncs == 3, count
    assert "syncs" in count.line() and "kernels" in count.line()


def test_fused_regions_count_as_one_kernel_when_asked():
    """``fused=True``: the ops inside a fused region (nested ones included) count as one kernel
    named by the region, as the fused path launches them; otherwise each op counts, and a
    region outside any counter changes nothing."""
    from megatron_hcp.attention.reference.launches import fused_region

    x = torch.randn(4, 6)

    def step():
        with fused_region("megatron_hcp::fused_merge"):
            y = torch.sigmoid(x) * 2
            with fused_region("megatron_hcp::inner"):
                y = y.lerp(x, 0.5)
        return (y + 1).sum()

    want, eager = count_launches(step)
    assert eager.by_op == {"aten::sigmoid": 1, "aten::mul": 1, "aten::lerp": 1,
                           "aten::add": 1, "aten::sum": 1}, eager.by_op
    got, fused = count_launches(step, fused=True)
    assert fused.by_op == {"megatron_hcp::fused_merge": 1, "aten::add": 1, "aten::sum": 1}
    with fused_region("megatron_hcp::fused_merge", kernels=2):  # no counter: nothing changes
        pass
    _, two = count_launches(lambda: _two_kernel_region(x), fused=True)
    assert two.by_op == {"megatron_hcp::fused_merge": 2}, two.by_op
    assert torch.equal(got, want) and torch.equal(step(), want)


def _two_kernel_region(x):
    from megatron_hcp.attention.reference.launches import fused_region

    with fused_region("megatron_hcp::fused_merge", kernels=2):
        return torch.sigmoid(x) + x.sum()
