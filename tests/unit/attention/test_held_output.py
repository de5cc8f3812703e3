"""reorder.HeldOutput: an attention function's returned output, held for its backward and let
go of there (single process, no groups)."""

from __future__ import annotations

import pytest
import torch

from megatron_hcp.attention.reference.reorder import HeldOutput

pytestmark = pytest.mark.torch_only


def test_applies_only_without_saved_tensor_hooks():
    """Under saved-tensor hooks (offloading, checkpointing) the output is saved as usual, and
    so is an inference tensor (no version counter)."""
    out = torch.randn(2, 2)
    assert HeldOutput.applies(out)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        assert not HeldOutput.applies(out)
    assert HeldOutput.applies(out)
    with torch.inference_mode():
        assert not HeldOutput.applies(torch.randn(2, 2))


def test_holds_an_alias_and_checks_its_version():
    """The held tensor shares the output's storage (no copy) and has no graph; a change in
    place after the forward is refused with the fix."""
    out = torch.randn(4, 3, requires_grad=True) * 2
    held = HeldOutput(out)
    assert held._out.data_ptr() == out.data_ptr() and held._out.grad_fn is None
    with torch.no_grad():
        out.add_(1)
    with pytest.raises(RuntimeError, match="modified in place .*out-of-place"):
        held.take()


def test_take_outside_a_backward_keeps_it():
    """Outside a backward torch cannot say whether the graph is kept: the output stays."""
    out = torch.randn(2, 2)
    held = HeldOutput(out)
    assert held.take() is held.take()


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_a_forward_without_a_graph_saves_as_before(mode):
    """Without a graph (no_grad; inference mode, whose tensors have no version counter) a
    function whose output leaves in another order holds nothing of its own and runs."""
    from megatron_hcp.attention.reference.functions import RingAttention
    from megatron_hcp.attention.reference.reorder import OutputOrder, pack_kv
    from megatron_hcp.attention.reference.seq_layout import SeqLayout

    s = 16
    layout = SeqLayout.dense(s, 1, 1, "zigzag", "cpu")
    perm = torch.randperm(s, generator=torch.Generator().manual_seed(0))
    order = OutputOrder("tokens", perm, torch.argsort(perm))
    q, k, v = (torch.randn(1, 2, s, 8, generator=torch.Generator().manual_seed(i))
               for i in range(3))
    kv = pack_kv(k, v)
    with torch.no_grad() if mode == "no_grad" else torch.inference_mode():
        out = RingAttention.apply(q, kv, 8, layout, None, [0], False, 0.3, None, None, None,
                                  order)
    q.requires_grad_()
    want = RingAttention.apply(q, kv, 8, layout, None, [0], False, 0.3, None, None, None,
                               order)
    assert torch.equal(out, want.detach())
    assert want.grad_fn.held is not None
